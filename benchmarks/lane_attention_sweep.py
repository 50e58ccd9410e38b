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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="lane-attention-sweep.jsonl")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lane_attention_sweep.py needs a CUDA GPU")
    from triton.testing import do_bench_cudagraph

    import vllm_loop_kernels.lane_attention as la
    from vllm_loop.loopspec.lane_kv import LaneAttention

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
