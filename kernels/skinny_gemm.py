"""``x @ w.T`` for a handful of rows (Triton): a candidate for the lanes' linear layers, not used by
the engine yet.

A lane step at one request multiplies 4-8 rows by every weight matrix of the shared block: pure
weight streaming. cuBLAS does that near the H200's bandwidth for the wide matrices, but for the
square attention output (Ouro-1.4B's 2,048 x 2,048) it picked a split-K kernel plus a reduction:
10.7 us for 8.4 MB, a quarter of the bandwidth (benchmarks/RESULTS.md, eleventh run). Here each
program streams ``BLOCK_N`` whole rows of ``w`` and multiplies them with all rows of ``x`` at once.
Whether that beats cuBLAS, and in which configuration, is for ``benchmarks/lane_gemm_compare.py`` to
measure on the GPU (under CUDA graphs, as lane calls run): timed eagerly, each call's launch costs
the host more than the product costs the GPU, and that hides the difference. 16-bit inputs only
(``tl.dot`` would round fp32 to TF32).

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how CI checks it against ``torch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # tl.dot's smallest row tile: fewer rows are masked, more go to cuBLAS
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the configurations benchmarks/lane_gemm_compare.py times
CONFIGS = ((16, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (16, 512, 8, 3))


@triton.jit
def _skinny_gemm_kernel(x_ptr, sx, w_ptr, sw, out_ptr, so, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for first in range(0, K, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * sw + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + m[:, None] * so + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config=CONFIGS[0]) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` for ``M <= MAX_ROWS``, 16-bit, fp32 accumulation."""
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_ROWS or w.shape[1] != K:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)}, w {tuple(w.shape)} (at most {MAX_ROWS} rows)")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config
    _skinny_gemm_kernel[(triton.cdiv(N, block_n),)](x, x.stride(0), w, w.stride(0), out, out.stride(0), M, N, K,
                                                    BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
                                                    num_warps=warps, num_stages=stages)
    return out
