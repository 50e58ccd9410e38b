"""vllm-loop demo: a tiny looped model through real vLLM, checked against the reference, plus LoopSpec.

1. builds a tiny random Ouro checkpoint (real config keys and tensor names; nothing downloaded),
2. serves it with ``vllm.LLM`` (the plugin registers Ouro; T·L KV banks) and generates greedily,
3. checks every token against the plain-PyTorch reference,
4. decodes the same prompts with LoopSpec (d1=1, d2=2) on the reference's pipelined executor: same
   tokens, with the mean accepted length and commit shares it measured.

LoopSpec inside the vLLM engine (``--speculative-config '{"method": "loopspec"}'``) is not built yet;
step 4 runs the engine-independent library that will drive it.

    make demo          # or: .venv/bin/python examples/demo.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "A looped language model",
]
NEW_TOKENS = 24


def main() -> int:
    ap = argparse.ArgumentParser(description="vllm-loop demo")
    ap.add_argument("--out", default=None, help="where to write the tiny checkpoint (default: a temp dir)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # the reference is tiny: one thread is fastest next to a running engine
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_loop.loopspec import LoopSpecSchedule
    from vllm_loop.loopspec.executor import GenerationRequest, PipelinedExecutor
    from vllm_loop.reference import load_reference
    from vllm_loop.testing.checkpoints import make_checkpoint
    from vllm_loop.testing.engines import kv_cache_layout, start_llm, stop_llm, worker_functions

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="vllm-loop-demo-"))
    # agreement=0.005 makes early depths predict like the final one, so LoopSpec has drafts to accept
    path = str(make_checkpoint("ouro", out / "tiny-ouro", options={"agreement": "0.005"}))
    config = json.loads((Path(path) / "config.json").read_text())
    T, L = config["total_ut_steps"], config["num_hidden_layers"]
    print(f"[1] tiny Ouro checkpoint: {path}  (L={L} layers looped T={T} times, vocab {config['vocab_size']})")
    print("    (random weights: the text is noise; what matters is that every implementation agrees)")

    t0 = time.time()
    # collective_rpc(kv_cache_layout) sends our function to the worker: only the engine's start and
    # that call run with pickled RPC allowed (worker_functions), nothing else in this process does
    with worker_functions():
        llm = start_llm(path)
    print(f"[2] vLLM engine up in {time.time() - t0:.0f} s")
    try:
        with worker_functions():
            (kv,) = llm.collective_rpc(kv_cache_layout)
        print(f"    KV cache: {len(kv['groups'][0])} attention banks (T*L = {T * L}) in {len(kv['groups'])} group")
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [tok(p).input_ids for p in PROMPTS]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        stop_llm(llm)

    ref = load_reference(path)
    schedule = LoopSpecSchedule(R=T, d1=1, d2=2)
    loopspec = PipelinedExecutor(ref, schedule).generate(
        [GenerationRequest(prompt=p, max_new_tokens=NEW_TOKENS) for p in prompts])
    ok = True
    for text, prompt, out_, spec_tokens in zip(PROMPTS, prompts, outs, loopspec.tokens):
        got = list(out_.outputs[0].token_ids)
        same_ref = got == ref.greedy_generate(prompt, NEW_TOKENS)
        same_spec = spec_tokens == got
        ok &= same_ref and same_spec
        print(f"\n    prompt: {text!r}")
        print(f"    vLLM:   {out_.outputs[0].text!r}")
        print(f"    tokens: {got}")
        print(f"    [3] reference decoding identical: {same_ref}   [4] LoopSpec identical: {same_spec}")
    print(f"\n[4] LoopSpec (R={T}, d1=1, d2=2) on the reference pipelined executor, 3 requests together:")
    print("    " + loopspec.report().replace("\n", "\n    "))
    print("\nOK: vLLM, the reference and LoopSpec agree token for token." if ok else "\nMISMATCH (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
