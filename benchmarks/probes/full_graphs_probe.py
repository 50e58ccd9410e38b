"""Which engines start, and generate, with vLLM's full CUDA graphs for mixed steps (``cudagraph_mode``
FULL: prefills included), without torch.compile: one engine a case, each in its own process (an
illegal memory access takes its process down).

The cases are tiny factory checkpoints (vanilla and LoopSpec; fp32 with Triton attention, as the GPU
identity tests run, and bf16 with vLLM's default attention) at ``max_model_len`` 128 or 1024 and a
largest capture size of 512 or 64 tokens asked for. Its first form (an H100, benchmarks/RESULTS.md)
found LoopSpec engines crashing at start-up wherever the capture exceeded ``max_model_len``; a LoopSpec
engine now caps its graphs at ``max_model_len`` (``loopspec/config.py: graph_capture_sizes``). vLLM's
warm-up over-reads the block table in every engine (``dummy_run_overread.py``); whether vLLM's packed
KV layout, which LoopSpec engines use, is what makes that fatal, ``vanilla-huginn-fp32-packed`` tests:
a vanilla engine given that layout (the case reports the layout taken: ``packed_kv``). GPU only.

    python benchmarks/probes/full_graphs_probe.py --out full-graphs-probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HUGINN = ("huginn_raven", {"layout": "huginn", "state_init": "seeded", "agreement": "0.5"}, {"mean_recurrence": 32})
OURO = ("ouro", {"agreement": "0.005"}, {})
LOOPSPEC_1_5 = {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 5}
CASES = {  # name -> (checkpoint, speculative config or None, dtype, largest capture size, max_model_len)
    "vanilla-huginn-fp32": (HUGINN, None, "float32", 512, 128),
    "loopspec-huginn-fp32": (HUGINN, LOOPSPEC_1_5, "float32", 512, 128),
    "loopspec-huginn-fp32-cap64": (HUGINN, LOOPSPEC_1_5, "float32", 64, 128),
    "loopspec-huginn-fp32-len1024": (HUGINN, LOOPSPEC_1_5, "float32", 512, 1024),
    "loopspec-huginn-bf16": (HUGINN, LOOPSPEC_1_5, "bfloat16", 512, 128),
    "vanilla-ouro-fp32": (OURO, None, "float32", 512, 128),
    # vanilla-huginn-fp32 with vLLM's packed KV layout (one allocation for all layers), which a LoopSpec
    # engine always has: does the layout alone make a vanilla engine's over-read crash? (On an H100,
    # benchmarks/RESULTS.md: no, it started)
    "vanilla-huginn-fp32-packed": (HUGINN, None, "float32", 512, 128),
}


def force_packed_kv_layout() -> None:
    """vLLM's packed KV layout for every engine of this process (engine core in-process, so the patch
    reaches it)."""
    from vllm.v1.core import kv_cache_utils

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kv_cache_utils._use_packed_kv_cache_config = lambda vllm_config, kv_cache_groups: len(kv_cache_groups) == 1


def case(name: str, folder: Path) -> dict:
    """Start the case's engine, generate 20 tokens for three prompts (3, 17, 40 tokens), stop."""
    from vllm import SamplingParams

    from vllm_loop.testing.checkpoints import make_checkpoint
    from vllm_loop.testing.engines import start_llm

    (family, options, overrides), spec, dtype, capture, max_model_len = CASES[name]
    if name.endswith("-packed"):
        force_packed_kv_layout()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the layout check below sends a function
    path = make_checkpoint(family, folder / name, seed=0, options=options, **overrides)
    kw = dict(dtype=dtype, max_model_len=max_model_len, block_size=16,
              compilation_config={"mode": 0, "cudagraph_mode": "FULL", "max_cudagraph_capture_size": capture})
    if spec:
        kw["speculative_config"] = spec
    t = time.time()
    llm = start_llm(str(path), **kw)
    mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name
    # the layout really taken: packed = one tensor backs every layer's KV
    packed = llm.collective_rpc(
        lambda w: len({c.untyped_storage().data_ptr() for c in w.model_runner.kv_caches}) == 1)[0]
    outs = llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)],
                        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    return {"case": name, "started": True, "cudagraph_mode": mode, "start_s": round(time.time() - t, 1),
            "tokens": [len(o.outputs[0].token_ids) for o in outs], "packed_kv": packed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--out", required=True, help="JSON lines, one a case; each case's log beside it")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--folder", default="/tmp/full-graphs-probe", help="where the checkpoints are made")
    args = ap.parse_args()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    if args.case:
        print("RESULT " + json.dumps(case(args.case, folder)), flush=True)
        return 0
    out = Path(args.out)
    with open(out, "w") as results:
        for name in args.cases:
            log = out.with_suffix(f".{name}.log")
            with open(log, "w") as err:
                cmd = [sys.executable, __file__, "--case", name, "--folder", str(folder), "--out", str(out)]
                p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            row = json.loads(line[len("RESULT "):]) if line else {
                "case": name, "started": False, "exit": p.returncode,
                "error": next((x.strip() for x in log.read_text().splitlines() if "Error" in x), "")[:300]}
            results.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
