"""Proposals, gate and cascade verification: exact losslessness, Theorem 1, the sampler itself.

Losslessness is checked exactly on the production code: ``propose_first``, ``propose_second`` and
``cascade_verify`` make decisions that are piecewise constant in their uniforms (a comparison
``u < a``, or an inverse-CDF draw), so enumerating the intervals of each uniform gives the exact
output distribution of the very code the executor runs. Mutants of ``verify.py`` (the known ways
to get a residual sampler wrong) must fail the same check.
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

import vllm_loop.loopspec.verify as verify_mod

from vllm_loop.loopspec.proposals import (
    SamplingParams,
    filter_probs,
    gate_opens,
    residual,
    residual_or,
    sample_from,
    sample_token,
    second_proposal,
    total_variation,
)
from vllm_loop.loopspec.verify import (
    CommitSource,
    Proposal,
    cascade_analysis,
    cascade_output_distribution,
    cascade_verify,
    cascade_verify_greedy,
    double_rejection_probability,
    gate_open_probability,
    propose_first,
    propose_second,
)

V = 12




def _logits(g, n=3, scale=2.0):
    return [torch.randn(V, generator=g) * scale for _ in range(n)]


# -- filtering ------------------------------------------------------------------------------------------------
def test_filter_temperature_topk_topp():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0, -1.0])
    p = filter_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(p, torch.softmax(logits.double(), -1))
    p = filter_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits.double() / 0.5, -1))
    p = filter_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p > 0).tolist() == [True, False, True, False, False]
    assert torch.allclose(p[[0, 2]], torch.softmax(torch.tensor([3.0, 2.0]).double(), -1))
    # top-p: softmax masses ~ [.64, .09, .24, .03, .01]; p=0.8 keeps {0, 2} (0.88 >= 0.8), p=0.5 keeps {0}
    assert (filter_probs(logits, SamplingParams(1.0, top_p=0.8)) > 0).tolist() == [True, False, True, False, False]
    assert (filter_probs(logits, SamplingParams(1.0, top_p=0.5)) > 0).tolist() == [True, False, False, False, False]
    # top-k then top-p on the renormalised top-k distribution
    both = filter_probs(logits, SamplingParams(1.0, top_k=3, top_p=0.7))
    assert (both > 0).tolist() == [True, False, True, False, False]
    assert float(both.sum()) == pytest.approx(1.0)
    # greedy: one-hot argmax
    assert filter_probs(logits, SamplingParams(0.0)).tolist() == [1.0, 0, 0, 0, 0]


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(1.0, top_k=2.5)


def test_residual_and_gate():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert residual(p, p) is None
    assert residual_or(p, p) is p and residual_or(p, None) is p
    assert float(total_variation(p, q)) == pytest.approx(0.3)
    assert gate_opens(q, p, 0) and not gate_opens(q, p, 2) and not gate_opens(q, p, 1)
    assert second_proposal(q, p, 2) is None  # gate closed
    assert torch.allclose(second_proposal(q, p, 0), torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    assert second_proposal(q, p, 2, gate=False) is not None  # ungated: residual whenever it has mass
    assert second_proposal(p, p, 0, gate=False) is None  # empty residual


def test_sample_from_never_picks_zero_probability():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0], dtype=torch.float64)
    for u in [0.0, 1e-12, 0.2499, 0.25, 0.5, 0.9999999, 1.0]:
        assert sample_from(probs, u) in (1, 3)
    assert sample_from(probs, 0.1) == 1 and sample_from(probs, 0.3) == 3


# -- exact losslessness -------------------------------------------------------------------------------------
FILTERS = [
    SamplingParams(1.0),
    SamplingParams(0.7),
    SamplingParams(1.0, top_k=4),
    SamplingParams(1.0, top_p=0.7),
    SamplingParams(1.3, top_k=6, top_p=0.8),
]


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("gate", [True, False])
def test_cascade_output_is_exactly_p(params, gate):
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        l1, l2, lR = _logits(g, scale=0.5 + trial % 4)
        q1, q2t, p = (filter_probs(x, params) for x in (l1, l2, lR))
        out = cascade_output_distribution(p, q1, q2t, gate=gate)
        assert torch.allclose(out, p, atol=1e-6, rtol=0), (trial, (out - p).abs().max())
        out1 = cascade_output_distribution(p, q1, None)  # single-proposal mode
        assert torch.allclose(out1, p, atol=1e-6, rtol=0)


def test_cascade_exact_edge_cases():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    same = p.clone()
    disjoint = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    for q1, q2t in [(same, same), (disjoint, disjoint), (disjoint, p), (p, disjoint), (same, None)]:
        for gate in (True, False):
            out, dr = cascade_analysis(p, q1, q2t, gate=gate)
            assert torch.allclose(out, p, atol=1e-12)
    # q1 = p: never rejected
    assert double_rejection_probability(p, same, disjoint) == 0.0
    # proposals disjoint from p and q2 = q1: always restarts
    assert double_rejection_probability(p, disjoint, disjoint) == pytest.approx(1.0)
    # q2~ = p recovers every first rejection (ungated)
    assert double_rejection_probability(p, disjoint, p, gate=False) == pytest.approx(0.0)


def test_theorem1_bounds_exactly():
    """P(both rejected) <= eps2 without the gate and <= 2 eps2 with it (eps2 = TV(p_d2, p_R))."""
    g = torch.Generator().manual_seed(1)
    worst = {True: 0.0, False: 0.0}
    for trial in range(500):
        params = FILTERS[trial % len(FILTERS)]
        l1, l2, lR = _logits(g, scale=0.5 + trial % 5)
        lR = l2 + 0.3 * torch.randn(V, generator=g) if trial % 2 else lR  # some p_d2 close to p_R
        q1, q2t, p = (filter_probs(x, params) for x in (l1, l2, lR))
        eps2 = float(total_variation(q2t, p))
        ungated = double_rejection_probability(p, q1, q2t, gate=False)
        gated = double_rejection_probability(p, q1, q2t, gate=True)
        assert ungated <= eps2 + 1e-9
        assert gated <= 2 * eps2 + 1e-9
        if eps2 > 0:
            worst[False] = max(worst[False], ungated / eps2)
            worst[True] = max(worst[True], gated / eps2)
    assert worst[True] > 1.0  # the gated bound needs its factor 2 on some inputs


def test_gate_open_probability():
    q1 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q2t = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    assert gate_open_probability(q1, q2t) == pytest.approx(0.5)  # only x1 = 0 loses confidence


# -- the samplers ---------------------------------------------------------------------------------------------
def test_greedy_cascade():
    assert cascade_verify_greedy(5, 5, 7) == cascade_verify_greedy(5, 5)
    assert cascade_verify_greedy(5, 5, 7).source == CommitSource.FIRST
    v = cascade_verify_greedy(7, 5, 7)
    assert (v.token, v.source) == (7, CommitSource.SECOND)
    v = cascade_verify_greedy(9, 5, 7)
    assert (v.token, v.source) == (9, CommitSource.FULL)
    assert cascade_verify_greedy(9, 5).source == CommitSource.FULL


def test_cascade_verify_with_given_uniforms():
    p = torch.tensor([0.6, 0.4, 0.0], dtype=torch.float64)
    q1 = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    q2 = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    # x1 = 2 has p = 0: rejected whatever the uniform; rho = [p - q1]+ ~ [0.4, 0.2, 0] -> [2/3, 1/3, 0]
    v = cascade_verify(p, Proposal(2, q1), Proposal(1, q2), rng=[0.0, 0.1, 0.5])
    assert (v.token, v.source) == (1, CommitSource.SECOND)  # accept x2=1 w.p. min(1, (1/3)/1): u=0.1 accepts
    v = cascade_verify(p, Proposal(2, q1), Proposal(1, q2), rng=[0.0, 0.9, 0.5])
    assert (v.token, v.source) == (0, CommitSource.FULL)  # rho ⊖ q2 = [1, 0, 0]
    v = cascade_verify(p, Proposal(0, q1), None, rng=[0.99])
    assert (v.token, v.source) == (0, CommitSource.FIRST)  # p/q1 = 3 >= 1: always accepted
    v = cascade_verify(p, Proposal(2, q1), None, rng=[0.5, 0.7])
    assert (v.token, v.source) == (1, CommitSource.FULL)  # rho = [2/3, 1/3]: u=0.7 -> token 1


# -- exact enumeration of the production sampler ----------------------------------------------------------
class _Uniform(float):
    """A uniform draw that records every threshold it is compared with (``u < a`` and friends)."""

    def __new__(cls, value: float, cuts: list):
        obj = super().__new__(cls, value)
        obj.cuts = cuts
        return obj

    def _recorded(op):
        def compare(self, other):
            self.cuts.append(float(other))
            return getattr(float, op)(float(self), float(other))

        return compare

    __lt__, __le__ = _recorded("__lt__"), _recorded("__le__")
    __gt__, __ge__ = _recorded("__gt__"), _recorded("__ge__")


def _recording_sample_from(real):
    """``sample_from`` that also records its breakpoints (the normalised CDF) on the uniform."""

    def sample_from(probs, u):
        if isinstance(u, _Uniform):
            cdf = probs.to(torch.float64).cumsum(0)
            u.cuts.extend((cdf[:-1] / cdf[-1]).tolist())
        return real(probs, u)

    return sample_from


def exact_pipeline(mod, p, q1, q2_tilde, gate=True) -> dict[tuple[int, int], float]:
    """Exact P(committed token, commit source) of ``mod``'s propose_first -> propose_second ->
    cascade_verify, by enumerating the intervals on which each uniform's decisions are constant.

    A run with a prefix of chosen uniforms discovers the next uniform the code draws and where its
    decisions can change (the thresholds it is compared with, the CDF it is inverted through); each
    interval between those breakpoints is explored with its midpoint, weighted by its length."""
    out: dict[tuple[int, int], float] = defaultdict(float)

    def run(values):
        draws: list[list[float]] = []

        def uniform():
            cuts: list[float] = []
            value = values[len(draws)] if len(draws) < len(values) else 0.5
            draws.append(cuts)
            return _Uniform(value, cuts)

        first = mod.propose_first(q1, uniform)
        second = None if q2_tilde is None else mod.propose_second(q2_tilde, first, uniform, gate=gate)
        return mod.cascade_verify(p, first, second, uniform), draws

    stack = [((), 1.0)]
    while stack:
        values, weight = stack.pop()
        verdict, draws = run(values)
        if len(draws) <= len(values):  # every uniform drawn was a chosen one: a leaf
            out[(verdict.token, int(verdict.source))] += weight
            continue
        edges = [0.0, *sorted({c for c in draws[len(values)] if 0.0 < c < 1.0}), 1.0]
        for lo, hi in zip(edges, edges[1:]):
            if hi > lo:
                stack.append(((*values, (lo + hi) / 2), weight * (hi - lo)))
    return out


def _marginal(dist: dict, n: int) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.float64)
    for (token, _), pr in dist.items():
        m[token] += pr
    return m


EXACT_V = 6


def _exact_cases(n_cases: int = 12):
    g = torch.Generator().manual_seed(7)
    cases = []
    for trial in range(n_cases):
        params = FILTERS[trial % len(FILTERS)]
        l1, l2, lR = (torch.randn(EXACT_V, generator=g) * (0.7 + trial % 3) for _ in range(3))
        cases.append(tuple(filter_probs(x, params) for x in (l1, l2, lR)))
    # degenerate corners: q1 = p, disjoint supports, q~2 = p
    p = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0], dtype=torch.float64)
    far = torch.tensor([0, 0, 0, 0.6, 0.4, 0], dtype=torch.float64)
    cases += [(p, far, p), (far, far, far[[5, 4, 3, 2, 1, 0]]), (p.clone(), p, far)]
    return cases


def _exact_check(mod, monkeypatch) -> list[str]:
    """Every case and mode through ``mod``; returns what differs from p (empty: exact)."""
    monkeypatch.setattr(mod, "sample_from", _recording_sample_from(mod.sample_from))
    errors = []
    for i, (q1, q2t, p) in enumerate(_exact_cases()):
        for q2_mode, gate in (("q2", True), ("q2", False), (None, True)):
            q2_tilde = q2t if q2_mode else None
            dist = exact_pipeline(mod, p, q1, q2_tilde, gate)
            marginal = _marginal(dist, EXACT_V)
            if abs(float(marginal.sum()) - 1.0) > 1e-9:
                errors.append(f"case {i} gate={gate} q2={q2_mode}: total mass {float(marginal.sum())}")
            worst = float((marginal - p).abs().max())
            if worst > 1e-9:
                errors.append(f"case {i} gate={gate} q2={q2_mode}: max |P(token) - p| = {worst:.3g}")
            restart = sum(pr for (_, src), pr in dist.items() if src == int(CommitSource.FULL))
            expected = double_rejection_probability(p, q1, q2_tilde, gate=gate)
            if abs(restart - expected) > 1e-9:
                errors.append(f"case {i} gate={gate} q2={q2_mode}: P(restart) {restart:.6g} != {expected:.6g}")
    return errors


def test_production_cascade_is_exactly_lossless(monkeypatch):
    """The production sampler's exact output distribution equals p in every case, and its exact
    restart probability equals ``double_rejection_probability`` (so the analysis is checked too)."""
    assert _exact_check(verify_mod, monkeypatch) == []


VERIFY_SOURCE = Path(verify_mod.__file__).read_text()
# name -> (code in verify.py, mutated code): the ways a residual sampler goes wrong.
MUTANTS = {
    "stage 2 tests x2 against p, not the residual": (
        "accept_probability(rho[x2], q2[x2])", "accept_probability(p[x2], q2[x2])"),
    "stage 3 resamples from p ⊖ q2, not (p ⊖ q1) ⊖ q2": (
        "sample_from(residual_or(rho, q2), u())", "sample_from(residual_or(p, q2), u())"),
    "stage 3 resamples from p ⊖ q1 (q2 not removed)": (
        "sample_from(residual_or(rho, q2), u())", "sample_from(rho, u())"),
    "stage 3 resamples from p": (
        "sample_from(residual_or(rho, q2), u())", "sample_from(p, u())"),
    "gate closed: resample from p, not p ⊖ q1": (
        "return Verdict(sample_from(rho, u()), CommitSource.FULL)", "return Verdict(sample_from(p, u()), CommitSource.FULL)"),
    "x2 drawn from q~2 but verified as drawn from q2": (
        "return Proposal(sample_from(q2, uniform_source(rng)()), q2)",
        "return Proposal(sample_from(q2_tilde, uniform_source(rng)()), q2)"),
}


def _mutant(name: str, monkeypatch) -> types.ModuleType:
    old, new = MUTANTS[name]
    assert VERIFY_SOURCE.count(old) == 1, f"mutation site for {name!r} not found once in verify.py: {old}"
    mod = types.ModuleType(f"{verify_mod.__name__}_mutant")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # dataclasses look their module up
    exec(compile(VERIFY_SOURCE.replace(old, new), verify_mod.__file__, "exec"), mod.__dict__)
    return mod


@pytest.mark.parametrize("name", list(MUTANTS))
def test_exact_check_catches_mutant(name, monkeypatch):
    errors = _exact_check(_mutant(name, monkeypatch), monkeypatch)
    assert any("P(token)" in e for e in errors), f"the exact check did not see the output distribution change: {name}"


def test_cascade_sampler_matches_p_by_chi_square():
    """The sampling path itself (not the exact formula): 8000 seeded cascades vs p (chi-square, p-value > 1e-3)."""
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(1.0, top_k=6)
    l1, l2, lR = _logits(g, scale=1.5)
    q1, q2t, p = (filter_probs(x, params) for x in (l1, l2, lR))
    rng = torch.Generator().manual_seed(4)
    counts = torch.zeros(V)
    sources = torch.zeros(4)
    n = 8000
    for _ in range(n):
        first = propose_first(q1, rng)
        v = cascade_verify(p, first, propose_second(q2t, first, rng, gate=True), rng=rng)
        counts[v.token] += 1
        sources[int(v.source)] += 1
    support = p > 0
    assert counts[~support].sum() == 0
    expected = (p[support] * n).numpy()
    assert chisquare(counts[support].numpy(), expected).pvalue > 1e-3
    # the restart frequency matches the exact double-rejection probability
    dr = double_rejection_probability(p, q1, q2t, gate=True)
    assert abs(sources[int(CommitSource.FULL)] / n - dr) < 4 * (dr * (1 - dr) / n) ** 0.5 + 1e-3


def test_sample_token_baseline():
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert sample_token(logits, SamplingParams(0.0)) == 1
    g = torch.Generator().manual_seed(0)
    draws = [sample_token(logits, SamplingParams(1.0, top_k=2), g) for _ in range(200)]
    assert set(draws) <= {1, 2} and draws.count(1) > 150
