"""LoopSpec under vLLM's async scheduling (CPU emulation), against the reference.

vLLM's CPU platform turns async scheduling off, and its CPU runner cannot build async outputs (CUDA
events). So these engines run the async *engine core* -- the batch queue, ``LoopSpecAsyncScheduler``
with its barriers, drafts handed over on the output, plain steps scheduled behind plain steps -- over
a synchronous runner, in this process. That is exact for plain steps because the worker runs steps in
order: the token a pipelined step needs is on the host before it runs. What only the GPU exercises
(vLLM's async runner state, its reset after barriers) is in ``test_gpu.py``.

The lanes policy is forced through fixed patterns (``VLLM_LOOP_LANES_PATTERN``): every transition --
lanes to plain, plain to lanes (a drain), plain behind plain (pipelined) -- with requests arriving,
finishing, aborted and preempted, chunked prefill and prefix-cache hits.
"""

from __future__ import annotations

import os

import pytest

from vllm_loop.testing.engines import (
    engine_core,
    free_kv_blocks,
    generate_mixed,
    greedy_jobs,
    lane_census,
    run_jobs,
    start_llm,
    stop_llm,
    worker_functions,
)


@pytest.fixture(scope="module", autouse=True)
def _async_core_sync_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_loop.vllm_patches import loopspec as vllm_patches

    init = GPUModelRunner.__init__

    def sync_runner_init(self, vllm_config, *args, **kwargs):
        scheduler_config = vllm_config.scheduler_config
        saved, scheduler_config.async_scheduling = scheduler_config.async_scheduling, False
        try:
            init(self, vllm_config, *args, **kwargs)
        finally:
            scheduler_config.async_scheduling = saved

    with pytest.MonkeyPatch.context() as mp, worker_functions():
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setattr(vllm_patches, "async_blocker", lambda config: None)  # the CUDA check
        mp.setattr(GPUModelRunner, "__init__", sync_runner_init)
        yield


def _engine(path, spec, pattern: str | None, **kw):
    from vllm_loop.loopspec.policy import PATTERN_ENV

    if pattern:
        os.environ[PATTERN_ENV] = pattern  # read by the scheduler, which this process builds
    try:
        return start_llm(path, speculative_config=spec, block_size=16, max_model_len=128,
                         kv_cache_memory_bytes=2**28, disable_log_stats=False, **kw)
    finally:
        os.environ.pop(PATTERN_ENV, None)


def _drain(llm) -> None:
    """Step until the engine holds nothing: requests finished in the last step are freed in the
    runner (their lanes too) by the next step's ``finished_req_ids``."""
    core = engine_core(llm)
    for _ in range(10):
        if not core.scheduler.has_requests() and not core.batch_queue:
            return
        core.step_fn()
    raise AssertionError("the engine did not go idle")


def _run(llm, jobs):
    core = engine_core(llm)
    assert core.batch_queue_size == 2 and type(core.scheduler).__name__ == "LoopSpecAsyncScheduler"
    free_before = free_kv_blocks(llm)
    got = run_jobs(llm, jobs)
    _drain(llm)
    census = llm.collective_rpc(lane_census)[0]
    assert census["lanes"] == 0 and census["requests"] == 0 and census["free_slots"] == census["slots"], census
    assert free_kv_blocks(llm) == free_before
    return got, core.scheduler.loopspec_totals


def _check(path, jobs, got) -> None:
    from vllm_loop.reference import load_reference

    ref = load_reference(path)
    for job in jobs:
        want = ref.greedy_generate(job.prompt, job.params.max_tokens)
        if job.abort_at is None:
            assert got[job.request_id] == want, job.request_id
        else:  # what an aborted request produced is a prefix of the reference
            assert got[job.request_id] == want[: len(got[job.request_id])], job.request_id


CASES = {  # name -> (family, options, overrides, speculative config, lanes pattern, engine options)
    "ouro-1:2-lanes-on": ("ouro", {}, {}, {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2}, None, {}),
    "ouro-agree-LLLPPPPP": ("ouro", {"agreement": "0.005"}, {}, {"method": "loopspec", "d1": 1, "d2": 2},
                            "LLLPPPPP", {}),
    "ouro-agree-LP": ("ouro", {"agreement": "0.005"}, {}, {"method": "loopspec", "d1": 1, "d2": 2}, "LP", {}),
    "ouro-agree-PPPPPPPL": ("ouro", {"agreement": "0.005"}, {}, {"method": "loopspec", "d1": 1, "d2": 2},
                            "PPPPPPPL", {}),
    "raven-R8-2:4-LLPPP-chunked": ("huginn_raven", {"layout": "llama", "state_init": "seeded"},
                                   {"mean_recurrence": 8}, {"method": "loopspec", "d1": 2, "d2": 4}, "LLPPP",
                                   {"max_num_batched_tokens": 16}),
}


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_async_loopspec_greedy_equals_reference(case, ckpt_factory):
    family, options, overrides, spec, pattern, engine = CASES[case]
    path = ckpt_factory(family, options=options, **overrides)
    async_flag = {"async_scheduling": True} if spec.get("lanes") == "on" else {}  # "on" is sync unless asked
    llm = _engine(path, spec, pattern, **async_flag, **engine)
    try:
        got, totals = _run(llm, greedy_jobs())
    finally:
        stop_llm(llm)
    _check(path, greedy_jobs(), got)
    # a lane step needs a lanes-mode step before it (which starts the lanes); a lone L only starts them
    assert (totals.lane_steps > 0) is (pattern is None or "LL" in pattern + pattern)
    if pattern is None:  # every step a barrier: nothing pipelined, nothing to drain
        assert totals.pipelined_steps == 0 and totals.plain_steps == 0
    else:
        assert totals.plain_steps > 0 and totals.drains > 0
        assert totals.pipelined_steps > 0 or pattern == "LP"  # LP: a plain step is always followed by a barrier
    print(f"async LoopSpec {case}: identical to the reference; {totals.lane_steps} lane steps, "
          f"{totals.plain_steps} plain ({totals.pipelined_steps} pipelined), {totals.drains} drains")


@pytest.mark.engine
def test_async_aborts_and_preemption_leave_nothing_behind(ckpt_factory, tmp_path, monkeypatch):
    """... and the policy trace (``VLLM_LOOP_POLICY_TRACE``) has a line per step, in which a plain step
    is a throughput sample only where the batch did not change."""
    import json

    from vllm_loop.loopspec.scheduler import TRACE_ENV
    from vllm_loop.testing.engines import greedy_jobs as jobs_of

    path = ckpt_factory("huginn_raven", options={"layout": "llama", "state_init": "seeded"}, mean_recurrence=8)
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace.jsonl"))
    llm = _engine(path, {"method": "loopspec", "d1": 2, "d2": 4}, "LLLLPPPPP", num_gpu_blocks_override=12)
    jobs = jobs_of(seed=3, aborts=4)
    try:
        got, totals = _run(llm, jobs)
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        stop_llm(llm)
    trace = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert sum(t["lanes"] for t in trace) >= totals.lane_steps and sum(t["arrivals"] for t in trace) == len(jobs)
    plain = [(before["rows"], t) for before, t in zip(trace, trace[1:]) if not t["lanes"] and t["scheduled"] == t["rows"]]
    assert all(rows == t["rows"] for rows, t in plain if t["sample"]) and any(t["sample"] for _, t in plain)
    assert any(rows != t["rows"] and not t["sample"] for rows, t in plain)  # the batch changed: no sample
    assert preemptions > 0, "the small KV cache must force preemption"
    assert any(len(got[j.request_id]) < j.params.max_tokens for j in jobs if j.abort_at is not None)
    _check(path, jobs, got)
    assert totals.lane_steps > 0 and totals.pipelined_steps > 0


@pytest.mark.engine
def test_async_requests_lanes_cannot_serve_next_to_lane_requests(ckpt_factory):
    """Requests the lanes do not serve (logprobs, penalties, min_tokens, allowed tokens, seeded sampling
    with bad words) decode on vLLM's path next to lane requests through forced transitions: the same
    outputs as a vanilla engine."""
    path = ckpt_factory("ouro", options={"agreement": "0.005"})
    vanilla = start_llm(path, block_size=16, max_model_len=128, kv_cache_memory_bytes=2**28)
    try:
        want = generate_mixed(vanilla)
    finally:
        stop_llm(vanilla)
    llm = _engine(path, {"method": "loopspec", "d1": 1, "d2": 2}, "LLPPPLP")
    try:
        got = generate_mixed(llm)
        _drain(llm)
        totals = engine_core(llm).scheduler.loopspec_totals
    finally:
        stop_llm(llm)
    assert got == want
    assert totals.lane_steps > 0 and totals.pipelined_steps > 0
