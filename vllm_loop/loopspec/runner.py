"""LoopSpec inside vLLM: the adapter at the V1 model runner's seam.

vLLM knows LoopSpec as a ``custom_class`` speculative method whose "proposer" is this class; the
plugin hooks ``GPUModelRunner.execute_model`` and ``sample_tokens`` (``vllm_patches``) so that

* a **lane step** -- every scheduled request is a decoding LoopSpec request -- runs here: recurrent
  steps in which one batched model call advances every live lane of every request (each row at its
  own depth, reading its own KV bank), readouts at d1 / d2 / R, the decisions of each request's
  ``RequestPipeline``, until every request has committed at least one token (in a step of greedy
  requests each recurrent step is enqueued before the host has decided the one before, on its likely
  outcome, ``RequestPipeline.expect``: the GPU computes while the host decides). The tokens go back as
  the step's sampled tokens and each request's first-proposal chain as its drafts (padded to
  ``step_tokens``, ``step_drafts``), so the scheduler allocates KV slots for the next step
  (vLLM's contract: a decode row receives between 1 and 1 + its scheduled drafts tokens per step,
  which the commit cap enforces);
* any other step (a prefill joins, a request the lanes cannot serve, a resumed request) is vLLM's
  own: its forward verifies the lane chains as ordinary drafts with vLLM's rejection sampler
  (lossless), and afterwards each request keeps the lanes on the committed path
  (``after_standard_step``), starts its pipeline after its prefill, or restarts.

A step the scheduler marks plain (``loopspec_lanes`` False: the lanes policy, ``policy.py``) is
vLLM's own forward without drafts; afterwards the requests hold no lanes until a step marked for
lanes restarts them.

The algorithm lives in ``pipeline.py``; lane KV and attention in ``lane_kv.py``; this module only
moves tensors and keeps vLLM's books (input batch, request states, drafts, output).
"""

from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch.profiler import record_function

from vllm_loop import get_logger
from vllm_loop.loopspec.config import knobs
from vllm_loop.loopspec.lane_graphs import (
    DEPTH,
    GREEDY_FIELDS,
    PREFIX,
    WARM_KINDS,
    LaneBatch,
    LaneGraphs,
    lane_call,
    sampling_fields,
    upload,
)
from vllm_loop.loopspec.lane_kv import LaneScratch, PagedBanks
from vllm_loop.loopspec.lanes import Lane
from vllm_loop.loopspec.metrics import EngineCounters
from vllm_loop.loopspec.pipeline import Commit, Expected, RequestPipeline, readout_values
from vllm_loop.loopspec.policy import lane_options
from vllm_loop.loopspec.proposals import SamplingParams
from vllm_loop.loopspec.verify import CommitSource
from vllm_loop.models.layers import bank_prefix

logger = get_logger(__name__)

# Recurrent steps an engine step may take past its first commits while requests wait to join (Ouro-1.4B,
# H200: ~27 ms at one request). With none waiting it may go on to ``step_tokens`` recurrent steps: the
# engine step around a lane step (vLLM's scheduler, the step's output) took ~0.56 ms on the H200 at one
# request beyond the lane step itself, ~2 % of Ouro-1.4B's decode (benchmarks/RESULTS.md;
# measured since as ``lane_step_gap_seconds``: 0.63 ms on an H100, 0.6 % of Huginn-0125's).
LOCKSTEP = 16


def _named(name: str):
    """A named range in torch.profiler traces (``benchmarks/loopspec_speed.py --profile``), and nothing
    when no profiler runs: ``record_function`` costs the host ~12 us even then, on the H200 host of
    ``benchmarks/results/cuda-host-costs-h200.txt``, and a recurrent step opens six."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else nullcontext()


def triton_lane_attention(cuda: bool):
    """The Triton lane attention kernel (``lane_attention: "triton"``): on CUDA, or on the CPU under
    Triton's interpreter (``TRITON_INTERPRET=1``, for tests)."""
    import os

    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("speculative_config (loopspec): lane_attention='triton' needs a CUDA device "
                         "(or TRITON_INTERPRET=1); allowed on this device: 'torch'")
    from vllm_loop_kernels.lane_attention import lane_attention

    return lane_attention


def _lanes_on(so) -> bool:
    """The lanes policy's decision for this step (set by ``LoopSpecScheduler.schedule``)."""
    return getattr(so, "loopspec_lanes", True)


def _requests_waiting(so) -> bool:
    """Whether requests waited to join when this step was scheduled (``LoopSpecScheduler``; unknown:
    assumed so, which keeps the shorter lockstep bound)."""
    return getattr(so, "loopspec_waiting", True)


def lane_sampling(sp) -> SamplingParams | None:
    """The lane path's sampling parameters for a vLLM request, or None when the request needs
    something lanes do not do (it then decodes on vLLM's ordinary path in the same engine)."""
    if sp is None:
        return None
    needs_vllm = (
        sp.logprobs is not None or sp.prompt_logprobs is not None or sp.logprob_token_ids
        or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0
        or sp.min_p > 0.0 or sp.min_tokens > 0 or sp.logit_bias or sp.allowed_token_ids
        or sp.bad_words or sp.bad_words_token_ids or sp.structured_outputs is not None
        or sp.thinking_token_budget is not None or sp.repetition_detection is not None
    )
    if needs_vllm:
        return None
    return SamplingParams(temperature=float(sp.temperature), top_k=int(sp.top_k) if sp.top_k > 0 else 0,
                          top_p=float(sp.top_p))


@dataclass(eq=False)
class _Live:
    """A LoopSpec request known to the runner."""

    req_id: str
    pipe: RequestPipeline
    fresh: bool = True  # its lanes were (re)started after vLLM's step and have not run a lane step yet
    sampling: tuple[int, int, int, int] = GREEDY_FIELDS  # its lane-call columns KEY .. TOP_P

    @property
    def coupled(self) -> bool:
        """A sampled request whose readouts are noisy argmaxes (``noise.py``)."""
        return self.sampling != GREEDY_FIELDS


@dataclass(eq=False)
class _Row:
    """One request's share of a lane step."""

    live: _Live
    index: int  # row in vLLM's input batch
    cap: int  # at most this many tokens this step (1 + scheduled drafts)
    state: object  # vLLM's CachedRequestState
    tokens: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.done_after(0)

    def done_after(self, commits: int) -> bool:
        """Done once ``commits`` more tokens are committed (an enqueued step's, known before its tokens)."""
        return len(self.tokens) + commits >= self.cap or not self.live.pipe.lanes


class _CallRow(NamedTuple):
    """One row of a lane call: ``fields`` as ``LaneBatch.pack`` takes them (slot, position, depth,
    token, prefix, source), the slots of the lane's uncommitted ancestors, its request's row in vLLM's
    input batch."""

    fields: tuple[int, int, int, int, int, int]
    ancestors: list[int]
    batch_row: int

    def deeper(self) -> _CallRow:
        """The same lane one depth further (its readout after a core step)."""
        f = self.fields
        return _CallRow(f[:DEPTH] + (f[DEPTH] + 1,) + f[DEPTH + 1:], self.ancestors, self.batch_row)


@dataclass(eq=False)
class _Planned:
    """A child lane enqueued before its parent's first proposal reached the host (overlap): its slot,
    and the lane ``advance`` spawned for it (None: none was, and its work is wasted)."""

    parent: Lane
    slot: int
    lane: Lane | None = None


def _lane_of(what) -> Lane | None:
    return what.lane if isinstance(what, _Planned) else what


class _HostCopy:
    """A small device tensor on its way to the host: copied into pinned memory behind the work already
    enqueued, so the host can enqueue more before it waits (``tolist``)."""

    def __init__(self, x: torch.Tensor):
        self.event = None
        if x.is_cuda:
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.host.copy_(x, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = x

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass(eq=False)
class _Flight:
    """A recurrent step whose GPU work is enqueued: its rows, the lanes its core call advances and those
    its logits call reads (lanes, or planned children), and the readout (logits, argmax)."""

    rows: list[_Row]
    lanes: list[tuple[_Row, object]]
    readers: list[tuple[_Row, object]]
    readout: tuple[torch.Tensor, torch.Tensor] | None
    host: _HostCopy | None
    planned: dict[int, _Planned]  # by id() of the parent lane


class LoopSpecRunner:
    loopspec = True  # what the vLLM hooks look for on ``runner.drafter``

    def __init__(self, vllm_config):
        k = knobs(vllm_config)
        if k is None:
            raise ValueError("LoopSpecRunner needs additional_config['loopspec'] (use method 'loopspec')")
        self.schedule = k.schedule
        self.max_lanes = k.max_lanes
        # the lane budgets a lanes-mode step may run (the scheduler's policy picks one: ``so.loopspec_option``)
        self.options = lane_options(self.schedule.R, self.schedule.d1, self.schedule.d2, self.max_lanes)
        self.num_spec_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.pad_drafts = k.step_tokens > 0  # step_drafts
        # the lockstep bounds (``_more_steps``): while no request waits to join, and while some do
        self.lockstep = max(self.schedule.R, LOCKSTEP, k.step_tokens)
        self.lockstep_joining = max(self.schedule.R, LOCKSTEP)
        self._waiting = True  # this engine step's: did requests wait to join when it was scheduled
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.max_model_len = vllm_config.model_config.max_model_len
        self.seed = vllm_config.model_config.seed or 0
        graph_mode = k.lane_graphs
        self.cuda = getattr(vllm_config.device_config, "device_type", "cpu") == "cuda"
        # overlap (auto): a greedy lane step enqueues each recurrent step on the likely outcome of the one
        # before, so the GPU computes while the host reads and decides ("off": one after the other)
        self.overlap = k.lane_overlap == "auto"
        # coupled (auto): sampled requests' readouts are noisy argmaxes on the GPU, decided as greedy ones
        # (``noise.py``); "cascade": the paper's cascade on filtered distributions, decided on the host
        self.coupled = k.coupled
        # auto: the kernel on CUDA (5.6 against 7.1 ms per Ouro-1.4B recurrent step on the H200,
        # benchmarks/RESULTS.md), the PyTorch path elsewhere
        self.attention_mode = k.lane_attention
        if self.attention_mode == "auto":
            self.attention_mode = "triton" if self.cuda else "torch"
        # the Triton lane attention (lane_attention "triton"); checked here, at start-up
        self.kernel = triton_lane_attention(self.cuda) if self.attention_mode == "triton" else None
        tp = vllm_config.parallel_config.tensor_parallel_size
        if graph_mode == "on" and tp > 1:
            raise ValueError("speculative_config (loopspec): lane_graphs='on' needs tensor_parallel_size 1 "
                             f"(got {tp}); allowed with tensor parallelism: 'auto', 'off'")
        # auto: graphs wherever vLLM itself would use them (a CUDA device, not enforce_eager); not under
        # tensor parallelism, whose all-reduces would need vLLM's own capture context.
        self.use_graphs = graph_mode == "on" or (
            graph_mode == "auto" and self.cuda and not vllm_config.model_config.enforce_eager and tp == 1)
        self.model = None
        self.paged: PagedBanks | None = None
        self.scratch: LaneScratch | None = None
        self.graphs: LaneGraphs | None = None
        self.live: dict[str, _Live] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.coupled_requests: dict[str, tuple[int, int, int, int] | None] = {}  # ``_coupled_fields``, by request
        self.totals = EngineCounters()
        self._step = EngineCounters()
        self._lane_step_end: float | None = None  # perf_counter() at the end of the last engine step, if a lane step

    # -- vLLM's proposer interface ----------------------------------------------------------------------
    def load_model(self, model) -> None:
        for name in ("lane_pre", "lane_core", "lane_logits", "lane_state_width"):
            if not hasattr(model, name):
                raise ValueError(f"LoopSpec needs a looped model with lanes; {type(model).__name__} has no {name}")
        self.model = model

    def warm_up(self, runner) -> None:
        """At engine start-up, once the KV cache exists: capture every lane-graph bucket (and with it
        compile every Triton kernel the lane calls launch, for every shape they meet), so that serving
        never stalls on a capture or a compilation. Nothing to do without lane graphs (the CPU, tensor
        parallelism, ``lane_graphs: "off"``)."""
        if not self.use_graphs or not self.cuda:
            return
        self._ensure_storage(runner)
        start = time.perf_counter()
        with torch.inference_mode():
            n = self.graphs.capture_all()
        logger.info("LoopSpec lanes: %d lane graphs captured at start-up in %.1f s (%d row buckets x %s)", n,
                    time.perf_counter() - start, len(self.graphs.buckets()), "/".join(WARM_KINDS))

    def propose(self, sampled_token_ids, *args, **kwargs):
        """vLLM asks after its own steps; the real drafts are set in ``after_standard_step``."""
        return [[] for _ in sampled_token_ids]

    # -- engine-step entry points (vllm_patches) --------------------------------------------------------------
    def execute_model(self, runner, scheduler_output):
        """Serve the step with lanes and return its ``ModelRunnerOutput``, or None for vLLM's path."""
        gap_from, self._lane_step_end = self._lane_step_end, None
        self._forget(scheduler_output)
        if not _lanes_on(scheduler_output) or not self._is_lane_step(scheduler_output):
            return None
        start = time.perf_counter()
        if gap_from is not None:  # the engine step before was a lane step too
            self._step.lane_step_gaps += 1
            self._step.lane_step_gap_seconds += start - gap_from
        self._waiting = _requests_waiting(scheduler_output)
        runner._update_states(scheduler_output)
        self._ensure_storage(runner)
        before = self._pipeline_stats()
        captured = 0 if self.graphs is None else self.graphs.captured
        rows = self._rows(runner, scheduler_output)
        option = self.options[getattr(scheduler_output, "loopspec_option", 0)]
        for row in rows:  # the step's lane budget (the policy's choice)
            row.live.pipe.cap, row.live.pipe.seconds = option.cap, option.second
        for row in rows:  # for the lanes policy: a step of mostly fresh pipelines is a warm-up
            self._step.warmup_rows += row.live.fresh
            row.live.fresh = False
        overlap = self.overlap and all(row.live.pipe.argmax for row in rows)
        with torch.inference_mode(), _named("loopspec.lane_step"):
            steps = 0
            flight = self._launch_real(runner, [row for row in rows if not row.done])
            while flight is not None:
                flight = self._recurrent_step(runner, rows, flight, steps, overlap)
                steps += 1
        self._step.lane_steps += 1
        self._step.graph_captures += 0 if self.graphs is None else self.graphs.captured - captured
        self._count_pipeline_stats(before)
        out = self._finish_lane_step(runner, rows)
        for row in rows:  # finished by its own stop rule: vLLM frees it next step (or it restarts)
            if not row.live.pipe.lanes:
                self.live.pop(row.live.req_id, None)
        # the tokens were read on the host, so the step's GPU work is (nearly all) done by now
        self._lane_step_end = time.perf_counter()
        self._step.lane_step_seconds += self._lane_step_end - start
        return out

    def _more_steps(self, rows: list[_Row], steps: int, pending: dict[int, int] | None = None) -> bool:
        """Every request must commit at least once per engine step (vLLM's contract). Past that, all
        requests go on in lockstep (fewer scheduler round trips) until one of them may commit no more
        (its cap: 1 + its scheduled drafts) or has finished, for at most max(R, LOCKSTEP) recurrent
        steps in all, which bounds how long a new request waits to join (the cap alone would not:
        at low acceptance a request commits a token only every R steps); for at most
        max(R, LOCKSTEP, step_tokens) when no request was waiting as the step was scheduled.
        ``pending``: commits of an enqueued step, by ``id(row)``, counted as if made (a commit is
        known before its token)."""
        pending = pending or {}
        done = [row.done_after(pending.get(id(row), 0)) for row in rows]
        if all(done):
            return False
        if not all(row.tokens or pending.get(id(row)) for row in rows):
            return True
        return not any(done) and steps < (self.lockstep_joining if self._waiting else self.lockstep)

    def after_standard_step(self, runner, scheduler_output, output) -> None:
        """After vLLM's own step: keep each request's lanes on the committed path (or start them),
        then hand the chains back as drafts."""
        if output is None or not getattr(output, "req_ids", None):
            return
        if not _lanes_on(scheduler_output):  # the policy chose plain decoding: no lanes, no drafts
            self.plain_step(output.req_ids)
            self.hand_over_drafts(runner, output)
            return
        self._ensure_storage(runner)
        counted = False
        starts: list[tuple[_Row, Lane]] = []
        for i, req_id in enumerate(output.req_ids):
            tokens = output.sampled_token_ids[i] if i < len(output.sampled_token_ids) else []
            state = runner.requests.get(req_id)
            if not tokens or state is None:
                continue
            params = lane_sampling(state.sampling_params)
            if params is None or self._ends(state, tokens[-1], len(state.output_token_ids)):
                self._drop(req_id)  # lanes do not serve it, or this step finished it
                continue
            live = self.live.get(req_id)
            position = state.num_prompt_tokens + len(state.output_token_ids) - 1  # the last token's
            if live is None:
                coupled = self.coupled and not params.greedy
                live = self.live[req_id] = _Live(req_id, RequestPipeline(
                    self.schedule, params, None if coupled else self._generator(req_id, state.sampling_params),
                    self.max_lanes, coupled=coupled))
                if coupled:
                    live.sampling = self._coupled_fields(req_id, state.sampling_params)
            else:
                counted = True  # a lane request decoded in vLLM's step
                # the chain's drafts, not their padding (step_drafts)
                scheduled = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
                drafts = min(scheduled, len(live.pipe.chain())) if scheduled else 0
                if drafts:
                    self._step.chain_rows += 1
                    self._step.chain_drafts += drafts
                    self._step.chain_accepted += min(len(tokens) - 1, drafts)
                if self._follow(live, tokens, position):
                    continue
            self._free(live.pipe.clear())
            live.fresh = True
            row = _Row(live, runner.input_batch.req_id_to_index[req_id], 0, state)
            starts.append((row, live.pipe.start(tokens[-1], position)))
        if counted:
            self._step.standard_steps += 1
        if starts:
            with torch.inference_mode():
                self._assign_slots([lane for _, lane in starts])
                self._run_pre(runner, starts)
        self.hand_over_drafts(runner, output)

    def couple_logits(self, runner, logits: torch.Tensor, spec_decode_metadata) -> None:
        """Coupled sampling on vLLM's path (its sampler and rejection sampler: prefills, plain steps,
        steps that verify lane chains): each logits row of a coupled request becomes the one-hot of its
        noisy argmax at the position it samples for, in place, so that whatever vLLM then draws from
        it (sampling, or a draft accepted iff it is that token, or the recovered / bonus token) is the
        token the lanes would commit there. A seeded request's text then depends on its seed alone,
        not on which path served each step. ``logits``: one row per request, or with drafts
        ``spec_decode_metadata.num_draft_tokens[i] + 1`` rows of request i, the last one its bonus."""
        ib = runner.input_batch
        n = ib.num_reqs
        counts = [1] * n if spec_decode_metadata is None else [d + 1 for d in spec_decode_metadata.num_draft_tokens]
        rows, req_rows, back, fields = [], [], [], []
        start = 0
        for i, req_id in enumerate(ib.req_ids[:n]):
            coupled = self._coupled_fields(req_id, runner.requests[req_id].sampling_params)
            if coupled is not None:
                for j in range(counts[i]):
                    rows.append(start + j)
                    req_rows.append(i)
                    back.append(counts[i] - 1 - j)  # the last row samples the position seq_len
                    fields.append(coupled)
            start += counts[i]
        if not rows:
            return
        dev = logits.device
        host = torch.tensor([rows, req_rows, back] + [list(c) for c in zip(*fields)], dtype=torch.int64)
        rows_t, req_t, back_t, key, temperature, top_k, top_p = upload(host, dev)
        positions = runner.seq_lens[req_t].to(torch.int64) - back_t
        from vllm_loop.loopspec.noise import coupled_sample

        tokens = coupled_sample(logits[rows_t], temperature.view(torch.float64).float(), top_k,
                                top_p.view(torch.float64).float(), key, positions)
        logits[rows_t] = float("-inf")
        logits[rows_t, tokens] = 0.0

    def _coupled_fields(self, req_id: str, sp) -> tuple[int, int, int, int] | None:
        """A coupled request's lane-call columns KEY .. TOP_P, or None (greedy, not coupled, or a
        request the lanes do not serve: vLLM samples it as usual)."""
        if req_id not in self.coupled_requests:
            params = lane_sampling(sp) if self.coupled else None
            self.coupled_requests[req_id] = None if params is None or params.greedy else sampling_fields(
                self._noise_key(req_id, sp), params.temperature, params.top_k, params.top_p)
        return self.coupled_requests[req_id]

    def plain_step(self, req_ids) -> None:
        """A step the policy ran without lanes: its requests hold none until a lanes-mode step."""
        for req_id in req_ids:
            self._drop(req_id)
        self._step.plain_steps += 1

    def take_counters(self) -> EngineCounters:
        """This step's counters (attached to the step's output for the scheduler)."""
        step, self._step = self._step, EngineCounters()
        step.lane_requests_live = len(self.live)
        step.lanes_live = sum(len(x.pipe.lanes) for x in self.live.values())
        self.totals.add(step)
        return step

    def lane_census(self) -> dict:
        """Live requests, lanes and free lane slots (tests: nothing leaks)."""
        return {"requests": len(self.live), "lanes": sum(len(x.pipe.lanes) for x in self.live.values()),
                "free_slots": None if self.scratch is None else self.scratch.free,
                "slots": None if self.scratch is None else self.scratch.num_slots}

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def _forget(self, so) -> None:
        gone = set(so.finished_req_ids) | set(so.preempted_req_ids or ()) | set(so.scheduled_cached_reqs.resumed_req_ids)
        for req_id in gone:
            self._drop(req_id)
        for req_id in so.finished_req_ids:
            self.generators.pop(req_id, None)
            self.coupled_requests.pop(req_id, None)

    def _drop(self, req_id: str) -> None:
        live = self.live.pop(req_id, None)
        if live is not None:
            self._free(live.pipe.clear())

    def _free(self, lanes) -> None:
        for lane in lanes:
            if lane.slot is not None:
                self.scratch.give_back(lane.slot)
                lane.slot = None

    def _noise_key(self, req_id: str, sp) -> int:
        """A sampled request's random key: its seed, or else a hash of the engine seed and the request
        id. Every tensor-parallel rank runs the same lanes and must take the same decisions with no
        communication, so nothing here may depend on a rank's own random state."""
        if sp.seed is not None:
            return int(sp.seed)
        digest = hashlib.sha256(f"{self.seed}:{req_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def _generator(self, req_id: str, sp) -> torch.Generator | None:
        """One generator per request for its whole life (a restarted pipeline keeps drawing fresh
        uniforms), seeded with ``_noise_key``: the cascade's uniforms."""
        if sp.temperature < 1e-5:
            return None
        if req_id not in self.generators:
            self.generators[req_id] = torch.Generator().manual_seed(self._noise_key(req_id, sp))
        return self.generators[req_id]

    def _is_lane_step(self, so) -> bool:
        if so.scheduled_new_reqs or so.scheduled_cached_reqs.resumed_req_ids or not so.num_scheduled_tokens:
            return False
        computed = dict(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        for req_id, n in so.num_scheduled_tokens.items():
            live = self.live.get(req_id)
            if live is None or live.pipe.root is None:
                return False
            if n != 1 + len(so.scheduled_spec_decode_tokens.get(req_id, ())):
                return False  # a prefill chunk
            if computed.get(req_id) != live.pipe.root.position:
                return False
        return True

    def _follow(self, live: _Live, tokens: list[int], position: int) -> bool:
        """vLLM's forward committed ``tokens`` after the root: keep the lane that computes the last of
        them (reached along the committed path) with its subtree. False: no such lane."""
        node = live.pipe.root
        if node is None or node.position != position - len(tokens):
            return False
        for token in tokens:
            node = next((c for c in node.children if c.alive and c.token == token), None)
            if node is None:
                return False
        self._free(live.pipe.tree.reroot(node))
        return True

    def _pipeline_stats(self) -> dict[str, tuple[int, int]]:
        return {k: (x.pipe.stats.gate_evaluations, x.pipe.stats.gate_opens) for k, x in self.live.items()}

    def _count_pipeline_stats(self, before) -> None:
        for k, x in self.live.items():
            e, o = before.get(k, (0, 0))
            self._step.gate_evaluations += x.pipe.stats.gate_evaluations - e
            self._step.gate_opens += x.pipe.stats.gate_opens - o

    # -- storage -------------------------------------------------------------------------------------------
    def _ensure_storage(self, runner) -> None:
        if self.paged is not None:
            return
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        probe = get_layers_from_vllm_config(runner.vllm_config, Attention)[bank_prefix(0)]
        self.paged = PagedBanks(list(runner.kv_caches), probe)
        kernel_block = runner.input_batch.block_table[0].block_size
        if kernel_block != self.paged.block_size:
            raise RuntimeError(f"block table of {kernel_block}-token blocks, KV cache of {self.paged.block_size}")
        slots = self.max_num_seqs * (self.max_lanes + 1)  # +1: a verified root keeps its slot until copied
        dtype = runner.kv_caches[0].dtype
        self.scratch = LaneScratch(self.paged.num_banks, slots, self.paged.num_heads, self.paged.head_dim,
                                   self.model.lane_state_width, dtype, runner.kv_caches[0].device)
        mib = (self.scratch.kv.numel() + self.scratch.states.numel()) * self.scratch.kv.element_size() / 2**20
        if self.use_graphs:
            self.graphs = LaneGraphs(self.model, self.paged, self.scratch,
                                     table_width=runner.input_batch.block_table[0].block_table.np.shape[1],
                                     ancestors=max(0, self.max_lanes - 1), max_rows=slots, capture=self.cuda,
                                     kernel=self.kernel)
        calls = "eager" if self.graphs is None else "as CUDA graphs" if self.cuda else "padded to graph shapes (no CUDA)"
        logger.info("LoopSpec lanes: %d slots (%d requests x %d lanes + 1), %.1f MiB of lane KV and states, "
                    "KV layout %s, lane calls %s, lane attention %s", slots, self.max_num_seqs, self.max_lanes, mib,
                    self.paged.layout, calls, self.attention_mode)

    def _assign_slots(self, lanes: list[Lane]) -> None:
        for lane in lanes:
            lane.slot = self.scratch.take()
            if lane.slot is None:
                raise RuntimeError("LoopSpec lane slots exhausted (the pool is sized for max_num_seqs requests)")

    # -- one lane step -----------------------------------------------------------------------------------------
    def _rows(self, runner, so) -> list[_Row]:
        rows = []
        for index, req_id in enumerate(runner.input_batch.req_ids):
            cap = 1 + len(so.scheduled_spec_decode_tokens.get(req_id, ()))
            rows.append(_Row(self.live[req_id], index, cap, runner.requests[req_id]))
        return rows

    @staticmethod
    def _call_row(row: _Row, lane: Lane, prefix: int | None = None, ancestors: list[int] | None = None) -> _CallRow:
        """``lane`` as a row of a lane call; ``prefix`` / ``ancestors`` (their slots): the request's as
        they will be (default: as they are)."""
        pipe = row.live.pipe
        prefix = pipe.root.position if prefix is None else prefix
        ancestors = [a.slot for a in pipe.tree.ancestors(lane)] if ancestors is None else ancestors
        return _CallRow((lane.slot, lane.position, lane.depth, lane.token, prefix, -1) + row.live.sampling, ancestors,
                        row.index)

    @staticmethod
    def _ancestor_slots(lanes: list[Lane], skip: Lane | None = None) -> dict[Lane, list[int]]:
        """The slots of each lane's uncommitted ancestors, oldest first, leaving out ``skip`` (a root
        about to be committed): one pass over ``lanes`` in birth order, where a parent comes before its
        children, instead of a walk up the tree per lane (at many requests the host's time per lane is
        a large part of a lane step: benchmarks/probes/lane_host_costs.py)."""
        chains: dict[Lane, list[int]] = {}
        for lane in lanes:
            parent = lane.parent
            chains[lane] = [] if parent is None or parent is skip else chains[parent] + [parent.slot]
        return chains

    def _lane_call(self, runner, kind: str, calls: list[_CallRow]):
        """Run lane call ``kind`` (``lane_graphs.KINDS``) on rows ``calls``: replayed from a CUDA graph
        when its shape has a bucket, else eagerly. Returns ``(logits, argmax)`` for ``logits``."""
        with _named(f"loopspec.{kind}"):
            n = len(calls)
            fields, ancestry, batch_rows = zip(*calls)
            context = max(f[PREFIX] for f in fields)
            shape = self.graphs.shape(n, context) if self.graphs is not None else None
            rows, ctx = shape if shape is not None else (n, context)
            width = self.graphs.ancestors if shape is not None else max(map(len, ancestry), default=0)
            table = runner.input_batch.block_table[0].block_table.np
            batch = LaneBatch.pack(fields, ancestry, table[list(batch_rows)], rows=rows, ancestors=width, context=ctx,
                                   pad_slot=self.scratch.pad_slot)
            if shape is not None:
                return self.graphs(kind, batch)
            packed = upload(batch.columns(), self.scratch.kv.device)
            return lane_call(self.model, self.paged, self.scratch, kind, packed, width, ctx, self.kernel)

    def _run_pre(self, runner, items: list[tuple[_Row, Lane]]) -> None:
        """Depth-0 states of new lanes (children and restarts)."""
        self._lane_call(runner, "pre", [self._call_row(row, lane) for row, lane in items])

    def _launch(self, runner, rows: list[_Row], items: list[tuple[_Row, object, _CallRow]],
                planned: dict[int, _Planned] | None = None) -> _Flight | None:
        """Enqueue one recurrent step: a core call for ``items`` (row, lane or planned child, call row at
        the depth before the step), then the readouts of the rows that reach d1, d2 or R."""
        if not items:
            return None
        depths = self.schedule.readout_depths
        self._lane_call(runner, "core", [call for _, _, call in items])
        readers = [(row, what, call.deeper()) for row, what, call in items if call.fields[DEPTH] + 1 in depths]
        kind = "dist" if any(not row.live.pipe.argmax for row, _, _ in readers) else \
            "sample" if any(row.live.coupled for row, _, _ in readers) else "logits"
        readout = self._lane_call(runner, kind, [call for _, _, call in readers]) if readers else None
        self._step.recurrent_steps += 1
        self._step.lanes_advanced += len(items)
        self._step.request_steps += len(rows)
        return _Flight(rows, [(row, what) for row, what, _ in items], [(row, what) for row, what, _ in readers],
                       readout, None if readout is None else _HostCopy(readout[1]), planned or {})

    def _launch_real(self, runner, rows: list[_Row]) -> _Flight | None:
        """The next recurrent step of the requests' lanes as they are."""
        items = []
        for row in rows:
            lanes = row.live.pipe.lanes
            chains = self._ancestor_slots(lanes)
            items += [(row, lane, self._call_row(row, lane, ancestors=chains[lane])) for lane in lanes]
        return self._launch(runner, rows, items)

    def _launch_expected(self, runner, rows: list[_Row], expected: dict[int, Expected]) -> _Flight | None:
        """The next recurrent step as each request's ``Expected`` outcome of this one has it (overlap):
        verified roots committed, the first proposals' children started with their tokens taken on
        the device from their parents' readouts."""
        items, planned, pre = [], {}, []
        for row in rows:
            exp = expected[id(row)]
            pipe = row.live.pipe
            prefix = pipe.root.position + (exp.commit is not None)
            chains = self._ancestor_slots(exp.stay, skip=exp.commit)
            items += [(row, lane, self._call_row(row, lane, prefix, chains[lane])) for lane in exp.stay]
            for parent in exp.proposers:
                slot = self.scratch.take()
                if slot is None:
                    break  # no slot: the child, if spawned, starts a step later
                child = _Planned(parent, slot)
                # depth 0 at the next position; its token: the parent's readout, read on the device
                call = _CallRow((slot, parent.position + 1, 0, 0, prefix, parent.slot) + row.live.sampling,
                                chains[parent] + [parent.slot], row.index)
                planned[id(parent)] = child
                pre.append(call)
                items.append((row, child, call))
        if pre:
            self._lane_call(runner, "pre", pre)
        return self._launch(runner, rows, items, planned)

    def _recurrent_step(self, runner, rows: list[_Row], flight: _Flight, steps: int, overlap: bool) -> _Flight | None:
        """Take the decisions of the enqueued recurrent step ``flight``; return the next one, enqueued
        (None: the lane step ends). With ``overlap`` the next step is enqueued before this one's
        readouts are read, so the GPU runs it while the host decides; otherwise after."""
        # 1. the core call advanced its lanes (those pruned meanwhile, and planned children never spawned,
        #    were computed for nothing)
        for _, what in flight.lanes:
            lane = _lane_of(what)
            if lane is not None and lane.alive:
                lane.depth += 1
            else:
                self._step.overlap_wasted += 1
        live = [row for row in flight.rows if row.live.pipe.lanes]
        expected = {id(row): row.live.pipe.expect() for row in live}
        # 2. a root at R is committed whatever its verdict: its K/V of every bank goes to the paged cache now
        commits = [(row, expected[id(row)].commit) for row in live if expected[id(row)].commit is not None]
        if commits:
            with _named("loopspec.commit_kv"):
                self._write_commits(runner, commits)
        # 3. overlap: the next step, on the likely outcome of this one
        nxt = None
        if overlap:
            pending = {id(row): 1 for row, _ in commits}
            if self._more_steps(rows, steps + 1, pending):
                going = [row for row in live if not row.done_after(pending.get(id(row), 0))]
                nxt = self._launch_expected(runner, going, expected)
        # 4. each request's decisions on this step's readouts
        read = self._read(flight)
        new: list[tuple[_Row, Lane]] = []
        with _named("loopspec.decide"):
            for row in live:
                step = row.live.pipe.advance(read[id(row)], lambda token, row=row: self._is_final(row, token))
                self._free(step.pruned)
                if step.commit is not None:
                    self._count_commit(step.commit)
                    self._free([step.commit.lane])
                    row.tokens.append(step.commit.verdict.token)
                new += self._claim(nxt, row, step.spawned)
        if nxt is not None:
            for child in nxt.planned.values():  # planned children advance did not spawn: their slots come back
                if child.lane is None:
                    self.scratch.give_back(child.slot)
            self._step.overlap_lagged += len(new)
        # 5. pre-layers for the new lanes the next step does not already run
        if new:
            self._assign_slots([lane for _, lane in new])
            self._run_pre(runner, new)
        if nxt is None and self._more_steps(rows, steps + 1):
            nxt = self._launch_real(runner, [row for row in rows if not row.done])
        return nxt

    @staticmethod
    def _claim(flight: _Flight | None, row: _Row, spawned: list[Lane]) -> list[tuple[_Row, Lane]]:
        """Spawned lanes that ``flight`` already runs as planned children take their slots; the rest
        are returned (they need their pre-layers). A planned child is its parent's first proposal, its
        token the parent's argmax on the device: the very value the host read (greedy steps only)."""
        if flight is None:
            return [(row, lane) for lane in spawned]
        rest = []
        for lane in spawned:
            child = flight.planned.get(id(lane.parent)) if lane.origin == CommitSource.FIRST else None
            if child is None or child.lane is not None:
                rest.append((row, lane))
            else:
                child.lane, lane.slot = lane, child.slot
        return rest

    def _read(self, flight: _Flight) -> dict[int, dict[int, object]]:
        """Each request's readouts of ``flight``: ``{id(row): {lane.id: value}}`` for its live lanes."""
        read: dict[int, dict[int, object]] = {id(row): {} for row in flight.rows}
        if flight.readout is None:
            return read
        logits, _ = flight.readout
        with _named("loopspec.read"):  # the host waits for the GPU here
            values = flight.host.tolist()  # greedy and coupled rows: only their tokens cross to the host
            by_params: dict[SamplingParams, list[int]] = {}
            for i, (row, _) in enumerate(flight.readers):
                if not row.live.pipe.argmax:
                    by_params.setdefault(row.live.pipe.params, []).append(i)
            for params, idx in by_params.items():
                for i, value in zip(idx, readout_values(logits[idx], params)):
                    values[i] = value
        for (row, what), value in zip(flight.readers, values):
            lane = _lane_of(what)
            if lane is not None and lane.alive:
                read[id(row)][lane.id] = value
        return read

    def _is_final(self, row: _Row, token: int) -> bool:
        """Would committing ``token`` finish the request?"""
        return self._ends(row.state, token, len(row.state.output_token_ids) + len(row.tokens) + 1)

    def _ends(self, state, token: int, n_out: int) -> bool:
        """Does ``token``, the request's ``n_out``-th output token, end it (vLLM's stop rules for lane
        requests; stop strings are the front end's, and are left to vLLM's next step)?"""
        sp = state.sampling_params
        return ((token == sp.eos_token_id and not sp.ignore_eos) or token in (sp.stop_token_ids or ())
                or n_out >= (sp.max_tokens if sp.max_tokens is not None else self.max_model_len)
                or state.num_prompt_tokens + n_out >= self.max_model_len)

    def _count_commit(self, commit: Commit) -> None:
        source, root = commit.verdict.source, commit.lane
        self._step.first += source == CommitSource.FIRST
        self._step.second += source == CommitSource.SECOND
        self._step.late += source == CommitSource.LATE
        self._step.full += source == CommitSource.FULL
        self._step.first_verified += root.first is not None
        self._step.second_verified += root.second is not None
        self._step.late_verified += len(root.late)

    def _write_commits(self, runner, commits: list[tuple[_Row, Lane]]) -> None:
        """Verified roots: their K/V of every bank goes from their scratch slots to the paged cache."""
        device, B = self.scratch.kv.device, self.paged.block_size
        table = runner.input_batch.block_table[0].block_table.np
        nb = self.paged.num_banks
        blocks = [int(table[row.index, root.position // B]) for row, root in commits]
        offsets = [root.position % B for _, root in commits]
        slots = [root.slot for _, root in commits]
        # (bank, slot, block, offset) of every commit at every bank, built host-side: one copy to the device
        index = np.empty((4, len(commits), nb), dtype=np.int64)
        index[0] = np.arange(nb)
        index[1:] = np.array([slots, blocks, offsets], dtype=np.int64)[:, :, None]
        banks, slot_t, block_t, offset_t = upload(torch.from_numpy(index.reshape(4, -1)), device)
        kv = self.scratch.kv[banks, slot_t]  # [m * banks, 2, H, D]
        self.paged.write(block_t, banks, offset_t, kv[:, 0], kv[:, 1])

    def _finish_lane_step(self, runner, rows: list[_Row]):
        """vLLM's bookkeeping for the committed tokens (as ``_bookkeeping_sync`` does), the drafts,
        and the step's output."""
        from vllm.v1.outputs import ModelRunnerOutput

        ib = runner.input_batch
        for row in rows:
            start = ib.num_tokens_no_spec[row.index]
            end = start + len(row.tokens)
            ib.token_ids_cpu[row.index, start:end] = row.tokens
            ib.is_token_ids[row.index, start:end] = True
            ib.num_tokens_no_spec[row.index] = end
            row.state.output_token_ids.extend(row.tokens)
        out = ModelRunnerOutput(req_ids=list(ib.req_ids), req_id_to_index=dict(ib.req_id_to_index),
                                sampled_token_ids=[row.tokens for row in rows])
        self.hand_over_drafts(runner, out)
        return out

    def hand_over_drafts(self, runner, out) -> None:
        """Each request's first-proposal chain becomes its drafts (``step_drafts``): where vLLM's
        ``take_draft_token_ids`` reads them, or, under async scheduling (whose engine core never
        asks), on the step's output for ``LoopSpecAsyncScheduler``."""
        req_ids = list(runner.input_batch.req_ids)
        # pad while the batch's padded steps fit in half the token budget: a prefill joining the
        # batch must still get its share (its step verifies the padding too, losslessly)
        budget = runner.vllm_config.scheduler_config.max_num_batched_tokens
        pad = self.pad_drafts and len(req_ids) * (1 + self.num_spec_tokens) <= budget // 2
        drafts = []
        for req_id in req_ids:
            live = self.live.get(req_id)
            drafts.append([] if live is None or live.pipe.root is None else step_drafts(
                [lane.token for lane in live.pipe.chain()], live.pipe.root.token, self.num_spec_tokens, pad))
        if runner.vllm_config.scheduler_config.async_scheduling:
            out.loopspec_drafts = (req_ids, drafts)
            runner._draft_token_ids = runner._draft_token_req_ids = None
        else:
            runner._draft_token_ids, runner._draft_token_req_ids = drafts, req_ids


def step_drafts(chain: list[int], root_token: int, k: int, pad: bool) -> list[int]:
    """A request's drafts for its next engine step: its first-proposal chain (at most ``k``), padded
    to ``k`` with its last token when ``pad``. The scheduler gives every draft a KV slot, and a lane
    step commits up to 1 + drafts tokens a request, so the padding lets a lane step run past the
    chain's end (Ouro's chain is at most 4 long) instead of returning to vLLM every ~4 tokens. A step
    of vLLM's own forward verifies padding like any draft: rejected, or accepted because it is the
    model's own token, lossless either way."""
    drafts = chain[:k]
    if pad:
        drafts += [drafts[-1] if drafts else root_token] * (k - len(drafts))
    return drafts


def reset_async_carry(runner) -> None:
    """After a barrier step of an async engine (a lane step, or a lanes-mode step that ran vLLM's
    synchronous sampling), forget what vLLM's async runner carries from one step into the next
    (``GPUModelRunner`` of vLLM 0.26): the next step must read its inputs from ``token_ids_cpu``,
    where the barrier step wrote its real tokens. Left in place, the last plain step's sampled
    tokens would overwrite the barrier's (``_prepare_input_ids``), and its draft count would "correct"
    ``num_computed_tokens`` with a count custom_class drafters never fill."""
    ib = runner.input_batch
    ib.prev_sampled_token_ids = ib.prev_req_id_to_index = None
    ib.sampled_token_ids_cpu = ib.async_copy_ready_event = None
    runner.valid_sampled_token_count_gpu = None
    runner._draft_token_ids = runner._draft_token_req_ids = None
    for req_id in ib.req_ids:
        state = runner.requests.get(req_id)
        if state is not None:
            state.prev_num_draft_len = 0
