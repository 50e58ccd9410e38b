"""``x @ w.T`` for a few rows (Triton), optionally split over K, optionally with SwiGLU's
``silu(gate) * up`` taken on the fly as ``x``: the lanes' MLP down projection (``swiglu_down``).
As a plain GEMM the engine does not use it: cuBLAS is as fast or faster (below; launched with
programmatic dependent launch the chain of Triton kernels was slower still, benchmarks/RESULTS.md).

A lane step at one request multiplies 4-16 rows by every weight matrix of the shared block: pure
weight streaming. cuBLAS does that near the H200's bandwidth for the wide matrices, but not for
Ouro-1.4B's square attention output (2,048 x 2,048: 6.0 us, 1.4 TB/s) or its down projection
(2,048 x 5,632: ~11.9 us, ~2 TB/s). The idea tried here: with so few output columns too few blocks
keep loads in flight, so split K as well. The grid is (output tiles of ``BLOCK_N`` columns) x
(``splits`` slices of K); each program streams ``BLOCK_N`` rows of ``w`` over its slice and
multiplies them with all rows of ``x``. With ``splits > 1`` each program stores its fp32 partial and
the last program of a tile to finish (``arrivals.py``) sums the tile's partials in slice order --
the same sum whichever came last -- and writes the output, in one launch. On the H200
(``benchmarks/probes/lane_gemm_compare.py``) no configuration beat cuBLAS on the attention
output (6.0 us at best, as cuBLAS), and the best on the down projection (32 columns, 8 slices) took
10.9-11.1 us against 11.9: ~1 % of an Ouro-1.4B recurrent step, not worth a second GEMM path.

``swiglu_down`` is where it pays: a lane call's MLP is ``down(silu_and_mul(gate_up(x)))``, and at a few
rows ``silu_and_mul`` is a kernel of almost no work whose launch and gap in the lane graph cost more
than its work, once a layer. Loading the gate and up halves of ``gate_up``'s output and forming the
product as the GEMM's ``x`` removes that kernel (rounded to the dtype as vLLM's ``silu_and_mul``
rounds it: ``silu(gate)`` first, then the product). The gate and up loads go one iteration ahead of
their use: the activation is computed rather than fed to ``tl.dot`` as loaded, and without the manual
prefetch their latency stayed in every iteration (26 us against 14.4 for the two kernels it replaces
on Ouro-1.4B at 4 rows, and 0.28 ms more a recurrent step in the engine). With it, on the H200
(benchmarks/RESULTS.md): 9.8 / 11.1 / 11.6 us against 13.0 / 14.4 / 14.5 at 1 / 4 / 16 rows for
Ouro-1.4B's down projection, 46.6 / 48.6 / 51.2 against 54.9 / 55.3 / 56.0 for Huginn-0125's.

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


# the configurations benchmarks/probes/lane_gemm_compare.py times (splits 1: no split)
CONFIGS = (GemmConfig(16, 256, 4, 4, 1), GemmConfig(32, 128, 4, 4, 1), GemmConfig(64, 128, 4, 3, 1),
           GemmConfig(16, 512, 8, 3, 1),
           GemmConfig(16, 256, 4, 2, 2), GemmConfig(16, 256, 4, 2, 4), GemmConfig(16, 128, 4, 2, 8),
           GemmConfig(32, 256, 4, 2, 4), GemmConfig(32, 128, 4, 2, 8), GemmConfig(16, 256, 4, 1, 8))


@triton.jit
def _gate_up(x_ptr, sx, m, k, M, K, end):
    """SwiGLU's gate and up halves of ``x`` at rows ``m``, columns ``k`` (below ``end``), as stored."""
    mask = (m < M)[:, None] & (k < end)[None, :]
    gate = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=mask, other=0.0)
    return gate, tl.load(x_ptr + m[:, None] * sx + K + k[None, :], mask=mask, other=0.0)


@triton.jit
def _swiglu(gate, up):
    """silu(gate) rounded to the dtype, then times up, rounded again (vLLM's ``silu_and_mul``)."""
    g = gate.to(tl.float32)
    x = (g / (1.0 + tl.exp(-g))).to(up.dtype)
    return (x.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _mma(acc, x, w, IEEE: tl.constexpr):
    if IEEE:
        return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w))


@triton.jit
def _skinny_gemm_kernel(x_ptr, sx, w_ptr, sw, out_ptr, so, part_ptr, count_ptr, M, N, K, K_SLICE,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLITS: tl.constexpr, IEEE: tl.constexpr, GATED: tl.constexpr,
                        PREFETCH: tl.constexpr):
    tile = tl.program_id(0)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = tl.program_id(1) * K_SLICE
    end = tl.minimum(first + K_SLICE, K)
    loop_from = first
    if GATED:  # loaded one iteration ahead: the activation is computed, not fed to tl.dot as loaded,
        #        so Triton's pipelining leaves these loads' latency in every iteration otherwise
        gate_next, up_next = _gate_up(x_ptr, sx, m, loop_from + tl.arange(0, BLOCK_K), M, K, end)
    for start in range(loop_from, end, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        if GATED:  # x is [gate | up]
            gate, up = gate_next, up_next
            if PREFETCH:
                gate_next, up_next = _gate_up(x_ptr, sx, m, k + BLOCK_K, M, K, end)
            else:
                gate, up = _gate_up(x_ptr, sx, m, k, M, K, end)
            x = _swiglu(gate, up)
        else:
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * sw + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        acc = _mma(acc, x, w, IEEE)
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


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: GemmConfig = CONFIGS[0], *, gated: bool = False,
                prefetch: bool = True) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` for ``M <= MAX_ROWS``; fp16, bf16 or fp32, accumulated in fp32.
    ``gated``: ``x`` is ``[M, 2K]``, gate then up, and the product is ``(silu(gate) * up) @ w.T``."""
    M, K = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    N = w.shape[0]
    if M > MAX_ROWS or w.shape[1] != K or (gated and x.shape[1] != 2 * K):
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)}, w {tuple(w.shape)}, gated={gated} "
                         f"(at most {MAX_ROWS} rows)")
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
                                         GATED=gated, PREFETCH=prefetch,
                                         num_warps=config.warps, num_stages=config.stages)
    return out


# The fused down projection's configurations, the fastest of those timed per shape on the
# H200 (results/lane-swiglu-down-h200.txt, 1-16 rows): narrow outputs (Ouro-1.4B's 2,048)
# want K in 16 slices to give the GPU enough programs, wide ones (Huginn-0125's 5,280) 64 columns a
# program in 8 slices. Above 16 rows (SWIGLU_MAX_ROWS) it was not timed and lane calls keep vLLM's
# kernels (the plain few-rows GEMM lost to cuBLAS at 64 rows).
SWIGLU_NARROW, SWIGLU_WIDE = GemmConfig(32, 128, 4, 2, 16), GemmConfig(64, 128, 4, 2, 8)
SWIGLU_MAX_ROWS = 16


def swiglu_config(n: int) -> GemmConfig:
    return SWIGLU_NARROW if n <= 4096 else SWIGLU_WIDE


def swiglu_down(h: torch.Tensor, w: torch.Tensor, config: GemmConfig | None = None,
                prefetch: bool = True) -> torch.Tensor:
    """``(silu(gate) * up) @ w.T`` of ``h = [gate | up]`` ``[M, 2F]``, ``w [N, F]``, in one launch
    (``config`` None: ``swiglu_config``)."""
    return skinny_gemm(h, w, config or swiglu_config(w.shape[0]), gated=True, prefetch=prefetch)
