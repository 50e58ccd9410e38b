"""``second(first(x) + residual)`` in one Triton kernel: two RMSNorms and the residual add between them.

Ouro's sandwich layers norm every sublayer's output before adding it to the residual stream, and the
stream is normed again for the next sublayer: two norm kernels at every seam, four per layer. Inside
vLLM's compiled forward Inductor fuses each pair; LoopSpec's lane calls run the layers outside it
(``vllm_loop/loopspec/lane_graphs.py``), where every kernel also costs its launch gap in a CUDA graph.
The arithmetic is vLLM's native ``rms_norm`` and ``fused_add_rms_norm`` (``vllm.ir``): fp32
statistics, each norm rounded to the input dtype before its weight, the sum kept in fp32 for the
second norm's statistics and stored rounded as the new residual.

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how CI checks it against vLLM's norms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_add_norm_kernel(x_ptr, sx, res_ptr, sr, out_ptr, so, wa_ptr, wb_ptr, eps_a, eps_b, H,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < H
    x = tl.load(x_ptr + row * sx + c, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    # each norm rounds to the input dtype before its weight; the product of two such values is exact in
    # fp32, so multiplying there and rounding once is the dtype's own multiply
    wa = tl.load(wa_ptr + c, mask=mask, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps_a)).to(ty).to(tl.float32) * wa
    z = y.to(ty).to(tl.float32) + tl.load(res_ptr + row * sr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_ptr + row * sr + c, z.to(ty), mask=mask)
    wb = tl.load(wb_ptr + c, mask=mask, other=0.0).to(tl.float32)
    out = (z * tl.rsqrt(tl.sum(z * z, axis=0) / H + eps_b)).to(ty).to(tl.float32) * wb
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
