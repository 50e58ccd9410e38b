"""LoopSpec acceptance on agreement-controlled tiny checkpoints (plain-PyTorch executor, CPU).

For each model and schedule, greedy and sampling: mean accepted length gamma (paper eq. 9) and the
measured tokens per R recurrent steps, commit shares (first proposal / second / full depth),
gate-open frequency, effective batch size per recurrent step (mean, peak, all requests together),
and the double-rejection (restart) rate next to Theorem 1's bound 2*eps2, eps2 = mean TV(p_d2, p_R)
over the committed positions (under greedy: the d2/R argmax disagreement rate), plus the exact
expected restart probability averaged over the same positions. Greedy output is checked
token-for-token against ordinary full-depth decoding.

    python benchmarks/loopspec_acceptance.py --out results/loopspec
    python benchmarks/loopspec_acceptance.py --out /tmp/r --models raven --schedules 2:8 4:8 --requests 4

Schedules are absolute depths "d1:d2" (or "d1" for a single proposal), as in the paper's tables.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from vllm_loop.loopspec.executor import GenerationRequest, PipelinedExecutor, baseline_generate
from vllm_loop.loopspec.metrics import format_summary
from vllm_loop.loopspec.proposals import SamplingParams
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.reference import load_reference
from vllm_loop.testing.checkpoints import make_checkpoint

# family, factory options, config overrides, default schedules
MODELS = {
    "ouro": ("ouro", {"agreement": "0.02"}, {}, ["1", "1:2"]),
    "raven": ("huginn_raven", {"layout": "llama", "state_init": "seeded", "agreement": "0.6"},
              {"mean_recurrence": 32}, ["2", "2:8", "4", "4:8"]),
}
PROMPTS = [
    "The capital of France is",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "def add(a, b):",
    "Memory bandwidth limits the speed of decoding when the batch is small",
    "The river flows to the sea, the sea meets the sky, and the sky holds",
    "Numbers: 0 1 2 3 4 5",
    "A looped transformer applies the same block",
    "Once upon a time",
]


def parse_schedule(text: str, R: int) -> LoopSpecSchedule:
    parts = text.split(":")
    if len(parts) > 2:
        raise SystemExit(f"--schedules {text!r}: expected d1 or d1:d2")
    d1 = int(parts[0])
    d2 = int(parts[1]) if len(parts) == 2 else None
    return LoopSpecSchedule(R, d1, d2)


def encode(checkpoint: Path, n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return [tok.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(n)]


def run_one(model, schedule, prompts, max_new, params, seed, check_greedy) -> dict:
    reqs = [GenerationRequest(p, max_new, sampling=params, seed=seed + i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    out = PipelinedExecutor(model, schedule).generate(reqs)
    seconds = time.perf_counter() - t0
    s = out.summary()
    s["seconds"] = seconds
    s["schedule"] = {"R": schedule.R, "d1": schedule.d1, "d2": schedule.d2, "gate": schedule.gate}
    s["sampling"] = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
    if check_greedy and params.greedy:
        s["greedy_identical_to_full_depth"] = out.tokens == [baseline_generate(model, r) for r in reqs]
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for loopspec_acceptance.json")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--agreement", type=str, default=None, help="override the factory's agreement option")
    ap.add_argument("--checkpoint", type=Path, default=None, help="use this checkpoint instead (one model)")
    ap.add_argument("--schedules", nargs="+", default=None, help="e.g. 2:8 4:8 2 (default per model)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling runs (greedy runs always happen)")
    ap.add_argument("--top-p", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--no-ungated", action="store_true", help="skip the ungated (gate=False) sampling runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny models: 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    results = {"command": vars(args) | {"out": str(args.out), "checkpoint": str(args.checkpoint)}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            family, options, overrides, schedules = MODELS[name]
            options = dict(options)
            if args.agreement is not None:
                options["agreement"] = args.agreement
            ckpt = args.checkpoint or make_checkpoint(family, Path(tmp) / name, seed=args.seed, options=options, **overrides)
            model = load_reference(ckpt)
            prompts = encode(Path(ckpt), args.requests)
            sampling = SamplingParams(args.temperature, top_k=args.top_k, top_p=args.top_p)
            for text in args.schedules or schedules:
                schedule = parse_schedule(text, model.depth)
                variants = [(SamplingParams(0.0), schedule), (sampling, schedule)]
                if schedule.d2 is not None and not args.no_ungated:
                    variants.append((sampling, LoopSpecSchedule(schedule.R, schedule.d1, schedule.d2, gate=False)))
                for params, sch in variants:
                    s = run_one(model, sch, prompts, args.max_new_tokens, params, args.seed, check_greedy=True)
                    s["model"] = name
                    s["checkpoint_options"] = options
                    results["runs"].append(s)
                    mode = "greedy" if params.greedy else f"T={params.temperature} top_k={params.top_k} top_p={params.top_p}"
                    gate = "" if sch.d2 is None else (" gated" if sch.gate else " UNGATED")
                    print(f"== {name} R={sch.R} d1={sch.d1} d2={sch.d2}{gate}  {mode}  ({s['seconds']:.1f}s)")
                    print(format_summary(s, s["effective_batch"]))
                    print(f"measured tokens per R recurrent steps: {s['measured_gamma']:.3f}; "
                          f"exact expected restart rate: {s['expected_double_rejection']:.4f}"
                          + ("" if "greedy_identical_to_full_depth" not in s
                             else f"; greedy identical to full depth: {s['greedy_identical_to_full_depth']}"))
    path = args.out / "loopspec_acceptance.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
