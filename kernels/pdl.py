"""Programmatic dependent launch (PDL) for the lane kernels: the one switch, read where they launch.

A lane call at a few rows is a chain of short kernels (an Ouro-1.4B layer: seam norm, qkv, lane
attention, output projection, seam norm, gate / up, down), and each one's launch, first loads and
tail are a large part of its time (the o projection: ~6 us for 8 MB, ~2 us of streaming at the
H200's copy bandwidth). On Hopper a kernel launched with PDL may start while the kernel before it
in the stream still runs: its programs wait (``gdc_wait``) before they read anything that kernel may
have written, and what comes before the wait overlaps that kernel's tail. The few-rows GEMMs load
their first weight tile there (no kernel writes weights); the others only get their launch overlapped.

The rules every kernel launched with PDL here keeps: before ``gdc_wait`` it reads only weights and
writes nothing; right after it, it calls ``gdc_launch_dependents``, so the next kernel's programs
may start (and load their weights) while this one runs; they too wait for its end before reading
its output. Kernels launched without PDL (cuBLAS, PyTorch's) start after the one before has ended,
as always, so a chain may mix both.

Off unless ``VLLM_LOOP_PDL=1``, on CUDA devices of compute capability 9 or above: with cuBLAS's GEMMs in
the chain it made an Ouro-1.4B recurrent step 4.5 % slower on an H100 (benchmarks/RESULTS.md),
and together with the Triton GEMMs (``VLLM_LOOP_LANE_GEMM=triton``) 1.9 % slower
than the default chain on the H200 (benchmarks/RESULTS.md); ``benchmarks/probes/lane_gemm_compare.py --chain`` times the chain alone.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "VLLM_LOOP_PDL"


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (read at each launch: a benchmark sets the
    variable for one engine of several in one process)."""
    return os.environ.get(ENV) == "1" and device.type == "cuda" and _hopper(device.index)


def compiled(pdl: bool) -> bool:
    """Whether a kernel asked to use PDL waits and launches that way: not under Triton's interpreter
    (the CPU's tests), which runs one program at a time and has no such instructions."""
    return pdl and not triton.knobs.runtime.interpret


@functools.lru_cache
def _hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_inputs(GDC: tl.constexpr):
    """In a kernel launched with PDL (``GDC``): wait for the kernel before to end, then let the next
    one start. Everything before this call may read only weights, and write nothing."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
