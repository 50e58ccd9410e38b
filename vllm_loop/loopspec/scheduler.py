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
"""

from __future__ import annotations

import json
import os

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_loop.loopspec.metrics import EngineCounters

METRICS_ENV = "VLLM_LOOP_METRICS_FILE"  # set by the front end when it translates a loopspec config


def metrics_path(base: str, engine_index: int) -> str:
    return f"{base}.engine{engine_index}.json"


def loopspec_spec_stats(step: EngineCounters, num_spec_tokens: int) -> SpecDecodingStats | None:
    if not step.first_verified and not step.chain_rows:
        return None
    stats = SpecDecodingStats.new(num_spec_tokens)
    stats.num_drafts = step.first_verified + step.chain_rows
    stats.num_draft_tokens = step.first_verified + step.second_verified + step.chain_drafts
    stats.num_accepted_tokens = step.first + step.second + step.chain_accepted
    stats.num_accepted_tokens_per_pos[0] = step.first
    stats.num_draft_tokens_per_pos[0] = step.first_verified
    if num_spec_tokens > 1:
        stats.num_accepted_tokens_per_pos[1] = step.second
        stats.num_draft_tokens_per_pos[1] = step.second_verified
    return stats


class LoopSpecScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loopspec_totals = EngineCounters()
        self._loopspec_step: EngineCounters | None = None
        base = os.environ.get(METRICS_ENV)
        index = self.vllm_config.parallel_config.data_parallel_rank
        self._metrics_file = metrics_path(base, index) if base else None

    def update_from_output(self, scheduler_output, model_runner_output):
        self._loopspec_step = getattr(model_runner_output, "loopspec", None)
        if self._loopspec_step is not None:
            self.loopspec_totals.add(self._loopspec_step)
            self._publish()
        return super().update_from_output(scheduler_output, model_runner_output)

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
