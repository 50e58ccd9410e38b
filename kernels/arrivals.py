"""Arrival counters for "the last program to finish merges" (split-K style) kernels.

A kernel whose programs each compute a partial result can merge them in the same launch: every
program stores its partial, bumps an atomic counter of its output tile, and the one that sees the
last count sums the partials (in a fixed order, so the result does not depend on which arrived last)
and re-arms the counter to zero. So the counters are zero between launches, and a CUDA graph
replays them as they are. One buffer per (device, owner): kernels of different owners never share
counters, whatever streams they run on.
"""

from __future__ import annotations

import torch

COUNTERS = 1 << 20
_counters: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counters(device: torch.device, needed: int, owner: str) -> torch.Tensor:
    """At least ``needed`` int32 counters, zero, for ``owner``'s kernels on ``device``. Allocated
    once, outside graph capture: a buffer made during capture would live in the graph's private pool."""
    counters = _counters.get((device, owner))
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: {needed} arrival counters needed under CUDA graph capture; "
                               "run the call once eagerly first (as graph warm-ups do)")
        counters = _counters[(device, owner)] = torch.zeros(max(needed, COUNTERS), dtype=torch.int32, device=device)
    return counters
