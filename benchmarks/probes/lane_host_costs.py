"""What a lane step costs the host per lane, with the model taken out: the runner's own work.

At many requests a recurrent step of lanes holds hundreds of lanes (~196 at 64 Ouro-1.4B requests),
and the host's part of it -- the pipelines' decisions, packing each lane call's rows, the commits --
grew to ~4.3 ms a recurrent step on the H200's host (benchmarks/RESULTS.md),
next to ~6.3 ms of GPU kernels. At short contexts, where the lane attention is small, that host time
is what a lane step costs, and it decides whether lanes beat plain decoding at 64-128 requests.

This benchmark starts a real vLLM engine on a tiny Ouro (this process, any device) with lanes on and
the lane calls padded to their graph shapes as on the GPU, and replaces the lane calls' model work
with a stub (``lane_graphs.lane_call``): every readout is token 0, so every first proposal is
accepted and each request keeps its steady pipeline of ~R lanes (3.9 at Ouro's R=4, 1:2; as at ~97 %
acceptance). Everything else is the engine's: vLLM's scheduler, the runner's decisions,
``LaneBatch.pack``, the uploads into the graphs' input buffer, the commits' K/V copies (on a CPU
these copies are compute the host does; on a GPU they are kernels it enqueues). It reports the
runner's wall time in lane steps per recurrent step and per lane (``EngineCounters.lane_step_seconds``),
medians of ``--runs``, and with ``--profile`` the runner's functions by own time (cProfile).

    python benchmarks/probes/lane_host_costs.py --requests 1 64 128 --runs 3
    python benchmarks/probes/lane_host_costs.py --requests 64 --profile 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the stub below reaches it


def stub_lane_calls() -> None:
    """Lane calls without the model: ``logits`` returns zero logits (argmax token 0) for every row."""
    import torch

    from vllm_loop.loopspec import lane_graphs

    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by padded rows

    def lane_call(model, paged, scratch, kind, packed, ancestors, context, kernel=None):
        if kind != "logits":
            return None
        rows = packed.shape[1]
        if rows not in cache:
            vocab = model.config.vocab_size
            cache[rows] = (torch.zeros(rows, vocab, device=packed.device), torch.zeros(rows, dtype=torch.long,
                                                                                     device=packed.device))
        return cache[rows]

    lane_graphs.lane_call = lane_call


def measure(llm, requests: int, tokens: int, profile: int = 0) -> dict:
    """One batch of ``requests`` greedy requests of ``tokens`` new tokens; the runner's counters over it."""
    from vllm import SamplingParams

    from vllm_loop.testing.engines import runner_totals

    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 400 + 5 for j in range(32)]} for i in range(requests)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = runner_totals(llm)
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    if prof:
        prof.disable()
    after = runner_totals(llm)
    d = {k: after[k] - before[k] for k in ("lane_step_seconds", "recurrent_steps", "lanes_advanced", "lane_steps")}
    out = {"requests": requests, "lane_steps": d["lane_steps"], "recurrent_steps": d["recurrent_steps"],
           "lanes_per_step": d["lanes_advanced"] / d["recurrent_steps"],
           "ms_per_recurrent_step": 1e3 * d["lane_step_seconds"] / d["recurrent_steps"],
           "us_per_lane": 1e6 * d["lane_step_seconds"] / d["lanes_advanced"]}
    if prof:
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats("vllm_loop|numpy|built-in", profile)
        out["profile"] = text.getvalue()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 64, 128])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a request")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="one more run per request count under cProfile: its N costliest functions")
    ap.add_argument("--out", help="a JSON line per request count is appended here")
    args = ap.parse_args()

    import json

    import torch

    torch.set_num_threads(1)
    from vllm_loop.testing.checkpoints import make_checkpoint
    from vllm_loop.testing.engines import start_llm, stop_llm, worker_functions

    stub_lane_calls()
    with tempfile.TemporaryDirectory() as tmp, worker_functions():
        path = make_checkpoint("ouro", Path(tmp) / "ouro")
        spec = {"method": "loopspec", "d1": 1, "d2": 2, "lanes": "on", "lane_graphs": "on"}
        llm = start_llm(str(path), max_num_seqs=max(args.requests), max_model_len=512, speculative_config=spec,
                        kv_cache_memory_bytes=2**30)
        try:
            for n in args.requests:
                measure(llm, n, 8)  # warm-up: the first calls of each padded shape
                runs = [measure(llm, n, args.tokens) for _ in range(args.runs)]
                row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                row["runs"] = args.runs
                line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")
                if args.profile:
                    print(measure(llm, n, args.tokens, args.profile)["profile"], flush=True)
        finally:
            stop_llm(llm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
