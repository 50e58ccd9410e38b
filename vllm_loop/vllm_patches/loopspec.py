"""LoopSpec at vLLM's seams: the ``{"method": "loopspec"}`` front door, async scheduling for LoopSpec
engines, the packed KV layout the lanes read, the model runner's lane steps and coupled sampling on
vLLM's own path, and (on the CPU) a KV layout the lanes can read. The algorithm and the adapter live
in ``vllm_loop/loopspec/``; this module only connects them to vLLM."""

from __future__ import annotations

from vllm_loop import get_logger
from vllm_loop.vllm_patches import patch

logger = get_logger(__name__)


def install() -> None:
    install_loopspec_front_door()
    install_loopspec_async()
    install_loopspec_packed_kv()
    install_loopspec_runner()
    install_loopspec_coupled_sampling()
    install_cpu_loopspec_kv_layout()


def install_cpu_loopspec_kv_layout() -> None:
    """vLLM 0.26 on CPU picks an attention ISA per layer and per metadata builder
    (``cpu_attn._get_attn_isa``), and the ISA fixes how the KV cache is laid out inside a block: "amx"
    (bf16, a block size that is a multiple of 32, a CPU with AMX tiles) stores K in tiles that are no
    strided view, while LoopSpec's lanes read the cache in place through views
    (``lane_kv.PagedBanks``: its first decode step failed with "cannot read the KV layout").
    LoopSpec engines get "vec" instead, what the same CPU without AMX runs (K transposed per head, a
    layout the lanes read); other engines keep vLLM's choice. Both objects that carry the ISA are
    set, since the kernels that write and read the cache and the scheduling metadata must agree. CPU only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.config import get_current_vllm_config_or_none
    from vllm.v1.attention.backends import cpu_attn

    from vllm_loop.loopspec.config import knobs

    impl, builder = cpu_attn.CPUAttentionBackendImpl, cpu_attn.CPUAttentionMetadataBuilder
    impl_init, builder_init = impl.__init__, builder.__init__

    def readable(obj, vllm_config) -> None:
        if obj.isa == "amx" and knobs(vllm_config) is not None:
            obj.isa = "vec"

    def init_impl(self, *args, **kwargs):
        impl_init(self, *args, **kwargs)
        readable(self, get_current_vllm_config_or_none())  # the one vLLM's __init__ just read

    def init_builder(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        builder_init(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        readable(self, vllm_config)

    patch(impl, "__init__", "loopspec.cpu_kv_layout", init_impl)
    patch(builder, "__init__", "loopspec.cpu_kv_layout", init_builder)


def install_loopspec_front_door() -> None:
    """``{"method": "loopspec", ...}`` is not a method vLLM's ``SpeculativeConfig`` accepts (a
    validated Literal, unknown keys forbidden): translate it where ``EngineArgs`` builds that
    config (process 0, before validation) into vLLM's ``custom_class`` method plus our knobs in
    ``additional_config``, and our scheduler (``loopspec/config.py``)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        import os
        import tempfile
        import uuid

        from vllm_loop.loopspec import config as loopspec_config
        from vllm_loop.loopspec.scheduler import METRICS_ENV

        if loopspec_config.is_loopspec(self.speculative_config):
            spec, knobs = loopspec_config.translate(self.speculative_config, target_model_config)
            if self.scheduler_cls not in (None, loopspec_config.SCHEDULER):
                raise ValueError(f"speculative_config (loopspec) needs its own scheduler; --scheduler-cls "
                                 f"{self.scheduler_cls!r} cannot be combined with it")
            # vLLM refuses async scheduling for custom_class drafters: validate synchronous, and let
            # install_loopspec_async turn it on once the config is built (the user's flag is a knob)
            knobs["async"] = {None: "auto", True: "on", False: "off"}[self.async_scheduling]
            self.speculative_config = spec
            self.additional_config = {**(self.additional_config or {}), "loopspec": knobs}
            self.scheduler_cls = loopspec_config.SCHEDULER
            self.async_scheduling = False
            _fast_start(self, target_parallel_config)
            # Where the engine core publishes LoopSpec counters for this front end's /metrics (an
            # environment variable, not a config field: it must not change vLLM's compile-cache hash).
            os.environ[METRICS_ENV] = os.path.join(tempfile.gettempdir(), f"vllm-loop-{uuid.uuid4().hex[:12]}")
        return original(self, target_model_config, target_parallel_config)

    patch(EngineArgs, "create_speculative_config", "loopspec.front_door", create_speculative_config)


def _fast_start(args, parallel_config) -> None:
    """A LoopSpec engine without torch.compile unless the user asked for it
    (``loopspec_config.fast_start_compilation`` says why). Set on ``EngineArgs.compilation_config``,
    which ``create_engine_config`` reads after it built the speculative config."""
    import copy

    from vllm.config.vllm import OptimizationLevel
    from vllm.platforms import current_platform

    from vllm_loop.loopspec.config import fast_start_compilation

    fields = fast_start_compilation(
        args.compilation_config, enforce_eager=bool(args.enforce_eager),
        optimization_level_set=args.optimization_level != OptimizationLevel.O2, cuda=current_platform.is_cuda(),
        gpus=parallel_config.tensor_parallel_size * parallel_config.pipeline_parallel_size)
    if fields is None:
        return
    args.compilation_config = copy.deepcopy(args.compilation_config)  # not a shared default's
    for name, value in fields.items():
        setattr(args.compilation_config, name, value)
    logger.info("LoopSpec: vLLM's forward runs without torch.compile, replayed from its full CUDA graphs (prefills "
                "too; lane steps replay the plugin's own graphs): a start without Dynamo / Inductor. To compile "
                "it anyway: --compilation-config '{\"mode\": 3}'")


def async_blocker(vllm_config) -> str | None:
    """Why this LoopSpec deployment cannot schedule asynchronously, or None when it can."""
    from vllm.platforms import current_platform
    from vllm.v1.executor.abstract import Executor

    parallel = vllm_config.parallel_config
    if not current_platform.is_cuda():
        return "it needs a CUDA device"
    if vllm_config.use_v2_model_runner:
        return "vLLM's V2 model runner is not supported"
    if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
        return "it needs pipeline_parallel_size 1 and data_parallel_size 1"
    if vllm_config.kv_transfer_config is not None or vllm_config.ec_transfer_config is not None:
        return "KV / encoder-cache transfer is not supported"
    executor = Executor.get_class(vllm_config)
    if not executor.supports_async_scheduling():
        return f"the {executor.__name__} does not support it (use the mp or uni executor)"
    return None


def install_loopspec_async() -> None:
    """Async scheduling for LoopSpec engines (vLLM 0.26 turns it off for ``custom_class`` drafters,
    whose drafts it cannot keep on the GPU). Plain steps then pipeline as in vanilla vLLM -- a
    synchronous engine decodes at 0.75-0.81x of an async one on the H200 (benchmarks/RESULTS.md) --
    and lanes-mode steps run as barriers (``LoopSpecAsyncScheduler``, ``install_loopspec_runner``).

    The flag is flipped after ``EngineArgs.create_engine_config``, through which every entry point
    (``LLM``, ``vllm serve``, ``AsyncLLM``) builds the config that is then shipped to the engine core
    and the workers as it is. ``--async-scheduling`` (knob "on") asks for it, ``--no-async-scheduling``
    ("off") refuses it; by default ("auto") it is on where the lanes policy is "auto" (with
    ``lanes: "on"`` every step is a barrier, and async would only add its bookkeeping)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_loop.loopspec.config import ASYNC_SCHEDULER, knobs

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        k = knobs(config)
        asked = None if k is None else k.async_scheduling
        if asked is None or asked == "off" or (asked == "auto" and k.lanes != "auto"):
            return config
        reason = async_blocker(config)
        if reason is not None:
            if asked == "on" and current_platform.is_cuda():  # elsewhere vLLM itself drops the flag
                raise ValueError(f"--async-scheduling with speculative_config (loopspec): {reason}; "
                                 "allowed: --no-async-scheduling")
            return config
        config.scheduler_config.async_scheduling = True
        config.scheduler_config.scheduler_cls = ASYNC_SCHEDULER
        config.model_config.disable_cascade_attn = True  # as vLLM does for async + spec decoding
        config.parallel_config.disable_nccl_for_dp_synchronization = True
        logger.info("LoopSpec: async scheduling on (plain steps pipelined, lanes-mode steps as barriers)")
        return config

    patch(EngineArgs, "create_engine_config", "loopspec.async", create_engine_config)
    _revalidate_synchronously()
    _no_idle_sleep_after_barriers()


def _revalidate_synchronously() -> None:
    """The engine-core process runs ``VllmConfig.__post_init__`` again after its handshake
    (``EngineCoreProc._perform_handshakes``), which would refuse the flipped flag for custom_class:
    validate with the flag off there too, and put it back."""
    from vllm.config import VllmConfig

    from vllm_loop.loopspec.config import ASYNC_SCHEDULER

    original = VllmConfig.__post_init__

    def post_init(self, *args, **kwargs):
        scheduler = self.scheduler_config
        flipped = scheduler is not None and scheduler.async_scheduling and scheduler.scheduler_cls == ASYNC_SCHEDULER
        if flipped:
            scheduler.async_scheduling = False
        try:
            return original(self, *args, **kwargs)
        finally:
            if flipped:
                scheduler.async_scheduling = True

    patch(VllmConfig, "__post_init__", "loopspec.revalidate_synchronously", post_init)


def _no_idle_sleep_after_barriers() -> None:
    """``EngineCoreProc._process_engine_step`` sleeps 1 ms after a step that executed nothing while
    requests remain (for KV-transfer threads). Under ``LoopSpecAsyncScheduler`` every lanes-mode step
    is such a step -- the scheduler holds while the barrier runs, and the engine only collects it --
    a 1 ms wait per lane step (estimated ~8 % of one at concurrency 1; not measured apart). Report
    those collecting steps as executed (the flag
    only feeds that sleep, the DP dummy batch and, in sync engines only, ``post_step``)."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.step_with_batch_queue

    def step_with_batch_queue(self):
        if not hasattr(self.scheduler, "held_for_barrier"):
            return original(self)
        self.scheduler.held_for_barrier = False
        outputs, executed = original(self)
        return outputs, executed or self.scheduler.held_for_barrier

    patch(EngineCore, "step_with_batch_queue", "loopspec.no_idle_sleep_after_barriers", step_with_batch_queue)


def install_loopspec_packed_kv() -> None:
    """Lanes of every depth read their banks through one view of the KV cache, which needs all
    banks of a block in one allocation at a uniform page stride: vLLM's packed layout, which it
    only chooses for a few model types (``_use_packed_kv_cache_config`` in the engine core's
    ``kv_cache_utils``, looked up as a module global). Turn it on for LoopSpec deployments."""
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils._use_packed_kv_cache_config

    def use_packed(vllm_config, kv_cache_groups):
        from vllm_loop.loopspec.config import knobs

        return original(vllm_config, kv_cache_groups) or (knobs(vllm_config) is not None and len(kv_cache_groups) == 1)

    patch(kv_cache_utils, "_use_packed_kv_cache_config", "loopspec.packed_kv", use_packed)


def loopspec_runner(runner):
    drafter = getattr(runner, "drafter", None)
    return drafter if getattr(drafter, "loopspec", False) else None


def _with_census(out, lanes):
    """An output of an empty step (no tokens scheduled: it only tells the workers which requests
    finished), with the runner's counters on a copy (vLLM's empty output is one shared object): the
    step's lanes given back reach the live-lanes gauge although no request runs any more."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if out is not EMPTY_MODEL_RUNNER_OUTPUT:
        return out
    import copy

    out = copy.copy(out)
    out.loopspec = lanes.take_counters()
    return out


def install_loopspec_runner() -> None:
    """Decode steps of LoopSpec requests run lanes (``loopspec/runner.py``) instead of vLLM's
    forward. A lane step's output is what ``execute_model`` returns (``EngineCore.step`` then skips
    ``sample_tokens``); under async scheduling, whose batch queue always calls ``sample_tokens`` and
    uses only its result, ``sample_tokens`` hands it back. After vLLM's own steps the lanes follow the
    committed tokens.

    Under async scheduling (``install_loopspec_async``) vLLM's runner leaves each step's sampled
    tokens on the GPU for the next step's inputs. Its plain steps keep that (they pipeline). A
    lanes-mode step is a barrier: a lane step never samples through vLLM, and a lanes-mode step on
    vLLM's path runs vLLM's *synchronous* sampling (``use_async_scheduling`` off for that call: vLLM's
    async bookkeeping takes one token per row, and the lanes need the real tokens on the host to
    follow them); either way vLLM's async carry-over is then reset (``runner.reset_async_carry``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_loop.loopspec.runner import reset_async_carry

    execute_model, sample_tokens = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens

    def execute_model_hook(self, scheduler_output, *args, **kwargs):
        lanes = loopspec_runner(self)
        if lanes is None:
            return execute_model(self, scheduler_output, *args, **kwargs)
        out = lanes.execute_model(self, scheduler_output)
        if out is not None:  # a lane step
            out.loopspec = lanes.take_counters()
            if not self.vllm_config.scheduler_config.async_scheduling:
                return out  # EngineCore.step then skips sample_tokens (one executor round trip less)
            self._vllm_loop_lane_output = out  # the batch queue reads sample_tokens' result only
            return None
        out = execute_model(self, scheduler_output, *args, **kwargs)
        # None: vLLM samples in sample_tokens next, where the lanes follow its tokens
        self._vllm_loop_scheduled = scheduler_output if out is None else None
        return _with_census(out, lanes)

    def sample_tokens_hook(self, grammar_output):
        lanes = loopspec_runner(self)
        if lanes is None:
            return sample_tokens(self, grammar_output)
        out = getattr(self, "_vllm_loop_lane_output", None)
        if out is not None:
            self._vllm_loop_lane_output = None
            if self.use_async_scheduling:
                reset_async_carry(self)
            return out
        scheduled, self._vllm_loop_scheduled = getattr(self, "_vllm_loop_scheduled", None), None
        if scheduled is None:
            return _with_census(sample_tokens(self, grammar_output), lanes)
        if self.use_async_scheduling and not getattr(scheduled, "loopspec_lanes", True):
            out = sample_tokens(self, grammar_output)  # a pipelined plain step (AsyncGPUModelRunnerOutput)
            lanes.plain_step(scheduled.num_scheduled_tokens)
            getattr(out, "_model_runner_output", out).loopspec = lanes.take_counters()
            return out
        barrier = self.use_async_scheduling
        self.use_async_scheduling = False
        try:
            out = sample_tokens(self, grammar_output)
        finally:
            self.use_async_scheduling = barrier
        lanes.after_standard_step(self, scheduled, out)
        out.loopspec = lanes.take_counters()
        if barrier:
            reset_async_carry(self)
        return out

    patch(GPUModelRunner, "execute_model", "loopspec.runner", execute_model_hook)
    patch(GPUModelRunner, "sample_tokens", "loopspec.runner", sample_tokens_hook)


def install_loopspec_coupled_sampling() -> None:
    """Coupled sampling on vLLM's own path: before ``GPUModelRunner._sample`` (vLLM's sampler, or its
    rejection sampler when the step verifies drafts), a LoopSpec runner turns each logits row of a
    coupled request into the one-hot of that request's noisy argmax (``LoopSpecRunner.couple_logits``),
    so every token of a coupled request -- the prefill's, a plain step's, a lane chain's verification --
    is the draw of its seed and position, as on the lanes."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._sample

    def sample(self, logits, spec_decode_metadata, *args, **kwargs):
        lanes = loopspec_runner(self)
        if lanes is not None and lanes.coupled and logits is not None:
            lanes.couple_logits(self, logits, spec_decode_metadata)
        return original(self, logits, spec_decode_metadata, *args, **kwargs)

    patch(GPUModelRunner, "_sample", "loopspec.coupled_sampling", sample)
