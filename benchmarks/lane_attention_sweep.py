"""The lane attention kernels' settings swept on the GPU (PyTorch and Triton only, no vLLM engine).

Times ``kernels/lane_attention.py`` (both kernels, under ``triton.testing.do_bench_cudagraph``) on
``lane_attention_compare.make_case`` inputs -- Ouro-1.4B and Huginn-0125 head shapes, 4-256 lanes,
64-1,024 committed positions -- with block tables 64 blocks (1,024 tokens) and 512 blocks (8,192
tokens) wide, after checking each setting against the PyTorch lane attention:

* ``default``: the module's settings as they are;
* ``P{pieces}s{split}``: a fixed number of programs per (lane, KV head) and a minimum piece;
* ``w{lane warps}m{merge warps}`` (64-block tables): warps per program of the lane kernel and of
  the two-pass merge kernel (not launched where a call merges one-pass).

One JSON line per case; benchmarks/RESULTS.md (benchmarks/RESULTS.md) has the H200's:

    python benchmarks/lane_attention_sweep.py --out benchmarks/results/lane-attention-warps-pieces-h200.jsonl

``--new-vs-old``: the module's settings (``new``) against those before that run (``old``: 4 warps per
program, the prefix split over the whole block table), on a few cases including prefixes past
``SPLIT_SPAN`` in wide tables. ``--merge``: the one-pass merge (the last program of a (lane, head)
merges) against the two-pass one (a second kernel merges), on every case of the sweep (the module's
``MERGE = "auto"`` picks by the number of (lane, KV head) pairs):

    python benchmarks/lane_attention_sweep.py --merge --out benchmarks/results/lane-attention-merge-h200.jsonl

``--ancestors FILE``: deep lane windows -- Huginn-0125 lanes with ancestor lists as wide as an R=32
pipeline's lane cap (63) and up to 3 / 31 / 63 ancestors each -- timed with the module's kernel and
with the kernel in FILE (an earlier copy of ``kernels/lane_attention.py``), same inputs:

    git show 7432c9e:kernels/lane_attention.py > /tmp/old.py
    python benchmarks/lane_attention_sweep.py --ancestors /tmp/old.py --out lane-attention-ancestors.jsonl

``--blocks``: the lane kernel at 1 / 2 / 4 warps per program, 2 to 64 positions a step
(``BLOCK_N``) and the module's split or 64 / 128 positions a program (``w{warps}n{positions}s{split}``),
on the engine's lane counts at one and four requests: Huginn-0125 (1:5, ~28 lanes a request, up to 31
ancestors each) and Ouro-1.4B (1:2, ~4):

    python benchmarks/lane_attention_sweep.py --blocks --out lane-attention-blocks.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lane_attention_compare import BLOCK, make_case  # noqa: E402  (one home for the inputs)

CASES = [("ouro-1.4b", 1, 4, p) for p in (64, 128, 352, 1024)] + [("ouro-1.4b", 1, 8, 352)] + \
        [("ouro-1.4b", r, 4, 352) for r in (4, 16, 64)] + [("ouro-1.4b", 64, 4, 1024)] + \
        [("huginn-0125", r, 16, 352) for r in (1, 4)]


# (shape, requests, lanes a request, committed positions, ancestors up to)
BLOCKS = [("huginn-0125", 1, 28, 352, 31), ("huginn-0125", 4, 28, 352, 31), ("huginn-0125", 1, 28, 1024, 31),
          ("ouro-1.4b", 1, 4, 352, 3), ("ouro-1.4b", 4, 4, 352, 3), ("ouro-1.4b", 16, 4, 352, 3)]

NEW_VS_OLD = [("ouro-1.4b", 1, 4, 64), ("ouro-1.4b", 1, 4, 352), ("ouro-1.4b", 1, 4, 1024), ("ouro-1.4b", 4, 4, 352),
              ("ouro-1.4b", 64, 4, 352), ("ouro-1.4b", 1, 4, 3000), ("ouro-1.4b", 16, 4, 3000),
              ("huginn-0125", 1, 16, 352)]


def checked_us(call, want: torch.Tensor, what: str) -> float:
    """Microseconds per ``call()`` (CUDA graphs), after checking its output against ``want`` (bf16:
    max abs error <= 2e-2)."""
    from triton.testing import do_bench_cudagraph

    err = (call().float() - want).abs().max().item()
    if err > 2e-2:
        raise AssertionError(f"{what}: max abs error {err:.3g}")
    return round(do_bench_cudagraph(call) * 1e3, 2)


def emit(lines: list[str], res: dict) -> None:
    """One case's JSON line, kept and printed; the case's tensors (deleted by the caller) freed."""
    lines.append(json.dumps(res))
    print(lines[-1], flush=True)
    torch.cuda.empty_cache()


def sweep(cases, settings, widths=(64, 512)) -> list[str]:
    """Each case (shape, requests, lanes a request, prefix[, ancestors up to: 3]) at each table width:
    every setting of ``settings(case, width, paged)`` (name -> (``lane_attention`` arguments, the
    module's constants to override, or None)) checked against the PyTorch lane attention, then timed;
    one JSON line per case and width."""
    import vllm_loop_kernels.lane_attention as la
    from vllm_loop.loopspec.lane_kv import LaneAttention

    lines = []
    for case in cases:
        shape, requests, lanes, prefix = case[:4]
        window = case[4] if len(case) > 4 else 3
        for width in widths:
            if prefix > width * BLOCK:
                continue
            paged, scratch, rows, banks, q, k, v = make_case(shape, requests, lanes, prefix, window, width=width)
            scale = q.shape[-1] ** -0.5
            ids = torch.arange(paged.num_banks, device=q.device)
            want = LaneAttention(paged, scratch, rows)(ids, banks, q, k, v, scale).float()

            def call(**kw):
                return lambda: la.lane_attention(q, k, v, paged.k, paged.v, paged.page_of, ids, banks, rows.prefix,
                                                 rows.slots, rows.block_rows, rows.ancestors, scratch.kv, scale, **kw)

            res = {"shape": shape, "lanes": requests * lanes, "prefix": prefix, "table_tokens": width * BLOCK,
                   "ancestors_up_to": window}
            for name, (kw, overrides) in settings(case, width, paged).items():
                kept = {a: getattr(la, a) for a in overrides or {}}
                for a, value in (overrides or {}).items():
                    setattr(la, a, value)
                try:
                    res[name] = checked_us(call(**kw), want, f"{res} {name}")
                finally:
                    for a, value in kept.items():
                        setattr(la, a, value)
            del paged, scratch
            emit(lines, res)
    return lines


def settings_swept(case, width, paged) -> dict:
    out = {"default": ({}, None)} | {f"P{p}s{s}": ({"pieces": p, "split": s}, None) for p in (4, 8, 16, 32)
                                     for s in (16, 32)}
    if width == 64:
        out |= {f"w{pw}m{mw}": ({}, {"LANE_WARPS": pw, "MERGE_WARPS": mw}) for pw in (1, 2, 4) for mw in (1, 4)}
    return out


def settings_new_vs_old(case, width, paged) -> dict:
    """The module's settings against the earlier ones: 4 warps, the prefix split over the whole table."""
    from vllm_loop_kernels.lane_attention import default_split

    split = default_split(case[1] * case[2], paged.num_heads)
    return {"new": ({}, None),
            "old": ({"pieces": -(-width * BLOCK // split), "merge": "two-pass"}, {"LANE_WARPS": 4, "MERGE_WARPS": 4})}


def settings_merge(case, width, paged) -> dict:
    return {"one-pass": ({"merge": "one-pass"}, None), "two-pass": ({"merge": "two-pass"}, None)}


def settings_blocks(case, width, paged) -> dict:
    """Warps per program x positions a step x positions a program (a multiple of the step)."""
    from vllm_loop_kernels.lane_attention import default_split

    own = default_split(case[1] * case[2], paged.num_heads)
    return {f"w{w}n{n}s{s}": ({"split": s}, {"LANE_WARPS": w, "BLOCK_N": n})
            for w in (1, 2, 4) for n in (2, 4, 8, 16, 32, 64) for s in sorted({own, 64, 128}) if s % n == 0}


def ancestors_sweep(baseline: str) -> list[str]:
    """The module's kernel and ``baseline``'s on lanes with deep ancestor lists (``--ancestors``)."""
    import importlib.util

    import vllm_loop_kernels.lane_attention as la
    from vllm_loop.loopspec.lane_kv import LaneAttention

    spec = importlib.util.spec_from_file_location("baseline_lane_attention", baseline)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    lines = []
    for lanes in (28, 56):
        for deepest in (3, 31, 63):
            paged, scratch, rows, banks, q, k, v = make_case("huginn-0125", 1, lanes, 352, 0, width=256)
            # ancestors in pool slots of their own (no row of the call writes them, as in an engine, where
            # a lane reads its ancestors at its own bank), up to `deepest` a row, -1 padded to the lane cap
            S, n, _, H, D = scratch.kv.shape
            kv = torch.randn(S, n + 64, 2, H, D, device=q.device, dtype=scratch.kv.dtype)
            kv[:, :n] = scratch.kv
            scratch.kv = kv
            g = torch.Generator(device=q.device).manual_seed(lanes + deepest)
            count = torch.randint(0, deepest + 1, (lanes, 1), device=q.device, generator=g)
            a = torch.arange(63, device=q.device)[None, :]
            rows.ancestors = torch.where(a < count, n + a, -1)
            scale = q.shape[-1] ** -0.5
            ids = torch.arange(paged.num_banks, device=q.device)
            want = LaneAttention(paged, scratch, rows)(ids, banks, q, k, v, scale).float()
            res = {"shape": "huginn-0125", "lanes": lanes, "prefix": 352, "ancestor_width": 63,
                   "ancestors_up_to": deepest}
            for name, mod in (("module", la), ("baseline", old)):
                def call(mod=mod):
                    return mod.lane_attention(q, k, v, paged.k, paged.v, paged.page_of, ids, banks, rows.prefix,
                                              rows.slots, rows.block_rows, rows.ancestors, scratch.kv, scale)
                res[f"{name}_us"] = checked_us(call, want, f"{res} {name}")
            del paged, scratch
            emit(lines, res)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="lane-attention-sweep.jsonl")
    ap.add_argument("--new-vs-old", action="store_true", help="the module's settings against the earlier ones")
    ap.add_argument("--merge", action="store_true", help="one-pass merge against two-pass, on the sweep's cases")
    ap.add_argument("--ancestors", metavar="FILE", help="deep lane windows: the module's kernel against FILE's")
    ap.add_argument("--blocks", action="store_true", help="warps x positions a step x a program, engine lane counts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lane_attention_sweep.py needs a CUDA GPU")
    if args.ancestors:
        lines = ancestors_sweep(args.ancestors)
    elif args.blocks:
        lines = sweep(BLOCKS, settings_blocks, widths=(64,))
    elif args.new_vs_old:
        lines = sweep(NEW_VS_OLD, settings_new_vs_old)
    else:
        lines = sweep(CASES, settings_merge if args.merge else settings_swept)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
