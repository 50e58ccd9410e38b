"""``x @ w.T`` for a few rows (Triton), optionally split over K: a candidate for the lanes' linear
layers that the engine does not use (cuBLAS is as fast or faster; benchmarks/RESULTS.md).

A lane step at one request multiplies 4-16 rows by every weight matrix of the shared block: pure
weight streaming. cuBLAS does that near the H200's bandwidth for the wide matrices, but not for
Ouro-1.4B's square attention output (2,048 x 2,048: 6.0 us, 1.4 TB/s) or its down projection
(2,048 x 5,632: ~11.9 us, ~2 TB/s). The idea tried here: with so few output columns too few blocks
keep loads in flight, so split K as well. The grid is (output tiles of ``BLOCK_N`` columns) x
(``splits`` slices of K); each program streams ``BLOCK_N`` rows of ``w`` over its slice and
multiplies them with all rows of ``x``. With ``splits > 1`` each program stores its fp32 partial and
the last program of a tile to finish (``arrivals.py``) sums the tile's partials in slice order --
the same sum whichever came last -- and writes the output, in one launch. On the H200
(``benchmarks/lane_gemm_compare.py``, 2026-12-03) no configuration beat cuBLAS on the attention
output (6.0 us at best, as cuBLAS), and the best on the down projection (32 columns, 8 slices) took
10.9-11.1 us against 11.9: ~1 % of an Ouro-1.4B recurrent step, not worth a second GEMM path.

fp32 inputs multiply in full fp32 (``input_precision="ieee"``, not TF32). Runs on CUDA, and on the
CPU under ``TRITON_INTERPRET=1`` (how CI checks it against ``torch``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 64  # beyond this cuBLAS's larger tiles fill the GPU anyway (and BLOCK_M x BLOCK_K outgrows shared memory)


class GemmConfig(NamedTuple):
    block_n: int  # output columns per program
    block_k: int  # K per loop iteration
    warps: int
    stages: int
    splits: int  # slices of K (1: no split, each program writes its output directly)


# the configurations benchmarks/lane_gemm_compare.py times (splits 1: no split)
CONFIGS = (GemmConfig(16, 256, 4, 4, 1), GemmConfig(32, 128, 4, 4, 1), GemmConfig(64, 128, 4, 3, 1),
           GemmConfig(16, 512, 8, 3, 1),
           GemmConfig(16, 256, 4, 2, 2), GemmConfig(16, 256, 4, 2, 4), GemmConfig(16, 128, 4, 2, 8),
           GemmConfig(32, 256, 4, 2, 4), GemmConfig(32, 128, 4, 2, 8), GemmConfig(16, 256, 4, 1, 8))


@triton.jit
def _skinny_gemm_kernel(x_ptr, sx, w_ptr, sw, out_ptr, so, part_ptr, count_ptr, M, N, K, K_SLICE,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLITS: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = tl.program_id(1) * K_SLICE
    for start in range(first, tl.minimum(first + K_SLICE, K), BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * sw + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out_mask = (m < M)[:, None] & (n < N)[None, :]
    out = out_ptr + m[:, None] * so + n[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials [SPLITS, BLOCK_M, N]; the barrier orders every thread's stores before the atomic,
        # whose release half publishes them and whose acquire half shows the others' to the last arrival
        part = part_ptr + m[:, None] * N + n[None, :]
        tl.store(part + tl.program_id(1) * BLOCK_M * N, acc, mask=out_mask)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLITS):
                total += tl.load(part + s * BLOCK_M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(count_ptr + tile, 0)  # re-armed for the next launch (and graph replay)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: GemmConfig = CONFIGS[0]) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` for ``M <= MAX_ROWS``; fp16, bf16 or fp32, accumulated in fp32."""
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_ROWS or w.shape[1] != K:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)}, w {tuple(w.shape)} (at most {MAX_ROWS} rows)")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"skinny_gemm: x {x.dtype}, w {w.dtype}; allowed: both of one of {DTYPES}")
    config = GemmConfig(*config)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(M))  # tl.dot's smallest tile
    tiles, splits = triton.cdiv(N, config.block_n), config.splits
    k_slice = triton.cdiv(triton.cdiv(K, splits), config.block_k) * config.block_k
    if splits > 1:
        part = torch.empty(splits, block_m, N, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, tiles, "skinny_gemm")
    else:
        part = counters = out  # never read
    _skinny_gemm_kernel[(tiles, splits)](x, x.stride(0), w, w.stride(0), out, out.stride(0), part, counters,
                                         M, N, K, k_slice, BLOCK_M=block_m, BLOCK_N=config.block_n,
                                         BLOCK_K=config.block_k, SPLITS=splits, IEEE=x.dtype == torch.float32,
                                         num_warps=config.warps,
                                         num_stages=config.stages)
    return out
