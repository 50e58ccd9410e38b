"""Next-token distributions at a readout depth, the residual operator, the gate, and sampling.

Every depth is filtered exactly like ordinary sampling, in vLLM's order: temperature, then top-k
(keep logits >= the k-th largest), then top-p (drop the lowest tokens whose cumulative mass is
<= 1 - top_p, always keeping the top token), then softmax. LoopSpec is lossless with respect to the
filtered target ``p_R``; the proposals ``q1 = p_d1`` and ``q~2 = p_d2`` go through the same filter.
Distributions are float64 so that residuals of nearly equal distributions stay meaningful.

Greedy (temperature 0) needs no distributions at all: a readout proposes its argmax, the gate opens
when the d2 argmax differs from the d1 proposal, and the committed token is the argmax at depth R.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # vLLM treats temperature < 1e-5 as greedy
EMPTY_MASS = 1e-12  # a residual with less mass than this is empty (rounding), use the fallback


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k <= 0 = off; top_p = 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} is invalid: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} is invalid: must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k={self.top_k!r} is invalid: must be an integer (<= 0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def filter_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[..., V]`` logits -> float64 probabilities after temperature, top-k and top-p.

    Greedy params give the one-hot argmax (the degenerate distribution greedy decoding samples from).
    """
    x = logits.to(torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(torch.float64)
    x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1)  # ascending
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop_sorted = cum <= 1.0 - params.top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def positive_part(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[p - q]+`` elementwise."""
    return (p - q).clamp_min(0.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    """``p ⊖ q = [p - q]+ / sum [p - q]+`` (paper eq. 2), or None when it has (almost) no mass."""
    diff = positive_part(p, q)
    mass = float(diff.sum())
    if mass <= EMPTY_MASS:
        return None
    return diff / mass


def residual_or(p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """``p ⊖ q``, falling back to ``p`` itself when q is absent or the residual is empty."""
    if q is None:
        return p
    r = residual(p, q)
    return p if r is None else r


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``TV(p, q) = 1/2 sum |p - q|`` over the last dimension."""
    return 0.5 * (p.to(torch.float64) - q.to(torch.float64)).abs().sum(-1)


def gate_opens(q2_tilde: torch.Tensor, q1: torch.Tensor, x1: int) -> bool:
    """The paper's gate (eq. 6): the deeper readout withdrew confidence from the first proposal."""
    return bool(q2_tilde[x1] < q1[x1])


def second_proposal(q2_tilde: torch.Tensor, q1: torch.Tensor, x1: int, gate: bool = True) -> torch.Tensor | None:
    """The residual second-proposal distribution ``q2 = q~2 ⊖ q1`` (eq. 5), or None when no second
    proposal is made (gate closed, or the residual is empty)."""
    if gate and not gate_opens(q2_tilde, q1, x1):
        return None
    return residual(q2_tilde, q1)


# -- drawing tokens ---------------------------------------------------------------------------------
Uniforms = Callable[[], float]


def uniform_source(rng: torch.Generator | Iterable[float] | Callable[[], float] | None) -> Uniforms:
    """A zero-argument function returning uniforms in [0, 1): from a torch.Generator, from an
    iterable of given numbers (tests), or a callable passed through."""
    if rng is None:
        return lambda: float(torch.rand(()))
    if isinstance(rng, torch.Generator):
        return lambda: float(torch.rand((), generator=rng, dtype=torch.float64))
    if callable(rng):
        return rng
    it: Iterator[float] = iter(rng)
    return lambda: float(next(it))


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw with the uniform ``u`` in [0, 1); only tokens of positive probability come out.

    ``searchsorted(right=True)`` returns the first index whose CDF exceeds ``u * total``; the CDF is
    flat across zero-probability tokens, so that index has positive probability. Rounding can put
    ``u * total`` at the total itself: then the last positive token is taken.
    """
    cdf = probs.to(torch.float64).cumsum(0)
    j = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    if j >= probs.shape[0]:
        j = int(torch.nonzero(probs > 0).max())
    return j


def sample_token(logits: torch.Tensor, params: SamplingParams, rng=None) -> int:
    """Ordinary sampling from ``[V]`` logits with the same filter (argmax when greedy). This is the
    baseline LoopSpec must match in distribution."""
    if params.greedy:
        return int(torch.argmax(logits))
    return sample_from(filter_probs(logits, params), uniform_source(rng)())
