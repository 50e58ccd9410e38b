"""The seams of sandwich-norm layers in one Triton kernel each: two RMSNorms and the residual add.

Ouro's and Huginn's sandwich layers norm every sublayer's output as well as its input: two norm
kernels and an add at every seam. Inside vLLM's compiled forward Inductor fuses them; LoopSpec's lane
calls (``vllm_loop/loopspec/lane_graphs.py``) and vLLM's forward without torch.compile (a LoopSpec
engine's default on one GPU) run them as written, where every kernel also costs its launch gap in a
CUDA graph. Two seams:

* ``norm_add_norm`` -- Ouro: ``second(first(x) + residual)`` (the sublayer's output normed, added to
  the residual stream, the stream normed for the next sublayer);
* ``add_norm_norm`` -- Huginn: ``x = first(a + x)``, then ``second(x)`` (the stream itself normed after
  the add, then normed again as the next sublayer's input).

The arithmetic is vLLM's native ``rms_norm`` / ``fused_add_rms_norm`` and PyTorch's add (``vllm.ir``):
fp32 statistics, each norm rounded to the input dtype before its weight, the product rounded.

Run on CUDA, and on the CPU under
``TRITON_INTERPRET=1`` (how CI checks them against vLLM's norms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _rms_norm(x, w_ptr, eps, H, c, mask, ty):
    """vLLM's RMSNorm of the fp32 row ``x``, in fp32 and not yet rounded: the normed row rounded to
    ``ty``, times the weight (the product of two ``ty`` values is exact in fp32, so rounding it once
    is the dtype's own multiply)."""
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    return (x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)).to(ty).to(tl.float32) * w


@triton.jit
def _add_norm_norm_kernel(a_ptr, sa, x_ptr, sx, x_out_ptr, sxo, h_ptr, sh, wa_ptr, wb_ptr, eps_a, eps_b, H,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < H
    ty = h_ptr.dtype.element_ty
    z = tl.load(a_ptr + row * sa + c, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(x_ptr + row * sx + c, mask=mask, other=0.0).to(tl.float32)
    x = _rms_norm(z.to(ty).to(tl.float32), wa_ptr, eps_a, H, c, mask, ty).to(ty)  # the add rounds, as torch's
    tl.store(x_out_ptr + row * sxo + c, x, mask=mask)
    h = _rms_norm(x.to(tl.float32), wb_ptr, eps_b, H, c, mask, ty)
    tl.store(h_ptr + row * sh + c, h.to(ty), mask=mask)


@triton.jit
def _norm_add_norm_kernel(x_ptr, sx, res_ptr, sr, out_ptr, so, wa_ptr, wb_ptr, eps_a, eps_b, H,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < H
    x = tl.load(x_ptr + row * sx + c, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    y = _rms_norm(x, wa_ptr, eps_a, H, c, mask, ty)
    # the sum stays fp32 for the second norm's statistics (vLLM's native fused add-norm), stored rounded
    z = y.to(ty).to(tl.float32) + tl.load(res_ptr + row * sr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_ptr + row * sr + c, z.to(ty), mask=mask)
    out = _rms_norm(z, wb_ptr, eps_b, H, c, mask, ty)
    tl.store(out_ptr + row * so + c, out.to(ty), mask=mask)


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, weight_a: torch.Tensor, eps_a: float,
                  weight_b: torch.Tensor, eps_b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual [n, H]`` -> ``(rms_norm(r, b), r)`` with ``r = rms_norm(x, a) + residual``;
    ``residual`` is updated in place (as vLLM's fused add-norm does) and returned."""
    n, H = x.shape
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("norm_add_norm needs rows contiguous in the hidden dimension")
    out = torch.empty_like(x)
    if n:
        _norm_add_norm_kernel[(n,)](x, x.stride(0), residual, residual.stride(0), out, out.stride(0),
                                    weight_a, weight_b, eps_a, eps_b, H, BLOCK=triton.next_power_of_2(H))
    return out, residual


def add_norm_norm(a: torch.Tensor, x: torch.Tensor, weight_a: torch.Tensor, eps_a: float,
                  weight_b: torch.Tensor, eps_b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, x [n, H]`` -> ``(y, rms_norm(y, b))`` with ``y = rms_norm(a + x, a)`` (new tensors)."""
    n, H = x.shape
    if a.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("add_norm_norm needs rows contiguous in the hidden dimension")
    y, h = torch.empty_like(x), torch.empty_like(x)
    if n:
        _add_norm_norm_kernel[(n,)](a, a.stride(0), x, x.stride(0), y, y.stride(0), h, h.stride(0), weight_a,
                                    weight_b, eps_a, eps_b, H, BLOCK=triton.next_power_of_2(H))
    return y, h
