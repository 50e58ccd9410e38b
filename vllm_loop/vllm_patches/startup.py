"""Start-up of the plugin's engines: its config checks, its model classes inspected in-process, and
the start-up of its compiled models (the saved artifact off the critical path, the collector held
off while compiling, Inductor's compile workers started early). Applies to the plugin's own model
classes only; every other model keeps vLLM's start-up."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import warnings
from contextlib import contextmanager

from vllm_loop import get_logger
from vllm_loop.vllm_patches import patch

logger = get_logger(__name__)


def _ours(module_name: str) -> bool:
    """Is this one of the plugin's own modules (the only code the hooks below change vLLM's ways for)?"""
    return module_name.startswith("vllm_loop.")


def install() -> None:
    install_config_verifiers()
    install_inprocess_model_inspection()
    install_compiled_model_startup()


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
    and vLLM from scratch: 21-23 s of a cold engine start on the H200 host (benchmarks/RESULTS.md).
    This plugin's model modules create no CUDA state at import, so their classes are
    inspected in this process instead (and cached as vLLM caches them); every other model keeps vLLM's
    subprocess."""
    from unittest import mock

    from vllm.model_executor.models import registry

    original = registry._LazyRegisteredModel.inspect_model_cls

    def inspect_model_cls(self):
        if not _ours(self.module_name):
            return original(self)
        with mock.patch.object(registry, "_run_in_subprocess", lambda fn: fn()):
            return original(self)

    patch(registry._LazyRegisteredModel, "inspect_model_cls", "startup.inprocess_inspection", inspect_model_cls)


# Escape hatches, as environment variables (they must not enter vLLM's compile-cache hash):
AOT_SAVE_ENV = "VLLM_LOOP_AOT_SAVE"  # "fork" (default): save the compiled forward from a child process; "inline"
GC_FREEZE_ENV = "VLLM_LOOP_GC_FREEZE"  # "1" (default): no full collections while compiling; "0": vLLM's collector
COMPILE_THREADS_ENV = "VLLM_LOOP_COMPILE_THREADS"  # Inductor's Triton-compile processes (CUDA); "1": vLLM's one
AOT_SAVE_TIMEOUT_S = 900  # a save that has not finished by then ends its child (it would only hold memory)


def install_compiled_model_startup() -> None:
    """A looped model's forward unrolls T x L layers, and on the H200 host a cold engine start spends
    seconds after Dynamo and Inductor that only a looped model's size makes long (benchmarks/RESULTS.md):

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

    def support_torch_compile(cls, *args, **kwargs):
        cls = original(cls, *args, **kwargs)
        if _ours(cls.__module__):
            patch(cls, "__call__", "startup.compiled_on_first_call", _compiled_on_first_call(cls.__call__))
            patch(cls, "save_aot_compiled_function", "startup.saved_in_background",
                  _saved_in_background(cls.save_aot_compiled_function))
        return cls

    try_load = decorators._try_load_aot_compiled_fn

    def try_load_aot_compiled_fn(model, path):
        loaded = try_load(model, path)
        if loaded is None and _ours(type(model).__module__):
            _start_compile_workers(model)  # no saved forward: this start compiles
        return loaded

    patch(decorators, "_support_torch_compile", "startup.compiled_model", support_torch_compile)
    patch(decorators, "_try_load_aot_compiled_fn", "startup.compiled_model", try_load_aot_compiled_fn)


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
