"""Numerics shared by the reference models, written to match the original modeling code's dtype handling.

Every function is a small pure function of tensors. Shapes: hidden states ``[n, H]`` (one sequence,
no batch dimension), per-head tensors ``[n, heads, head_dim]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Ouro (Qwen2), Huginn and the retrofits compute it: normalise in fp32, cast back to
    the input dtype, then multiply by the gain (in the gain's dtype)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``down(silu(gate x) * up x)``. Raven's fused ``fc`` is ``cat[gate, up]`` (gate first)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# -- rotary position embeddings ------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/d)`` in fp32, optionally with Llama-3 frequency scaling.

    ``scaling`` is an HF ``rope_scaling`` / ``rope_parameters`` dict; only ``default`` and ``llama3``
    occur in the supported checkpoints, anything else is refused rather than silently ignored.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_type={rope_type!r} is not supported by the reference (supported: default, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama-3.x: long wavelengths slowed by ``factor``, short ones kept, a linear blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[n] x [d/2] -> [n, d/2]`` rotation angles, fp32 (position times inverse frequency)."""
    return positions.float()[:, None] * inv_freq[None, :]


def apply_neox_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF Llama / Qwen2 / OLMo-2 RoPE ("rotate_half"): dim i pairs with dim i + d/2.

    cos/sin are computed in fp32 and cast to x's dtype before the multiply, as HF does.
    """
    angles = rope_angles(positions, inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_interleaved_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Huginn RoPE (GPT-J style): dims (2i, 2i+1) rotate as one complex number; computed in fp32."""
    angles = rope_angles(positions, inv_freq)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([re * cos - im * sin, im * cos + re * sin], dim=-1).flatten(-2)
    return rotated.to(x.dtype)


def huginn_freqs_cis(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """Huginn's persistent ``freqs_cis`` buffer ``[1, length, 1, head_dim/2, 2]`` = (cos, sin).

    Only the checkpoint factory writes it (the real checkpoint stores it); the reference recomputes
    angles from positions and ignores the stored table.
    """
    angles = rope_angles(torch.arange(length), rope_inv_freq(head_dim, theta))
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None, :, :]
