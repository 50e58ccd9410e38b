"""The lanes policy (``vllm_loop/loopspec/policy.py``): per batch-size bucket, try lanes, try plain
decoding, then run the faster and re-check the other now and then. Pure: no engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_loop.loopspec import policy as policy_module
from vllm_loop.loopspec.policy import LanePolicy, StepSample, bucket_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from policy_stall_model import MODELS, run, wave  # noqa: E402  (the model of engine steps has its home there)


def _run(policy: LanePolicy, rows: int, steps: int, speed: dict[bool, float]) -> list[bool]:
    """``steps`` engine steps of ``rows`` requests; a mode commits ``speed[mode]`` tokens per second."""
    chosen = []
    for _ in range(steps):
        lanes = policy.lanes(rows)
        chosen.append(lanes)
        policy.observe(StepSample(lanes=lanes, rows=rows, tokens=rows * (3 if lanes else 1),
                                  seconds=rows * (3 if lanes else 1) / speed[lanes]))
    return chosen


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65, 128)] == [1, 2, 4, 4, 8, 8, 16, 64, 128, 128]


def _seconds(rows: int, lanes: bool, speed: dict[bool, float]) -> float:
    return rows * (3 if lanes else 1) / speed[lanes]


@pytest.mark.parametrize("lanes_faster", [True, False])
def test_tries_both_then_runs_the_faster(lanes_faster):
    policy = LanePolicy(trial=4, recheck=50, budget=1.0)  # a budget this loose: re-checks every 50 decisions
    speed = {True: 300.0, False: 250.0} if lanes_faster else {True: 200.0, False: 250.0}
    chosen = _run(policy, rows=1, steps=200, speed=speed)
    assert chosen[:8] == [True] * 4 + [False] * 4  # the trials
    after = chosen[8:]
    # the faster mode, except re-checks of the other: 4 trial steps after every 50 decisions (192 steps
    # after the trials: 50 decisions, a re-check of 4, 50 more, ...)
    assert after.count(lanes_faster) == len(after) - 4 * 3
    assert after[:54] == [lanes_faster] * 50 + [not lanes_faster] * 4
    assert policy.describe()[1] == {"lanes": speed[True], "plain": speed[False]}


@pytest.mark.parametrize("lanes_faster", [True, False])
def test_a_clearly_slower_mode_ends_its_trial_after_one_steady_step(lanes_faster):
    policy = LanePolicy(trial=4, recheck=50, budget=1.0)
    speed = {True: 300.0, False: 200.0} if lanes_faster else {True: 100.0, False: 200.0}  # 0.67x, 0.5x
    chosen = _run(policy, rows=1, steps=200, speed=speed)
    # the first lanes trial runs in full (nothing to compare with yet); plain's ends early if it loses
    assert chosen[:5 if lanes_faster else 8] == [True] * 4 + [False] * (1 if lanes_faster else 4)
    after = chosen[5 if lanes_faster else 8:]
    assert after[:51] == [lanes_faster] * 50 + [not lanes_faster]  # re-checks of one step
    assert after.count(not lanes_faster) == 3


def test_each_batch_size_bucket_decides_for_itself():
    policy = LanePolicy(trial=2, recheck=1000)
    _run(policy, rows=1, steps=20, speed={True: 300.0, False: 100.0})
    _run(policy, rows=40, steps=20, speed={True: 500.0, False: 2000.0})  # compute-bound: lanes lose
    assert policy.lanes(1) is True and policy.lanes(3) is True  # bucket 1 chose lanes; bucket 4 still trying
    assert policy.lanes(33) is False and policy.lanes(64) is False


def test_a_recheck_follows_a_change():
    """Acceptance drops (new text): lanes were faster, then measure slower and plain takes over, lanes
    getting only their re-check trials; when lanes speed up again, a re-check brings them back."""
    policy = LanePolicy(trial=3, recheck=20, budget=1.0)
    _run(policy, rows=2, steps=40, speed={True: 300.0, False: 100.0})
    assert policy.lanes(2) is True
    chosen = _run(policy, rows=2, steps=60, speed={True: 50.0, False: 100.0})
    assert chosen[-40:].count(True) <= 2 * 3
    chosen = _run(policy, rows=2, steps=60, speed={True: 400.0, False: 100.0})
    assert chosen[-20:].count(False) <= 3  # at most one re-check trial of plain decoding


@pytest.mark.parametrize("lanes_speed", [1900.0, 1500.0, 1000.0, 500.0])
def test_rechecks_cost_at_most_the_budget(lanes_speed):
    """Lanes stay slower (64 requests, compute-bound): every re-check costs its trial's lane steps
    against the plain steps that would have committed the same tokens. The policy spaces re-checks so
    that this stays under ``budget`` of the engine time -- the more lanes lose, the rarer they come --
    but never more often than every ``recheck`` decisions, and it keeps re-checking."""
    budget, speed = 0.01, {True: lanes_speed, False: 2000.0}
    policy = LanePolicy(trial=4, recheck=256, budget=budget)
    chosen = _run(policy, rows=64, steps=6000, speed=speed)
    assert chosen[:8] == [True] * 4 + [False] * 4
    after = chosen[8:]
    lane_steps = after.count(True)
    spent = sum(_seconds(64, lanes, speed) for lanes in after)
    plain_equivalent = (lane_steps * 3 * 64 + after.count(False) * 64) / speed[False]
    assert spent - plain_equivalent <= budget * spent
    assert lane_steps >= 1  # it does re-check
    runs = [len(r) for r in "".join("L" if x else "P" for x in after).split("L") if r]
    assert min(runs[:-1], default=256) >= 256, runs


def test_plain_falling_behind_the_lanes_older_rate_waits_for_the_budgeted_recheck():
    """Plain steps slow down as contexts grow; the lanes' rate was measured at the start, and lanes slow
    down faster. No lane step until the planned re-check, which finds them slower still."""
    policy = LanePolicy(trial=4, recheck=100, budget=1.0)
    _run(policy, rows=64, steps=20, speed={True: 1500.0, False: 2000.0})
    chosen = _run(policy, rows=64, steps=150, speed={True: 600.0, False: 1000.0})  # longer contexts
    assert 0 < chosen.index(True) and chosen.count(True) == 1  # the re-check (ended after one step)
    assert chosen.index(True) >= 100 - 12  # at its planned time, not when plain fell behind
    assert policy.describe()[64] == {"lanes": 600.0, "plain": 1000.0}


def test_lanes_falling_behind_plains_older_rate_bring_a_plain_recheck():
    """Lanes ran (short contexts); as contexts grow they fall below the rate plain steps had at the
    start. Plain is measured again at once, and takes over only if it is faster now."""
    policy = LanePolicy(trial=4, recheck=1000)
    _run(policy, rows=64, steps=20, speed={True: 3000.0, False: 2000.0})
    chosen = _run(policy, rows=64, steps=40, speed={True: 900.0, False: 1500.0})
    assert chosen[:2] == [True, True]  # the lanes' estimate falls below 2000 while they run
    assert chosen[-20:] == [False] * 20 and policy.describe()[64]["plain"] == 1500.0


def test_a_warmup_is_a_trial_step_not_the_lanes_rate():
    """The first lane step after plain steps restarts every pipeline (one token per request after R
    recurrent steps): it takes a trial step but not the lanes' rate, which steady steps give; a trial
    of warm-ups alone still ends, with the warm-ups' rate."""
    policy = LanePolicy(trial=4, recheck=1000)
    samples = [StepSample(True, 8, 8, 0.04, warmup=True)] + [StepSample(True, 8, 24, 0.03)] * 3
    for sample in samples:
        assert policy.lanes(8) is True
        policy.observe(sample)
    assert policy.describe()[8]["lanes"] == 800.0  # 24 tokens / 0.03 s: the warm-up's 200 tokens/s left out
    assert policy.lanes(8) is False  # plain's trial next: the lanes' trial took 4 steps, warm-up included
    policy.observe(StepSample(True, 8, 24, 0.03, warmup=True))  # a warm-up later on (a new request joined)
    assert policy.describe()[8]["lanes"] == 800.0
    # a re-check of lanes (plain ran): its warm-up is slow, which does not end the re-check early
    recheck = LanePolicy(trial=4, recheck=1, budget=1e9)  # re-check as soon as allowed
    _run(recheck, rows=1, steps=9, speed={True: 100.0, False: 200.0})  # trials: plain chosen
    assert recheck.lanes(1) is True  # the re-check (every decision, recheck=1)
    recheck.observe(StepSample(True, 1, 1, 0.02, warmup=True))  # 50 tokens/s
    assert recheck.lanes(1) is True  # still on trial: a steady step decides
    recheck.observe(StepSample(True, 1, 5, 0.01))  # 500 tokens/s
    assert recheck.describe()[1]["lanes"] == 500.0
    only = LanePolicy(trial=2, recheck=1000)
    for _ in range(2):
        assert only.lanes(3) is True
        only.observe(StepSample(True, 3, 3, 0.01, warmup=True))
    assert only.lanes(3) is False and only.describe()[4]["lanes"] == 300.0


def test_the_first_plain_step_after_lanes_is_a_warmup():
    """The plain step right after a lanes-mode step is slow (not pipelined, after the lane step's last
    work): it takes a plain trial step but neither sets plain's rate nor ends the trial early; the
    next, steady plain step does."""
    policy = LanePolicy(trial=4, recheck=1000)
    for _ in range(4):
        assert policy.lanes(64) is True
        policy.observe(StepSample(True, 64, 192, 0.04))  # 4,800 tokens/s
    assert policy.lanes(64) is False
    policy.observe(StepSample(False, 64, 64, 0.025, warmup=True))  # 2,560 tokens/s: below 0.75x lanes
    assert policy.lanes(64) is False  # the trial goes on
    policy.observe(StepSample(False, 64, 64, 0.0125))  # 5,120 tokens/s
    assert policy.describe()[64]["plain"] == 5120.0


def test_contexts_growing_at_64_requests_end_in_plain_steps():
    """The twelfth H200 run's 64-request case, as a model: a lane step (2.8 tokens per request, 1 in a
    warm-up) costs 20 ms + 0.09 ms per position of context, a plain step 9.5 ms + 0.0085 ms per
    position, and the first plain step after lanes twice that. Lanes win below ~100 positions only.
    Over a 576-token run from a 32-token prompt (after a 64-token one), the policy runs plain steps
    nearly throughout and stays within 2 % of plain decoding alone."""
    model = MODELS["64-h200"]
    policy = LanePolicy()
    wave(policy, n_tokens=64, **model)
    seconds, lane_steps, _ = wave(policy, n_tokens=576, **model)
    plain_only, _, _ = wave(None, n_tokens=576, **model)
    assert lane_steps <= 8 and seconds <= 1.02 * plain_only, (lane_steps, seconds / plain_only)


def test_on_always_runs_lanes_and_bad_modes_are_refused():
    policy = LanePolicy("on")
    assert _run(policy, rows=4, steps=20, speed={True: 1.0, False: 1000.0}) == [True] * 20
    with pytest.raises(ValueError, match="lanes='off': allowed values: auto, on"):
        LanePolicy("off")


def test_a_pattern_fixes_the_decisions_for_tests():
    policy = LanePolicy("auto", pattern="LLP")
    assert _run(policy, rows=4, steps=7, speed={True: 1.0, False: 1000.0}) == [True, True, False] * 2 + [True]
    with pytest.raises(ValueError, match="VLLM_LOOP_LANES_PATTERN='LX': a non-empty string of L"):
        LanePolicy("auto", pattern="LX")


def test_steps_that_say_nothing_about_a_mode_give_no_sample():
    """A lane step that captured a lane CUDA graph, and the last step of a pipelined run (no time
    given), are not throughput samples; an ordinary lane or plain decode step is; a lane step in
    which most rows had just started their lanes is a warm-up, and so is a plain step right after a
    lanes-mode step. A plain step in a batch that changes (a request left, joined or finished in its
    update) is not one either. A sample carries its rows' mean context (for the policy's log line)."""
    from types import SimpleNamespace

    from vllm_loop.loopspec.metrics import EngineCounters
    from vllm_loop.loopspec.scheduler import step_sample

    def so(lanes: bool):
        return SimpleNamespace(loopspec_lanes=lanes, num_scheduled_tokens={"a": 1, "b": 1}, scheduled_new_reqs=[],
                               scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(),
                                                                     num_computed_tokens=[300, 500]),
                               scheduled_spec_decode_tokens={})

    out = SimpleNamespace(sampled_token_ids=[[1, 2], [3]])
    lane_step = EngineCounters(lane_steps=1)
    assert step_sample(so(True), out, lane_step, 0.01) == StepSample(lanes=True, rows=2, tokens=3, seconds=0.01,
                                                                      context=400.0)
    assert step_sample(so(True), out, EngineCounters(lane_steps=1, graph_captures=2), 0.01) is None
    assert step_sample(so(True), out, EngineCounters(lane_steps=1, warmup_rows=2), 0.01).warmup
    assert not step_sample(so(True), out, EngineCounters(lane_steps=1, warmup_rows=1), 0.01).warmup
    plain_out = SimpleNamespace(sampled_token_ids=[[1], [3]])
    assert step_sample(so(False), plain_out, None, 0.01).tokens == 2
    assert not step_sample(so(False), plain_out, None, 0.01).warmup
    assert step_sample(so(False), plain_out, None, 0.01, after_lanes=True).warmup  # right after a lane step
    assert not step_sample(so(True), out, lane_step, 0.01, after_lanes=True).warmup
    assert step_sample(so(False), out, None, None) is None
    # the batch changes: a plain step's pipelined interval is not its own (a lane step's is)
    assert step_sample(so(False), plain_out, None, 0.01, rows_before=2) is not None
    assert step_sample(so(False), plain_out, None, 0.01, rows_before=3) is None  # a request left or joined
    assert step_sample(so(False), plain_out, None, 0.01, finishes=True) is None  # its update finished one
    assert step_sample(so(True), out, lane_step, 0.01, rows_before=3, finishes=True) is not None


def test_lanes_must_beat_plain_by_a_margin():
    """Lanes 5 % faster than plain steps are not worth their switching costs (unseen by the samples);
    20 % faster are."""
    close, clear = LanePolicy(trial=2, recheck=1000), LanePolicy(trial=2, recheck=1000)
    assert _run(close, rows=64, steps=30, speed={True: 1050.0, False: 1000.0})[4:] == [False] * 26
    assert _run(clear, rows=64, steps=30, speed={True: 1200.0, False: 1000.0})[4:] == [True] * 26


def test_a_rate_from_far_longer_contexts_is_measured_again_before_the_other_mode_runs_on_it():
    """A 128-request case measured on an H100 (benchmarks/RESULTS.md): plain won, ran to ~600 positions a request and
    slowed down there; the next wave of requests began at ~70 positions with a planned lane re-check, whose
    rate was then compared with plain's from ~600 positions. Plain is measured again at once instead, and
    runs on when it is the faster at today's contexts. A mode's older rate from *shorter* contexts (it
    flatters that mode) brings nothing forward."""
    def steps(policy: LanePolicy, n: int, rate: dict[bool, float], context: float) -> list[bool]:
        chosen = []
        for _ in range(n):
            lanes = policy.lanes(128)
            chosen.append(lanes)
            tokens = 128 * (3 if lanes else 1)
            policy.observe(StepSample(lanes, 128, tokens, tokens / rate[lanes], context=context))
        return chosen

    policy = LanePolicy(trial=4, recheck=20, budget=1e9)  # re-checks every 20 decisions
    assert steps(policy, 8, {True: 9000.0, False: 10000.0}, 40.0) == [True] * 4 + [False] * 4
    # plain runs on to long contexts (the lanes' rate, from 40 positions, flatters them: nothing early)
    assert steps(policy, 20, {True: 4000.0, False: 5000.0}, 600.0) == [False] * 20
    # the new wave: the planned lane re-check at 70 positions measures 9,500 tokens/s against plain's
    # 5,000 from 600 positions ...
    assert steps(policy, 5, {True: 9500.0, False: 10500.0}, 70.0) == [True] * 4 + [False]
    # ... so plain is re-checked at once, measures 10,500 and runs on
    assert steps(policy, 20, {True: 9500.0, False: 10500.0}, 75.0) == [False] * 20
    assert policy.describe()[128] == {"lanes": 9500.0, "plain": 10500.0}
    # without the longer contexts (plain's rate from 70 positions too), the same lanes would not run either
    b = policy.buckets[128]
    assert b.stale_mode() is None and not b.best()
    b.context[False], b.latest = 600.0, True  # plain's figure from 600 positions, lanes' newer at 70
    assert b.stale_mode() is False
    b.context[False] = 150.0  # under 2 x 70 + 64 positions: a lane trial's own growth, not stale
    assert b.stale_mode() is None


def test_lanes_within_the_margin_keep_running_without_plain_rechecks():
    """A choice of lanes needs LANES_MARGIN over plain; once running, lanes that slow to 1.05x plain's
    rate keep running with no re-check of plain (each costs both warm-ups); below plain's rate they bring
    one at once."""
    policy = LanePolicy(trial=4, recheck=1000)
    _run(policy, rows=128, steps=20, speed={True: 1300.0, False: 1000.0})
    assert _run(policy, rows=128, steps=30, speed={True: 1050.0, False: 1000.0}) == [True] * 30
    assert policy.describe()[128]["lanes"] == pytest.approx(1050.0, rel=1e-3)
    chosen = _run(policy, rows=128, steps=10, speed={True: 950.0, False: 1000.0})
    assert chosen[:2] == [True, True] and False in chosen  # fell below 1,000: plain re-checked


def test_a_mode_s_average_restarts_when_its_contexts_drop():
    """A steady sample from far shorter contexts than a mode's moving average (a new wave of requests)
    replaces the average instead of being mixed into it; nearby contexts are averaged as before."""
    policy = LanePolicy(trial=2, recheck=1000, smoothing=0.3)
    for lanes, rate in ((True, 1000.0), (True, 1000.0), (False, 2000.0), (False, 2000.0)):
        assert policy.lanes(64) is lanes
        policy.observe(StepSample(lanes, 64, 64, 64 / rate, context=590.0))
    policy.observe(StepSample(False, 64, 64, 64 / 3000.0, context=500.0))  # like contexts: averaged
    assert policy.describe()[64]["plain"] == pytest.approx(2300.0)
    policy.observe(StepSample(False, 64, 64, 64 / 6000.0, context=40.0))  # a new wave: restarted
    assert policy.describe()[64]["plain"] == pytest.approx(6000.0)
    policy.observe(StepSample(False, 64, 64, 64 / 500.0, context=5.0, warmup=True))  # a warm-up: left out
    assert policy.describe()[64]["plain"] == pytest.approx(6000.0)


def test_a_slower_sample_from_far_shorter_contexts_is_a_stall_not_a_new_wave():
    """Shorter contexts are faster, so a steady sample from far shorter contexts that is slower than the
    mode's average is a stalled step: it is averaged in, not taken as the new rate, and the faster mode
    keeps running (it replaced the lanes' rate before, and plain steps ran on that, in the stall model)."""
    policy = LanePolicy(trial=2, recheck=1000, smoothing=0.3)
    for lanes, rate in ((True, 3000.0), (True, 3000.0), (False, 600.0)):  # plain's trial ends early
        assert policy.lanes(4) is lanes
        policy.observe(StepSample(lanes, 4, 4 * (3 if lanes else 1), 4 * (3 if lanes else 1) / rate, context=590.0))
    assert policy.lanes(4) is True
    policy.observe(StepSample(True, 4, 12, 12 / 220.0, context=40.0))  # a new wave's step, stalled
    assert policy.describe()[4]["lanes"] == pytest.approx(3000.0 + 0.3 * (220.0 - 3000.0))
    # plain's rate is from far longer contexts, so plain is re-checked first (``stale_mode``); then lanes run
    for rate, warmup in ((300.0, True), (650.0, False)):
        assert policy.lanes(4) is False
        policy.observe(StepSample(False, 4, 4, 4 / rate, context=41.0, warmup=warmup))
    assert [policy.lanes(4) for _ in range(5)] == [True] * 5


def test_contexts_growing_at_128_requests_switch_rarely_and_never_lose_to_plain_alone():
    """The forty-second H100 run's 128-request case, as a model: a lane step commits 10.5 tokens a
    request (3 in a warm-up) and costs 80 ms + 0.36 ms per position, a plain step 11.2 ms + 0.028 ms per
    position and twice that after lanes. Lanes win ~1.5x at the start of a wave and ~1.1x by its end.
    Over waves of 576 tokens from 32-token prompts the policy switches modes at most 10 times a wave and is
    never slower than plain steps alone. (A re-check whenever lanes fell within the margin of plain's
    older rate (9997854) switched 18-22 times a wave here and lost 5.6-7.5 %.)"""
    model = MODELS["128-h100"]
    policy = LanePolicy()
    wave(policy, n_tokens=64, **model)
    plain_only, _, _ = wave(None, n_tokens=576, **model)
    for _ in range(3):
        seconds, _, switches = wave(policy, n_tokens=576, **model)
        assert switches <= 10 and seconds <= plain_only, (switches, plain_only / seconds)


def test_rare_stalls_at_128_requests_do_not_cost_the_waves():
    """The 128-request model (benchmarks/policy_stall_model.py) with 1 % of steps, lane or plain, stalled by
    60 ms: over the benchmark's waves the policy stays faster than plain steps alone with the same stalls,
    in every one of 20 seeded runs (a stall in a trial can still cost a wave: at 3 % of steps some runs fall
    below plain alone, benchmarks/RESULTS.md)."""
    ratios = [run(None, MODELS["128-h100"], seed, 0.01, 60.0) / run(policy_module, MODELS["128-h100"], seed, 0.01, 60.0)
              for seed in range(20)]
    assert min(ratios) > 1.0, ratios


# -- the lane budget (LaneOption) ----------------------------------------------------------------------------
def test_lane_options_of_a_schedule():
    from vllm_loop.loopspec.policy import LaneOption, lane_options

    assert lane_options(4, 1, 2, 7) == [LaneOption("full"), LaneOption("first", None, False), LaneOption("cap2", 2, False)]
    assert lane_options(32, 2, 8, 64) == [LaneOption("full"), LaneOption("first", None, False),
                                          LaneOption("cap8", 8, False)]
    assert lane_options(4, 1, None, 7) == [LaneOption("full"), LaneOption("cap2", 2, False)]  # no second depth
    assert lane_options(4, 1, 2, 2) == [LaneOption("full"), LaneOption("first", None, False)]  # cap not below max_lanes


def _run_options(policy: LanePolicy, rows: int, steps: int, option_speed: list[float], plain: float) -> list:
    """Engine steps of ``rows`` requests; a lane step at option i commits at ``option_speed[i]`` tokens/s."""
    ran = []
    for _ in range(steps):
        lanes = policy.lanes(rows)
        option = policy.option() if lanes else None
        ran.append(option)
        rate = option_speed[option] if lanes else plain
        tokens = rows * (3 if lanes else 1)
        policy.observe(StepSample(lanes=lanes, rows=rows, tokens=tokens, seconds=tokens / rate,
                                  option=option or 0))
    return ran


def test_policy_runs_the_fastest_lane_budget_and_rechecks_the_others():
    """Lanes at the full budget lose to plain decoding here, with first proposals only they win: the
    policy tries every option, then runs lanes at the winning budget, and re-checks the others."""
    from vllm_loop.loopspec.policy import lane_options

    policy = LanePolicy(trial=4, recheck=50, budget=1.0, options=lane_options(32, 2, 8, 64))
    ran = _run_options(policy, 16, 600, option_speed=[200.0, 400.0, 300.0], plain=250.0)
    tail = ran[200:]
    assert tail.count(1) > 0.8 * len(tail)  # "first"
    assert 0 in tail and 2 in tail  # the other budgets re-checked now and then
    assert policy.describe()[16]["lanes:first"] == pytest.approx(400.0)


def test_the_first_lane_trial_weighs_every_budget_against_plain():
    """Lanes at the full budget lose to plain decoding, with first proposals only they win: after
    the full budget's trial and plain's, the bucket runs the other budgets' trials, so the policy
    runs lanes at "first" from then on instead of keeping plain until a re-check (the trained Raven
    at 4 requests kept plain for a whole run after the full budget's trial alone). Where the full
    budget is clearly slower than plain, the other budgets get no trial then."""
    from vllm_loop.loopspec.policy import lane_options

    policy = LanePolicy(trial=4, recheck=50, budget=1.0, options=lane_options(32, 2, 8, 64))
    ran = _run_options(policy, 4, 60, option_speed=[200.0, 400.0, 300.0], plain=250.0)
    assert ran[:16] == [0] * 4 + [None] * 4 + [1] * 4 + [2] * 4  # full, plain, first, cap8
    assert ran[16:50] == [1] * 34  # then lanes at "first"
    hopeless = LanePolicy(trial=4, recheck=50, budget=1.0, options=lane_options(32, 2, 8, 64))
    ran = _run_options(hopeless, 4, 40, option_speed=[100.0, 150.0, 120.0], plain=250.0)
    assert ran == [0] * 4 + [None] * 36  # the full budget's trial, then plain's, then plain


def test_a_buckets_plain_rate_cuts_only_its_own_budget_trials():
    """A budget's trial that starts clearly below plain decoding ends at once -- plain's rate in the
    same bucket; another bucket's (here a far faster one) must not end this bucket's trials."""
    from vllm_loop.loopspec.policy import LaneOption, OptionChooser

    chooser = OptionChooser([LaneOption("a"), LaneOption("b", 8, False)], trial=4, recheck=1000)
    chooser.set_floor(64, 10_000.0)  # 64 requests: plain far faster than any lane budget
    chooser.set_floor(1, 100.0)
    for option in (0, 1):
        for _ in range(4):
            assert chooser.choose(1) == option
            chooser.observe(1, option, 3, 0.01)  # 300 tokens/s: above 1 request's plain
    assert chooser.settled(1)
    chooser.observe(64, 0, 3, 0.01)  # 300 against 64 requests' plain 10,000: its trial ends
    assert chooser.buckets[64].seen[0] == 4


def test_lane_budgets_are_rated_by_ratios_of_sums():
    """A lane step commits a varying number of tokens: budget 0 alternates 1 token in 10 ms and 16
    in 20 ms (17 tokens in 30 ms: 567 tokens/s, though its steps average 450), budget 1 commits at
    500 tokens/s every step. The chooser rates each by its tokens over its seconds and runs budget
    0; averaging per-step rates would run budget 1."""
    from vllm_loop.loopspec.policy import LaneOption, OptionChooser

    chooser = OptionChooser([LaneOption("a"), LaneOption("b", 8, False)], trial=4, recheck=1000)
    steps = {0: [(1, 0.010), (16, 0.020)], 1: [(5, 0.010), (10, 0.020)]}
    counts = {0: 0, 1: 0}
    picks = []
    for _ in range(100):
        option = chooser.choose(1)
        picks.append(option)
        tokens, seconds = steps[option][counts[option] % 2]
        counts[option] += 1
        chooser.observe(1, option, tokens, seconds)
    assert picks[8:].count(0) == len(picks) - 8
    assert chooser.describe()[1]["a"] == pytest.approx(17 / 0.030, abs=0.1)  # describe() rounds
    assert chooser.describe()[1]["b"] == pytest.approx(500.0)


def test_lanes_on_runs_the_full_budget_and_patterns_force_options():
    from vllm_loop.loopspec.policy import lane_options

    on = LanePolicy("on", options=lane_options(4, 1, 2, 7))
    assert all(on.lanes(4) and on.option() == 0 for _ in range(20))
    forced = LanePolicy("auto", pattern="01P2", options=lane_options(4, 1, 2, 7))
    seen = [(forced.lanes(4), forced.option()) for _ in range(8)]
    assert [s for s in seen if s[0]] == [(True, 0), (True, 1), (True, 2)] * 2
    assert [lanes for lanes, _ in seen].count(False) == 2
    with pytest.raises(ValueError, match="digits"):
        LanePolicy("auto", pattern="LX")
