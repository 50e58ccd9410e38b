"""Depth readouts of a looped model inside vLLM: which depths to read, and where they are kept.

A readout at depth r is the post-layers applied to the depth-r state (Ouro: the LM head; Raven: the
coda with its own KV banks for depth r, ``ln_f`` and the head). The ordinary forward reads depth T
only. A deployment that asks for more (``hf_overrides={"readout_depths": [1, 2, ...]}``) gets them
recorded per forward, for tests and depth tuning; recording keeps Python state across the forward,
so it needs eager mode.
"""

from __future__ import annotations

import torch


def parse_readout_depths(config, depth: int) -> tuple[int, ...]:
    """Validated readout depths to record (each in 1..T, sorted)."""
    raw = getattr(config, "readout_depths", None) or ()
    if isinstance(raw, int) or not all(isinstance(r, int) and not isinstance(r, bool) for r in raw):
        raise ValueError(f"readout_depths={raw!r} is invalid: expected a list of integers in 1..{depth}")
    bad = [r for r in raw if not 1 <= r <= depth]
    if bad:
        raise ValueError(f"readout_depths={list(raw)!r} is invalid: each depth must be in 1..{depth} (T={depth})")
    return tuple(sorted(set(raw)))


class ReadoutRecorder:
    """Holds the post-layer hidden states (before the LM head) of the requested depths for the
    tokens of the last forward pass."""

    def __init__(self, depths: tuple[int, ...], vllm_config):
        self.depths = depths
        self.recorded: dict[int, torch.Tensor] = {}
        if depths:
            from vllm.config import CompilationMode

            if vllm_config.compilation_config.mode != CompilationMode.NONE:
                raise ValueError(
                    "readout_depths records per-depth readouts in eager mode only: start the engine with "
                    "enforce_eager=True (--enforce-eager)"
                )

    def wants(self, r: int) -> bool:
        return r in self.depths

    def record(self, r: int, hidden: torch.Tensor) -> None:
        # A copy: on GPU the fused residual-add RMSNorm updates its inputs in place, so the state of
        # depth r would be overwritten while depth r+1 is computed.
        self.recorded[r] = hidden.clone()
