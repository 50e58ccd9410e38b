"""Start-up of the plugin's compiled models (``vllm_patches.startup.install_compiled_model_startup``): the
compiled forward saved from a forked child process, no full collections while it compiles, and both
(with the compile pool's hook) confined to the plugin's own classes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from vllm import envs  # noqa: F401  (imported by the save hook; here, so its import is not timed below)

from vllm_loop.vllm_patches import startup as vllm_patches

CLASSES = """
import json
from vllm_loop import plugin
plugin.register()
from vllm_loop.models.ouro import OuroModel
from vllm_loop.models.raven import RavenModel
from vllm.model_executor.models.llama import LlamaModel
from vllm.compilation import decorators
from vllm_loop.vllm_patches import installed
assert installed(decorators, "_try_load_aot_compiled_fn") == ("startup.compiled_model",)
def ours(cls):
    return [installed(cls, "save_aot_compiled_function") == ("startup.saved_in_background",),
            installed(cls, "__call__") == ("startup.compiled_on_first_call",)]
print("RESULT" + json.dumps({c.__name__: ours(c) for c in (OuroModel, RavenModel, LlamaModel)}))
"""


@pytest.mark.slow
def test_only_the_plugins_compiled_classes_are_changed():
    res = subprocess.run([sys.executable, "-c", CLASSES], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    assert out == {"OuroModel": [True, True], "RavenModel": [True, True], "LlamaModel": [False, False]}


class _Compiled:
    """What ``save_aot_compiled_function`` reads of vLLM's compiled model."""

    def __init__(self, path: str):
        self._aot_compilation_path = path
        self.was_aot_compile_fn_loaded_from_disk = False


def _saver(pause: float = 0.0, fail: bool = False):
    def save(self):  # vLLM's: write a temporary file, then rename it (here: the writer's pid)
        time.sleep(pause)
        if fail:
            raise RuntimeError("no space left")
        tmp = f"{self._aot_compilation_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, self._aot_compilation_path)

    return save


def _join_saver_threads() -> None:
    for thread in threading.enumerate():
        if thread.name == "vllm-loop-aot-save":
            thread.join(timeout=60)


@pytest.fixture
def warnings_logged(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(vllm_patches.logger, "warning", lambda msg, *args: seen.append(msg % args))
    monkeypatch.delenv(vllm_patches.AOT_SAVE_ENV, raising=False)
    monkeypatch.setenv(vllm_patches.GC_FREEZE_ENV, "0")  # this process's heap stays as it is
    return seen


def test_the_compiled_forward_is_saved_by_a_child_process(tmp_path, warnings_logged):
    path = tmp_path / "model"
    save = vllm_patches._saved_in_background(_saver(pause=1.0))
    t = time.monotonic()
    save(_Compiled(str(path)))
    assert time.monotonic() - t < 0.5  # the caller does not wait for the save
    assert not path.exists()
    _join_saver_threads()
    assert int(path.read_text()) != os.getpid()  # written (and renamed) by the child
    assert warnings_logged == []


def test_inline_save_when_asked(tmp_path, warnings_logged, monkeypatch):
    monkeypatch.setenv(vllm_patches.AOT_SAVE_ENV, "inline")
    path = tmp_path / "model"
    vllm_patches._saved_in_background(_saver())(_Compiled(str(path)))
    assert int(path.read_text()) == os.getpid()


def test_ray_workers_save_inline(tmp_path, warnings_logged):
    from types import SimpleNamespace

    path = tmp_path / "model"
    compiled = _Compiled(str(path))
    compiled.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="ray"))
    vllm_patches._saved_in_background(_saver())(compiled)
    assert int(path.read_text()) == os.getpid()


def test_a_failed_save_is_reported(tmp_path, warnings_logged):
    path = tmp_path / "model"
    vllm_patches._saved_in_background(_saver(fail=True))(_Compiled(str(path)))
    _join_saver_threads()
    assert not path.exists()
    assert len(warnings_logged) == 1 and "not saved" in warnings_logged[0] and "status 1" in warnings_logged[0]


def test_a_stuck_save_ends_itself(tmp_path, warnings_logged, monkeypatch):
    monkeypatch.setattr(vllm_patches, "AOT_SAVE_TIMEOUT_S", 1)
    path = tmp_path / "model"
    t = time.monotonic()
    vllm_patches._saved_in_background(_saver(pause=30))(_Compiled(str(path)))
    _join_saver_threads()
    assert time.monotonic() - t < 20 and not path.exists()
    assert len(warnings_logged) == 1 and "not saved" in warnings_logged[0]


def test_no_full_collection_while_the_forward_compiles(monkeypatch):
    monkeypatch.setenv(vllm_patches.GC_FREEZE_ENV, "1")
    before = gc.get_threshold()

    class Model:
        compiled, do_not_compile = False, False

        def __call__(self):
            self.compiled = True
            return gc.get_freeze_count(), gc.get_threshold()

    call = vllm_patches._compiled_on_first_call(Model.__call__)
    gc.unfreeze()
    try:
        frozen, threshold = call(Model())  # the call that compiles
        assert frozen > 0 and threshold[2] > 10**6 and threshold[:2] == before[:2]
        assert gc.get_threshold() == before and gc.get_freeze_count() > 0  # afterwards: the threshold as before
        gc.unfreeze()
        eager = Model()
        eager.do_not_compile = True
        assert call(eager) == (0, before)  # nothing to compile: the collector as it was
    finally:
        gc.unfreeze()
