"""The front door: ``--speculative-config '{"method": "loopspec", ...}'`` turned into what vLLM 0.26 runs.

vLLM validates ``SpeculativeConfig.method`` against a fixed list and forbids unknown keys, so the
plugin translates a loopspec config before vLLM sees it (``vllm_patches.install_loopspec``):

* ``speculative_config`` becomes vLLM's own ``custom_class`` method with our runner component as
  the "proposer" and ``num_speculative_tokens = max(ceil(R / d1), step_tokens)``: the longest lane
  chain a request can hand back as drafts (so the scheduler gives its positions KV slots), and at
  least ``step_tokens``, so that a lane step may commit that many tokens a request before vLLM's
  scheduler runs again (``runner.step_drafts`` pads a short chain);
* the LoopSpec knobs travel in ``additional_config["loopspec"]``, which reaches every process;
* the scheduler is ``LoopSpecScheduler`` (vLLM's scheduler with LoopSpec's acceptance counters in
  the spec-decode metrics); where async scheduling is possible, ``LoopSpecAsyncScheduler`` (plain
  steps pipelined, lanes-mode steps as barriers; ``vllm_patches.loopspec.install_loopspec_async``). The user's
  ``--async-scheduling`` / ``--no-async-scheduling`` becomes the knob ``async`` ("on" / "off"; unset:
  "auto").

Knobs: ``d1`` (first-proposal depth), ``d2`` (second-proposal depth; omitted: single-proposal
mode), ``gate`` (the paper's gate on the second proposal, default true), ``late`` (a list of
depths between d2 and R, multiples of d1, default none: greedy requests re-propose the argmax there
when it is new, see ``schedule.py``), ``max_lanes`` (cap on
one request's live lanes; default: the schedule's bound, at most 64), ``lanes`` (``"auto"``, the
default: each decode step runs lanes or plain decoding, whichever has measured faster at that batch
size, see ``policy.py``; ``"on"``: always lanes), ``lane_graphs`` (``"auto"``, the default: lane calls
replay CUDA graphs wherever vLLM uses graphs -- a CUDA device, no ``enforce_eager``, one GPU per
model; ``"on"``: always (without CUDA, the same padded calls run eagerly); ``"off"``: eager lane calls,
see ``lane_graphs.py``), ``lane_attention`` (``"auto"``, the default: the Triton kernel in
``kernels/lane_attention.py`` on a CUDA device, the PyTorch lane attention elsewhere; ``"triton"``,
``"torch"``: that one; measured on the H200 in benchmarks/RESULTS.md), ``lane_overlap``
(``"auto"``, the default: in a lane step of greedy requests, each recurrent step is enqueued on the
likely outcome of the one before, so the GPU computes while the host decides; ``"off"``: one after
the other, see ``runner.py``), ``sampling`` (``"auto"``, the default, = ``"coupled"``: a sampled
request's readouts are its noisy argmaxes, drawn on the GPU with one noise per position that every
depth shares, and it is verified as greedy is, see ``noise.py``; ``"cascade"``: the paper's cascade on
filtered distributions, decided on the host), ``step_tokens`` (default 16: each request is scheduled at least this
many drafts a step, its lane chain padded to it, so a lane step may commit up to 1 + that many tokens
a request before vLLM's scheduler runs again, and above 16 may run that many recurrent steps while no
request waits to join, see ``runner.py``; 0: the chain alone; at most 256). Both depths omitted:
the family default (Ouro 1:2 at R=4; Raven the paper's 2:8 at R=32, scaled to the deployed R).

Compilation: a LoopSpec engine on one CUDA GPU skips ``torch.compile`` unless the user sets it
(``fast_start_compilation``); its CUDA graph sizes are ``graph_capture_sizes``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_loop import get_logger
from vllm_loop.loopspec.policy import LANES_MODES
from vllm_loop.loopspec.schedule import LoopSpecSchedule

logger = get_logger(__name__)

# ``step_tokens``: drafts a request is scheduled per engine step, at least. A lane step commits at most
# 1 + its drafts a request (vLLM's contract), and each engine step around it costs ~1-2 ms on the H200
# (the scheduler, the step's output, the lane pipeline's drain): with Ouro's 4-lane chains alone a lane
# step ended after ~4 recurrent steps of ~1.9 ms (benchmarks/RESULTS.md). 16: 1.05-1.18x
# the chain alone at every concurrency 1-128 on the H200 (benchmarks/RESULTS.md); 0: the chain alone.
STEP_TOKENS = 16
MAX_STEP_TOKENS = 256

METHOD = "loopspec"
KEYS = ("method", "d1", "d2", "gate", "late", "max_lanes", "lanes", "lane_graphs", "lane_attention", "lane_overlap",
        "step_tokens", "sampling")
LANE_GRAPHS = ("auto", "on", "off")
LANE_OVERLAP = ("auto", "off")
LANE_ATTENTION = ("auto", "torch", "triton")
SAMPLING = ("auto", "coupled", "cascade")
DEFAULT_LANE_CAP = 64
RUNNER = "vllm_loop.loopspec.runner.LoopSpecRunner"
SCHEDULER = "vllm_loop.loopspec.scheduler.LoopSpecScheduler"
ASYNC_SCHEDULER = "vllm_loop.loopspec.scheduler.LoopSpecAsyncScheduler"

# Looped architectures -> (family, the config field holding the loop count R).
LOOPED = {"OuroForCausalLM": ("ouro", "total_ut_steps"), "RavenForCausalLM": ("raven", "mean_recurrence")}


def is_loopspec(config) -> bool:
    return isinstance(config, dict) and config.get("method") == METHOD


def model_depth(hf_config, architectures) -> tuple[str, int]:
    """(family, R) of a looped model; a clear error for a model that does not loop."""
    for arch in architectures or ():
        if arch in LOOPED:
            family, field = LOOPED[arch]
            return family, int(getattr(hf_config, field))
    raise ValueError(
        f"speculative_config method 'loopspec' needs a looped model (architectures {', '.join(LOOPED)}); "
        f"this model is {', '.join(architectures or ['unknown'])}, which does not loop"
    )


def default_depths(family: str, R: int) -> tuple[int, int | None]:
    """Ouro: 1:2 (the paper's best at R=4). Raven: the paper's 2:8 at R=32, scaled to R (d2 a
    multiple of d1 below R; single-proposal when R leaves no room for a second depth)."""
    if family == "ouro":
        d1, d2 = 1, 2
    else:
        d1 = max(1, round(2 * R / 32))
        d2 = max(2 * d1, d1 * round(8 * R / 32 / d1))
    if d1 >= R:
        d1 = max(1, R - 1)
    if d2 >= R:
        d2 = None if 2 * d1 >= R else 2 * d1
    return d1, d2


def _field(config: dict, key: str):
    value = config.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"speculative_config (loopspec): {key}={value!r} is invalid: {key} must be an integer")
    return value


def _choice(config: dict, key: str, allowed: tuple[str, ...]) -> str:
    value = config.get(key, "auto")
    if value not in allowed:
        raise ValueError(f"speculative_config (loopspec): {key}={value!r} is invalid; allowed values: "
                         f"{', '.join(map(repr, allowed))}")
    return value


def build_schedule(config: dict, family: str, R: int) -> tuple[LoopSpecSchedule, int]:
    """Validated (schedule, max_lanes) from a user's loopspec config; errors name the key and the rule."""
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config (loopspec): unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed keys: {', '.join(KEYS)}"
        )
    d1, d2 = _field(config, "d1"), _field(config, "d2")
    if d1 is None and d2 is not None:
        raise ValueError("speculative_config (loopspec): d2 needs d1 (the first-proposal depth)")
    if d1 is None:
        d1, d2 = default_depths(family, R)
    gate = config.get("gate", True)
    if not isinstance(gate, bool):
        raise ValueError(f"speculative_config (loopspec): gate={gate!r} is invalid: gate must be true or false")
    try:
        schedule = LoopSpecSchedule(R, d1, d2, gate, config.get("late", ()))
    except ValueError as e:
        raise ValueError(f"speculative_config (loopspec), model loop count R={R}: {e}") from None
    cap = _field(config, "max_lanes")
    if cap is not None and cap < 1:
        raise ValueError(f"speculative_config (loopspec): max_lanes={cap} is invalid: max_lanes must be >= 1")
    max_lanes = cap if cap is not None else min(schedule.max_lanes, DEFAULT_LANE_CAP)
    return schedule, max_lanes


def translate(config: dict, model_config) -> tuple[dict, dict]:
    """A user's loopspec config -> (vLLM speculative config dict, additional_config["loopspec"])."""
    family, R = model_depth(model_config.hf_config, getattr(model_config, "architectures", None))
    hf = model_config.hf_config
    if family == "ouro" and (getattr(hf, "early_exit_step", None) is not None
                             or (getattr(hf, "early_exit_threshold", None) or 1.0) < 1.0):
        raise ValueError(
            "speculative_config (loopspec) verifies every token at full depth R, but this deployment reads "
            "another depth (early_exit_step / early_exit_threshold < 1): remove those overrides or loopspec")
    schedule, max_lanes = build_schedule(config, family, R)
    lanes = _choice(config, "lanes", LANES_MODES)
    graphs = _choice(config, "lane_graphs", LANE_GRAPHS)
    attention = _choice(config, "lane_attention", LANE_ATTENTION)
    overlap = _choice(config, "lane_overlap", LANE_OVERLAP)
    sampling = _choice(config, "sampling", SAMPLING)
    step_tokens = _field(config, "step_tokens")
    step_tokens = STEP_TOKENS if step_tokens is None else step_tokens
    if not 0 <= step_tokens <= MAX_STEP_TOKENS:
        raise ValueError(f"speculative_config (loopspec): step_tokens={step_tokens} is invalid: allowed 0 (the lane "
                         f"chain alone) to {MAX_STEP_TOKENS}")
    knobs = {"R": R, "d1": schedule.d1, "d2": schedule.d2, "gate": schedule.gate, "late": list(schedule.late),
             "max_lanes": max_lanes,
             "lanes": lanes, "lane_graphs": graphs, "lane_attention": attention, "lane_overlap": overlap,
             "step_tokens": step_tokens, "sampling": sampling}
    spec = {"method": "custom_class", "model": RUNNER,
            "num_speculative_tokens": max(math.ceil(R / schedule.d1), step_tokens)}
    logger.info("LoopSpec on: %s, lanes per request <= %d, lanes %s (%s)", schedule.describe(), max_lanes, lanes,
                "defaults for " + family if config.get("d1") is None else "from --speculative-config")
    return spec, knobs


def fast_start_compilation(compilation, *, enforce_eager: bool, optimization_level_set: bool, cuda: bool,
                           gpus: int) -> dict | None:
    """The compilation fields a LoopSpec engine gets by default, or None to leave vLLM's.

    Why: a LoopSpec engine decodes in lane steps, which replay the plugin's own CUDA graphs
    (``lane_graphs.py``) and never call vLLM's forward; that forward serves prefills, lane-verifying
    steps and the lanes policy's plain steps. Compiling it (Dynamo tracing the T x L unrolled layers,
    then Inductor) was most of a cold start and bought no measurable speed at 1-4 requests (H200,
    benchmarks/RESULTS.md); plain steps without it run the sandwich seams as the
    plugin's kernels (``layers._fused_seam``). vLLM's full CUDA graphs replay every step it can
    (``cudagraph_mode`` FULL: prefills and mixed steps too, up to ``graph_capture_sizes``; decode steps in
    their own graphs, ``vllm_patches.graphs.install_loopspec_decode_graphs``): without them an eager prefill
    was 63-79 ms of a one-request first token (an H100, benchmarks/RESULTS.md; in graphs Ouro-1.4B's first
    token 92.5 -> 13.9 ms, Huginn-0125's 142.6 -> 51.0 ms). Only where the user set
    neither (no ``mode`` / ``cudagraph_mode`` in ``--compilation-config``, no ``-O``, no
    ``--enforce-eager``), on CUDA, with one GPU (lane graphs need it; tensor parallel keeps vLLM's
    default, not measured)."""
    unset = compilation.mode is None and compilation.cudagraph_mode is None
    if not unset or enforce_eager or optimization_level_set or not cuda or gpus != 1:
        return None
    from vllm.config import CompilationMode
    from vllm.config.compilation import CUDAGraphMode

    return {"mode": CompilationMode.NONE, "cudagraph_mode": CUDAGraphMode.FULL}


def graph_capture_sizes(sizes: list[int] | None, largest: int | None, *, mixed: bool, max_num_seqs: int,
                        max_model_len: int) -> tuple[list[int] | None, int | None]:
    """``(cudagraph_capture_sizes, max_cudagraph_capture_size)`` for a LoopSpec engine, from the user's
    (None: unset), before vLLM fills in the list.

    Decode-only full graphs: vLLM sizes its largest graph for draft-model steps,
    ``min(max_num_seqs x (1 + num_speculative_tokens) x 2, 512)`` (512 for LoopSpec at any batch, its
    drafts being 16+), where a LoopSpec engine's plain steps have one token a request; so, unless the
    user set sizes, a vanilla engine's ``min(max_num_seqs x 2, 512)``: at 128 sequences 35 graphs
    instead of 51, and 6-7 s less start-up on the H200 (benchmarks/RESULTS.md).

    Mixed-step full graphs (``cudagraph_mode`` FULL): prefills run in them, so vLLM's own 512 unless
    the user set sizes; and none longer than ``max_model_len``. vLLM 0.26's warm-up before capturing a
    mixed-step graph of n tokens gives every dummy request a context of n tokens (``_dummy_run``:
    ``seq_lens = max_query_len``; vLLM issue #53658, fix #53671 unmerged), and its Triton attention
    loads block-table entries unmasked, so for n > ``max_model_len`` the last rows read ids from past
    the end of the block table (``benchmarks/probes/dummy_run_overread.py``). Vanilla engines over-read too and
    did not crash, LoopSpec engines did (an H100, benchmarks/RESULTS.md: all four cases where n >
    ``max_model_len``, none of five where not); what makes the garbage ids fatal only in LoopSpec
    engines is not found (not their packed KV layout alone: a vanilla engine given it started). A real step never has a request longer than ``max_model_len``; batches larger than the
    largest graph run eagerly."""
    if not mixed:
        if sizes is None and largest is None:
            largest = min(max_num_seqs * 2, 512)  # vLLM's cap, 512
        return sizes, largest
    if sizes is not None:
        sizes = [n for n in sizes if n <= max_model_len] or [min(max_model_len, 512)]
        return sizes, (max(sizes) if largest is not None else None)
    return None, min(512 if largest is None else largest, max_model_len)


@dataclass(frozen=True)
class Knobs:
    """An engine's LoopSpec settings as ``translate`` validated them: the one typed, read-only view of
    ``additional_config["loopspec"]`` (a plain dict there, because vLLM hashes and ships that config to
    every process), and the one place a missing key gets its default."""

    R: int
    d1: int = 1
    d2: int | None = None
    gate: bool = True
    late: tuple[int, ...] = ()
    max_lanes: int = DEFAULT_LANE_CAP
    lanes: str = "auto"
    lane_graphs: str = "auto"
    lane_attention: str = "auto"
    lane_overlap: str = "auto"
    step_tokens: int = STEP_TOKENS
    sampling: str = "auto"
    async_scheduling: str = "auto"  # the dict's "async": what the user asked of --async-scheduling

    @classmethod
    def of(cls, d: dict) -> Knobs:
        fields = {k: v for k, v in d.items() if k != "async"} | {"late": tuple(d.get("late", ()))}
        if "async" in d:
            fields["async_scheduling"] = d["async"]
        return cls(**fields)

    @property
    def schedule(self) -> LoopSpecSchedule:
        return LoopSpecSchedule(self.R, self.d1, self.d2, self.gate, self.late)

    @property
    def coupled(self) -> bool:
        """Sampled requests by coupled sampling (``noise.py``), not the cascade."""
        return self.sampling in ("auto", "coupled")


def knobs(vllm_config) -> Knobs | None:
    """The engine's LoopSpec settings, or None when LoopSpec is off."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get("loopspec") if isinstance(extra, dict) else None
    return None if raw is None else Knobs.of(raw)


def schedule_of(vllm_config) -> LoopSpecSchedule | None:
    k = knobs(vllm_config)
    return None if k is None else k.schedule


def readout_depths(vllm_config) -> tuple[int, ...]:
    """Depths the model must read out (and keep coda KV for) when LoopSpec is on; () when off."""
    s = schedule_of(vllm_config)
    return () if s is None else s.readout_depths


def flag(d1: int, d2: int | None, gate: bool = True, late=()) -> str:
    """The ``vllm serve`` flag for a schedule (printed by the tuner)."""
    import json

    cfg = {"method": METHOD, "d1": d1} | ({} if d2 is None else {"d2": d2}) | ({} if gate else {"gate": False}) \
        | ({"late": list(late)} if late else {})
    return f"--speculative-config '{json.dumps(cfg)}'"
