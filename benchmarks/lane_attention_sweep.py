"""The lane attention kernels' settings swept on the GPU (PyTorch and Triton only, no vLLM engine).

Times ``kernels/lane_attention.py`` (both kernels, under ``triton.testing.do_bench_cudagraph``) on
``lane_attention_compare.make_case`` inputs -- Ouro-1.4B and Huginn-0125 head shapes, 4-256 lanes,
64-1,024 committed positions -- with block tables 64 blocks (1,024 tokens) and 512 blocks (8,192
tokens) wide, after checking each setting against the PyTorch lane attention:

* ``default``: the module's settings as they are;
* ``P{pieces}s{split}``: a fixed number of programs per (lane, KV head) and a minimum piece;
* ``w{prefix warps}m{merge warps}`` (64-block tables): warps per program of the two kernels.

One JSON line per case; benchmarks/RESULTS.md (thirteenth run) has the H200's:

    python benchmarks/lane_attention_sweep.py --out benchmarks/results/lane-attention-warps-pieces-h200.jsonl

``--new-vs-old``: the module's settings (``new``) against those before that run (``old``: 4 warps per
program, the prefix split over the whole block table), on a few cases including prefixes past
``SPLIT_SPAN`` in wide tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lane_attention_compare import make_case  # noqa: E402  (one home for the inputs)

CASES = [("ouro-1.4b", 1, 4, p) for p in (64, 128, 352, 1024)] + [("ouro-1.4b", 1, 8, 352)] + \
        [("ouro-1.4b", r, 4, 352) for r in (4, 16, 64)] + [("ouro-1.4b", 64, 4, 1024)] + \
        [("huginn-0125", r, 16, 352) for r in (1, 4)]


NEW_VS_OLD = [("ouro-1.4b", 1, 4, 64), ("ouro-1.4b", 1, 4, 352), ("ouro-1.4b", 1, 4, 1024), ("ouro-1.4b", 4, 4, 352),
              ("ouro-1.4b", 64, 4, 352), ("ouro-1.4b", 1, 4, 3000), ("ouro-1.4b", 16, 4, 3000),
              ("huginn-0125", 1, 16, 352)]


def new_vs_old(la, LaneAttention, do_bench_cudagraph) -> list[str]:
    lines = []
    for shape, requests, lanes, prefix in NEW_VS_OLD:
        for width in (64, 512):
            if prefix > width * 16:
                continue
            paged, scratch, rows, banks, q, k, v = make_case(shape, requests, lanes, prefix, 3, width=width)
            scale = q.shape[-1] ** -0.5
            ids = torch.arange(paged.num_banks, device="cuda")
            want = LaneAttention(paged, scratch, rows)(ids, banks, q, k, v, scale).float()

            def call(**kw):
                return lambda: la.lane_attention(q, k, v, paged.k, paged.v, paged.page_of, ids, banks, rows.prefix,
                                                 rows.slots, rows.block_rows, rows.ancestors, scratch.kv, scale, **kw)

            res = {"shape": shape, "lanes": requests * lanes, "prefix": prefix, "table_tokens": width * paged.block_size}
            warps = (la.PREFIX_WARPS, la.MERGE_WARPS)
            old = {"pieces": -(-width * paged.block_size // la.default_split(requests * lanes, paged.num_heads))}
            for name, kw, w in (("new", {}, warps), ("old", old, (4, 4))):
                la.PREFIX_WARPS, la.MERGE_WARPS = w
                assert (call(**kw)().float() - want).abs().max().item() < 2e-2, (res, name)
                res[name] = round(do_bench_cudagraph(call(**kw)) * 1e3, 2)
            la.PREFIX_WARPS, la.MERGE_WARPS = warps
            lines.append(json.dumps(res))
            print(lines[-1], flush=True)
            del paged, scratch
            torch.cuda.empty_cache()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="lane-attention-sweep.jsonl")
    ap.add_argument("--new-vs-old", action="store_true", help="the module's settings against the thirteenth run's")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lane_attention_sweep.py needs a CUDA GPU")
    from triton.testing import do_bench_cudagraph

    import vllm_loop_kernels.lane_attention as la
    from vllm_loop.loopspec.lane_kv import LaneAttention

    if args.new_vs_old:
        Path(args.out).write_text("\n".join(new_vs_old(la, LaneAttention, do_bench_cudagraph)) + "\n")
        return
    warps = (la.PREFIX_WARPS, la.MERGE_WARPS)
    lines = []
    for shape, requests, lanes, prefix in CASES:
        for width in (64, 512):
            paged, scratch, rows, banks, q, k, v = make_case(shape, requests, lanes, prefix, 3, width=width)
            scale = q.shape[-1] ** -0.5
            ids = torch.arange(paged.num_banks, device="cuda")
            want = LaneAttention(paged, scratch, rows)(ids, banks, q, k, v, scale).float()

            def call(**kw):
                return lambda: la.lane_attention(q, k, v, paged.k, paged.v, paged.page_of, ids, banks, rows.prefix,
                                                 rows.slots, rows.block_rows, rows.ancestors, scratch.kv, scale, **kw)

            res = {"shape": shape, "lanes": requests * lanes, "prefix": prefix, "table_tokens": width * paged.block_size}
            variants = {"default": {}} | {f"P{p}s{s}": {"pieces": p, "split": s} for p in (4, 8, 16, 32) for s in (16, 32)}
            for name, kw in variants.items():
                err = (call(**kw)().float() - want).abs().max().item()
                if err > 2e-2:
                    raise AssertionError(f"{shape} {res} {name}: max abs error {err:.3g}")
                res[name] = round(do_bench_cudagraph(call(**kw)) * 1e3, 2)
            if width == 64:
                for pw in (1, 2, 4):
                    for mw in (1, 4):
                        la.PREFIX_WARPS, la.MERGE_WARPS = pw, mw
                        res[f"w{pw}m{mw}"] = round(do_bench_cudagraph(call()) * 1e3, 2)
                la.PREFIX_WARPS, la.MERGE_WARPS = warps
            lines.append(json.dumps(res))
            print(lines[-1], flush=True)
            del paged, scratch
            torch.cuda.empty_cache()
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
