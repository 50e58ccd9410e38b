"""vLLM's scheduler with LoopSpec's counters in the spec-decode metrics (engine-core process).

Scheduling itself is vLLM's: a lane step's tokens come back as the step's sampled tokens and the
lane chains as drafts, which the base class already handles. Only the statistics change meaning:
vLLM would count "drafts" per request per step; with LoopSpec the spec-decode metrics count
cascade verifications instead (vLLM's names, LoopSpec's meaning):

* ``num_drafts``: verifications that had a first proposal,
* ``num_draft_tokens``: proposals verified (first + second),
* ``num_accepted_tokens``: proposals accepted; per position: 0 = first proposal, 1 = second,
* plus, in steps where vLLM's ordinary forward verified the lane chains (a prefill joined), each
  chain as one draft of its length (in the totals only, not per position).

The full LoopSpec counters (recurrent steps, lanes, gate) are published as running totals to a
small JSON file that the front end's stat logger (``stat_logger.py``) turns into ``/metrics``.

The scheduler also takes the lanes policy's decision for each step (``policy.py``: lanes or plain
decoding, from the engine-step throughput each mode has shown at this batch size). It travels to
every worker as ``scheduler_output.loopspec_lanes``, so tensor-parallel ranks never disagree.

Under vLLM's async scheduling (``LoopSpecAsyncScheduler``) plain steps pipeline as in vanilla vLLM:
step N+1 is scheduled while step N runs, assuming one token per row. A lanes-mode step cannot be
pipelined -- how many tokens each row commits is known only when it ends -- so it is a *barrier*:
the scheduler drains the steps in flight, runs it alone, and schedules nothing behind it.
"""

from __future__ import annotations

import json
import os
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_loop.loopspec.config import knobs
from vllm_loop.loopspec.metrics import EngineCounters
from vllm_loop.loopspec.policy import PATTERN_ENV, LanePolicy, StepSample, lane_options

METRICS_ENV = "VLLM_LOOP_METRICS_FILE"  # set by the front end when it translates a loopspec config
# Diagnostics: a JSON line per engine step with tokens (mode, rows, tokens, engine seconds, whether the
# policy took it as a sample, arrivals since the step before, ...) appended to this file. For reading
# what the lanes policy saw; off unless set.
TRACE_ENV = "VLLM_LOOP_POLICY_TRACE"


def metrics_path(base: str, engine_index: int) -> str:
    return f"{base}.engine{engine_index}.json"


def loopspec_spec_stats(step: EngineCounters, num_spec_tokens: int) -> SpecDecodingStats | None:
    if not step.first_verified and not step.chain_rows:
        return None
    stats = SpecDecodingStats.new(num_spec_tokens)
    stats.num_drafts = step.first_verified + step.chain_rows
    # a lane's alternatives for the same position (second, late) count as its position-1 drafts
    stats.num_draft_tokens = step.first_verified + step.second_verified + step.late_verified + step.chain_drafts
    stats.num_accepted_tokens = step.first + step.second + step.late + step.chain_accepted
    stats.num_accepted_tokens_per_pos[0] = step.first
    stats.num_draft_tokens_per_pos[0] = step.first_verified
    if num_spec_tokens > 1:
        stats.num_accepted_tokens_per_pos[1] = step.second + step.late
        stats.num_draft_tokens_per_pos[1] = step.second_verified + step.late_verified
    return stats


def step_sample(so, output, step: EngineCounters | None, seconds: float | None,
                after_lanes: bool = False, rows_before: int | None = None, finishes: bool = False) -> StepSample | None:
    """A policy sample from a finished step that ran in the mode the policy chose for it:

    * a lane step (a warm-up when most of its rows had just started their lanes);
    * a plain step of decode rows with no drafts (a warm-up ``after_lanes``: right after a lanes-mode
      step) in a batch that does not change: as many rows as the step before (``rows_before``), and
      none finishing in this step's update (``finishes``). Under async scheduling a step's time is the
      interval between two completions, and around a batch change those are not the steps' own: at
      the end of a short run in a policy trace on the H200, 24 ms for the step whose update
      finished requests, 3.5 ms for the next, against 11.7 ms steady (Ouro-1.4B, 128 requests).

    Other steps (a prefill joined, a chain verified as drafts) say little about either mode's speed."""
    lanes = getattr(so, "loopspec_lanes", True)
    if seconds is None or output is None or not so.num_scheduled_tokens or not getattr(output, "sampled_token_ids", None):
        return None
    rows = len(so.num_scheduled_tokens)
    if lanes:
        # a step that captured a lane graph (a new shape bucket) took far longer than its mode does
        if step is None or not step.lane_steps or step.graph_captures:
            return None
    elif (so.scheduled_new_reqs or so.scheduled_cached_reqs.resumed_req_ids or so.scheduled_spec_decode_tokens
          or any(n != 1 for n in so.num_scheduled_tokens.values())
          or finishes or (rows_before is not None and rows_before != rows)):
        return None
    tokens = sum(len(t) for t in output.sampled_token_ids)
    return StepSample(lanes=lanes, rows=rows, tokens=tokens, seconds=seconds,
                      warmup=2 * step.warmup_rows > rows if lanes else after_lanes,
                      context=mean_context(so), option=getattr(so, "loopspec_option", 0))


def mean_context(so) -> float:
    """The scheduled running requests' mean committed positions (both modes slow down with it)."""
    computed = so.scheduled_cached_reqs.num_computed_tokens
    return sum(computed) / len(computed) if computed else 0.0


# The engine core publishes its LoopSpec totals to a file the front end's /metrics reads. Writing it
# every engine step cost ~0.6 ms of host time per step (CPU profile): while requests run it is written
# at most this often, and always when the last request finishes (so a finished batch reads exact totals).
PUBLISH_EVERY_S = 0.25


class LoopSpecScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loopspec_totals = EngineCounters()
        self._loopspec_step: EngineCounters | None = None
        base = os.environ.get(METRICS_ENV)
        index = self.vllm_config.parallel_config.data_parallel_rank
        self._metrics_file = metrics_path(base, index) if base else None
        k = knobs(self.vllm_config)
        options = None if k is None else lane_options(k.R, k.d1, k.d2, k.max_lanes)
        # without LoopSpec (k None) no step runs lanes whatever the policy says
        self.lane_policy = LanePolicy("on" if k is None else k.lanes, pattern=os.environ.get(PATTERN_ENV),
                                      options=options)
        self._published_at, self._unpublished = 0.0, False
        self._last_lanes = False  # the mode of the last step that ran (for plain steps' warm-ups)
        self._last_rows: int | None = None  # its rows (a plain sample needs an unchanged batch)
        trace = os.environ.get(TRACE_ENV)
        self._trace = open(trace, "a", buffering=1) if trace else None
        self._arrivals = 0  # requests added since the last schedule (for the trace)

    def add_request(self, request) -> None:
        self._arrivals += 1
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        start = time.perf_counter()
        so = super().schedule(*args, **kwargs)
        self._stamp(so, self.lane_policy.lanes(len(so.num_scheduled_tokens)), start)
        return so

    def _stamp(self, so, lanes: bool, start: float) -> None:
        """What the step carries to its worker and its update: its mode, whether requests still wait,
        when it was scheduled, the arrivals before it."""
        so.loopspec_lanes, so.loopspec_start = lanes, start
        # the lane budget of a lanes-mode step (an index into ``lane_policy.options``; the runner builds the
        # same list from the same knobs)
        so.loopspec_option = self.lane_policy.option() if lanes else 0
        if lanes and so.total_num_scheduled_tokens:
            counts, name = self.loopspec_totals.option_steps, self.lane_policy.options[so.loopspec_option].name
            counts[name] = counts.get(name, 0) + 1
        # requests left waiting: the lane step keeps to the shorter lockstep bound (runner._more_steps)
        so.loopspec_waiting = bool(self.waiting or self.skipped_waiting)
        so.loopspec_arrivals, self._arrivals = self._arrivals, 0

    def update_from_output(self, scheduler_output, model_runner_output):
        step = self._loopspec_step = getattr(model_runner_output, "loopspec", None)
        seconds = self._step_seconds(scheduler_output)
        if step is not None:
            self.loopspec_totals.add(step)
            self._unpublished = True
        finished = len(self.finished_req_ids)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        sample = step_sample(scheduler_output, model_runner_output, step, seconds, after_lanes=self._last_lanes,
                             rows_before=self._last_rows, finishes=len(self.finished_req_ids) > finished)
        if sample is not None:
            self.lane_policy.observe(sample)
        if scheduler_output.num_scheduled_tokens:
            if self._trace is not None:
                self._write_trace(scheduler_output, model_runner_output, seconds, sample)
            self._last_lanes = getattr(scheduler_output, "loopspec_lanes", True)
            self._last_rows = len(scheduler_output.num_scheduled_tokens)
        now = time.perf_counter()
        if self._unpublished and (now - self._published_at >= PUBLISH_EVERY_S
                                  or self.get_num_unfinished_requests() == 0):
            self._publish()
            self._published_at, self._unpublished = now, False
        return outputs

    def _write_trace(self, so, output, seconds, sample) -> None:
        sampled = getattr(output, "sampled_token_ids", None) or []
        self._trace.write(json.dumps({
            "t": round(time.perf_counter(), 6), "lanes": getattr(so, "loopspec_lanes", True),
            "option": self.lane_policy.options[getattr(so, "loopspec_option", 0)].name,
            "rows": len(so.num_scheduled_tokens), "tokens": sum(len(t) for t in sampled),
            "scheduled": so.total_num_scheduled_tokens, "new": len(so.scheduled_new_reqs),
            "arrivals": getattr(so, "loopspec_arrivals", 0), "waiting": len(self.waiting),
            "finished": len(so.finished_req_ids), "seconds": seconds and round(seconds, 6),
            "sample": sample is not None, "warmup": bool(sample and sample.warmup),
            "context": round(mean_context(so), 1),
            "rates": self.lane_policy.describe()}) + "\n")

    def _step_seconds(self, scheduler_output) -> float | None:
        """Engine time of the step just finished (schedule + execute + update so far)."""
        return time.perf_counter() - scheduler_output.loopspec_start

    def make_spec_decoding_stats(self, spec_decoding_stats, *args, **kwargs):
        return spec_decoding_stats  # per-request draft counts do not apply; see make_stats

    def make_stats(self, spec_decoding_stats=None, *args, **kwargs):
        step, self._loopspec_step = self._loopspec_step, None
        if step is not None:
            spec_decoding_stats = loopspec_spec_stats(step, self.num_spec_tokens)
        return super().make_stats(spec_decoding_stats, *args, **kwargs)

    def _publish(self) -> None:
        if self._metrics_file is None:
            return
        tmp = f"{self._metrics_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(vars(self.loopspec_totals), f)
        os.replace(tmp, self._metrics_file)


class LoopSpecAsyncScheduler(LoopSpecScheduler, AsyncScheduler):
    """LoopSpec under async scheduling (chosen by ``vllm_patches.loopspec.install_loopspec_async``).

    * Plain steps are scheduled with no drafts at all (``num_spec_tokens`` 0 while they are made):
      the base scheduler would otherwise give a new one-token decode ``[-1] * K`` placeholder drafts,
      and the step pipelined behind it would then be placed K positions too far.
    * A lanes-mode step is a barrier. ``has_requests`` answers False while one is in flight, or while
      one is wanted and plain steps are still in flight: the engine core then blocks on its oldest
      batch instead of scheduling (no empty step, no executor round trip). It answers False only
      while a step of ours is in the engine's batch queue, so the engine never waits for input.
    * Drafts (the lane chains) come back on the step's output (``loopspec_drafts``): under async
      scheduling the engine core never calls ``take_draft_token_ids``.
    * The policy's throughput samples time each step from its start or the previous step's end,
      whichever is later: pipelined steps overlap, and the steady interval between completions is
      what each mode delivers (``_step_seconds``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # our scheduler outputs with tokens, not yet updated: id -> lanes mode (a barrier)
        self._in_flight: dict[int, bool] = {}
        self._wanted: bool | None = None  # the next step's mode, decided before it can be scheduled
        self._drained = False
        self.held_for_barrier = False
        self._last_update = 0.0

    def _next_is_lanes(self) -> bool:
        """Decided before the step is scheduled, for the rows it will likely have: the running requests
        and the waiting ones that fit (the running ones alone asked bucket 8 for a step that admitted
        121 more requests: lanes started for all 128 and dropped a step later)."""
        if self._wanted is None:
            rows = min(len(self.running) + len(self.waiting), self.max_num_running_reqs)
            self._wanted = self.lane_policy.lanes(max(1, rows))
        return self._wanted

    def has_requests(self) -> bool:
        if not super().has_requests():
            return False
        barrier = any(self._in_flight.values())
        if barrier or (self._in_flight and self._next_is_lanes()):
            self._drained = not barrier
            self.held_for_barrier = True  # read by vllm_patches.loopspec._no_idle_sleep_after_barriers
            return False
        return True

    def schedule(self, *args, **kwargs):
        lanes, self._wanted = self._next_is_lanes(), None
        lanes = lanes and not self._in_flight  # has_requests holds such steps back; plain is always safe
        start = time.perf_counter()
        if lanes:
            so = Scheduler.schedule(self, *args, **kwargs)
        else:
            for request in self.running:  # plain decoding: the last lane chains are dropped
                request.spec_token_ids = []
            k, self.num_spec_tokens = self.num_spec_tokens, 0
            try:
                so = Scheduler.schedule(self, *args, **kwargs)
            finally:
                self.num_spec_tokens = k
        self._stamp(so, lanes, start)
        if so.total_num_scheduled_tokens > 0:
            self.loopspec_totals.pipelined_steps += bool(self._in_flight)
            self.loopspec_totals.drains += lanes and self._drained
            self._in_flight[id(so)] = lanes  # the engine hands this same object back to update_from_output
        self._drained = False
        return so

    def _step_seconds(self, scheduler_output) -> float | None:
        """From the step's start or the previous step's end, whichever is later: the steady interval
        between completions while steps overlap. None for the last step of a pipelined run (nothing
        scheduled behind it): it ran while the host finished the step before, so that interval is
        too short to say anything."""
        start = scheduler_output.loopspec_start
        if start < self._last_update and not self._in_flight:
            return None
        return time.perf_counter() - max(start, self._last_update)

    def _update_after_schedule(self, scheduler_output) -> None:
        super()._update_after_schedule(scheduler_output)  # AsyncScheduler's: 1 + drafts placeholders
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if not request.is_prefill_chunk:  # not [-1] * K: drafts come only from a lanes-mode output
                request.spec_token_ids = []

    def update_from_output(self, scheduler_output, model_runner_output):
        self._in_flight.pop(id(scheduler_output), None)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._last_update = time.perf_counter()
        drafts = getattr(model_runner_output, "loopspec_drafts", None)
        if drafts is not None:
            self.update_draft_token_ids(DraftTokenIds(*drafts))
        return outputs
