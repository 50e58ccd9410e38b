"""Test-time scaling sweep: the same questions with latent_budget = 0..N through one vLLM engine.

Every budget rides in the same batch (one ``generate`` call). Each output's ``token_ids`` / ``text``
is the answer; the latent phase (start, latent positions, end) ends its ``prompt_token_ids``, from
which ``LatentSpec.phase_budget`` reads the budget back. Builds a tiny random checkpoint unless
``--model`` points at a real one (a converted folder: ``python -m vllm_loop.convert``).

    .venv/bin/python examples/latent_budget_sweep.py --family coconut --max-budget 8
    .venv/bin/python examples/latent_budget_sweep.py --model ./CODI-gpt2 --max-budget 6
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

QUESTIONS = [
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\n",
    "Question: A train travels 60 miles in 2 hours. What is its speed?\n",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder of a latent model (default: build a tiny one)")
    ap.add_argument("--family", default="coconut", choices=["coconut", "codi", "lotus"])
    ap.add_argument("--max-budget", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    from vllm import SamplingParams

    from vllm_loop.latent.spec import LatentSpec
    from vllm_loop.testing.checkpoints import make_checkpoint
    from vllm_loop.testing.engines import start_llm, stop_llm

    path = args.model or str(make_checkpoint(args.family, Path(tempfile.mkdtemp()) / args.family))
    spec = LatentSpec.from_config(json.loads((Path(path) / "config.json").read_text()))
    if spec is None:
        raise SystemExit(f"{path} is not a latent-reasoning model (no latent_spec in config.json)")
    budgets = list(range(min(args.max_budget, spec.max_budget) + 1))
    llm = start_llm(path, max_model_len=512)
    try:
        jobs = [(q, b) for q in QUESTIONS for b in budgets]
        t0 = time.time()
        outs = llm.generate([q for q, _ in jobs], [
            SamplingParams(max_tokens=args.max_tokens, temperature=0.0, extra_args={"latent_budget": b})
            for _, b in jobs
        ])
        elapsed = time.time() - t0
    finally:
        stop_llm(llm)

    print(f"{spec.kind} latent model {path}: default budget {spec.default_budget}, "
          f"{len(jobs)} requests in one batch, {elapsed:.1f} s")
    for q in QUESTIONS:
        print(f"\n{q.strip()}")
        print(f"  {'budget':>6}  {'latent positions':>16}  answer tokens")
        for (q2, b), out in zip(jobs, outs):
            if q2 != q:
                continue
            ran = spec.phase_budget(out.prompt_token_ids)  # the step count, read from the output
            print(f"  {ran:>6}  {spec.latent_positions(ran):>16}  {list(out.outputs[0].token_ids)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
