"""The lanes policy (``vllm_loop/loopspec/policy.py``) in a model of engine steps, with random stalls: how
much a rule loses when some steps take longer for reasons that are not their mode's (a GC pause, a host
hiccup). CPU only, no engine; seconds to run. A model, not a speed measurement.

Each model is one batch of ``rows`` requests from 32-token prompts: a lane step costs ``lane_ms(context)``
and commits ``tokens`` a request (``warmup_tokens`` in a warm-up), a plain step ``plain_ms(context)`` (twice
that right after lanes) and one token. The step costs are fits to GPU runs (named in ``MODELS``). A run is
the waves of ``loopspec_speed.py --runs 2`` (16, 64, 64, 576, 576 tokens a request). With probability
``p`` any step (lane or plain) takes ``ms`` longer.

    python benchmarks/policy_stall_model.py                 # today's policy against plain steps alone
    python benchmarks/policy_stall_model.py --rival 9d4f21e # ... and against the policy.py of a revision

The rival's ``policy.py`` is read with ``git show REV:vllm_loop/loopspec/policy.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from vllm_loop.loopspec import policy as today  # noqa: E402

MODELS = {  # name: the step costs of one bucket (fits, see each source)
    # an H100 run (benchmarks/RESULTS.md): lanes win ~1.5x at a wave's start, ~1.1x by its end
    "128-h100": dict(rows=128, lane_ms=lambda c: 80 + 0.36 * c, plain_ms=lambda c: 11.2 + 0.028 * c,
                     tokens=10.5, warmup_tokens=3.0),
    # an H200 run (benchmarks/RESULTS.md): lanes win below ~100 positions only
    "64-h200": dict(rows=64, lane_ms=lambda c: 20 + 0.09 * c, plain_ms=lambda c: 9.5 + 0.0085 * c,
                    tokens=2.8, warmup_tokens=1.0),
    # a few requests: lanes ~6x faster throughout (3.5 tokens a request in the time of two plain steps)
    "4-lanes-win": dict(rows=4, lane_ms=lambda c: 3.5 + 0.002 * c, plain_ms=lambda c: 7.0 + 0.001 * c,
                        tokens=3.5, warmup_tokens=1.0),
}
WAVES = (16, 64, 64, 576, 576)
STALLS = ((0.0, 0.0), (0.01, 60.0), (0.03, 60.0), (0.05, 30.0), (0.1, 20.0), (0.03, 150.0))  # (p, ms)


def wave(policy, rows: int, n_tokens: int, lane_ms, plain_ms, tokens: float, warmup_tokens: float,
         stall: tuple[float, float, random.Random] | None = None, sample=today.StepSample) -> tuple[float, int, int]:
    """One wave of ``rows`` requests, ``n_tokens`` each (``policy`` None: plain steps only). ``stall``
    (p, ms, rng): each step takes ``ms`` longer with probability ``p``. ``sample``: the StepSample class
    of the policy's module. Seconds, lane steps and mode switches."""
    context, out, seconds, last, lane_steps, switches = 32.0, 0.0, 0.0, False, 0, 0
    while out < n_tokens:
        lanes = policy.lanes(rows) if policy else False
        if lanes:
            step_tokens, dt = (tokens if last else warmup_tokens), lane_ms(context) / 1000
            lane_steps += 1
        else:
            step_tokens, dt = 1.0, plain_ms(context) / 1000 * (2.0 if last else 1.0)
        if stall and stall[2].random() < stall[0]:
            dt += stall[1] / 1000
        if policy:
            policy.observe(sample(lanes, rows, int(rows * step_tokens), dt, warmup=lanes != last, context=context))
        switches += lanes != last
        last, out, context, seconds = lanes, out + step_tokens, context + step_tokens, seconds + dt
    return seconds, lane_steps, switches


def run(module, model: dict, seed: int, p: float, ms: float) -> float:
    """Seconds of one benchmark run (``module`` None: plain steps only)."""
    rng, policy = random.Random(seed), module.LanePolicy() if module else None
    return sum(wave(policy, n_tokens=n, stall=(p, ms, rng), sample=(module or today).StepSample, **model)[0]
               for n in WAVES)


def load_rival(rev: str):
    text = subprocess.run(["git", "show", f"{rev}:vllm_loop/loopspec/policy.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "rival_policy.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("rival_policy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rival_policy"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rival", help="a git revision whose policy.py to compare with today's")
    ap.add_argument("--seeds", type=int, default=200)
    args = ap.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the policy's log lines
    rules = {"today": today} | ({args.rival: load_rival(args.rival)} if args.rival else {})
    print("speed against plain steps alone with the same stalls: mean (worst) over seeds"
          + (f"; {args.rival} against today: runs >2 % slower / >2 % faster" if args.rival else ""))
    for name, model in MODELS.items():
        for p, ms in STALLS:
            plain = [run(None, model, seed, p, ms) for seed in range(args.seeds)]
            times = {rule: [run(m, model, seed, p, ms) for seed in range(args.seeds)] for rule, m in rules.items()}
            cells = [f"{rule} {statistics.mean(b / t for b, t in zip(plain, ts)):.4f} "
                     f"({min(b / t for b, t in zip(plain, ts)):.4f})" for rule, ts in times.items()]
            if args.rival:
                pairs = list(zip(times["today"], times[args.rival]))
                cells.append(f"{sum(r > 1.02 * t for t, r in pairs)} / {sum(t > 1.02 * r for t, r in pairs)}")
            print(f"{name:12s} stalls p={p:<4} {ms:5.0f} ms: " + "; ".join(cells))


if __name__ == "__main__":
    main()
