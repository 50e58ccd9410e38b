"""LoopSpec counters on ``/metrics`` and in the periodic log line (front-end process).

A ``vllm.stat_logger_plugins`` entry: vLLM's API server creates one per engine next to its own
loggers. The engine core publishes LoopSpec's running totals (``scheduler.py``); on every stats
record this logger reads them and advances Prometheus counters by the difference, and every log
interval it prints one line next to vLLM's own. Engines without LoopSpec get a logger that does
nothing.

Metrics (labels ``model_name``, ``engine``): ``vllm_loop:loopspec_commits_total{source=first|second|late|full}``,
``..._recurrent_steps_total``, ``..._lanes_advanced_total``, ``..._request_steps_total``,
``..._gate_evaluations_total``, ``..._gate_opens_total``, ``..._lane_steps_total``,
``..._prefill_joined_steps_total``, ``..._chain_drafts_total``, ``..._chain_accepted_total``,
``..._plain_steps_total`` (decode steps the lanes policy ran without lanes),
``..._lane_option_steps_total{option=full|first|capN}`` (lanes-mode steps by the lane budget they ran), under async scheduling
``..._pipelined_steps_total`` (steps scheduled while another ran) and ``..._barrier_drains_total``
(lanes-mode steps that waited for the steps in flight), ``..._lane_step_seconds_total`` (the model
runner's wall time in lane steps), ``..._lane_step_gaps_total`` and ``..._lane_step_gap_seconds_total``
(consecutive lane steps, and the engine's wall time between them: no lane work on the GPU then), and the
gauges ``vllm_loop:loopspec_gamma`` (tokens a request commits per R recurrent steps, since start),
``vllm_loop:loopspec_lanes_per_step``, and the live ``vllm_loop:loopspec_lanes_live`` /
``..._lane_requests_live`` (lanes and lane requests held after the engine's last step: 0 once idle).
"""

from __future__ import annotations

import atexit
import json
import os

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_loop import get_logger
from vllm_loop.loopspec.config import knobs
from vllm_loop.loopspec.metrics import EngineCounters
from vllm_loop.loopspec.scheduler import METRICS_ENV, metrics_path

logger = get_logger(__name__)

COUNTERS = {  # counter name -> EngineCounters field
    "recurrent_steps": "recurrent_steps", "lanes_advanced": "lanes_advanced", "request_steps": "request_steps",
    "gate_evaluations": "gate_evaluations", "gate_opens": "gate_opens", "lane_steps": "lane_steps",
    "prefill_joined_steps": "standard_steps", "chain_drafts": "chain_drafts", "chain_accepted": "chain_accepted",
    "plain_steps": "plain_steps", "pipelined_steps": "pipelined_steps", "barrier_drains": "drains",
    "lane_step_seconds": "lane_step_seconds", "lane_step_gaps": "lane_step_gaps",
    "lane_step_gap_seconds": "lane_step_gap_seconds",
}
_metrics: dict | None = None  # created once per process (Prometheus names are global)


def _prometheus() -> dict:
    global _metrics
    if _metrics is None:
        from prometheus_client import Counter, Gauge

        labels = ["model_name", "engine"]
        _metrics = {name: Counter(f"vllm_loop:loopspec_{name}", f"LoopSpec {name.replace('_', ' ')}", labels)
                    for name in COUNTERS}
        _metrics["commits"] = Counter("vllm_loop:loopspec_commits", "LoopSpec committed tokens by where they came "
                                      "from (first / second proposal or late re-proposal accepted, full-depth residual)",
                                      labels + ["source"])
        _metrics["gamma"] = Gauge("vllm_loop:loopspec_gamma", "LoopSpec tokens committed per R recurrent steps "
                                  "of a request (since start)", labels)
        _metrics["lanes_per_step"] = Gauge("vllm_loop:loopspec_lanes_per_step", "LoopSpec lanes advanced per "
                                           "recurrent step (since start)", labels)
        _metrics["option_steps"] = Counter("vllm_loop:loopspec_lane_option_steps", "LoopSpec lanes-mode steps by "
                                           "the lane budget they ran (full, first, capN)", labels + ["option"])
        _metrics["lanes_live"] = Gauge("vllm_loop:loopspec_lanes_live", "LoopSpec lanes held now (after the "
                                       "engine's last step)", labels)
        _metrics["lane_requests_live"] = Gauge("vllm_loop:loopspec_lane_requests_live", "Requests holding "
                                               "LoopSpec lanes now (after the engine's last step)", labels)
    return _metrics


class LoopSpecStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        k = knobs(vllm_config)
        base = os.environ.get(METRICS_ENV)
        self.enabled = k is not None and base is not None
        if not self.enabled:
            return
        self.R = k.R
        self.path = metrics_path(base, engine_index)
        self.labels = [str(vllm_config.model_config.served_model_name), str(engine_index)]
        self.seen = EngineCounters()  # totals already turned into counter increments
        self.logged = EngineCounters()  # totals at the last log line
        self._mtime = None
        atexit.register(lambda path=self.path: os.path.exists(path) and os.remove(path))

    def _read(self) -> EngineCounters | None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime == self._mtime:
                return None
            with open(self.path) as f:
                totals = EngineCounters(**json.load(f))
            self._mtime = mtime
            return totals
        except (OSError, ValueError, TypeError):
            return None

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if not self.enabled:
            return
        totals = self._read()
        if totals is None:
            return
        delta, self.seen = totals.minus(self.seen), totals
        m = _prometheus()
        for name, fld in COUNTERS.items():
            m[name].labels(*self.labels).inc(max(0, getattr(delta, fld)))
        for source in ("first", "second", "late", "full"):
            m["commits"].labels(*self.labels, source).inc(max(0, getattr(delta, source)))
        for option, steps in delta.option_steps.items():
            m["option_steps"].labels(*self.labels, option).inc(max(0, steps))
        summary = totals.summary(self.R)
        m["gamma"].labels(*self.labels).set(summary["gamma"])
        m["lanes_per_step"].labels(*self.labels).set(summary["lanes_per_step"])
        m["lanes_live"].labels(*self.labels).set(totals.lanes_live)
        m["lane_requests_live"].labels(*self.labels).set(totals.lane_requests_live)

    def log(self):
        if not self.enabled:
            return
        interval = self.seen.minus(self.logged)
        if interval.recurrent_steps or interval.standard_steps or interval.plain_steps:
            logger.info("%s", interval.log_line(self.R))
        self.logged = self.seen

    def log_engine_initialized(self):
        pass


def engine_totals(engine_index: int = 0) -> EngineCounters | None:
    """LoopSpec's running totals of the engine this process started last (offline ``LLM`` too), as
    published by its engine core; None when LoopSpec is off or nothing ran yet."""
    base = os.environ.get(METRICS_ENV)
    if base is None:
        return None
    try:
        with open(metrics_path(base, engine_index)) as f:
            return EngineCounters(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None
