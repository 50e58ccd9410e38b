"""A plain-PyTorch pipelined LoopSpec executor over a reference looped model (the oracle).

It runs many requests at once. One *recurrent step* advances every live lane of every request by
one core step (one application of the shared block); the number of lanes advanced is the step's
effective batch size. Lanes are grouped by depth into one ``core_step`` call per distinct depth
(the reference API takes one depth per call; a vLLM runner does all of them in one batched call).
After the core step, lanes at a readout depth run the readout (grouped by depth), then each request
handles its events: proposals at d1 (always) and d2 (gated), which spawn child lanes, and
verification of the root at R, which commits one token, re-roots or restarts the tree. Newly
spawned lanes that survived the commit run the pre-layers at the end of the step (depth 0), so
they gain their first depth in the next step, d1 (or d2) steps behind their parent.

KV: each request keeps its committed ``SequenceKV``; a lane's context is a ``LaneKV`` over the
committed prefix plus its uncommitted ancestors' per-bank KV; the lane records its own KV per bank,
and on commit the root's KV is appended to the committed sequence. Prefill is an ordinary forward
of the prompt that fills every bank, including coda banks at the readout depths {d1, d2, R}; the
first token comes from p_R at the last prompt position, and the pipeline starts with one lane for
it at depth 0.

Sampling uses one ``torch.Generator`` per request (seeded), consumed for the first-token draw, the
proposals and the cascade's uniforms; with ``coupled=True`` every readout (and the first token) is
instead the request's noisy argmax at its position (``noise.py``), keyed by the request's seed, so a
run's tokens equal ordinary decoding with the same sampler (``coupled_generate``) token for token.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import torch

from vllm_loop.loopspec.lanes import Lane
from vllm_loop.loopspec.metrics import LoopSpecStats, batch_size_summary, format_summary
from vllm_loop.loopspec.noise import coupled_sample
from vllm_loop.loopspec.pipeline import RequestPipeline, readout_values
from vllm_loop.loopspec.proposals import SamplingParams, sample_token
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.reference.kv import LaneKV, SequenceKV


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    eos_token_id: int | Iterable[int] | None = None

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("prompt must hold at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} is invalid: must be >= 1")

    def eos_ids(self) -> frozenset[int]:
        if self.eos_token_id is None:
            return frozenset()
        if isinstance(self.eos_token_id, int):
            return frozenset([self.eos_token_id])
        return frozenset(self.eos_token_id)


@dataclass
class RequestOutput:
    tokens: list[int]
    finish_reason: str  # "length" | "eos"
    stats: LoopSpecStats


@dataclass
class RunOutput:
    outputs: list[RequestOutput]
    effective_batch: list[int]  # lanes advanced per recurrent step, all requests together
    stats: LoopSpecStats  # all requests merged

    @property
    def tokens(self) -> list[list[int]]:
        return [o.tokens for o in self.outputs]

    def summary(self) -> dict:
        s = self.stats.summary()
        s["effective_batch"] = batch_size_summary(self.effective_batch)
        s["recurrent_steps"] = len(self.effective_batch)
        # measured, not eq. 9: pipeline tokens per R recurrent steps of each request (includes the
        # pipeline fill and the steps spent on a last token cut off by the length limit)
        steps = sum(o.stats.recurrent_steps for o in self.outputs)
        s["measured_gamma"] = self.stats.decoded * self.stats.R / steps if steps else 0.0
        return s

    def report(self) -> str:
        s = self.summary()
        return format_summary(s, s["effective_batch"])


class LaneBatchKV:
    """KV context for a batch of lanes, one row each, every row with its own context
    (committed prefix + ancestors + itself, as ``LaneKV`` defines it).

    One row goes through ``LaneKV.attend`` itself. Several rows are gathered into a padded
    ``[n, M, H, d]`` key/value batch and attended in one masked call (the same arithmetic as
    ``kv.attention``: fp32 scores, softmax, fp32 weighted sum); padded keys get probability 0.
    """

    def __init__(self, views: list[LaneKV]):
        self.views = views

    def attend(self, bank, q, k, v, scale: float) -> torch.Tensor:
        n = q.shape[0]
        if n != len(self.views):
            raise ValueError(f"{n} query rows for {len(self.views)} lanes")
        if n == 1:
            return self.views[0].attend(bank, q, k, v, scale)
        contexts = [view.context(bank, k[i : i + 1], v[i : i + 1]) for i, view in enumerate(self.views)]
        keys, values = [c[0] for c in contexts], [c[1] for c in contexts]
        lengths = torch.tensor([t.shape[0] for t in keys])
        K = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)  # [n, M, Hkv, d]
        Vv = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
        rep = q.shape[1] // K.shape[2]
        K, Vv = K.repeat_interleave(rep, dim=2), Vv.repeat_interleave(rep, dim=2)
        scores = torch.einsum("nhd,nmhd->nhm", q.float(), K.float()) * scale
        pad = torch.arange(K.shape[1]).unsqueeze(0) >= lengths.unsqueeze(1)  # [n, M]
        scores = scores.masked_fill(pad.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("nhm,nmhd->nhd", probs, Vv.float()).to(q.dtype)


def _cat_states(states: list) -> object:
    cls = type(states[0])
    kwargs = {}
    for f in fields(states[0]):
        vals = [getattr(s, f.name) for s in states]
        kwargs[f.name] = torch.cat(vals) if isinstance(vals[0], torch.Tensor) else vals[0]
    return cls(**kwargs)


def _split_state(state, n: int) -> list:
    cls = type(state)
    out = []
    for i in range(n):
        kwargs = {}
        for f in fields(state):
            val = getattr(state, f.name)
            kwargs[f.name] = val[i : i + 1] if isinstance(val, torch.Tensor) else val
        out.append(cls(**kwargs))
    return out


@dataclass(eq=False)
class _Live:
    """Executor-side state of one request: its committed KV, its pipeline and its output."""

    index: int
    request: GenerationRequest
    committed: SequenceKV
    pipe: RequestPipeline
    rng: torch.Generator | None
    key: int = 0  # coupled sampling: the request's noise key
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling


class PipelinedExecutor:
    """``PipelinedExecutor(model, schedule).generate(requests)``; ``model`` follows the
    ``LoopedReference`` contract (``pre``, ``core_step``, ``readout``, ``forward_depths``) and its
    ``depth`` must equal ``schedule.R``.

    ``batch_lanes=False`` runs every lane in its own call (one row, the exact shapes of ordinary
    one-token decoding) instead of one call per depth group. ``check_capacity`` asserts that no
    request ever has more lanes than ``schedule.max_lanes``. ``share_prefill`` lets requests with
    the same prompt share one prefill; it is turned off for a model whose prefill is random (Raven's
    ``state_init="like-init"``), where requests must draw their own initial states.
    """

    def __init__(
        self,
        model,
        schedule: LoopSpecSchedule,
        *,
        batch_lanes: bool = True,
        check_capacity: bool = True,
        share_prefill: bool = True,
        coupled: bool = False,
    ):
        if model.depth != schedule.R:
            raise ValueError(f"schedule R={schedule.R} does not match the model's depth {model.depth}")
        self.model, self.schedule = model, schedule
        self.batch_lanes, self.check_capacity, self.coupled = batch_lanes, check_capacity, coupled
        random_prefill = getattr(getattr(model, "config", None), "state_init", None) == "like-init"
        self.share_prefill = share_prefill and not random_prefill

    # -- public API -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest]) -> RunOutput:
        """Decode all requests together; sampling requests use ``torch.Generator().manual_seed(seed)``
        (seed None: the request's index)."""
        if not requests:
            raise ValueError("generate() needs at least one request")
        sch = self.schedule
        live: list[_Live] = []
        for i, req in enumerate(requests):
            rng = None
            if not req.sampling.greedy:
                rng = torch.Generator().manual_seed(req.seed if req.seed is not None else i)
            pipe = RequestPipeline(sch, req.sampling, rng, coupled=self.coupled)
            live.append(_Live(i, req, SequenceKV(), pipe, rng, key=req.seed if req.seed is not None else i))
        prefills: dict[tuple[int, ...], tuple[SequenceKV, torch.Tensor]] = {}
        for st in live:
            self._prefill(st, prefills)
        effective_batch: list[int] = []
        while any(st.finish_reason is None for st in live):
            effective_batch.append(self._step([st for st in live if st.finish_reason is None]))
        outputs = [RequestOutput(st.tokens, st.finish_reason, st.pipe.stats) for st in live]
        merged = outputs[0].stats
        for o in outputs[1:]:
            merged = merged.merge(o.stats)
        merged.recurrent_steps = len(effective_batch)
        return RunOutput(outputs, effective_batch, merged)

    def generate_one(self, prompt: list[int], max_new_tokens: int, **kwargs) -> RequestOutput:
        return self.generate([GenerationRequest(list(prompt), max_new_tokens, **kwargs)]).outputs[0]

    # -- prefill --------------------------------------------------------------------------------------------
    def _prefill(self, st: _Live, cache: dict) -> None:
        """Ordinary forward of the prompt filling every bank (coda banks at d1, d2, R). Requests with
        the same prompt share one prefill: the KV is forked (tensors are never written in place)."""
        key = tuple(st.request.prompt)
        if key not in cache or not self.share_prefill:
            kv = SequenceKV()
            logits = self.model.forward_depths(torch.tensor(key), kv, depths=self.schedule.readout_depths)
            cache[key] = (kv, logits[self.schedule.R][-1])
        kv, last = cache[key]
        st.committed = kv.fork()
        if self.coupled:
            token = int(_coupled([st.params], last.unsqueeze(0), [st.key], [len(st.request.prompt)])[0])
        else:
            token = sample_token(last, st.params, st.rng)
        if self._emit(st, token):
            return
        lane = st.pipe.start(token, len(st.request.prompt))
        self._run_pre([(st, lane)])

    def _emit(self, st: _Live, token: int) -> bool:
        """Append a committed token; True when the request is finished."""
        st.tokens.append(token)
        if token in st.request.eos_ids():
            st.finish_reason = "eos"
        elif len(st.tokens) >= st.request.max_new_tokens:
            st.finish_reason = "length"
        return st.finish_reason is not None

    def _is_final(self, st: _Live):
        """``is_final`` for the pipeline: would committing this token end the request?"""
        eos = st.request.eos_ids()
        return lambda token: token in eos or len(st.tokens) + 1 >= st.request.max_new_tokens

    # -- one recurrent step ---------------------------------------------------------------------------------
    def _views(self, items: list[tuple[_Live, Lane]]) -> LaneBatchKV:
        return LaneBatchKV(
            [LaneKV(st.committed, [a.kv for a in st.pipe.tree.ancestors(lane)], lane.kv) for st, lane in items]
        )

    def _groups(self, items: list[tuple[_Live, Lane]], key) -> list[tuple[int, list[tuple[_Live, Lane]]]]:
        by: dict[int, list] = defaultdict(list)
        for item in items:
            by[key(item)].append(item)
        out = []
        for k in sorted(by):
            group = by[k]
            if self.batch_lanes:
                out.append((k, group))
            else:
                out.extend((k, [item]) for item in group)
        return out

    def _run_pre(self, items: list[tuple[_Live, Lane]]) -> None:
        for _, group in self._groups(items, key=lambda it: 0):
            tokens = torch.tensor([lane.token for _, lane in group])
            positions = torch.tensor([lane.position for _, lane in group])
            state = self.model.pre(tokens, positions, self._views(group))
            for (_, lane), s in zip(group, _split_state(state, len(group))):
                lane.state, lane.depth = s, 0

    def _step(self, active: list[_Live]) -> int:
        sch = self.schedule
        items = [(st, lane) for st in active for lane in st.pipe.lanes]
        for st in active:
            if self.check_capacity and len(st.pipe.tree) > sch.max_lanes:
                raise AssertionError(f"request {st.index}: {len(st.pipe.tree)} lanes exceed the bound {sch.max_lanes}")
        # 1. core step: depth t -> t+1 for every lane
        for t, group in self._groups(items, key=lambda it: it[1].depth):
            positions = torch.tensor([lane.position for _, lane in group])
            state = self.model.core_step(_cat_states([lane.state for _, lane in group]), t, positions, self._views(group))
            for (_, lane), s in zip(group, _split_state(state, len(group))):
                lane.state, lane.depth = s, t + 1
        # 2. readouts at d1, d2, R (grouped by depth, then by sampling parameters)
        read: dict[int, dict[int, object]] = defaultdict(dict)  # request index -> lane id -> value
        readers = [(st, lane) for st in active for lane in st.pipe.readers()]
        for r, group in self._groups(readers, key=lambda it: it[1].depth):
            positions = torch.tensor([lane.position for _, lane in group])
            out = self.model.readout(_cat_states([lane.state for _, lane in group]), r, positions, self._views(group))
            if self.coupled:  # a token per row: its noisy argmax at the position it proposes for
                tokens = _coupled([st.params for st, _ in group], out, [st.key for st, _ in group],
                                  [lane.position + 1 for _, lane in group])
                for (st, lane), token in zip(group, tokens.tolist()):
                    read[st.index][lane.id] = token
                continue
            by_params: dict[SamplingParams, list[int]] = defaultdict(list)
            for i, (st, _) in enumerate(group):
                by_params[st.params].append(i)
            for params, rows in by_params.items():
                for i, value in zip(rows, readout_values(out[rows], params)):
                    st, lane = group[i]
                    read[st.index][lane.id] = value
        # 3. per request: proposals, then verification of the root (the pipeline decides)
        spawned: list[tuple[_Live, Lane]] = []
        for st in active:
            step = st.pipe.advance(read[st.index], self._is_final(st))
            if step.commit is not None:
                self._commit(st, step.commit.lane, step.commit.verdict.token)
            spawned.extend((st, lane) for lane in step.spawned)
        # 4. pre-layers for the new lanes (children and restarts)
        if spawned:
            self._run_pre(spawned)
        return len(items)

    def _commit(self, st: _Live, root: Lane, token: int) -> None:
        """The root's position joins the committed KV; its verified token is emitted."""
        for bank, (k, v) in root.kv.items():
            if st.committed.length(bank) != root.position:
                raise AssertionError(f"bank {bank}: committed length {st.committed.length(bank)} != {root.position}")
            st.committed.append(bank, k, v)
        root.kv, root.state = {}, None
        self._emit(st, token)


@torch.no_grad()
def full_depth_generate(model, prompt: list[int], max_new_tokens: int, pick, eos_ids=frozenset()) -> list[int]:
    """Ordinary decoding read at depth R (``model.depth``) for every token, with a KV cache.

    Written against ``forward_depths`` rather than ``model.generate`` so that a family whose
    ordinary forward reads another depth (Ouro's early-exit config) is still compared with p_R.
    """
    kv = SequenceKV()
    logits = model.forward_depths(torch.tensor(list(prompt)), kv)[model.depth][-1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = pick(logits)
        out.append(tok)
        if tok in eos_ids:
            break
        logits = model.forward_depths(torch.tensor([tok]), kv)[model.depth][-1]
    return out


def baseline_generate(model, request: GenerationRequest, rng: torch.Generator | None = None) -> list[int]:
    """Ordinary full-depth decoding of ``request`` with the same sampling filter: the output (greedy)
    or the distribution (sampling) LoopSpec must reproduce. ``rng`` defaults to a generator seeded
    with the request's seed."""
    params = request.sampling
    if rng is None and not params.greedy:
        rng = torch.Generator().manual_seed(request.seed or 0)
    return full_depth_generate(
        model, request.prompt, request.max_new_tokens, lambda lg: sample_token(lg, params, rng), request.eos_ids()
    )


def _coupled(params: list[SamplingParams], logits: torch.Tensor, keys: list[int], positions: list[int],
             dtype=torch.float64) -> torch.Tensor:
    """``noise.coupled_sample`` of rows with their own parameters (by default in float64, as
    ``filter_probs``; an engine's lane calls sample in float32)."""
    return coupled_sample(logits.to(dtype), torch.tensor([p.temperature for p in params], dtype=dtype),
                          torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params], dtype=dtype),
                          torch.tensor(keys), torch.tensor(positions))


def coupled_generate(model, request: GenerationRequest, key: int, dtype=torch.float64) -> list[int]:
    """Ordinary full-depth decoding of ``request`` in which the token of every position is its noisy
    argmax with noise ``key`` (``noise.coupled_sample``): what coupled LoopSpec must reproduce token
    for token."""
    position = [len(request.prompt)]

    def pick(logits: torch.Tensor) -> int:
        token = int(_coupled([request.sampling], logits.unsqueeze(0), [key], position, dtype)[0])
        position[0] += 1
        return token

    return full_depth_generate(model, request.prompt, request.max_new_tokens, pick, request.eos_ids())
