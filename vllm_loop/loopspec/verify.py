"""Cascade verification at depth R (paper Section 4.3, Algorithm 1 ``Verify``).

1. Accept the first proposal x1 ~ q1 with probability ``min(1, p(x1)/q1(x1))``.
2. Otherwise the target becomes ``rho = p ⊖ q1``; if a second proposal x2 ~ q2 exists, accept it
   with probability ``min(1, rho(x2)/q2(x2))``.
3. Otherwise sample from ``rho ⊖ q2`` (or from ``rho`` when there was no second proposal).
A residual with no mass (rounding) falls back to the distribution it was taken from.

Greedy is the same cascade on one-hot distributions: accept x1 iff it is argmax p, else x2 iff it
is, else a late re-proposal iff one is (greedy only: ``LoopSpecSchedule.late``), else commit argmax p.
The committed token is always argmax p.

``cascade_output_distribution`` computes the exact distribution of the committed token of one
cascade (summing over the proposals instead of sampling them) from the same building blocks; the
tests check it equals p. ``double_rejection_probability`` is the exact restart probability that
Theorem 1 bounds by eps2 (ungated) or 2 eps2 (gated).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from vllm_loop.loopspec.proposals import (
    gate_opens,
    residual,
    residual_or,
    sample_from,
    second_proposal,
    uniform_source,
)


class CommitSource(IntEnum):
    """Where a committed token came from (paper Section E's three categories)."""

    FIRST = 1  # first proposal accepted
    SECOND = 2  # second proposal accepted after the first was rejected
    FULL = 3  # both rejected (or no second proposal): full-depth residual sample, pipeline restarts
    LATE = 4  # greedy: both rejected, a late re-proposal (argmax at a depth past d2) accepted


@dataclass(frozen=True)
class Proposal:
    token: int
    dist: torch.Tensor | None = None  # the distribution it was drawn from (None under greedy)


@dataclass(frozen=True)
class Verdict:
    token: int
    source: CommitSource


def accept_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Elementwise ``min(1, p/q)`` where q > 0 (0 where q = 0: such a token is never proposed)."""
    safe_q = torch.where(q > 0, q, torch.ones_like(q))
    return torch.where(q > 0, torch.clamp(p / safe_q, max=1.0), torch.zeros_like(q))


def cascade_verify_greedy(target: int, first: int, second: int | None = None, late=()) -> Verdict:
    """``late``: the tokens of the root's late re-proposals (all differ from ``first`` and ``second``)."""
    if first == target:
        return Verdict(target, CommitSource.FIRST)
    if second is not None and second == target:
        return Verdict(target, CommitSource.SECOND)
    if target in late:
        return Verdict(target, CommitSource.LATE)
    return Verdict(target, CommitSource.FULL)


def propose_first(q1: torch.Tensor, rng=None) -> Proposal:
    """The first proposal: ``x1 ~ q1`` (one uniform)."""
    return Proposal(sample_from(q1, uniform_source(rng)()), q1)


def propose_second(q2_tilde: torch.Tensor, first: Proposal, rng=None, gate: bool = True) -> Proposal | None:
    """The gated residual second proposal (eq. 5-6): None when the gate stays closed (or the
    residual is empty), else ``x2 ~ q2 = q~2 ⊖ q1`` (one uniform), carrying q2 -- the distribution
    it was drawn from, which is what stage 2 of the cascade must divide by."""
    q2 = second_proposal(q2_tilde, first.dist, first.token, gate=gate)
    if q2 is None:
        return None
    return Proposal(sample_from(q2, uniform_source(rng)()), q2)


def cascade_verify(p: torch.Tensor, first: Proposal, second: Proposal | None = None, rng=None) -> Verdict:
    """Sampling cascade. ``p`` is the filtered target distribution ``[V]``; proposals carry their
    filtered proposal distributions. ``rng``: a torch.Generator, an iterable of uniforms, or a
    callable returning uniforms (at most three are drawn: accept-1, accept-2, residual sample)."""
    u = uniform_source(rng)
    x1, q1 = first.token, first.dist
    if u() < float(accept_probability(p[x1], q1[x1])):
        return Verdict(x1, CommitSource.FIRST)
    rho = residual_or(p, q1)
    if second is None:
        return Verdict(sample_from(rho, u()), CommitSource.FULL)
    x2, q2 = second.token, second.dist
    if u() < float(accept_probability(rho[x2], q2[x2])):
        return Verdict(x2, CommitSource.SECOND)
    return Verdict(sample_from(residual_or(rho, q2), u()), CommitSource.FULL)


# -- exact analysis ------------------------------------------------------------------------------------
def _stage_two(rho: torch.Tensor, q2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Given the first proposal was rejected: (distribution of the committed token, probability
    that the second stage also rejects), summing over x2 ~ q2."""
    if q2 is None:
        return rho, torch.ones((), dtype=rho.dtype)
    accepted = q2 * accept_probability(rho, q2)  # P(x2 = y and accepted)
    reject = (1.0 - accepted.sum()).clamp_min(0.0)
    return accepted + reject * residual_or(rho, q2), reject


def cascade_analysis(p: torch.Tensor, q1: torch.Tensor, q2_tilde: torch.Tensor | None = None, gate: bool = True):
    """Exact (output distribution, P(double rejection)) of one cascade, summing over x1 ~ q1 and x2 ~ q2.

    Whether a second proposal exists depends on x1 through the gate; its distribution
    ``q2 = q~2 ⊖ q1`` does not, so the x1 with an open gate share one stage-two distribution.
    """
    p, q1 = p.to(torch.float64), q1.to(torch.float64)
    accept1 = q1 * accept_probability(p, q1)  # P(x1 = y and accepted)
    reject1 = q1 - accept1  # P(x1 = y and rejected)
    rho = residual_or(p, q1)
    if q2_tilde is None:
        opens = torch.zeros_like(q1, dtype=torch.bool)
        q2 = None
    else:
        q2_tilde = q2_tilde.to(torch.float64)
        opens = (q2_tilde < q1) if gate else torch.ones_like(q1, dtype=torch.bool)
        q2 = residual(q2_tilde, q1)
        if q2 is None:
            opens = torch.zeros_like(opens)
    w_open = reject1[opens].sum()
    w_closed = reject1[~opens].sum()
    second_dist, second_reject = _stage_two(rho, q2)
    out = accept1 + w_open * second_dist + w_closed * rho
    double_reject = w_open * second_reject + w_closed
    return out, double_reject


def cascade_output_distribution(p, q1, q2_tilde=None, gate: bool = True) -> torch.Tensor:
    return cascade_analysis(p, q1, q2_tilde, gate)[0]


def double_rejection_probability(p, q1, q2_tilde=None, gate: bool = True) -> float:
    return float(cascade_analysis(p, q1, q2_tilde, gate)[1])


def gate_open_probability(q1: torch.Tensor, q2_tilde: torch.Tensor) -> float:
    """P(gate opens) = q1-mass of the tokens whose d2 probability is lower."""
    return float(q1.to(torch.float64)[q2_tilde.to(torch.float64) < q1.to(torch.float64)].sum())


__all__ = [
    "CommitSource",
    "Proposal",
    "Verdict",
    "accept_probability",
    "cascade_verify",
    "cascade_verify_greedy",
    "propose_first",
    "propose_second",
    "cascade_analysis",
    "cascade_output_distribution",
    "double_rejection_probability",
    "gate_open_probability",
    "gate_opens",
]
