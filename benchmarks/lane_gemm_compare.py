"""Lane GEMMs: cuBLAS against the few-rows Triton kernel (``kernels/skinny_gemm.py``), GPU only.

A lane step multiplies a handful of rows (16 padded rows at one request, ~64 at four) by every
weight matrix of the shared block. This times ``torch.nn.functional.linear`` (cuBLAS) and each
configuration of the Triton kernel's ``CONFIGS`` (without and with K split) on the shared block's four matrices of a benchmark shape, at 4-64 rows, under CUDA
graphs (``triton.testing.do_bench_cudagraph``: lane calls replay graphs, and eager timing would
measure the host's launches instead), after checking each against an fp32 product. Each timed call
multiplies by enough copies of the matrix to pass 256 MB, one after another as a lane step's layers
do: one matrix alone would stay in the 50 MB L2 cache between repetitions, and a lane step streams
its weights from HBM. It needs only
PyTorch and Triton (no vLLM), so it runs on a bare GPU host in a few seconds:

    python benchmarks/lane_gemm_compare.py --out benchmarks/results/lane-gemm-compare-h200.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loopspec_speed import SHAPES  # noqa: E402  (the benchmark shapes' configs: one home)


def shared_block_matrices(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) of the shared block's fused linear layers of a benchmark shape."""
    family, _, c, _ = SHAPES[shape]
    if family == "ouro":
        H, D, heads, kv, F = (c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"],
                              c["intermediate_size"])
        return {"qkv": ((heads + 2 * kv) * D, H), "o": (H, heads * D), "gate_up": (2 * F, H), "down": (H, F)}
    H, F = c["n_embd"], c["intermediate_size"]
    return {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * F, H), "down": (H, F)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="lane-gemm-compare.txt")
    ap.add_argument("--shapes", nargs="+", default=["ouro-1.4b", "huginn-0125"])
    ap.add_argument("--rows", nargs="+", type=int, default=[4, 16, 64])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lane_gemm_compare.py needs a CUDA GPU")
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench_cudagraph

    from vllm_loop_kernels.skinny_gemm import CONFIGS, skinny_gemm

    def label(c) -> str:  # columns x K-step, warps, stages, K slices
        return f"{c.block_n}x{c.block_k} w{c.warps} s{c.stages} k{c.splits}"

    names = ["cuBLAS"] + [label(c) for c in CONFIGS]
    lines = [f"# {torch.cuda.get_device_name()}, bf16; us per call (do_bench_cudagraph); GB/s of weights read by "
             "the fastest (from HBM: each call streams its own copy)",
             "| shape | matrix | rows | " + " | ".join(names) + " | fastest | GB/s |",
             "|---|---|---|" + "---|" * (len(names) + 2)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        for name, (n, k) in shared_block_matrices(shape).items():
            copies = max(2, -(-2**28 // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
            w = ws[0]
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                want = (x.float() @ w.float().T)
                products = [lambda w: torch.nn.functional.linear(x, w)] + \
                           [lambda w, c=c: skinny_gemm(x, w, c) for c in CONFIGS]
                times = []
                for product in products:
                    try:
                        got = product(w)
                    except OutOfResources:  # a configuration too large for this many rows (shared memory)
                        times.append(float("inf"))
                        continue
                    err = (got.float() - want).abs().max().item()
                    if err > 0.05 * want.abs().max().item():
                        raise AssertionError(f"{shape} {name} rows {m}: max abs error {err:.3g}")
                    times.append(do_bench_cudagraph(lambda: [product(wi) for wi in ws]) * 1e3 / copies)
                best = min(range(len(times)), key=times.__getitem__)
                gbs = n * k * 2 / (times[best] * 1e-6) / 1e9
                lines.append(f"| {shape} | {name} {n}x{k} | {m} | " + " | ".join(f"{t:.1f}" for t in times)
                             + f" | {names[best]} | {gbs:.0f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
