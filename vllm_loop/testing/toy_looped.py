"""A tiny looped LM implementing the reference contract, for engine-free tests of LoopSpec.

One attention + MLP block looped ``depth`` times (KV bank ``("core", t, 0)``), optionally with a
prelude attention block (bank ``("pre", 0)``) whose output is re-injected at every step, and a coda
attention block per readout depth (bank ``("coda", r, 0)``), like Raven. The update of step t is
scaled by ``decay**t``: the closer ``decay`` is to 0, the sooner the depths agree, which gives an
"agreement knob" without training. Random weights from a seed; fp32; deterministic.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_loop.reference.base import LoopedReference, LoopState


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, g: torch.Generator, std: float):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads

        def p(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) * std)

        self.wqkv, self.wo = p(hidden, 3 * hidden), p(hidden, hidden)
        self.w1, self.w2 = p(hidden, 2 * hidden), p(2 * hidden, hidden)
        self.n1 = nn.Parameter(torch.ones(hidden))
        self.n2 = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor, bank, kv) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (_rms(x, self.n1) @ self.wqkv).split(x.shape[1], dim=-1)
        shape = (n, self.heads, self.head_dim)
        a = kv.attend(bank, q.reshape(shape), k.reshape(shape), v.reshape(shape), self.head_dim**-0.5)
        x = x + a.reshape(n, -1) @ self.wo
        return x + torch.nn.functional.gelu(_rms(x, self.n2) @ self.w1) @ self.w2


class ToyLoopedLM(LoopedReference):
    def __init__(
        self,
        *,
        vocab_size: int = 64,
        hidden: int = 32,
        heads: int = 2,
        depth: int = 4,
        decay: float = 1.0,
        prelude: bool = False,
        coda: bool = False,
        logit_scale: float = 4.0,
        seed: int = 0,
    ):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.depth, self.vocab_size, self.decay = depth, vocab_size, decay
        self.embed = nn.Parameter(torch.randn(vocab_size, hidden, generator=g))
        self.core = _Block(hidden, heads, g, std=hidden**-0.5)
        self.prelude = _Block(hidden, heads, g, std=hidden**-0.5) if prelude else None
        self.coda = _Block(hidden, heads, g, std=hidden**-0.5) if coda else None
        self.inject_w = nn.Parameter(torch.randn(hidden, hidden, generator=g) * hidden**-0.5) if prelude else None
        self.head = nn.Parameter(torch.randn(hidden, vocab_size, generator=g) * hidden**-0.5 * logit_scale)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.eval()

    def pre(self, tokens, positions, kv) -> LoopState:
        x = self.embed[tokens]
        if self.prelude is None:
            return LoopState(h=x)
        e = self.prelude(x, ("pre", 0), kv)
        return LoopState(h=torch.zeros_like(e), inject=e)

    def core_step(self, state, t, positions, kv) -> LoopState:
        h = state.h if state.inject is None else state.h + state.inject @ self.inject_w
        out = self.core(h, ("core", t, 0), kv)
        return LoopState(h=state.h + (self.decay**t) * (out - state.h), inject=state.inject)

    def readout(self, state, r, positions, kv) -> torch.Tensor:
        h = state.h if self.coda is None else self.coda(state.h, ("coda", r, 0), kv)
        return (_rms(h, self.norm) @ self.head).float()
