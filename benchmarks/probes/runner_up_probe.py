"""Where greedy LoopSpec loses a whole pipeline, and what a runner-up second proposal would win back
(teacher-forced, on the reference model: an estimate, not the engine).

Under greedy decoding a token costs the pipeline ~(R - d1) recurrent steps when both proposals miss
(a "full" commit): the first proposal (argmax at d1) differs from the argmax at R, and the readout
at d2 either agrees with the first proposal (the paper's gate: no second proposal) or misses too. On
random-weight checkpoints those misses are near-ties flipped by bf16 rounding between depths. This
probe runs the reference model (``vllm_loop.reference``) over random tokens, teacher-forced, reads
depths d1, d2 and R, and reports

* the commit shares of the paper's greedy cascade (first / second / full);
* for each ``--margins`` m, the rule "when d2's argmax equals the first proposal and d2's top-two
  logits are within m, propose d2's runner-up as the second proposal": how often it fires (each
  firing runs a sibling subtree for R - d2 recurrent steps) and how many full commits it turns into
  second ones (each saving ~R - d2 recurrent steps).

    python benchmarks/probes/runner_up_probe.py --shape huginn-0125 --d1 1 --d2 5 --margins 0.05 0.1 0.2 0.5

``--late K ...``: late re-proposals instead -- at each depth k (in order, between d2 and R), the
argmax at k proposed as one more sibling when it differs from every token the lane has proposed so
far. Reported per depth set (each prefix of K): how often a sibling is started at each k, how many
full commits it catches, and the recurrent steps a token costs under a simple model (a token whose
proposal was made at depth d costs d - d1 steps beyond one; a full commit R - d1), as gamma (tokens
per R steps) beside the paper's cascade's.

On the H200 (benchmarks/RESULTS.md) the estimate was good news -- exact ties at d2
would catch two thirds of the double rejections while firing on ~1 % of positions -- and the engine
said otherwise: with the rule in the engine (exact ties, since removed) it fired on ~12 % of the
committed tokens, and LoopSpec at 1:5 went from 6.9x to 5.5x vanilla.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: loopspec_speed
from loopspec_speed import SHAPES, make_shape_checkpoint  # noqa: E402
from vllm_loop.reference import load_reference


def cascade_shares(a1, a2, r2, m2, aR, margins) -> dict:
    """Commit shares of the greedy cascade per position (tensors of token ids and d2's margin)."""
    first = a1 == aR
    gate_open = a2 != a1
    second = ~first & gate_open & (a2 == aR)
    n = a1.numel()
    out = {"positions": n, "first": first.float().mean().item(), "second": second.float().mean().item(),
           "full": (~first & ~second).float().mean().item(), "gate_open": gate_open.float().mean().item()}
    full = ~first & ~second
    rows = []
    for m in margins:
        fires = ~gate_open & (m2 < m)  # the runner-up is proposed (a sibling subtree is started)
        caught = full & fires & (r2 == aR)
        rows.append({"margin": m, "fires": fires.float().mean().item(), "caught": caught.float().mean().item(),
                     "full_left": (full & ~caught).float().mean().item(),
                     "caught_per_firing": caught.sum().item() / max(fires.sum().item(), 1)})
    out["runner_up"] = rows
    # d2's margin at the positions that ended in a full commit with the gate closed: how near the tie was
    closed_full = full & ~gate_open
    if closed_full.any():
        q = torch.quantile(m2[closed_full].float(), torch.tensor([0.25, 0.5, 0.75, 0.9], device=m2.device))
        out["closed_full_margin_quartiles"] = [round(x, 4) for x in q.tolist()]
        out["closed_full_runner_up_is_R"] = (r2[closed_full] == aR[closed_full]).float().mean().item()
    out["all_margin_quartiles"] = [round(x, 4) for x in torch.quantile(
        m2.float(), torch.tensor([0.01, 0.05, 0.25, 0.5], device=m2.device)).tolist()]
    return out


def late_reproposals(a1, a2, aR, late: dict, d1: int, d2: int, R: int) -> list[dict]:
    """Greedy cascade with late re-proposals at the depths of ``late`` ({k: argmax at k}, in order):
    one row per prefix of the depth list."""
    gate_open = a2 != a1
    first = a1 == aR
    second = ~first & gate_open & (a2 == aR)
    rows = []
    for upto in range(len(late) + 1):
        depths = list(late)[:upto]
        proposed = [a1, torch.where(gate_open, a2, a1)]
        caught_any = first | second
        row = {"late_depths": depths, "fires": {}, "catches": {}}
        lost = second.float() * (d2 - d1)
        for k in depths:
            ak = late[k]
            fires = torch.stack([ak != t for t in proposed]).all(0)  # a new token: a sibling at k
            catch = ~caught_any & fires & (ak == aR)
            row["fires"][k] = round(fires.float().mean().item(), 5)
            row["catches"][k] = round(catch.float().mean().item(), 5)
            lost += catch.float() * (k - d1)
            caught_any |= catch
            proposed.append(ak)
        full = ~caught_any
        lost += full.float() * (R - d1)
        row["full"] = round(full.float().mean().item(), 5)
        row["steps_per_token"] = round(1 + lost.mean().item(), 4)
        row["gamma_model"] = round(R / row["steps_per_token"], 2)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="huginn-0125")
    ap.add_argument("--agreement", default="0.001")
    ap.add_argument("--checkpoint", help="an existing checkpoint folder of the shape (else one is made)")
    ap.add_argument("--d1", type=int, required=True)
    ap.add_argument("--d2", type=int, required=True)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--margins", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2, 0.5])
    ap.add_argument("--late", type=int, nargs="*", default=[], help="late re-proposal depths (d2 < k < R)")
    ap.add_argument("--out", help="JSON file for the result")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp()) / args.shape
    if not args.checkpoint:
        make_shape_checkpoint(args.shape, folder, args.agreement)
    ref = load_reference(folder, dtype=getattr(torch, args.dtype))
    ref.w = {k: v.to(device) for k, v in ref.w.items()}  # the reference keeps its weights in a plain dict
    for name in ("head_weight", "inv_freq"):
        if isinstance(getattr(ref, name, None), torch.Tensor):
            setattr(ref, name, getattr(ref, name).to(device))
    torch.set_default_device(device)  # the reference's positions and KV are made where the weights are
    vocab = ref.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    cols = {k: [] for k in ("a1", "a2", "r2", "m2", "aR")} | {f"late{k}": [] for k in args.late}
    t0 = time.time()
    for _ in range(args.sequences):
        tokens = torch.randint(0, vocab, (args.length,), generator=g, device="cpu").to(device)
        out = ref.forward_depths(tokens, depths=[args.d1, args.d2, ref.depth, *args.late])
        top2 = out[args.d2].topk(2, dim=-1)
        cols["a1"].append(out[args.d1].argmax(-1))
        cols["a2"].append(top2.indices[:, 0])
        cols["r2"].append(top2.indices[:, 1])
        cols["m2"].append(top2.values[:, 0] - top2.values[:, 1])
        cols["aR"].append(out[ref.depth].argmax(-1))
        for k in args.late:
            cols[f"late{k}"].append(out[k].argmax(-1))
        del out
    c = {k: torch.cat(v) for k, v in cols.items()}
    res = {"shape": args.shape, "agreement": args.agreement, "dtype": args.dtype, "device": device,
           "R": ref.depth, "d1": args.d1, "d2": args.d2, "seconds": round(time.time() - t0, 1)}
    res |= cascade_shares(c["a1"], c["a2"], c["r2"], c["m2"], c["aR"], args.margins)
    if args.late:
        res["late"] = late_reproposals(c["a1"], c["a2"], c["aR"], {k: c[f"late{k}"] for k in args.late},
                                       args.d1, args.d2, ref.depth)
    text = json.dumps(res, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
