"""Lane attention in one Triton kernel: the paged prefix and the lane window, read in place.

The PyTorch path (``LaneAttention`` in ``vllm_loop/loopspec/lane_kv.py``) gathers every lane's whole
context into new tensors, casts them to fp32 and runs a masked softmax: ~20 kernels per layer, and
memory traffic that grows with rows x padded context. Here one program handles one lane and one KV
head (its group of query heads): it walks the lane's committed prefix through its request's block
table, at the page of the lane's own bank, then its ancestors' and its own K/V in the lane pool,
with an online softmax in fp32 (flash-decoding style, one pass). The lane's own new K/V is stored
into its pool slot here too (the PyTorch path writes it with two scatters per layer first) and
attended to from registers. Decode-shaped: a handful of query heads per program, so the products
are broadcasts, not ``tl.dot``.

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how CI checks it against the PyTorch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(q, k, v, valid, m, l, acc, scale):
    """Fold keys ``k`` / values ``v`` ``[N, D]`` (``valid [N]``) into the running max ``m``, sum ``l``
    and weighted values ``acc`` of the query heads ``q [R, D]``."""
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [R, N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)


@triton.jit
def _lane_attention_kernel(
    q_ptr, sq0, sq1,  # q [n, Hq, D] (last stride 1)
    kn_ptr, skn0, skn1, vn_ptr, svn0, svn1,  # the rows' own new k, v [n, H, D] (last stride 1)
    out_ptr, so0, so1,  # out [n, Hq, D]
    k_ptr, v_ptr, sk0, sk1, sk2, sk3, sk4, sv0, sv1, sv2, sv3, sv4,  # paged K / V [blocks, pages, H, B, D]
    page_of_ptr,  # [banks] page of each global bank
    banks_ptr, prefix_ptr, slots_ptr,  # [n]
    table_ptr, st0, st1,  # block-table rows [n, W]
    anc_ptr, sa0, sa1,  # ancestors [n, A], -1 padded
    pool_ptr, sp0, sp1, sp2, sp3,  # lane pool kv [banks, slots, 2, H, D] (last stride 1)
    scale, A, rep,
    B: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)  # KV head
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rmask, dmask = r < rep, d < D
    qh = head * rep + r  # this group's query heads
    q = tl.load(q_ptr + row * sq0 + qh[:, None] * sq1 + d[None, :], mask=rmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    bank = tl.load(banks_ptr + row)
    page = tl.load(page_of_ptr + bank).to(tl.int64)
    prefix = tl.load(prefix_ptr + row)

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)

    # 1. the committed prefix, from the paged cache at this lane's bank
    for start in range(0, prefix, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jmask = j < prefix
        block = tl.load(table_ptr + row * st0 + (j // B) * st1, mask=jmask, other=0).to(tl.int64)
        off = (j % B).to(tl.int64)
        kv_mask = jmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + block[:, None] * sk0 + page * sk1 + head * sk2 + off[:, None] * sk3 + d[None, :] * sk4,
                    mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + block[:, None] * sv0 + page * sv1 + head * sv2 + off[:, None] * sv3 + d[None, :] * sv4,
                    mask=kv_mask, other=0.0).to(tl.float32)
        m, l, acc = _online_softmax_step(q, k, v, jmask, m, l, acc, scale)

    # 2. the lane's own K/V: into its pool slot (as stored, so self-attention sees the pool's rounding)
    pool_ty = pool_ptr.dtype.element_ty
    own = pool_ptr + bank.to(tl.int64) * sp0 + tl.load(slots_ptr + row).to(tl.int64) * sp1 + head * sp3 + d
    k_own = tl.load(kn_ptr + row * skn0 + head * skn1 + d, mask=dmask, other=0.0).to(pool_ty)
    v_own = tl.load(vn_ptr + row * svn0 + head * svn1 + d, mask=dmask, other=0.0).to(pool_ty)
    tl.store(own, k_own, mask=dmask)
    tl.store(own + sp2, v_own, mask=dmask)

    # 3. the lane window: its ancestors (oldest first) from the lane pool, then itself
    a = tl.arange(0, BLOCK_A)
    slot = tl.load(anc_ptr + row * sa0 + a * sa1, mask=a < A, other=-1)
    ancestor = (slot >= 0) & (a < A)
    base = pool_ptr + bank.to(tl.int64) * sp0 + tl.maximum(slot, 0).to(tl.int64)[:, None] * sp1 + head * sp3 + d[None, :]
    w_mask = ancestor[:, None] & dmask[None, :]
    is_self = a == A
    k = tl.where(is_self[:, None], k_own.to(tl.float32)[None, :], tl.load(base, mask=w_mask, other=0.0).to(tl.float32))
    v = tl.where(is_self[:, None], v_own.to(tl.float32)[None, :],
                 tl.load(base + sp2, mask=w_mask, other=0.0).to(tl.float32))
    m, l, acc = _online_softmax_step(q, k, v, ancestor | is_self, m, l, acc, scale)

    out = acc / l[:, None]
    tl.store(out_ptr + row * so0 + qh[:, None] * so1 + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


def lane_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                   v_pages: torch.Tensor, page_of: torch.Tensor, banks: torch.Tensor, prefix: torch.Tensor,
                   slots: torch.Tensor, block_rows: torch.Tensor, ancestors: torch.Tensor, pool: torch.Tensor,
                   scale: float, block_n: int = 32) -> torch.Tensor:
    """``q [n, Hq, D]`` and new ``k, v [n, H, D]`` of lanes at global banks ``banks [n]``; each
    stores its k, v in the lane pool ``pool [banks, slots, 2, H, D]`` at its own ``slots [n]``, and
    reads positions ``0..prefix-1`` of its request (``block_rows [n, W]``, kernel blocks of
    ``k_pages / v_pages [blocks, pages, H, B, D]``, bank -> page by ``page_of``), then the pool at its
    ``ancestors [n, A]`` (-1 padded), then itself. Returns ``[n, Hq, D]`` in q's dtype."""
    n, Hq, D = q.shape
    H, B = k_pages.shape[2], k_pages.shape[3]
    rep = Hq // H
    if pool.stride(4) != 1:
        raise ValueError("lane_attention needs the lane pool contiguous in the head dimension")
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    A = ancestors.shape[1]
    _lane_attention_kernel[(n, H)](
        q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        out, out.stride(0), out.stride(1),
        k_pages, v_pages, *k_pages.stride(), *v_pages.stride(),
        page_of, banks, prefix, slots,
        block_rows, block_rows.stride(0), block_rows.stride(1),
        ancestors if A else slots.view(n, 1), ancestors.stride(0) if A else 1, ancestors.stride(1) if A else 1,
        pool, pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
        scale, A, rep,
        B=B, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_R=triton.next_power_of_2(rep),
        BLOCK_N=block_n, BLOCK_A=triton.next_power_of_2(A + 1),
    )
    return out
