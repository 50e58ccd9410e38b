"""KV storage for the reference models: a committed sequence, and per-lane views for LoopSpec.

A bank id names one attention application: ``("pre", l)``, ``("core", t, l)`` or
``("coda", r, l)`` (coda blocks keep one bank per readout depth r, since they see depth-r states).
Attention always goes through ``ctx.attend(bank, q, k, v, scale)``: the context appends the new
keys/values where they belong and attends causally. Plain tensors and loops, written to be obviously
right rather than fast: this is the oracle.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

Bank = Hashable


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_pos: int) -> torch.Tensor:
    """Causal attention of queries at positions ``first_pos..first_pos+n-1`` over keys ``0..m-1``.

    ``q [n, Hq, d]``, ``k, v [m, Hkv, d]`` (GQA: Hq a multiple of Hkv) -> ``[n, Hq, d]``.
    """
    n, hq, _ = q.shape
    m, hkv, _ = k.shape
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * scale
    qpos = torch.arange(first_pos, first_pos + n, device=q.device).unsqueeze(1)
    kpos = torch.arange(m, device=q.device).unsqueeze(0)
    scores = scores.masked_fill((kpos > qpos).unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, v.float()).to(q.dtype)


class SequenceKV:
    """Committed KV of one sequence: for each bank, keys and values of positions ``0..len-1``."""

    def __init__(self):
        self.k: dict[Bank, torch.Tensor] = {}
        self.v: dict[Bank, torch.Tensor] = {}

    def length(self, bank: Bank) -> int:
        return 0 if bank not in self.k else self.k[bank].shape[0]

    def append(self, bank: Bank, k: torch.Tensor, v: torch.Tensor) -> None:
        if bank in self.k:
            self.k[bank] = torch.cat([self.k[bank], k])
            self.v[bank] = torch.cat([self.v[bank], v])
        else:
            self.k[bank], self.v[bank] = k, v

    def attend(self, bank: Bank, q, k, v, scale: float) -> torch.Tensor:
        first = self.length(bank)
        self.append(bank, k, v)
        return attention(q, self.k[bank], self.v[bank], scale, first)

    def fork(self) -> SequenceKV:
        """A copy that can grow independently (tensors are never mutated in place, so sharing is safe)."""
        other = SequenceKV()
        other.k, other.v = dict(self.k), dict(self.v)
        return other


class LaneKV:
    """KV view of one lane: a single position p whose context is the committed prefix
    ``0..c-1`` plus its uncommitted ancestor lanes ``c..p-1`` (oldest first), then itself.

    Each lane records its own keys/values per bank in ``own`` so that its descendants (and, once it
    commits, the committed sequence) can read them.
    """

    def __init__(self, committed: SequenceKV, ancestors: list[dict[Bank, tuple]], own: dict[Bank, tuple]):
        self.committed, self.ancestors, self.own = committed, ancestors, own

    def attend(self, bank: Bank, q, k, v, scale: float) -> torch.Tensor:
        assert q.shape[0] == 1, "a lane is one position"
        keys, values = self.context(bank, k, v)
        return attention(q, keys, values, scale, keys.shape[0] - 1)

    def context(self, bank: Bank, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """Record this lane's ``k, v`` for ``bank`` and return the keys/values it attends to:
        committed prefix, then ancestors (oldest first), then itself."""
        ks, vs = [], []
        if bank in self.committed.k:
            ks.append(self.committed.k[bank])
            vs.append(self.committed.v[bank])
        for anc in self.ancestors:
            if bank not in anc:
                raise KeyError(f"ancestor lane has no KV for bank {bank}: it must run that step first")
            ks.append(anc[bank][0])
            vs.append(anc[bank][1])
        ks.append(k)
        vs.append(v)
        self.own[bank] = (k, v)
        return torch.cat(ks), torch.cat(vs)
