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

    python benchmarks/probes/lane_gemm_compare.py --out benchmarks/results/lane-gemm-compare-h200.txt

``--swiglu`` times the MLP's second half as a lane call runs it instead: vLLM's ``silu_and_mul``
then cuBLAS's down projection (two launches, what lane calls ran before swiglu_down), against
``swiglu_down`` (one) in several configurations, with and without its activation loads one iteration
ahead; needs vLLM:

    python benchmarks/probes/lane_gemm_compare.py --swiglu --rows 1 4 16 --out benchmarks/results/lane-swiglu-down-h200.txt

(Its ``--chain`` mode, a recurrent step's chain of lane kernels with programmatic dependent launch, went
with that option: benchmarks/RESULTS.md has what it measured.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: loopspec_speed

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


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """vLLM's SiLU-and-mul kernel (what a lane call's MLP ran before ``swiglu_down``)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's CUDA ops: torch.ops._C.silu_and_mul)

    out = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
    torch.ops._C.silu_and_mul(out, h)
    return out


def table_head(title: str, first: str, names: list[str], last: str) -> list[str]:
    """A results table's comment line, header and rule: ``| shape | first | rows | names... | last |``."""
    return [f"# {torch.cuda.get_device_name()}, bf16; {title}", f"| shape | {first} | rows | " + " | ".join(names)
            + f" | {last} |", "|---|---|---|" + "---|" * (len(names) + last.count("|") + 1)]


def write_table(lines: list[str], out: str) -> None:
    text = "\n".join(lines) + "\n"
    Path(out).write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="lane-gemm-compare.txt")
    ap.add_argument("--shapes", nargs="+", default=["ouro-1.4b", "huginn-0125"])
    ap.add_argument("--rows", nargs="+", type=int, default=[4, 16, 64])
    ap.add_argument("--swiglu", action="store_true",
                    help="SiLU-and-mul + cuBLAS down projection against the fused swiglu_down")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lane_gemm_compare.py needs a CUDA GPU")
    if args.swiglu:
        return swiglu(args)
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench_cudagraph

    from vllm_loop_kernels.skinny_gemm import CONFIGS, skinny_gemm

    def label(c) -> str:  # columns x K-step, warps, stages, K slices
        return f"{c.block_n}x{c.block_k} w{c.warps} s{c.stages} k{c.splits}"

    names = ["cuBLAS"] + [label(c) for c in CONFIGS]
    lines = table_head("us per call (do_bench_cudagraph); GB/s of weights read by the fastest (from HBM: each call "
                       "streams its own copy)", "matrix", names, "fastest | GB/s")
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
    write_table(lines, args.out)


def swiglu(args) -> None:
    """us per down projection with its activation: vLLM's ``silu_and_mul`` + cuBLAS, ``swiglu_down`` in
    several configurations (with and without the activation loads one iteration ahead), and the plain
    few-rows GEMM on the activation (no SiLU inside), per shape and row count."""
    from triton.testing import do_bench_cudagraph

    from vllm_loop_kernels.skinny_gemm import SWIGLU_NARROW, SWIGLU_WIDE, GemmConfig, skinny_gemm, swiglu_down

    plain = GemmConfig(32, 128, 4, 2, 8)  # the plain GEMM's fastest on the down projections (benchmarks/RESULTS.md)
    configs = [plain, GemmConfig(16, 256, 4, 2, 4), GemmConfig(32, 256, 4, 2, 4), GemmConfig(16, 128, 4, 2, 8),
               GemmConfig(32, 128, 4, 3, 8), SWIGLU_WIDE, SWIGLU_NARROW]
    label = lambda c: f"{c.block_n}x{c.block_k} w{c.warps} s{c.stages} k{c.splits}"  # noqa: E731
    variants = {"silu_and_mul + cuBLAS": lambda h, w: torch.nn.functional.linear(silu_and_mul(h), w),
                f"fused {label(plain)} no prefetch": lambda h, w: swiglu_down(h, w, plain, prefetch=False)}
    variants |= {f"fused {label(c)}": lambda h, w, c=c: swiglu_down(h, w, c) for c in configs}
    variants[f"plain GEMM on the activation {label(plain)}"] = None  # timed on a precomputed activation
    names = list(variants)
    lines = table_head("us per call (do_bench_cudagraph, each call its own copy of the weights); the first column is "
                       "what a lane call ran before swiglu_down", "down", names, "fastest")
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        n, f = shared_block_matrices(shape)["down"]
        copies = max(2, -(-2**28 // (n * f * 2)))
        ws = [torch.randn(n, f, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        for m in args.rows:
            h = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16, generator=g)
            act = silu_and_mul(h)
            want = torch.nn.functional.linear(act, ws[0]).float()
            times = []
            for name, fn in variants.items():
                if fn is None:
                    fn = lambda h, w: skinny_gemm(act, w, plain)  # noqa: E731
                err = (fn(h, ws[0]).float() - want).abs().max().item()
                if err > 0.02 * want.abs().max().item():
                    raise AssertionError(f"{shape} rows {m} {name}: max abs error {err:.3g}")
                times.append(do_bench_cudagraph(lambda: [fn(h, w) for w in ws]) * 1e3 / copies)
            best = min(range(len(times)), key=times.__getitem__)
            lines.append(f"| {shape} | {n}x{f} | {m} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {names[best]} |")
            print(lines[-1], flush=True)
    write_table(lines, args.out)



if __name__ == "__main__":
    main()
