"""``x @ w.T`` for a handful of rows (Triton), and the choice between it and cuBLAS, made by timing.

A lane step at one request multiplies 4-8 rows by every weight matrix of the shared block: pure
weight streaming. cuBLAS does that near the H200's bandwidth for the wide matrices, but for the
square attention output (Ouro-1.4B's 2,048 x 2,048) it picked a split-K kernel plus a reduction:
10.7 us for 8.4 MB, a quarter of the bandwidth (benchmarks/RESULTS.md, eleventh run). Here each
program streams ``BLOCK_N`` whole rows of ``w`` and multiplies them with all rows of ``x`` at once.

Which is faster depends on the shape and the GPU, so ``GemmChoice`` times cuBLAS and a few
configurations of the kernel the first time it sees a (rows, out, in, dtype) and keeps the fastest.
16-bit inputs only: fp32 goes to cuBLAS (``tl.dot`` would round fp32 to TF32).

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how CI checks it against ``torch``).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger("vllm.plugins.vllm_loop_kernels.skinny_gemm")  # inside vLLM's logger tree

MAX_ROWS = 16  # tl.dot's smallest row tile: fewer rows are masked, more go to cuBLAS
# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried against cuBLAS
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


def _time(fn, reps: int = 20) -> float:
    """Mean seconds per call of ``fn`` on the current stream (after a warm-up that also compiles)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


class GemmChoice:
    """``linear(x, w)``: cuBLAS or ``skinny_gemm``, whichever timed faster for this (rows, out, in,
    dtype) the first time it came. Nothing is timed while a CUDA graph is being captured (cuBLAS then,
    until a later call outside a capture decides); lane graphs warm every call up before they capture
    it, so the decision is made by then."""

    def __init__(self):
        self.choice: dict[tuple, tuple | None] = {}  # key -> a config, or None: cuBLAS
        self.times: dict[tuple, dict] = {}  # key -> seconds per call of each candidate (for logs)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.dtype not in (torch.float16, torch.bfloat16) or not x.is_cuda:
            return torch.nn.functional.linear(x, w)
        key = (x.shape[0], *w.shape, x.dtype)
        if key not in self.choice:
            if torch.cuda.is_current_stream_capturing():
                return torch.nn.functional.linear(x, w)
            self.times[key] = self._time_all(x, w)
            self.choice[key] = min(self.times[key], key=self.times[key].get)
            logger.info("lane GEMM %s", self._line(key))
        config = self.choice[key]
        return torch.nn.functional.linear(x, w) if config is None else skinny_gemm(x, w, config)

    @staticmethod
    def _time_all(x: torch.Tensor, w: torch.Tensor) -> dict:
        times = {None: _time(lambda: torch.nn.functional.linear(x, w))}
        for config in CONFIGS:
            times[config] = _time(lambda: skinny_gemm(x, w, config))
        return times

    def _line(self, key: tuple) -> str:
        """The shape, cuBLAS's time, and the chosen kernel's."""
        (m, n, k, _), times, config = key, self.times[key], self.choice[key]
        chosen = "cuBLAS" if config is None else f"Triton {config} {times[config] * 1e6:.1f} us"
        return f"{m}x{k} @ {k}x{n}: cuBLAS {times[None] * 1e6:.1f} us; chosen: {chosen}"

    def describe(self) -> list[str]:
        """One line per decision (for logs and benchmarks)."""
        return [self._line(key) for key in sorted(self.times, key=lambda key: key[:3])]
