"""The pipelined LoopSpec executor: lossless against ordinary full-depth decoding.

* a toy looped LM (``vllm_loop.testing.toy_looped``): bookkeeping, capacity bounds, metrics;
* tiny Ouro (R=4) and Raven (R=32) checkpoints from the factory, random and agreement-controlled:
  greedy LoopSpec == greedy full-depth decoding, token for token, batches of several requests;
* seeded sampling on tiny Ouro: the distribution of the first three generated tokens matches ordinary
  sampling (chi-square two-sample test at significance 1e-3, plus goodness of fit against the exact
  distribution enumerated from the model), and a deliberately broken verifier fails the same test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import vllm_loop.loopspec.pipeline as pipeline_mod
from vllm_loop.loopspec.executor import GenerationRequest, PipelinedExecutor, baseline_generate
from vllm_loop.loopspec.proposals import SamplingParams, filter_probs, sample_from, sample_token
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.testing.toy_looped import ToyLoopedLM
from vllm_loop.loopspec.verify import CommitSource, Verdict
from vllm_loop.reference import load_reference
from vllm_loop.testing.distribution import chi2_gof, chi2_two_sample, exact_tree

ALPHA = 1e-3  # significance level of the statistical tests




def _requests(n_new: int, **kw) -> list[GenerationRequest]:
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [4, 10], [11, 12, 13, 14]]
    return [GenerationRequest(p, n_new, **kw) for p in prompts]


# -- toy model --------------------------------------------------------------------------------------------------
TOY_SCHEDULES = [(4, 1, None), (4, 1, 2), (8, 2, 4), (8, 2, None), (12, 2, 6), (16, 4, 8),
                 (8, 3, 6), (7, 2, 4), (8, 3, None)]  # the last three: R not a multiple of d1


@pytest.mark.parametrize("R, d1, d2", TOY_SCHEDULES)
@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_toy_greedy_equals_full_depth(R, d1, d2, decay):
    model = ToyLoopedLM(depth=R, decay=decay, prelude=True, coda=True, seed=R + d1)
    reqs = _requests(10)
    out = PipelinedExecutor(model, LoopSpecSchedule(R, d1, d2)).generate(reqs)
    assert out.tokens == [baseline_generate(model, r) for r in reqs]
    for o, r in zip(out.outputs, reqs):
        assert o.finish_reason == "length" and len(o.tokens) == r.max_new_tokens
        assert o.stats.decoded == len(o.tokens) - 1  # the first token comes from the prefill
        assert o.stats.first + o.stats.second + o.stats.full == o.stats.decoded
        assert 1.0 <= o.stats.gamma <= R / d1
    s = out.summary()
    assert sum(s["shares"].values()) == pytest.approx(1.0)
    assert s["effective_batch"]["steps"] == s["recurrent_steps"] > 0
    assert out.effective_batch[0] == len(reqs)  # step 1: one lane per request
    if d2 is None:
        assert s["second"] == 0 and s["gate_evaluations"] == 0


def test_toy_unbatched_lanes_give_the_same_tokens():
    model = ToyLoopedLM(depth=8, decay=0.7, prelude=True, coda=True, seed=5)
    sch = LoopSpecSchedule(8, 2, 4)
    reqs = _requests(8) + [GenerationRequest([1, 2, 3], 8)]  # a repeated prompt shares its prefill
    batched = PipelinedExecutor(model, sch).generate(reqs)
    single = PipelinedExecutor(model, sch, batch_lanes=False, share_prefill=False).generate(reqs)
    assert batched.tokens == single.tokens == [baseline_generate(model, r) for r in reqs]
    assert batched.effective_batch == single.effective_batch
    report = batched.report()
    assert "gamma (eq. 9)" in report and "commit shares" in report and "effective batch size" in report
    assert batched.summary()["measured_gamma"] <= batched.summary()["gamma"] + 1e-9


def test_random_prefill_is_not_shared(ckpt_factory):
    like_init = load_reference(ckpt_factory("huginn_raven", options={"state_init": "like-init"}))
    assert not PipelinedExecutor(like_init, LoopSpecSchedule(like_init.depth, 1, 2)).share_prefill
    seeded = load_reference(ckpt_factory("huginn_raven", options={"state_init": "seeded"}))
    assert PipelinedExecutor(seeded, LoopSpecSchedule(seeded.depth, 1, 2)).share_prefill


def test_eos_and_lengths():
    model = ToyLoopedLM(depth=4, decay=0.5, seed=3)
    full = baseline_generate(model, GenerationRequest([1, 2, 3], 12))
    eos = full[5]
    reqs = [GenerationRequest([1, 2, 3], 12, eos_token_id=eos), GenerationRequest([1, 2, 3], 1), GenerationRequest([4], 7)]
    out = PipelinedExecutor(model, LoopSpecSchedule(4, 1, 2)).generate(reqs)
    assert out.tokens[0] == full[: full.index(eos) + 1] and out.outputs[0].finish_reason == "eos"
    assert out.tokens[1] == full[:1] and out.outputs[1].stats.decoded == 0
    assert out.tokens[2] == baseline_generate(model, reqs[2])


@pytest.mark.parametrize("R, d1, d2", [(4, 1, 2), (8, 2, 4), (32, 4, 8), (32, 2, 8), (8, 3, 6), (7, 2, 4), (32, 3, 9)])
def test_capacity_bound_is_reached_without_gate_and_never_exceeded(R, d1, d2):
    """Ungated sampling proposes at d1 and d2 from every lane: before the first commit the tree grows
    exactly as the births recurrence says, so the peak lane count is the bound (249 for 2:8)."""
    model = ToyLoopedLM(depth=R, prelude=True, coda=True, seed=2)
    sch = LoopSpecSchedule(R, d1, d2, gate=False)
    req = GenerationRequest([1, 2], 3, sampling=SamplingParams(1.0), seed=0)
    out = PipelinedExecutor(model, sch).generate([req])  # raises if a step exceeds the bound
    assert max(out.effective_batch) == sch.max_lanes
    gated = PipelinedExecutor(model, LoopSpecSchedule(R, d1, d2)).generate([req])
    assert max(gated.effective_batch) <= sch.max_lanes


def test_sampling_metrics_are_consistent():
    """Restart frequency vs the exact per-position double-rejection probability (Theorem 1 per position)."""
    model = ToyLoopedLM(depth=8, decay=0.6, prelude=True, coda=True, seed=9)
    sch = LoopSpecSchedule(8, 2, 4)
    reqs = [GenerationRequest([i + 1, i + 2], 24, sampling=SamplingParams(1.0, top_p=0.9), seed=i) for i in range(8)]
    out = PipelinedExecutor(model, sch).generate(reqs)
    st = out.stats
    assert st.decoded == sum(len(t) - 1 for t in out.tokens)
    assert st.exact_double_reject_sum <= 2 * st.eps2_sum + 1e-9
    n, p = st.decoded, st.expected_double_rejection
    assert abs(st.double_rejection_rate - p) <= 4 * (p * (1 - p) / n) ** 0.5 + 2 / n
    assert 0 < st.gate_open_frequency < 1 and st.second_proposals == st.gate_opens


def test_schedule_must_match_model_depth():
    with pytest.raises(ValueError, match="does not match the model's depth"):
        PipelinedExecutor(ToyLoopedLM(depth=4), LoopSpecSchedule(8, 2, 4))
    with pytest.raises(ValueError, match="at least one request"):
        PipelinedExecutor(ToyLoopedLM(depth=4), LoopSpecSchedule(4, 1, 2)).generate([])


LATE_SCHEDULES = [(8, 1, 2, (4, 6)), (16, 2, 4, (8, 12)), (8, 1, None, (3, 5))]


@pytest.mark.parametrize("R, d1, d2, late", LATE_SCHEDULES)
def test_toy_greedy_late_reproposals(R, d1, d2, late):
    """Late re-proposals: greedy output identical to full depth (and to the schedule without them),
    late commits happen and take restarts away; sampled requests ignore them (same seeded tokens)."""
    model = ToyLoopedLM(depth=R, decay=1.0, prelude=True, coda=True, seed=R + d1)
    reqs = _requests(10)
    plain = PipelinedExecutor(model, LoopSpecSchedule(R, d1, d2)).generate(reqs)
    out = PipelinedExecutor(model, LoopSpecSchedule(R, d1, d2, late=late)).generate(reqs)
    assert out.tokens == plain.tokens == [baseline_generate(model, r) for r in reqs]
    s = out.stats
    assert s.first + s.second + s.late + s.full == s.decoded
    assert 0 < s.late <= s.late_proposals and s.full < plain.stats.full
    assert s.late_depth_sum >= s.late * late[0] and 1.0 <= s.gamma <= R / d1
    assert out.summary()["shares"]["late"] == pytest.approx(s.late / s.decoded)
    sampled = [GenerationRequest(r.prompt, 10, sampling=SamplingParams(1.0), seed=i) for i, r in enumerate(reqs)]
    a = PipelinedExecutor(model, LoopSpecSchedule(R, d1, d2)).generate(sampled)
    b = PipelinedExecutor(model, LoopSpecSchedule(R, d1, d2, late=late)).generate(sampled)
    assert a.tokens == b.tokens and b.stats.late_proposals == 0


# -- real tiny checkpoints: greedy is token-identical ---------------------------------------------------------
_BASELINES: dict = {}


def _check_greedy(model, key, R, d1, d2, reqs):
    if key not in _BASELINES:
        _BASELINES[key] = [baseline_generate(model, r) for r in reqs]
    out = PipelinedExecutor(model, LoopSpecSchedule(R, d1, d2)).generate(reqs)
    assert out.tokens == _BASELINES[key], out.summary()
    return out


@pytest.fixture(scope="module")
def ouro_models(ckpt_factory):
    return {
        "random": load_reference(ckpt_factory("ouro")),
        "agreement": load_reference(ckpt_factory("ouro", options={"agreement": "0.02"})),
    }


@pytest.mark.parametrize("kind", ["random", "agreement"])
@pytest.mark.parametrize("d1, d2", [(1, None), (1, 2)])
def test_ouro_greedy_identical(ouro_models, kind, d1, d2):
    model = ouro_models[kind]
    assert model.depth == 4
    out = _check_greedy(model, ("ouro", kind), 4, d1, d2, _requests(16))
    if kind == "agreement":
        assert out.stats.first / out.stats.decoded > 0.5  # the pipeline really runs ahead


RAVEN = {
    "random": {"layout": "llama"},
    "agreement": {"layout": "llama", "agreement": "0.5"},
    "huginn-agreement": {"layout": "huginn", "agreement": "0.3"},
}


@pytest.fixture(scope="module")
def raven_models(ckpt_factory):
    return {
        kind: load_reference(ckpt_factory("huginn_raven", options={**opts, "state_init": "seeded"}, mean_recurrence=32))
        for kind, opts in RAVEN.items()
    }


@pytest.mark.parametrize("kind", list(RAVEN))
@pytest.mark.parametrize("d1, d2", [(2, 8), (4, 8)])
def test_raven_greedy_identical(raven_models, kind, d1, d2):
    model = raven_models[kind]
    assert model.depth == 32
    # random weights restart almost every token with huge trees (2:8 peaks near 249 lanes/request)
    reqs = _requests(5)[:2] if kind == "random" else _requests(8)[:3]
    out = _check_greedy(model, ("raven", kind, len(reqs)), 32, d1, d2, reqs)
    for o in out.outputs:
        assert max(o.stats.lanes_per_step) <= LoopSpecSchedule(32, d1, d2).max_lanes
    if kind != "random":
        assert out.stats.gamma > 4


@pytest.mark.parametrize("kind", ["agreement", "huginn-agreement"])
def test_raven_greedy_late_reproposals_identical(raven_models, kind):
    """R = 32, 2:8 with late re-proposals at 16 and 24: token-identical to full depth."""
    model = raven_models[kind]
    reqs = _requests(8)[:3]
    key = ("raven", kind, len(reqs))
    if key not in _BASELINES:
        _BASELINES[key] = [baseline_generate(model, r) for r in reqs]
    out = PipelinedExecutor(model, LoopSpecSchedule(32, 2, 8, late=(16, 24))).generate(reqs)
    assert out.tokens == _BASELINES[key], out.summary()
    assert out.stats.first + out.stats.second + out.stats.late + out.stats.full == out.stats.decoded


@pytest.mark.parametrize("kind", ["random", "agreement"])
@pytest.mark.parametrize("d1, d2", [(3, 6), (3, None), (5, None)])
def test_raven_schedule_with_d1_not_dividing_R(ckpt_factory, kind, d1, d2):
    """R = 8 with d1 = 3 (or 5): lanes are verified between two of their children's births; greedy
    output is still token-identical and the lane count stays within the (ceil) capacity bound."""
    options = {"layout": "llama", "state_init": "seeded", **({"agreement": "0.5"} if kind == "agreement" else {})}
    model = load_reference(ckpt_factory("huginn_raven", options=options, mean_recurrence=8))
    assert model.depth == 8
    out = _check_greedy(model, ("raven-8", kind), 8, d1, d2, _requests(10)[:3])  # check_capacity asserts the bound
    bound = LoopSpecSchedule(8, d1, d2).max_lanes
    assert max(max(o.stats.lanes_per_step) for o in out.outputs) <= bound
    if kind == "agreement":
        assert out.stats.first > 0


# -- sampling: distribution of whole token sequences ----------------------------------------------------------
PROMPT = [3, 14, 15]
PARAMS = SamplingParams(temperature=1.0, top_k=3)  # at most 3 * 3 * 3 = 27 sequences of 3 tokens
N_TOKENS = 3
# name -> (family, options, overrides, schedule (R, d1, d2), samples)
SAMPLING_CASES = {
    "ouro-1:2": ("ouro", {"agreement": "0.1"}, {}, (4, 1, 2), 1200),
    "raven-olmo2-2:4": ("huginn_raven", {"layout": "olmo2", "state_init": "seeded", "agreement": "0.5"},
                        {"mean_recurrence": 8}, (8, 2, 4), 500),
}


def _loopspec_samples(model, schedule, n: int, seed0: int = 0) -> tuple[Counter, object]:
    reqs = [GenerationRequest(PROMPT, N_TOKENS, sampling=PARAMS, seed=seed0 + i) for i in range(n)]
    out = PipelinedExecutor(model, schedule).generate(reqs)
    return Counter(tuple(t) for t in out.tokens), out


@pytest.fixture(scope="module", params=list(SAMPLING_CASES))
def sampling_case(request, ckpt_factory):
    """Model, schedule, N, the exact distribution, and N ordinary samples.

    Ordinary sampling is ancestral sampling from the full-depth next-token distributions: the tree's
    conditionals are those ``model.generate`` samples from (checked on a few runs, which record the
    distributions they see), so the N ordinary samples are drawn from the enumerated conditionals
    instead of running N full decodes."""
    family, options, overrides, (R, d1, d2), n = SAMPLING_CASES[request.param]
    model = load_reference(ckpt_factory(family, options=options, **overrides))
    assert model.depth == R
    exact, cond = exact_tree(model, PROMPT, PARAMS, N_TOKENS)
    g = torch.Generator().manual_seed(12345)
    for _ in range(3):
        seen = []

        def sampler(logits):
            seen.append(filter_probs(logits, PARAMS))
            return sample_token(logits, PARAMS, g)

        seq = model.generate(PROMPT, N_TOKENS, sample=sampler)
        for i in range(N_TOKENS):
            assert torch.allclose(seen[i], cond[tuple(seq[:i])], atol=1e-5)
    ordinary = Counter()
    for _ in range(n):
        seq: tuple = ()
        for _ in range(N_TOKENS):
            seq += (sample_from(cond[seq], float(torch.rand((), generator=g, dtype=torch.float64))),)
        ordinary[seq] += 1
    return model, LoopSpecSchedule(R, d1, d2), n, exact, ordinary


def test_sampling_matches_ordinary_sampling(sampling_case):
    model, schedule, n, exact, ordinary = sampling_case
    assert sum(exact.values()) == pytest.approx(1.0)
    assert chi2_gof(ordinary, exact, n) > ALPHA  # the baseline sampler itself
    counts, out = _loopspec_samples(model, schedule, n)
    st = out.stats
    # every branch of the cascade was exercised
    assert st.first > 0 and st.second > 0 and st.full > 0 and st.gate_opens > 0
    assert chi2_gof(counts, exact, n) > ALPHA
    assert chi2_two_sample(counts, ordinary) > ALPHA


def test_broken_verifier_is_detected(sampling_case, monkeypatch):
    """Accepting the first proposal without the ratio test samples from q1 = p_d1: the same tests fail."""
    model, schedule, n, exact, ordinary = sampling_case

    def accept_always(p, first, second=None, rng=None):
        return Verdict(first.token, CommitSource.FIRST)

    monkeypatch.setattr(pipeline_mod, "cascade_verify", accept_always)
    counts, _ = _loopspec_samples(model, schedule, n)
    assert chi2_two_sample(counts, ordinary) < ALPHA
    assert set(counts) - set(exact) or chi2_gof(counts, exact, n) < ALPHA


# -- coupled sampling (noise.py): the same noise at every depth of a position ---------------------------------
COUPLED_PARAMS = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.7),
                  SamplingParams(temperature=0.7, top_k=20, top_p=0.95), SamplingParams(temperature=1.3)]


@pytest.mark.slow  # ~13 s a case on 2 cores
@pytest.mark.parametrize("params", COUPLED_PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_coupled_loopspec_equals_coupled_decoding_token_for_token(ouro_models, raven_models, params):
    """Coupled LoopSpec commits, at every position, the target's own noisy argmax: its tokens equal
    ordinary full-depth decoding with the same sampler and key, token for token, whatever the
    proposals were (exactness of that sampler: the distribution tests below)."""
    from vllm_loop.loopspec.executor import coupled_generate

    cases = [(ouro_models["agreement"], LoopSpecSchedule(4, 1, 2)), (ouro_models["random"], LoopSpecSchedule(4, 1, 2)),
             (raven_models["agreement"], LoopSpecSchedule(32, 2, 8))]
    for model, schedule in cases:
        reqs = [GenerationRequest(p, 12, sampling=params, seed=100 + i) for i, p in
                enumerate([[1, 2, 3], [5, 6, 7, 8, 9], [4, 10], [11, 12, 13, 14]])]
        out = PipelinedExecutor(model, schedule, coupled=True).generate(reqs)
        for req, got in zip(reqs, out.tokens):
            assert got == coupled_generate(model, req, req.seed), (schedule.describe(), req.prompt)


def test_coupled_sampler_draws_the_filtered_distribution():
    """``noise.coupled_sample`` at many (key, position) pairs is a sample of ``filter_probs``'s
    distribution (chi-square), for each filter; ignoring the position (one noise for every position)
    draws the same token every time and fails."""
    from scipy.stats import chisquare

    from vllm_loop.loopspec.noise import coupled_sample

    g = torch.Generator().manual_seed(3)
    n = 20000
    for params in COUPLED_PARAMS:
        logits = torch.randn(40, generator=g, dtype=torch.float64) * 2
        probs = filter_probs(logits, params)

        def draw(positions):
            return coupled_sample(logits.expand(n, -1), torch.full((n,), params.temperature, dtype=torch.float64),
                                  torch.full((n,), params.top_k), torch.full((n,), params.top_p, dtype=torch.float64),
                                  torch.full((n,), 9), positions)

        counts = torch.bincount(draw(torch.arange(n)), minlength=40).double()
        keep = probs > 0
        assert counts[~keep].sum() == 0, params  # nothing the filter removed
        assert chisquare(counts[keep].numpy(), (probs[keep] * n).numpy()).pvalue > ALPHA, params
        frozen = torch.bincount(draw(torch.zeros(n, dtype=torch.long)), minlength=40)
        assert int((frozen > 0).sum()) == 1  # a broken noise (the same at every position) is caught


def test_coupled_filter_equals_filter_probs():
    from vllm_loop.loopspec.noise import filter_logits

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(len(COUPLED_PARAMS), 300, generator=g, dtype=torch.float64) * 3
    got = torch.softmax(filter_logits(logits, torch.tensor([p.temperature for p in COUPLED_PARAMS], dtype=torch.float64),
                                      torch.tensor([p.top_k for p in COUPLED_PARAMS]),
                                      torch.tensor([p.top_p for p in COUPLED_PARAMS], dtype=torch.float64)), -1)
    for i, params in enumerate(COUPLED_PARAMS):
        torch.testing.assert_close(got[i], filter_probs(logits[i], params), rtol=0, atol=1e-12)


def _coupled_samples(model, schedule, n: int, seed0: int = 0) -> tuple[Counter, object]:
    reqs = [GenerationRequest(PROMPT, N_TOKENS, sampling=PARAMS, seed=seed0 + i) for i in range(n)]
    out = PipelinedExecutor(model, schedule, coupled=True).generate(reqs)
    return Counter(tuple(t) for t in out.tokens), out


def test_coupled_sampling_matches_ordinary_sampling(sampling_case):
    model, schedule, n, exact, ordinary = sampling_case
    counts, out = _coupled_samples(model, schedule, n)
    st = out.stats
    assert st.first > 0 and st.second > 0 and st.full > 0 and st.gate_opens > 0  # every branch ran
    assert chi2_gof(counts, exact, n) > ALPHA
    assert chi2_two_sample(counts, ordinary) > ALPHA


def test_broken_coupled_verifier_is_detected(sampling_case, monkeypatch):
    """Mutation: accepting the first proposal without comparing it with the target's noisy argmax
    commits samples of p_d1: the same tests fail."""
    model, schedule, n, exact, ordinary = sampling_case

    def accept_always(target, first, second=None, late=()):
        return Verdict(first, CommitSource.FIRST)

    monkeypatch.setattr(pipeline_mod, "cascade_verify_greedy", accept_always)
    counts, _ = _coupled_samples(model, schedule, n)
    assert chi2_two_sample(counts, ordinary) < ALPHA
    assert set(counts) - set(exact) or chi2_gof(counts, exact, n) < ALPHA
