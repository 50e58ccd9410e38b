"""Coupled sampling (``vllm_loop/loopspec/noise.py``) of a few rows in one Triton kernel.

``noise.coupled_sample`` in PyTorch is about forty kernels over ``[rows, vocab]`` temporaries: the
splitmix64 noise in int64, a sort of the vocabulary for top-k / top-p, a softmax, a cumulative sum, a
scatter back. A lane call samples at every readout depth of every recurrent step, for a handful of
rows. Here one program samples one row, without sorting:

1. one pass: the row's maximum and softmax normaliser (online) and the winner of the unfiltered race
   ``argmax x + g`` (``x`` the temperature-scaled logits, ``g`` the row's Gumbel noise, the same bits
   as ``noise.uniforms``); greedy rows (temperature < ``GREEDY_EPS``) take the plain argmax;
2. top-k and top-p keep every token at or above some value, so the winner of the race among the tokens
   above a dropped token contains the filtered winner: while the candidate is dropped (``top_k`` or
   more tokens above it, or their mass ``top_p`` or more of the top-k set's), take the winner among the
   tokens above it. One pass a round (the candidate's count and mass above, and the next candidate);
   the first candidate is dropped with probability ~1 - top_p, a later one less often;
3. with top-k and top-p together, the top-k set's mass needs the k-th largest value first: a bisection
   over the order-preserving integer keys of the float32 values (32 passes).

The filter is ``noise.filter_logits``'s up to the rounding of the masses (a sum instead of a sorted
cumulative sum): a token whose mass above sits within float32 rounding of ``top_p`` may fall on the
other side, as it may between any two samplers. Greedy rows break ties to the lowest token id, as
``torch.argmax``. Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how CI checks it against
``noise.coupled_sample``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GREEDY_EPS = 1e-5  # as noise.GREEDY_EPS
BLOCK = 2048  # vocabulary entries a program holds at once


@triton.jit
def _mix64(z):
    """splitmix64's finalizer on uint64 (wrapping), as ``noise.mix64``."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _gumbel(seed, v):
    """Token ``v``'s Gumbel noise of the stream ``seed`` (uint64): ``-log(-log(u))`` with ``u`` the
    uniform ``noise.uniforms`` draws for it."""
    z = _mix64(seed + (v + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
    u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _key(x):
    """Order-preserving int32 key of a float32 (no NaN)."""
    i = x.to(tl.int32, bitcast=True)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@triton.jit
def _above(row_ptr, t, V, key, m, BLOCK: tl.constexpr):
    """(count, softmax mass times the normaliser) of the row's values with key > ``key``."""
    count = tl.zeros((), tl.int32)
    mass = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + v, mask=v < V, other=float("-inf")).to(tl.float32) / t
        hit = (_key(x) > key) & (v < V)
        count += tl.sum(hit.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(hit, tl.exp(x - m), 0.0), axis=0)
    return count, mass


@triton.jit
def _coupled_sample_kernel(logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, key_ptr, position_ptr,
                           out_ptr, V, GREEDY_EPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temperature_ptr + row)
    greedy = t < GREEDY_EPS
    t = tl.where(greedy, 1.0, t)
    # noise.stream_seed: mix64(key + mix64(position * golden + golden))
    position = tl.load(position_ptr + row).to(tl.uint64)
    seed = tl.load(key_ptr + row).to(tl.uint64) + _mix64(position * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15)
    seed = _mix64(seed)

    # one pass: maximum, normaliser, the unfiltered winner (greedy rows: the argmax)
    m = tl.full((), float("-inf"), tl.float32)
    z = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    win = tl.zeros((), tl.int32)
    win_x = tl.full((), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        inside = v < V
        x = tl.load(row_ptr + v, mask=inside, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, tl.max(x, axis=0))
        z = z * tl.exp(m - m_new) + tl.sum(tl.where(inside, tl.exp(x - m_new), 0.0), axis=0)
        m = m_new
        if greedy:  # greedy and padding rows skip the noise's 64-bit hashing
            score = x
        else:
            score = x + _gumbel(seed, v)
        score = tl.where(inside, score, float("-inf"))
        s = tl.max(score, axis=0)
        i = tl.argmax(score, axis=0)  # the first of equal maxima
        take = s > best  # strictly: an earlier block keeps a tie
        win = tl.where(take, start + i, win)
        win_x = tl.where(take, tl.sum(tl.where(v == start + i, x, 0.0), axis=0), win_x)
        best = tl.where(take, s, best)

    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    use_k = (k > 0) & (k < V)
    use_p = p < 1.0
    if (~greedy) & (use_k | use_p):
        total = z  # the top-k set's normaliser
        if use_k & use_p:
            # the k-th largest value's key: the smallest key with fewer than k values above it
            lo = _key(tl.full((), float("-inf"), tl.float32)).to(tl.int64)
            hi = _key(m).to(tl.int64)
            while lo < hi:
                mid = lo + (hi - lo) // 2
                c, _ = _above(row_ptr, t, V, mid.to(tl.int32), m, BLOCK)
                lo = tl.where(c < k, lo, mid + 1)
                hi = tl.where(c < k, mid, hi)
            _, total = _above(row_ptr, t, V, (lo - 1).to(tl.int32), m, BLOCK)  # values >= the k-th
        searching = tl.full((), 1, tl.int1)
        while searching:
            count = tl.zeros((), tl.int32)
            mass = tl.zeros((), tl.float32)
            best = tl.full((), float("-inf"), tl.float32)
            next_win = win
            next_x = win_x
            for start in range(0, V, BLOCK):
                v = start + tl.arange(0, BLOCK)
                inside = v < V
                x = tl.load(row_ptr + v, mask=inside, other=float("-inf")).to(tl.float32) / t
                higher = inside & (x > win_x)
                count += tl.sum(higher.to(tl.int32), axis=0)
                mass += tl.sum(tl.where(higher, tl.exp(x - m), 0.0), axis=0)
                score = tl.where(higher, x + _gumbel(seed, v), float("-inf"))
                s = tl.max(score, axis=0)
                i = tl.argmax(score, axis=0)
                take = s > best
                next_win = tl.where(take, start + i, next_win)
                next_x = tl.where(take, tl.sum(tl.where(v == start + i, x, 0.0), axis=0), next_x)
                best = tl.where(take, s, best)
            # nothing above the candidate: it is the top (a NaN in the row could otherwise keep the
            # masses from ever passing, and the loop from ending)
            kept = (((~use_k) | (count < k)) & ((~use_p) | (mass < p * total))) | (count == 0)
            win = tl.where(kept, win, next_win)
            win_x = tl.where(kept, win_x, next_x)
            searching = ~kept
    tl.store(out_ptr + row, win.to(tl.int64))


def coupled_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``noise.coupled_sample`` of ``logits [rows, vocab]``: ``[rows]`` int64 tokens.
    ``temperature`` / ``top_p`` floats, ``top_k`` / ``key`` / ``position`` integers, one per row."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        _coupled_sample_kernel[(rows,)](
            logits, logits.stride(0), temperature.to(torch.float32).contiguous(), top_k.to(torch.int32).contiguous(),
            top_p.to(torch.float32).contiguous(), key.to(torch.int64).contiguous(), position.to(torch.int64).contiguous(),
            out, vocab, GREEDY_EPS=GREEDY_EPS, BLOCK=BLOCK, num_warps=8)
    return out
