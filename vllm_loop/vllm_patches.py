"""Every place vllm-loop reaches into vLLM internals, in one module, checked against the version.

Public extension points (``ModelRegistry``, ``AutoConfig.register``) are used from plugin.py; what
is here touches private vLLM objects that a vLLM upgrade may move, so it is pinned to 0.26.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import warnings
from contextlib import contextmanager

from vllm_loop import get_logger
from vllm_loop.unsupported import SUPPORTED_VLLM

logger = get_logger(__name__)


def _check_version() -> bool:
    """True on the vLLM these hooks are written for. On any other, ``plugin.register`` maps the
    plugin's architectures to a model that refuses to start (``vllm_loop/unsupported.py``)."""
    import vllm

    return vllm.__version__.startswith(SUPPORTED_VLLM)


def _ours(module_name: str) -> bool:
    """Is this one of the plugin's own modules (the only code the hooks below change vLLM's ways for)?"""
    return module_name.startswith("vllm_loop.")


def install_config_verifiers() -> None:
    """Run our start-up checks in the front end: vLLM looks up per-architecture config hooks in the
    private dict ``MODELS_CONFIG_MAP`` (vllm/model_executor/models/config.py) while building
    ``VllmConfig``; there is no public registration for them."""
    from vllm.model_executor.models import config as model_configs

    from vllm_loop.configs.verify import VERIFIERS

    model_configs.MODELS_CONFIG_MAP.update(VERIFIERS)


def install_inprocess_model_inspection() -> None:
    """The first time vLLM meets a lazily registered model module (``"module:Class"``) it inspects the
    class in a fresh Python subprocess (``_LazyRegisteredModel.inspect_model_cls`` ->
    ``_run_in_subprocess``), so that importing a model cannot initialize CUDA in the front end; the
    result is cached in ``VLLM_CACHE_ROOT/modelinfos`` for later starts. That subprocess imports torch
    and vLLM from scratch: 21-23 s of a cold engine start on the H200 host (benchmarks/RESULTS.md,
    eighteenth run). This plugin's model modules create no CUDA state at import, so their classes are
    inspected in this process instead (and cached as vLLM caches them); every other model keeps vLLM's
    subprocess."""
    from unittest.mock import patch

    from vllm.model_executor.models import registry

    original = registry._LazyRegisteredModel.inspect_model_cls
    if getattr(original, "_vllm_loop", False):
        return

    def inspect_model_cls(self):
        if not _ours(self.module_name):
            return original(self)
        with patch.object(registry, "_run_in_subprocess", lambda fn: fn()):
            return original(self)

    inspect_model_cls._vllm_loop = True
    registry._LazyRegisteredModel.inspect_model_cls = inspect_model_cls


def install() -> None:
    if not _check_version():
        return
    install_config_verifiers()
    install_inprocess_model_inspection()
    install_latent_frontend()
    install_latent_runner()
    install_latent_config()
    install_latent_outputs()
    install_loopspec()
    install_compiled_model_startup()
    install_server_exit_status()
    install_prompt_vocab_check()
    install_cpu_seeded_chunked_prefill()


# --- start-up of the plugin's compiled models ----------------------------------------------------------

# Escape hatches, as environment variables (they must not enter vLLM's compile-cache hash):
AOT_SAVE_ENV = "VLLM_LOOP_AOT_SAVE"  # "fork" (default): save the compiled forward from a child process; "inline"
GC_FREEZE_ENV = "VLLM_LOOP_GC_FREEZE"  # "1" (default): no full collections while compiling; "0": vLLM's collector
COMPILE_THREADS_ENV = "VLLM_LOOP_COMPILE_THREADS"  # Inductor's Triton-compile processes (CUDA); "1": vLLM's one
AOT_SAVE_TIMEOUT_S = 900  # a save that has not finished by then ends its child (it would only hold memory)


def install_compiled_model_startup() -> None:
    """A looped model's forward unrolls T x L layers, and on the H200 host a cold engine start spends
    seconds after Dynamo and Inductor that only a looped model's size makes long (benchmarks/RESULTS.md,
    eighteenth and nineteenth runs):

    * **the saved artifact**: with ``VLLM_USE_AOT_COMPILE`` (vLLM's default on torch >= 2.10) the
      decorated model's ``save_aot_compiled_function`` pickles the whole traced graph, in pure Python
      (dill), before the engine goes on: 10-21 s for Ouro-1.4B's 96 unrolled layers on the H200
      hosts, for later starts only. The plugin's models save it from a forked child process instead,
      which holds a copy-on-write image of the compiled function and writes the same file through
      vLLM's own temporary name and rename (a reader never sees half a file); the engine goes on. The
      child touches no CUDA state (the artifact holds meta tensors only), ends itself after
      ``AOT_SAVE_TIMEOUT_S``, and a failed save costs only the next start its warm cache. Ray
      workers save as vLLM does (forking them is untested).
    * **the collector**: the compile creates millions of long-lived objects (graphs, guards, fake
      tensors, compiled code) and each automatic full collection meanwhile walks the whole heap
      (0.4-0.6 s each there). While the forward compiles (or loads), the heap built so far is frozen
      and full collections are held off; afterwards one collection, and what survives is frozen too.
      (vLLM unfreezes and refreezes the heap itself around graph capture and at the end of start-up.)
    * **the kernels**: vLLM 0.26 has Inductor compile the forward's Triton kernels one after the other
      in the engine process (``TORCHINDUCTOR_COMPILE_THREADS=1``; ~20 builds of 0.25-0.45 s for
      Ouro). When no saved forward is found (the start compiles), Inductor's pool of compile processes
      is started while Dynamo traces, so that it is ready when Inductor needs it (``_start_compile_workers``).

    All apply to the plugin's own compiled classes only (``vllm_loop.*``); every other model keeps
    vLLM's start-up. ``VLLM_LOOP_AOT_SAVE=inline`` / ``VLLM_LOOP_GC_FREEZE=0`` /
    ``VLLM_LOOP_COMPILE_THREADS=1`` turn them off."""
    from vllm.compilation import decorators

    original = decorators._support_torch_compile
    if getattr(original, "_vllm_loop", False):
        return

    def support_torch_compile(cls, *args, **kwargs):
        cls = original(cls, *args, **kwargs)
        if _ours(cls.__module__) and not getattr(cls.__call__, "_vllm_loop", False):
            cls.__call__ = _compiled_on_first_call(cls.__call__)
            cls.save_aot_compiled_function = _saved_in_background(cls.save_aot_compiled_function)
        return cls

    try_load = decorators._try_load_aot_compiled_fn

    def try_load_aot_compiled_fn(model, path):
        loaded = try_load(model, path)
        if loaded is None and _ours(type(model).__module__):
            _start_compile_workers(model)  # no saved forward: this start compiles
        return loaded

    support_torch_compile._vllm_loop = try_load_aot_compiled_fn._vllm_loop = True
    decorators._support_torch_compile = support_torch_compile
    decorators._try_load_aot_compiled_fn = try_load_aot_compiled_fn


def _compiled_on_first_call(call):
    def __call__(self, *args, **kwargs):
        if getattr(self, "compiled", True) or getattr(self, "do_not_compile", True) or \
                getattr(self, "aot_compiled_fn", None) is not None:
            return call(self, *args, **kwargs)
        import torch

        if torch.compiler.is_compiling():
            return call(self, *args, **kwargs)
        with _compiling(self):  # this call compiles the forward (or loads it), then runs it once
            return call(self, *args, **kwargs)

    __call__._vllm_loop = True
    return __call__


@contextmanager
def _compiling(model):
    """Hold off full collections while the forward compiles (or loads)."""
    if os.environ.get(GC_FREEZE_ENV, "1") == "0":
        yield
        return
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()  # what start-up built so far (modules, weights) is long-lived
    gc.set_threshold(threshold[0], threshold[1], 1 << 30)  # young generations are still collected
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
        gc.freeze()  # the compiled forward is long-lived too


def _start_compile_workers(model) -> None:
    """Start Inductor's pool of Triton-compile processes (CUDA): ``VLLM_LOOP_COMPILE_THREADS`` of them,
    by default min(8, CPUs per visible GPU - 1). Started before Dynamo traces the unrolled forward,
    the processes have imported torch by the time Inductor compiles; Inductor uses the pool only once
    it is ready, and stops its processes when it has been idle a minute (``quiesce_async_compile_pool``)."""
    if getattr(model.vllm_config.device_config, "device_type", "cpu") != "cuda":
        return
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    default = min(8, cpus // max(1, torch.cuda.device_count()) - 1)
    n = int(os.environ.get(COMPILE_THREADS_ENV) or default)
    if n <= 1:
        return
    inductor_config.compile_threads = n
    AsyncCompile.warm_pool()
    AsyncCompile.use_process_pool()  # submits the pool's first job: its processes start now


def _saved_in_background(save):
    def save_aot_compiled_function(self):
        from vllm import envs

        config = getattr(self, "vllm_config", None)
        ray = config is not None and config.parallel_config.distributed_executor_backend == "ray"
        if (os.environ.get(AOT_SAVE_ENV, "fork") != "fork" or not hasattr(os, "fork") or envs.VLLM_DISABLE_COMPILE_CACHE
                or getattr(self, "was_aot_compile_fn_loaded_from_disk", False) or ray):
            return save(self)  # a Ray worker's own threads (its core worker) are not forked through: untested
        pid = _fork_and_run(lambda: save(self))
        threading.Thread(target=_wait_for_save, args=(pid, getattr(self, "_aot_compilation_path", None),
                                                      time.monotonic()), daemon=True, name="vllm-loop-aot-save").start()

    save_aot_compiled_function._vllm_loop = True
    return save_aot_compiled_function


def _fork_and_run(job) -> int:
    """Run ``job`` in a forked child (exit status 0 if it returned) and return the child's pid."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12: "multi-threaded ... fork()"
        pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        # only this thread lives on in the child: a lock another thread held at the fork stays held,
        # so a child stuck on one ends itself
        signal.alarm(AOT_SAVE_TIMEOUT_S)
        gc.freeze()  # the child's collections would touch (and copy) every page of the parent's heap
        job()
        status = 0
    finally:
        os._exit(status)  # no atexit handlers, no destructors of the parent's objects (CUDA, sockets)


def _wait_for_save(pid: int, path: str | None, started: float) -> None:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return
    seconds = time.monotonic() - started
    if os.waitstatus_to_exitcode(status) == 0 and path and os.path.exists(path):
        logger.info("compiled forward saved for later starts in %.1f s, off the start-up path (a child process)",
                    seconds)
    else:
        logger.warning("the compiled forward was not saved (child process status %s after %.1f s): the next "
                       "start compiles again", os.waitstatus_to_exitcode(status), seconds)


# --- the API server ----------------------------------------------------------------------------------


def install_server_exit_status() -> None:
    """``vllm serve`` exits with status 0 when its engine dies (a killed worker, a dead Ray actor): the
    watchdog in vllm/entrypoints/launcher.py stops uvicorn just as a requested shutdown does, so a
    supervisor (systemd, Kubernetes, Ray Serve) reads a crash as a clean stop. Exit 1 instead.

    ``serve_http`` returns the coroutine the caller awaits after the engine client is closed: vLLM's
    ``dummy_shutdown`` when uvicorn stopped by itself, ``server.shutdown()`` after a signal. Stopped by
    itself with the engine already errored = the engine died. Only in the API server process
    (api_server is imported there before plugins load; ``serve_http`` is looked up at call time)."""
    import sys

    api = sys.modules.get("vllm.entrypoints.openai.api_server")
    if api is None or getattr(api.serve_http, "_vllm_loop", False):
        return
    serve_http = api.serve_http

    async def serve_http_with_exit_status(app, *args, **kwargs):
        # read now: vLLM's lifespan handler deletes ``app.state`` when uvicorn stops, before
        # ``serve_http`` returns
        client = getattr(app.state, "engine_client", None)
        shutdown = await serve_http(app, *args, **kwargs)
        died = getattr(shutdown, "__name__", "") == "dummy_shutdown" and client is not None and client.errored

        async def finish():
            result = await shutdown
            if died:
                logger.error("the engine died while serving (see above); exiting with status 1")
                raise SystemExit(1)
            return result

        return finish()

    serve_http_with_exit_status._vllm_loop = True
    api.serve_http = serve_http_with_exit_status


# --- requests that would take an engine down --------------------------------------------------------


def install_prompt_vocab_check() -> None:
    """Upstream fix (vLLM 0.26; the check came with vllm-project/vllm#22471 and still admits ids up
    to max(tokenizer ids, ``tokenizer.vocab_size``, model vocab - 1)): a prompt token id equal to the
    tokenizer's ``vocab_size`` passes vLLM's check, and the embedding then raises ``IndexError`` in
    the engine core, which dies and takes the server down with it. For the plugin's models, whose
    embeddings have exactly ``vocab_size`` rows, a prompt id outside [0, vocab_size) is refused in the
    front end instead (a ``ValueError``: HTTP 400 from the API server). Other models keep vLLM's
    check; the hook can go once vLLM bounds prompt ids by the model's vocabulary."""
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_loop import plugin

    original = InputProcessor._validate_model_input
    if getattr(original, "_vllm_loop", False):
        return

    def validate_model_input(self, prompt_input, prompt_type, *args, **kwargs):
        archs = getattr(self.model_config, "architectures", None) or []
        ids = prompt_input.get("prompt_token_ids") if prompt_input.get("type") != "embeds" else None
        if ids and any(a in plugin.MODELS for a in archs):
            vocab = self.model_config.get_vocab_size()
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt: token id {bad} is out of vocabulary; allowed: token ids 0 to {vocab - 1} "
                                 f"(the model's vocab_size is {vocab})")
        return original(self, prompt_input, prompt_type, *args, **kwargs)

    validate_model_input._vllm_loop = True
    InputProcessor._validate_model_input = validate_model_input


def install_cpu_seeded_chunked_prefill() -> None:
    """Upstream fix (vLLM 0.26 on CPU, every model): a step that samples a token it then discards (a
    prefill chunk that does not end the prompt) rewinds the request's generator with
    ``set_offset(get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync`` -- the Philox offset of a
    CUDA generator. A CPU generator has no offset and raises ``RuntimeError: CPU Generator does not
    use offset``: a seeded request with a chunked prefill killed the engine. The same effect on the
    CPU: the generators of the rows to discard are saved before sampling and put back after it, so
    the discarded draw leaves the request's random stream as if it had not happened (as the rewind
    does on CUDA). Can go once vLLM's CPU runner stops rewinding CPU generators by offset."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync
    if getattr(bookkeeping, "_vllm_loop", False):
        return

    def sample_hook(self, *args, **kwargs):
        generators = self.input_batch.generators
        if generators:
            discard = self.discard_request_mask.np[: self.input_batch.num_reqs]
            self._vllm_loop_rewind = {int(i): generators[int(i)].get_state()
                                      for i in discard.nonzero()[0] if int(i) in generators}
        return sample(self, *args, **kwargs)

    def bookkeeping_hook(self, *args, **kwargs):
        saved, self._vllm_loop_rewind = getattr(self, "_vllm_loop_rewind", None), None
        if not saved:
            return bookkeeping(self, *args, **kwargs)
        generators = self.input_batch.generators
        held = {i: generators.pop(i) for i in saved if i in generators}  # vLLM's rewind skips them
        for i, gen in held.items():
            gen.set_state(saved[i])
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    sample_hook._vllm_loop_cpu_rewind = bookkeeping_hook._vllm_loop = True
    GPUModelRunner._sample = sample_hook
    GPUModelRunner._bookkeeping_sync = bookkeeping_hook


# --- latent reasoning (COCONUT, CODI, LOTUS) ---------------------------------------------------


def _latent_spec(model_config):
    from vllm_loop.latent.spec import LatentSpec

    return LatentSpec.from_config(model_config.hf_config)


def install_latent_frontend() -> None:
    """Check ``latent_budget`` and shape latent requests where vLLM turns a prompt into an engine
    request (``InputProcessor.process_inputs``, process 0): the one place that sees every request
    from ``LLM.generate`` and from the API server, and whose ``ValueError`` becomes an HTTP 400."""
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_loop.latent.frontend import prepare_request

    original = InputProcessor.process_inputs
    if getattr(original, "_vllm_loop", False):
        return

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        prepare_request(request, _latent_spec(self.model_config), self.model_config.max_model_len)
        return request

    process_inputs._vllm_loop = True
    InputProcessor.process_inputs = process_inputs


def _step_rows(runner, scheduler_output, driver):
    from vllm_loop.latent.driver import StepRow

    rows = []
    qsl = runner.query_start_loc.np
    for i, req_id in enumerate(runner.input_batch.req_ids[: runner.input_batch.num_reqs]):
        state = runner.requests[req_id]
        n = scheduler_output.num_scheduled_tokens[req_id]
        driver.track(req_id, state.sampling_params.extra_args, state.num_prompt_tokens)
        rows.append(StepRow(req_id, int(qsl[i]), state.num_computed_tokens, n,
                            state.num_computed_tokens + n >= state.num_tokens, len(state.output_token_ids)))
    return rows


def _driver(runner):
    """The runner's latent driver, or None when its model is not a latent model."""
    if not hasattr(runner, "_vllm_loop_driver"):
        from vllm_loop.latent.driver import LatentDriver

        model = runner.get_model()
        spec = getattr(model, "latent_spec", None)
        placeholder = None
        if spec is not None:
            codi = getattr(model, "codi", None) or {}
            placeholder = spec.latent_token_id if spec.latent_token_id is not None else codi.get("pad_token_id")
            placeholder = placeholder if placeholder is not None else spec.start_token_ids[-1]
        runner._vllm_loop_driver = LatentDriver(spec, placeholder) if spec is not None else None
    return runner._vllm_loop_driver


def install_latent_runner() -> None:
    """Drive latent requests from vLLM's V1 model runner (the CPU runner subclasses it; latent models
    are kept off Model Runner V2, see ``install_latent_config``). Three private seams:
    ``execute_model`` (the step's scheduler output, finished requests), ``_model_forward`` (fill the
    inject buffers before, store fed-back vectors after) and ``_sample`` (force the latent phase)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.execute_model, "_vllm_loop", False):
        return
    execute_model, model_forward, sample = (
        GPUModelRunner.execute_model, GPUModelRunner._model_forward, GPUModelRunner._sample)

    def execute_model_hook(self, scheduler_output, *args, **kwargs):
        driver = _driver(self)
        if driver is not None:
            driver.finish(scheduler_output.finished_req_ids)
            self._vllm_loop_step = scheduler_output
        return execute_model(self, scheduler_output, *args, **kwargs)

    def model_forward_hook(self, *args, **kwargs):
        driver, step = _driver(self), getattr(self, "_vllm_loop_step", None)
        if driver is None or step is None:
            return model_forward(self, *args, **kwargs)
        self._vllm_loop_step = None
        model = self.get_model()
        rows = _step_rows(self, step, driver)
        driver.before_forward(model, rows)
        out = model_forward(self, *args, **kwargs)
        driver.after_forward(model, out, rows)
        self._vllm_loop_rows = rows
        return out

    def sample_hook(self, logits, spec_decode_metadata):
        rows = getattr(self, "_vllm_loop_rows", None)
        if rows is not None and logits is not None:
            self._vllm_loop_rows = None
            _driver(self).adjust_logits(logits, rows)
        return sample(self, logits, spec_decode_metadata)

    for hook in (execute_model_hook, model_forward_hook, sample_hook):
        hook._vllm_loop = True
    GPUModelRunner.execute_model = execute_model_hook
    GPUModelRunner._model_forward = model_forward_hook
    GPUModelRunner._sample = sample_hook


def install_latent_config() -> None:
    """Latent models run on the V1 model runner (where the driver hooks live): report them as a
    feature Model Runner V2 does not support, which makes vLLM fall back to V1 as it does for other
    unsupported features."""
    from vllm.config import VllmConfig

    from vllm_loop.latent import LATENT_ARCHITECTURES

    original = VllmConfig._get_v2_model_runner_unsupported_features
    if getattr(original, "_vllm_loop", False):
        return

    def unsupported(self):
        found = original(self)
        archs = getattr(self.model_config, "architectures", None) or []
        if any(a in LATENT_ARCHITECTURES for a in archs):
            found.append("latent-reasoning models (vllm-loop)")
        return found

    unsupported._vllm_loop = True
    VllmConfig._get_v2_model_runner_unsupported_features = unsupported


def install_latent_outputs() -> None:
    """What the user receives from a feedback latent request (COCONUT, CODI): the answer only.

    The engine emits the forced latent phase (start, one placeholder per thought, end) as the
    request's first outputs; ``OutputProcessor`` (process 0, which serves ``LLM`` and the API
    server alike) turns engine outputs into ``RequestOutput``s. Before it detokenizes, checks stop
    strings or collects logprobs, the phase's tokens are moved from the output to the end of the
    request's prompt, so ``text`` / ``token_ids`` / ``logprobs`` / ``usage.completion_tokens`` are
    the answer, ``max_tokens`` / ``min_tokens`` / stop strings apply to the answer, and
    ``prompt_token_ids`` / ``usage.prompt_tokens`` hold prompt + latent phase -- the same shape a
    LOTUS request has (its phase is appended to the prompt up front). No output is emitted while
    only phase tokens have arrived (a stream starts with the first answer token)."""
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState
    from vllm.v1.outputs import LogprobsLists

    from vllm_loop.latent.frontend import PHASE_KEY

    if getattr(OutputProcessor.process_outputs, "_vllm_loop", False):
        return
    add_request, process_outputs, make_request_output = (
        OutputProcessor.add_request, OutputProcessor.process_outputs, RequestState.make_request_output)

    def add_request_hook(self, request, *args, **kwargs):
        add_request(self, request, *args, **kwargs)
        params = request.sampling_params
        state = self.request_states.get(request.request_id)
        phase = int(((params.extra_args or {}) if params is not None else {}).get(PHASE_KEY, 0))
        if state is None or phase <= 0 or getattr(state, "_vllm_loop_phase", None) is not None:
            return
        state._vllm_loop_phase = phase  # phase tokens still to come
        if state.max_tokens_param is not None:  # the user's max_tokens, for vLLM's request stats
            state.max_tokens_param -= phase
        detok = state.detokenizer
        if getattr(detok, "min_tokens", 0):  # stop strings count answer tokens
            detok.min_tokens = max(0, detok.min_tokens - phase)

    def process_outputs_hook(self, engine_core_outputs, *args, **kwargs):
        held = []
        for out in engine_core_outputs:
            state = self.request_states.get(out.request_id)
            left = getattr(state, "_vllm_loop_phase", 0)
            if not left:
                continue
            k = min(left, len(out.new_token_ids))
            if k:
                phase = list(out.new_token_ids[:k])
                out.new_token_ids = list(out.new_token_ids[k:])
                if out.new_logprobs is not None:
                    lp = out.new_logprobs
                    out.new_logprobs = LogprobsLists(lp.logprob_token_ids[k:], lp.logprobs[k:],
                                                     lp.sampled_token_ranks[k:], None)
                # a new list: n > 1 children share the request's prompt list
                state.prompt_token_ids = list(state.prompt_token_ids or []) + phase
                state.prompt_len = len(state.prompt_token_ids)
                prompt_logprobs = getattr(state.logprobs_processor, "prompt_logprobs", None)
                if prompt_logprobs is not None:
                    for _ in phase:
                        prompt_logprobs.append(None)
                state._vllm_loop_phase = left - k
            if not out.new_token_ids and out.finish_reason is None:
                state._vllm_loop_hold = True  # only phase tokens so far: nothing to show yet
                held.append(state)
        try:
            return process_outputs(self, engine_core_outputs, *args, **kwargs)
        finally:
            for state in held:
                state._vllm_loop_hold = False

    def make_request_output_hook(self, *args, **kwargs):
        if getattr(self, "_vllm_loop_hold", False):
            return None
        return make_request_output(self, *args, **kwargs)

    for hook in (add_request_hook, process_outputs_hook, make_request_output_hook):
        hook._vllm_loop = True
    OutputProcessor.add_request = add_request_hook
    OutputProcessor.process_outputs = process_outputs_hook
    RequestState.make_request_output = make_request_output_hook


# --- LoopSpec ----------------------------------------------------------------------------------------


def install_loopspec() -> None:
    install_loopspec_front_door()
    install_loopspec_async()
    install_loopspec_packed_kv()
    install_loopspec_runner()
    install_loopspec_decode_graphs()
    install_loopspec_warmup()
    install_loopspec_coupled_sampling()
    install_cpu_rejection_expand()
    install_cpu_seeded_sampling()
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
    if getattr(impl.__init__, "_vllm_loop", False):
        return
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

    init_impl._vllm_loop = init_builder._vllm_loop = True
    impl.__init__, builder.__init__ = init_impl, init_builder


def install_cpu_seeded_sampling() -> None:
    """vLLM 0.26 on CPU: ``TopKTopPSampler.forward_cpu`` ignores the per-request generators (a
    request's ``seed``) unless every row of the batch has one, and samples all rows from the global
    RNG. A seeded request's tokens then depend on what else shares its steps and on every other draw
    from the global RNG, e.g. the rejection sampler's, whose size follows the drafts of other
    requests (LoopSpec's lane chains). Batches with some seeded rows go to vLLM's own
    ``forward_native``, which honours them (as on the GPU); others are unchanged. CPU only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    original = TopKTopPSampler.forward_cpu
    if getattr(original, "_vllm_loop", False):
        return

    def forward_cpu(self, logits, generators, k, p):
        if generators and len(generators) != logits.shape[0]:
            return self.forward_native(logits, generators, k, p)
        return original(self, logits, generators, k, p)

    forward_cpu._vllm_loop = True
    TopKTopPSampler.forward_cpu = forward_cpu


def install_cpu_rejection_expand() -> None:
    """vLLM 0.26 on CPU: the rejection sampler spreads each request's temperature, top-k and top-p over
    its draft tokens with ``expand_batch_to_tokens``, whose CPU kernel
    (``cpu_triton_utils._expand_kernel_impl``) converts its output to int64 and fills the copy, so
    an int32 (top-k) or float (temperature, top-p) output is left uninitialised. A step that verifies
    drafts of a sampling request then sampled with garbage constraints (a crash in ``topk``, or a
    wrong distribution). LoopSpec's lane chains are such drafts. Same result as the GPU kernel, in
    PyTorch; CPU only (the Triton kernel is right)."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.sample.rejection_sampler as rejection

    if getattr(rejection.expand_batch_to_tokens, "_vllm_loop", False):
        return

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    expand_batch_to_tokens._vllm_loop = True
    rejection.expand_batch_to_tokens = expand_batch_to_tokens


def install_loopspec_front_door() -> None:
    """``{"method": "loopspec", ...}`` is not a method vLLM's ``SpeculativeConfig`` accepts (a
    validated Literal, unknown keys forbidden): translate it where ``EngineArgs`` builds that
    config (process 0, before validation) into vLLM's ``custom_class`` method plus our knobs in
    ``additional_config``, and our scheduler (``loopspec/config.py``)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_vllm_loop", False):
        return

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

    create_speculative_config._vllm_loop = True
    EngineArgs.create_speculative_config = create_speculative_config


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
    if getattr(original, "_vllm_loop", False):
        return

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        k = knobs(config)
        asked = None if k is None else k.get("async", "auto")
        if asked is None or asked == "off" or (asked == "auto" and k["lanes"] != "auto"):
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

    create_engine_config._vllm_loop = True
    EngineArgs.create_engine_config = create_engine_config
    _revalidate_synchronously()
    _no_idle_sleep_after_barriers()


def _revalidate_synchronously() -> None:
    """The engine-core process runs ``VllmConfig.__post_init__`` again after its handshake
    (``EngineCoreProc._perform_handshakes``), which would refuse the flipped flag for custom_class:
    validate with the flag off there too, and put it back."""
    from vllm.config import VllmConfig

    from vllm_loop.loopspec.config import ASYNC_SCHEDULER

    original = VllmConfig.__post_init__
    if getattr(original, "_vllm_loop", False):
        return

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

    post_init._vllm_loop = True
    VllmConfig.__post_init__ = post_init


def _no_idle_sleep_after_barriers() -> None:
    """``EngineCoreProc._process_engine_step`` sleeps 1 ms after a step that executed nothing while
    requests remain (for KV-transfer threads). Under ``LoopSpecAsyncScheduler`` every lanes-mode step
    is such a step -- the scheduler holds while the barrier runs, and the engine only collects it --
    a 1 ms wait per lane step (estimated ~8 % of one at concurrency 1; not measured apart). Report
    those collecting steps as executed (the flag
    only feeds that sleep, the DP dummy batch and, in sync engines only, ``post_step``)."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.step_with_batch_queue
    if getattr(original, "_vllm_loop", False):
        return

    def step_with_batch_queue(self):
        if not hasattr(self.scheduler, "held_for_barrier"):
            return original(self)
        self.scheduler.held_for_barrier = False
        outputs, executed = original(self)
        return outputs, executed or self.scheduler.held_for_barrier

    step_with_batch_queue._vllm_loop = True
    EngineCore.step_with_batch_queue = step_with_batch_queue


def install_loopspec_packed_kv() -> None:
    """Lanes of every depth read their banks through one view of the KV cache, which needs all
    banks of a block in one allocation at a uniform page stride: vLLM's packed layout, which it
    only chooses for a few model types (``_use_packed_kv_cache_config`` in the engine core's
    ``kv_cache_utils``, looked up as a module global). Turn it on for LoopSpec deployments."""
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils._use_packed_kv_cache_config
    if getattr(original, "_vllm_loop", False):
        return

    def use_packed(vllm_config, kv_cache_groups):
        from vllm_loop.loopspec.config import knobs

        return original(vllm_config, kv_cache_groups) or (knobs(vllm_config) is not None and len(kv_cache_groups) == 1)

    use_packed._vllm_loop = True
    kv_cache_utils._use_packed_kv_cache_config = use_packed


def _loopspec_runner(runner):
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
    if getattr(sample_tokens, "_vllm_loop", False):
        return

    def execute_model_hook(self, scheduler_output, *args, **kwargs):
        lanes = _loopspec_runner(self)
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
        lanes = _loopspec_runner(self)
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

    for hook in (execute_model_hook, sample_tokens_hook):
        hook._vllm_loop = True
    GPUModelRunner.execute_model = execute_model_hook
    GPUModelRunner.sample_tokens = sample_tokens_hook


def install_loopspec_coupled_sampling() -> None:
    """Coupled sampling on vLLM's own path: before ``GPUModelRunner._sample`` (vLLM's sampler, or its
    rejection sampler when the step verifies drafts), a LoopSpec runner turns each logits row of a
    coupled request into the one-hot of that request's noisy argmax (``LoopSpecRunner.couple_logits``),
    so every token of a coupled request -- the prefill's, a plain step's, a lane chain's verification --
    is the draw of its seed and position, as on the lanes."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._sample
    if getattr(original, "_vllm_loop_coupled", False):
        return

    def sample(self, logits, spec_decode_metadata, *args, **kwargs):
        lanes = _loopspec_runner(self)
        if lanes is not None and lanes.coupled and logits is not None:
            lanes.couple_logits(self, logits, spec_decode_metadata)
        return original(self, logits, spec_decode_metadata, *args, **kwargs)

    sample._vllm_loop_coupled = True
    GPUModelRunner._sample = sample


def install_loopspec_warmup() -> None:
    """No compilation while serving: vLLM warms its kernels up at start-up and then watches for
    Triton compilations (``vllm/utils/jit_monitor.py``), but a LoopSpec engine launches kernels its
    warm-up never met -- the lane calls' (``kernels/``), in every row bucket, and vLLM's rejection
    sampler at the draft lengths and greedy / random mixes that verifying lane chains brings -- and
    each one's first launch compiled it mid-stream (a 2 s inter-token stall under ``vllm bench
    serve``). Right after vLLM warms its sampler (``Worker.compile_or_warm_up_model`` ->
    ``GPUModelRunner._dummy_sampler_run``, the first call with a KV cache; the memory profile calls
    it before there is one), the lanes capture every lane-graph bucket (``LoopSpecRunner.warm_up``),
    the rejection sampler runs on dummy drafts of each kind (``_warm_rejection_sampler``) and the
    slot-mapping kernel runs once (``_warm_slot_mapping``)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._dummy_sampler_run
    if getattr(original, "_vllm_loop", False):
        return

    def dummy_sampler_run(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        lanes = _loopspec_runner(self)
        if lanes is not None and self.kv_caches and not getattr(lanes, "warmed_up", False):
            lanes.warmed_up = True
            lanes.warm_up(self)
            _warm_rejection_sampler(self, lanes.num_spec_tokens)
            _warm_slot_mapping(self)
        return out

    dummy_sampler_run._vllm_loop = True
    GPUModelRunner._dummy_sampler_run = dummy_sampler_run


def _warm_slot_mapping(runner) -> None:
    """vLLM's V1 runner computes each step's KV slot mapping with a Triton kernel
    (``BlockTable.compute_slot_mapping``) that its dummy runs never launch, so the first request
    compiled it mid-stream (seen in a LoopSpec server's log under ``vllm bench serve``). One launch on
    the runner's own block table compiles it for every later step (its token counts are not
    specialized on); it writes only the slot mapping, which every step writes afresh. CUDA only."""
    if runner.device.type != "cuda":
        return
    import torch

    dev = runner.device
    with torch.inference_mode():
        runner.input_batch.block_table.compute_slot_mapping(
            1, torch.tensor([0, 1], dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int64, device=dev))
    torch.cuda.synchronize()


def _warm_rejection_sampler(runner, max_drafts: int, *, cuda_only: bool = True) -> None:
    """Run vLLM's rejection sampler once for each kind of call a LoopSpec engine makes, so that each
    Triton kernel it launches compiles now: all greedy, all random (top-p, seeded or not) and mixed
    rows; 1, a few and 16 requests with 1, a few and 16 drafts each (Triton specializes an integer
    argument on being 1 or a multiple of 16). CUDA only: vLLM's CPU build runs no Triton here."""
    if cuda_only and runner.device.type != "cuda":
        return
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    vocab = runner.model_config.get_vocab_size()
    max_reqs = runner.scheduler_config.max_num_seqs
    dev = runner.device

    def metadata(n: int, kind: str) -> SamplingMetadata:
        full = lambda v: torch.full((n,), v, device=dev, dtype=torch.float32)  # noqa: E731
        temperature = full(0.0) if kind == "greedy" else full(0.8)
        if kind == "mixed":
            temperature[::2] = 0.0
        return SamplingMetadata(
            temperature=temperature, all_greedy=kind == "greedy", all_random=kind in ("random", "seeded"),
            top_p=None if kind == "greedy" else full(0.7), top_k=None,
            generators={0: torch.Generator(device=dev).manual_seed(0)} if kind == "seeded" else {},
            max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=full(0.0),
            presence_penalties=full(0.0), repetition_penalties=full(1.0), output_token_ids=[[] for _ in range(n)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
            spec_token_ids=[[] for _ in range(n)])

    with torch.inference_mode():
        for n in sorted({min(k, max_reqs) for k in (1, 3, 16)}):
            for drafts in sorted({min(k, max_drafts) for k in (1, 3, 16)}):
                spec = SpecDecodeMetadata.make_dummy([[0] * drafts for _ in range(n)], dev)
                logits = torch.randn(n * (drafts + 1), vocab, device=dev, dtype=runner.model_config.dtype)
                for kind in ("greedy", "random", "seeded", "mixed"):
                    runner.rejection_sampler(spec, None, logits.clone(), metadata(n, kind))
    if dev.type == "cuda":
        torch.cuda.synchronize()


def install_loopspec_decode_graphs() -> None:
    """vLLM captures its full CUDA graphs for decode steps of exactly 1 + num_speculative_tokens
    tokens per request (``uniform_decode_query_len``), the shape of a draft-model engine's steps. A
    LoopSpec engine never runs that shape through vLLM's forward (lane steps bypass it; steps that
    verify lane chains have a prefill in them), but it does run decode steps of 1 token per request:
    the lanes policy's plain steps and requests the lanes do not serve. Those fell to piecewise graphs
    (attention outside the graph, once per bank), which made a plain step cost ~2x a vanilla
    engine's on the H200 (benchmarks/RESULTS.md). So a LoopSpec runner declares 1-token decode
    uniform before vLLM builds its graph keys and capture sizes (``_check_and_update_cudagraph_mode``
    of vLLM 0.26's ``GPUModelRunner``, and the runner's ``CudagraphDispatcher``); its graph sizes are
    ``loopspec_config.graph_capture_sizes``'s (``VllmConfig._set_cudagraph_sizes``).

    Under ``cudagraph_mode`` FULL (full graphs for mixed steps too: prefills graphed), vLLM keys every
    graph as a mixed step, so a plain decode step replays a graph captured for a prefill of as many
    tokens: 14 % slower plain steps at 128 requests (an H100, thirty-ninth run). A LoopSpec engine
    also captures the decode graphs FULL_DECODE_ONLY would and sends 1-token decode steps to them
    (``add_decode_graph_keys``), as FULL_AND_PIECEWISE does with its piecewise half; vLLM 0.26 has no
    mode for full graphs on both sides."""
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_loop.loopspec.config import graph_capture_sizes, knobs

    original = GPUModelRunner._check_and_update_cudagraph_mode
    if getattr(original, "_vllm_loop", False):
        return
    set_sizes = VllmConfig._set_cudagraph_sizes

    def set_cudagraph_sizes(self):
        cc = self.compilation_config
        if knobs(self) is not None:
            cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = graph_capture_sizes(
                cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size, mixed=cc.cudagraph_mode == CUDAGraphMode.FULL,
                max_num_seqs=self.scheduler_config.max_num_seqs, max_model_len=self.model_config.max_model_len)
        return set_sizes(self)

    def check_and_update_cudagraph_mode(self, *args, **kwargs):
        lanes = _loopspec_runner(self) is not None
        if lanes:
            self.uniform_decode_query_len = 1
            self.cudagraph_dispatcher.uniform_decode_query_len = 1
        out = original(self, *args, **kwargs)
        if lanes and self.cudagraph_dispatcher.cudagraph_mode == CUDAGraphMode.FULL:
            add_decode_graph_keys(self.cudagraph_dispatcher)
        return out

    check_and_update_cudagraph_mode._vllm_loop = set_cudagraph_sizes._vllm_loop = True
    GPUModelRunner._check_and_update_cudagraph_mode = check_and_update_cudagraph_mode
    VllmConfig._set_cudagraph_sizes = set_cudagraph_sizes


def add_decode_graph_keys(dispatcher) -> None:
    """Add FULL_DECODE_ONLY's keys (1-token decode steps up to ``max_num_seqs`` requests, as vLLM 0.26's
    ``CudagraphDispatcher.initialize_cudagraph_keys`` adds them for a separate decode routine) to a
    dispatcher in ``cudagraph_mode`` FULL, and send decode steps to them: this dispatcher's ``dispatch``
    only, so other engines' dispatchers stay vLLM's (``install_loopspec_decode_graphs`` says why)."""
    from dataclasses import replace
    from itertools import product

    from vllm.config.compilation import CUDAGraphMode

    max_num_seqs = dispatcher.vllm_config.scheduler_config.max_num_seqs
    sizes = [n for n in dispatcher.compilation_config.cudagraph_capture_sizes if n <= max_num_seqs]
    for n, loras in product(sizes, dispatcher._get_lora_cases()):
        dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, dispatcher._create_padded_batch_descriptor(n, True, loras > 0, loras))
    dispatch, full_keys = dispatcher.dispatch, dispatcher.cudagraph_keys[CUDAGraphMode.FULL]

    def dispatch_decode_apart(num_tokens, uniform_decode=False, *args, **kwargs):
        mode, desc = dispatch(num_tokens, uniform_decode, *args, **kwargs)
        if mode == CUDAGraphMode.FULL and uniform_decode:
            decode = replace(desc, uniform=True)  # at 1 token a request, num_reqs is the mixed key's
            if decode in full_keys:
                desc = decode
        return mode, desc

    dispatcher.dispatch = dispatch_decode_apart
