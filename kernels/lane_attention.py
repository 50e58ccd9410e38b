"""Lane attention in Triton: the paged prefix split over many programs, the lane window beside it,
and the merge, by the last program to finish (one kernel) or by a second kernel.

The PyTorch path (``LaneAttention`` in ``vllm_loop/loopspec/lane_kv.py``) gathers every lane's whole
context into new tensors, casts them to fp32 and runs a masked softmax: ~20 kernels per layer, and
memory traffic that grows with rows x padded context. Here (flash-decoding style, fp32 online
softmax), ``_lane_kernel`` runs one program per (lane, KV head, piece):

* pieces ``0..PIECES-1`` each walk ``split`` positions (more past ``SPLIT_SPAN``) of the lane's
  committed prefix through its request's block table, at the page of the lane's own bank. Why split:
  a decode-shaped lane step has few lanes (4-8 at one request) and each lane walks its whole
  context, so one program per (lane, head) left most of the GPU idle and grew linearly with the
  context (H200, Ouro-1.4B shape, 4 lanes: 10.4 us per layer at 128 positions, 81 us at 1,024;
  split: 9.7 and 25 us; benchmarks/RESULTS.md);
* piece ``PIECES`` stores the lane's own new K/V into its pool slot and attends to itself and to
  its ancestors from the lane pool, ``BLOCK_N`` ancestors at a time (an R=32 lane cap lists up to
  63; all at once, one warp spilled: 111 against 79 us at 28 Huginn-0125 lanes);
* each leaves its running max, sum and weighted values; the last of a (lane, head)'s programs to
  arrive (an atomic counter) folds them into the output ("one-pass"), or ``_merge_kernel`` does
  ("two-pass", the original layout): one-pass for a few (lane, head) pairs, where
  it measured faster in the engine, two-pass for many, where it measured slower (``MERGE``).

A lane's bank is ``bank_ids[depths[lane]]`` (the layer's banks, the lane's depth), looked up here
rather than by a separate indexing kernel per layer, and RoPE (vLLM's ``cos_sin_cache``) is applied
to q and the new k as they are loaded rather than by vLLM's rotary kernel: in a lane step's CUDA
graph every kernel costs its launch gap besides its work. Decode-shaped: a handful of query heads per
program, so the products are broadcasts, not ``tl.dot``.

Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how CI checks it against the PyTorch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters


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
def _load_biased(ptr, mask, bias_ptr, HAS_BIAS: tl.constexpr):
    """``x`` at ``ptr``, plus the bias at ``bias_ptr`` (the same place in a head vector) rounded to x's
    dtype as PyTorch's add rounds it."""
    x = tl.load(ptr, mask=mask, other=0.0)
    if HAS_BIAS:
        x = (x.to(tl.float32) + tl.load(bias_ptr, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _load_rotated(ptr, mask, d, cs_ptr, ROT: tl.constexpr, NEOX: tl.constexpr, bias_ptr, HAS_BIAS: tl.constexpr):
    """Load ``[..., BLOCK_D]`` head vectors at ``ptr`` (``ptr - d`` is each vector's start) in fp32,
    plus their bias (``HAS_BIAS``: Huginn's q / k bias at ``bias_ptr``, laid out as ``ptr``), with RoPE
    applied over the first ``ROT`` dimensions from the position's ``cs_ptr`` row of vLLM's
    ``cos_sin_cache`` (cos then sin, ``ROT / 2`` each), as vLLM's rotary kernel does (NeoX: halves;
    else GPT-J: pairs). ``ROT`` 0: no RoPE."""
    x = _load_biased(ptr, mask, bias_ptr, HAS_BIAS)
    if ROT == 0:
        return x.to(tl.float32)
    half = ROT // 2
    rot = d < ROT
    if NEOX:
        first = d < half
        partner, i = tl.where(first, d + half, d - half), tl.where(first, d, d - half)
    else:
        first = d % 2 == 0
        partner, i = tl.where(first, d + 1, d - 1), d // 2
    x_p = _load_biased(ptr + (partner - d), mask & rot, bias_ptr + (partner - d), HAS_BIAS).to(tl.float32)
    cos = tl.load(cs_ptr + i, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(cs_ptr + half + i, mask=rot, other=0.0).to(tl.float32)
    y = x.to(tl.float32) * cos + tl.where(first, -x_p, x_p) * sin
    return tl.where(rot, y.to(x.dtype), x).to(tl.float32)  # rounded as vLLM's in-place rotation rounds


@triton.jit
def _bank_of(row, bank_ids_ptr, depths_ptr):
    return tl.load(bank_ids_ptr + tl.load(depths_ptr + row))


@triton.jit
def _chunk(prefix, SPLIT: tl.constexpr, PIECES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Prefix positions per program: ``SPLIT`` at least, more when ``PIECES`` programs would not cover
    the prefix otherwise (a multiple of ``BLOCK_N``)."""
    return tl.maximum(tl.cdiv(tl.cdiv(prefix, PIECES), BLOCK_N) * BLOCK_N, SPLIT)


@triton.jit
def _valid_pieces(prefix, SPLIT: tl.constexpr, PIECES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Prefix pieces with positions to walk (the rest of the ``PIECES`` programs idle)."""
    return tl.cdiv(prefix, _chunk(prefix, SPLIT, PIECES, BLOCK_N))


@triton.jit
def _store_partial(acc_ptr, san, sah, sas, ml_ptr, smn, smh, sms, row, qh, piece, d, rmask, dmask, m, l, acc):
    tl.store(acc_ptr + row * san + qh[:, None] * sah + piece * sas + d[None, :], acc,
             mask=rmask[:, None] & dmask[None, :])
    ml = ml_ptr + row * smn + qh * smh + piece * sms
    tl.store(ml, m, mask=rmask)
    tl.store(ml + 1, l, mask=rmask)


@triton.jit
def _lane_kernel(
    q_ptr, sq0, sq1,  # q [n, Hq, D] (last stride 1)
    k_ptr, v_ptr, sk0, sk1, sk2, sk3, sk4, sv0, sv1, sv2, sv3, sv4,  # paged K / V [blocks, pages, H, B, D]
    kn_ptr, skn0, skn1, vn_ptr, svn0, svn1,  # the rows' own new k, v [n, H, D] (last stride 1)
    out_ptr, so0, so1,  # out [n, Hq, D]
    page_of_ptr, bank_ids_ptr, depths_ptr, prefix_ptr, slots_ptr,  # [banks], [layer's banks], [n], [n], [n]
    table_ptr, st0, st1,  # block-table rows [n, W]
    anc_ptr, sa0, sa1,  # ancestors [n, A], -1 padded
    pool_ptr, sp0, sp1, sp2, sp3,  # lane pool kv [banks, slots, 2, H, D] (last stride 1)
    acc_ptr, san, sah, sas,  # partial results [n, Hq, PIECES + 1, D] fp32 (last stride 1)
    ml_ptr, smn, smh, sms,  # their running max and sum [n, Hq, PIECES + 1, 2] fp32 (last stride 1)
    count_ptr,  # [n * H] int32, zero between launches: arrivals per (lane, KV head) (ONE_PASS)
    pos_ptr, cs_ptr, scs,  # RoPE: positions [n], cos_sin_cache [positions, ROT]
    qb_ptr, kb_ptr,  # q / k bias [Hq * D], [H * D] (HAS_BIAS), added before RoPE
    scale, A, rep,
    B: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT: tl.constexpr, PIECES: tl.constexpr,
    ROT: tl.constexpr, NEOX: tl.constexpr, ONE_PASS: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Program (lane, KV head, piece): pieces ``0..PIECES-1`` walk their part of the paged prefix,
    piece ``PIECES`` the lane window; each leaves a partial result. ``ONE_PASS``: the last program of
    a (lane, head) to arrive folds the partials into the output (else ``_merge_kernel`` does)."""
    row = tl.program_id(0)
    head = tl.program_id(1)  # KV head
    piece = tl.program_id(2)
    prefix = tl.load(prefix_ptr + row)
    chunk = _chunk(prefix, SPLIT, PIECES, BLOCK_N)
    valid = _valid_pieces(prefix, SPLIT, PIECES, BLOCK_N)
    if (piece < valid) | (piece == PIECES):
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        rmask, dmask = r < rep, d < D
        qh = head * rep + r  # this group's query heads
        cs = cs_ptr
        if ROT > 0:
            cs = cs_ptr + tl.load(pos_ptr + row).to(tl.int64) * scs
        q = _load_rotated(q_ptr + row * sq0 + qh[:, None] * sq1 + d[None, :], rmask[:, None] & dmask[None, :],
                          d[None, :], cs, ROT, NEOX, qb_ptr + qh[:, None] * D + d[None, :], HAS_BIAS)
        bank = _bank_of(row, bank_ids_ptr, depths_ptr).to(tl.int64)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        if piece < PIECES:  # a piece of the committed prefix, through the block table
            page = tl.load(page_of_ptr + bank).to(tl.int64)
            start = piece * chunk
            end = tl.minimum(start + chunk, prefix)
            for first in range(start, end, BLOCK_N):
                j = first + tl.arange(0, BLOCK_N)
                jmask = j < end
                block = tl.load(table_ptr + row * st0 + (j // B) * st1, mask=jmask, other=0).to(tl.int64)
                off = (j % B).to(tl.int64)
                kv_mask = jmask[:, None] & dmask[None, :]
                k = tl.load(k_ptr + block[:, None] * sk0 + page * sk1 + head * sk2 + off[:, None] * sk3
                            + d[None, :] * sk4, mask=kv_mask, other=0.0).to(tl.float32)
                v = tl.load(v_ptr + block[:, None] * sv0 + page * sv1 + head * sv2 + off[:, None] * sv3
                            + d[None, :] * sv4, mask=kv_mask, other=0.0).to(tl.float32)
                m, l, acc = _online_softmax_step(q, k, v, jmask, m, l, acc, scale)
        else:  # the lane window
            # the lane's own K/V into its pool slot (as stored, so self-attention sees the pool's rounding)
            pool_ty = pool_ptr.dtype.element_ty
            own = pool_ptr + bank * sp0 + tl.load(slots_ptr + row).to(tl.int64) * sp1 + head * sp3 + d
            k_own = _load_rotated(kn_ptr + row * skn0 + head * skn1 + d, dmask, d, cs, ROT, NEOX,
                                  kb_ptr + head * D + d, HAS_BIAS).to(pool_ty)
            v_own = tl.load(vn_ptr + row * svn0 + head * svn1 + d, mask=dmask, other=0.0).to(pool_ty)
            tl.store(own, k_own, mask=dmask)
            tl.store(own + sp2, v_own, mask=dmask)
            # itself first (always there: the running max is finite before any piece is folded in) ...
            m, l, acc = _online_softmax_step(q, k_own.to(tl.float32)[None, :], v_own.to(tl.float32)[None, :],
                                             tl.arange(0, 1) < 1, m, l, acc, scale)
            # ... then its ancestors (oldest first, -1 padded) from the pool, BLOCK_N at a time up to the last
            # one: a deep pipeline has up to R - 1 of them, and a whole [A, D] block at once made one
            # warp's registers spill (Huginn's 63-wide ancestor rows)
            a = tl.arange(0, BLOCK_A)
            listed = tl.load(anc_ptr + row * sa0 + a * sa1, mask=a < A, other=-1)
            last = tl.max(tl.where(listed >= 0, a + 1, 0), axis=0)
            for w in range(0, last, BLOCK_N):  # (not `first`: the prefix loop's, an int64 there)
                j = w + tl.arange(0, BLOCK_N)
                slot = tl.load(anc_ptr + row * sa0 + j * sa1, mask=j < last, other=-1)
                ancestor = slot >= 0
                base = (pool_ptr + bank * sp0 + tl.maximum(slot, 0).to(tl.int64)[:, None] * sp1 + head * sp3
                        + d[None, :])
                w_mask = ancestor[:, None] & dmask[None, :]
                k = tl.load(base, mask=w_mask, other=0.0).to(tl.float32)
                v = tl.load(base + sp2, mask=w_mask, other=0.0).to(tl.float32)
                m, l, acc = _online_softmax_step(q, k, v, ancestor, m, l, acc, scale)
        _store_partial(acc_ptr, san, sah, sas, ml_ptr, smn, smh, sms, row, qh, piece, d, rmask, dmask, m, l, acc)
        if ONE_PASS:
            # Split-K's "last one merges": every thread's partial is stored before the barrier, the
            # release half of the atomic publishes them, its acquire half makes the others' visible to
            # the last arrival (which reads them from L2: .cg), and it re-arms the counter.
            tl.debug_barrier()
            count = count_ptr + row * tl.num_programs(1) + head
            if tl.atomic_add(count, 1, sem="acq_rel") == valid:
                _merge(acc_ptr, san, sah, sas, ml_ptr, smn, smh, sms, out_ptr, so0, so1, row, qh, d, rmask, dmask,
                       valid, BLOCK_R, BLOCK_D, BLOCK_S, PIECES)
                tl.store(count, 0)


@triton.jit
def _merge(acc_ptr, san, sah, sas, ml_ptr, smn, smh, sms, out_ptr, so0, so1, row, qh, d, rmask, dmask, valid,
           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PIECES: tl.constexpr):
    """Fold the window's partial (index ``PIECES``) and the ``valid`` prefix pieces' into the output."""
    ml_w = ml_ptr + row * smn + qh * smh + PIECES * sms
    m = tl.load(ml_w, mask=rmask, other=0.0, cache_modifier=".cg")
    l = tl.load(ml_w + 1, mask=rmask, other=1.0, cache_modifier=".cg")
    acc = tl.load(acc_ptr + row * san + qh[:, None] * sah + PIECES * sas + d[None, :],
                  mask=rmask[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")
    s = tl.arange(0, BLOCK_S)
    for first in range(0, valid, BLOCK_S):
        sr = ((first + s) < valid)[:, None] & rmask[None, :]
        ml = ml_ptr + row * smn + qh[None, :] * smh + (first + s)[:, None] * sms  # [S, R]
        m_s = tl.load(ml, mask=sr, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ml + 1, mask=sr, other=0.0, cache_modifier=".cg")
        at = acc_ptr + row * san + qh[None, :, None] * sah + (first + s)[:, None, None] * sas + d[None, None, :]
        acc_s = tl.load(at, mask=sr[:, :, None] & dmask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        alpha = tl.exp(m - m_new)
        w = tl.exp(m_s - m_new[None, :])  # [S, R]; 0 for missing pieces
        l = l * alpha + tl.sum(w * l_s, axis=0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * acc_s, axis=0)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + row * so0 + qh[:, None] * so1 + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _merge_kernel(
    out_ptr, so0, so1, prefix_ptr, acc_ptr, san, sah, sas, ml_ptr, smn, smh, sms, rep,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr, PIECES: tl.constexpr,
):
    """One program per (lane, KV head): ``_merge`` after ``_lane_kernel`` (two launches, no counters)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    valid = _valid_pieces(tl.load(prefix_ptr + row), SPLIT, PIECES, BLOCK_N)
    _merge(acc_ptr, san, sah, sas, ml_ptr, smn, smh, sms, out_ptr, so0, so1, row, head * rep + r, d, r < rep,
           d < D, valid, BLOCK_R, BLOCK_D, BLOCK_S, PIECES)


BLOCK_N = 16  # prefix positions per inner step
# Warps per program. A decode-shaped program holds little work (a 16 x D block of K and V per step, a
# handful of query heads): one warp per program let more programs run at once and took the (then two)
# kernels from 14.7 to 11.6 us at 4 Ouro-1.4B lanes x 352 positions, 341 to 199 us at 256 lanes,
# 80 to 48 us at 16 Huginn lanes (H200, Triton's default of 4 before; RESULTS.md).
LANE_WARPS = MERGE_WARPS = 1
# The prefix is split into pieces of `split` positions up to this many positions; a longer prefix gets
# longer pieces. So the launch (and the partial results) stay the size of a 1,024-position table
# whatever the engine's max_model_len: split over the whole block table, an 8,192-token table made
# 16 lanes at 352 positions take 63 us instead of 30 (H200).
SPLIT_SPAN = 1024
# "one-pass": the last program of a (lane, head) merges (one launch per layer, an atomic counter per
# (lane, head)); "two-pass": a second kernel merges (no counters; the original layout);
# "auto": one-pass for at most ONE_PASS_PAIRS (lane, KV head) pairs, else two-pass. In the engine on
# the H200 (Ouro-1.4B shape) one-pass took a recurrent step from 1.74-1.77 to 1.67 ms at
# one request (<= 16 lane rows x 16 heads), was even at 4, and slower from 16 requests on (3.10 against
# 2.91-2.95 ms at ~59 lanes; 7.8 against 6.4 ms at ~230; 15.3 against 11.5 ms at ~470).
MERGE = "auto"
ONE_PASS_PAIRS = 256
def default_split(lanes: int, kv_heads: int) -> int:
    """Prefix positions per program. Few (lane, head) pairs: short pieces, so that many programs share
    the walk; many: longer ones, since the GPU is full anyway and each piece costs a partial result.
    Chosen from a sweep on the H200 (benchmarks/RESULTS.md): within ~2 us or ~6 % of the
    best swept split at every measured shape (4-256 Ouro-1.4B lanes, 16-64 Huginn lanes, prefixes of
    64-1,024 positions)."""
    pairs = lanes * kv_heads
    return 32 if pairs <= 256 else 64 if pairs <= 1024 else 128


def lane_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                   v_pages: torch.Tensor, page_of: torch.Tensor, bank_ids: torch.Tensor, depths: torch.Tensor,
                   prefix: torch.Tensor, slots: torch.Tensor, block_rows: torch.Tensor, ancestors: torch.Tensor,
                   pool: torch.Tensor, scale: float, split: int | None = None, rope=None,
                   pieces: int | None = None, merge: str | None = None, bias=None) -> torch.Tensor:
    """``q [n, Hq, D]`` and new ``k, v [n, H, D]`` of lanes at global banks ``bank_ids[depths]``
    (``depths [n]``); each stores its k, v in the lane pool ``pool [banks, slots, 2, H, D]`` at its
    own ``slots [n]``, and reads positions ``0..prefix-1`` of its request (``block_rows [n, W]``,
    kernel blocks of ``k_pages / v_pages [blocks, pages, H, B, D]``, bank -> page by ``page_of``),
    then the pool at its ``ancestors [n, A]`` (-1 padded), then itself. ``split``: prefix positions
    per program (a multiple of ``BLOCK_N``; None: ``default_split``); ``pieces``: programs per (lane,
    KV head) (None: enough to cover ``SPLIT_SPAN`` positions, or the block table if narrower, at
    ``split``); each program walks ``max(split, ceil(prefix / pieces))`` positions, so the launch
    does not grow with the model length. ``rope``: ``(positions [n],
    cos_sin_cache [max positions, rotary dims], is_neox_style)``, vLLM's RoPE of q and k applied here
    (the stored k rotated), or None (q and k come rotated). ``merge``: "one-pass", "two-pass" or
    "auto" (``MERGE`` when None). ``bias``: ``(q bias [Hq * D], k bias [H * D])`` added to q and k as
    they load, before RoPE (Huginn's; two elementwise kernels a layer less), or None. Returns
    ``[n, Hq, D]`` in q's dtype.

    The launch shapes depend only on the tensors' shapes (the prefix can reach ``W`` blocks), so a
    CUDA graph of a call serves every prefix length."""
    n, Hq, D = q.shape
    H, B = k_pages.shape[2], k_pages.shape[3]
    rep = Hq // H
    merge = merge or MERGE
    if merge not in ("auto", "one-pass", "two-pass"):
        raise ValueError(f"lane_attention: merge={merge!r}; allowed: 'auto', 'one-pass', 'two-pass'")
    if merge == "auto":
        merge = "one-pass" if n * H <= ONE_PASS_PAIRS else "two-pass"
    if pool.stride(4) != 1:
        raise ValueError("lane_attention needs the lane pool contiguous in the head dimension")
    split = split or default_split(n, H)
    if split % BLOCK_N:
        raise ValueError(f"lane_attention: split={split} must be a multiple of {BLOCK_N}")
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    if bias is not None:
        if bias[0].shape != (Hq * D,) or bias[1].shape != (H * D,):
            raise ValueError(f"lane_attention: bias of shapes {[tuple(b.shape) for b in bias]} for {Hq} / {H} "
                             f"heads of {D}; allowed: ({Hq * D},), ({H * D},)")
        bias = tuple(b.contiguous() for b in bias)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    if rope is None:
        positions, cos_sin, neox = depths, q, True  # never read (ROT 0)
        rot = 0
    else:
        positions, cos_sin, neox = rope
        rot = cos_sin.shape[1]
        if cos_sin.stride(1) != 1 or rot % 2 or rot > D:
            raise ValueError(f"lane_attention: cos_sin_cache {tuple(cos_sin.shape)} for head size {D}")
    pieces = min(pieces or triton.cdiv(SPLIT_SPAN, split), triton.cdiv(block_rows.shape[1] * B, split))
    # partial results: the prefix pieces, then the lane window at index `pieces`
    acc = torch.empty(n, Hq, pieces + 1, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(n, Hq, pieces + 1, 2, dtype=torch.float32, device=q.device)
    parts = (acc, *acc.stride()[:3], ml, *ml.stride()[:3])
    one_pass = merge == "one-pass"
    counters = arrival_counters(q.device, n * H, "lane_attention") if one_pass else slots
    A = ancestors.shape[1]
    meta = dict(D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_R=triton.next_power_of_2(rep), BLOCK_N=BLOCK_N,
                SPLIT=split, PIECES=pieces, BLOCK_S=min(16, triton.next_power_of_2(pieces)))
    _lane_kernel[(n, H, pieces + 1)](
        q, q.stride(0), q.stride(1),
        k_pages, v_pages, *k_pages.stride(), *v_pages.stride(),
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        out, out.stride(0), out.stride(1),
        page_of, bank_ids, depths, prefix, slots,
        block_rows, block_rows.stride(0), block_rows.stride(1),
        ancestors if A else slots.view(n, 1), ancestors.stride(0) if A else 1, ancestors.stride(1) if A else 1,
        pool, pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
        *parts, counters, positions, cos_sin, cos_sin.stride(0), *(bias if bias is not None else (q, q)),
        scale, A, rep,
        B=B, BLOCK_A=triton.next_power_of_2(A + 1), ROT=rot, NEOX=neox, ONE_PASS=one_pass, HAS_BIAS=bias is not None,
        num_warps=LANE_WARPS, **meta,
    )
    if not one_pass:
        _merge_kernel[(n, H)](out, out.stride(0), out.stride(1), prefix, *parts, rep, num_warps=MERGE_WARPS, **meta)
    return out
