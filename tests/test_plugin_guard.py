"""The plugin on a vLLM it was not built for, and what importing its test helpers does to a process.

Each check runs in a fresh Python process: ``register()`` and environment variables are
process-wide, and the rest of the suite must keep the real registrations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_loop.testing.engines import INSECURE_SERIALIZATION, worker_functions


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != INSECURE_SERIALIZATION}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=600)


UNSUPPORTED = """
import json, types
import vllm
vllm.__version__ = "0.27.0"  # any vLLM other than 0.26.x
from vllm import ModelRegistry
from vllm_loop import plugin
plugin.register()
from vllm.v1.engine.input_processor import InputProcessor
out = {"patched": bool(getattr(InputProcessor.process_inputs, "_vllm_loop_hooks", ())), "classes": {}, "errors": {}}
for arch in plugin.MODELS:
    cls = ModelRegistry._try_load_model_cls(arch)
    out["classes"][arch] = cls.__module__ + ":" + cls.__name__
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(architectures=[arch]))
    try:
        cls(vllm_config=config, prefix="")
    except RuntimeError as e:
        out["errors"][arch] = str(e)
print("RESULT" + json.dumps(out))
"""


def test_unsupported_vllm_refuses_every_plugin_architecture():
    """On vLLM != 0.26.x, no hook is installed and every plugin architecture resolves to a model
    whose construction fails with a message naming the versions and the architecture (before the
    fix: a warning, and the real classes registered without their hooks)."""
    res = _run(UNSUPPORTED)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    assert not out["patched"]
    assert set(out["classes"].values()) == {"vllm_loop.unsupported:UnsupportedVLLM"}
    for arch, message in out["errors"].items():
        assert "vLLM 0.26.x only" in message and "0.27.0" in message and arch in message
    assert set(out["errors"]) == set(out["classes"])
    assert "Refusing to serve" in res.stdout + res.stderr  # logged once at register(), through vLLM's logger


SUPPORTED = """
from vllm import ModelRegistry
from vllm_loop import plugin
plugin.register()
print("RESULT" + ModelRegistry._try_load_model_cls("CoconutGPT2LMHeadModel").__name__)
"""


@pytest.mark.slow
def test_supported_vllm_registers_the_real_classes():
    res = _run(SUPPORTED)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("RESULT", 1)[1].strip() == "CoconutGPT2LMHeadModel"


INSPECTION = """
import json, os, sys
from vllm.model_executor.models import registry
from vllm_loop import plugin
plugin.register()
def no_subprocess(fn):
    raise RuntimeError("inspected in a subprocess")
registry._run_in_subprocess = no_subprocess
out = {}
for arch in ("OuroForCausalLM", "RavenForCausalLM", "CoconutGPT2LMHeadModel"):
    out[arch] = registry.ModelRegistry.models[arch].inspect_model_cls().is_text_generation_model
try:  # vLLM's own lazily registered models keep vLLM's subprocess
    registry._LazyRegisteredModel("vllm.model_executor.models.llama", "LlamaForCausalLM").inspect_model_cls()
    out["llama"] = "in process"
except RuntimeError as e:
    out["llama"] = str(e)
out["cached"] = sorted(os.listdir(os.path.join(os.environ["VLLM_CACHE_ROOT"], "modelinfos")))
out["cuda"] = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_plugin_models_are_inspected_in_process(tmp_path):
    """On an empty model-info cache vLLM inspects a lazily registered class in a fresh Python
    subprocess (~20 s of a cold start on the H200 host); the plugin's own classes are inspected in
    the calling process, cached where vLLM caches them, and leave CUDA untouched."""
    res = _run(INSPECTION, VLLM_CACHE_ROOT=str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    assert out["OuroForCausalLM"] and out["RavenForCausalLM"] and out["CoconutGPT2LMHeadModel"]
    assert out["llama"] == "inspected in a subprocess"
    assert out["cached"] == ["vllm_loop-latent-models-CoconutGPT2LMHeadModel.json",
                             "vllm_loop-models-ouro-OuroForCausalLM.json",
                             "vllm_loop-models-raven-RavenForCausalLM.json"]
    assert out["cuda"] is False


@pytest.mark.engine
def test_unsupported_vllm_engine_does_not_start(ckpt_factory):
    """End to end: ``LLM(coconut checkpoint)`` on a vLLM reporting 0.27.0 fails at model
    construction with the refusal (engine core in-process, so the error reaches the caller)."""
    code = f"""
import vllm
vllm.__version__ = "0.27.0"
from vllm import LLM
try:
    LLM({ckpt_factory("coconut")!r}, dtype="float32", max_model_len=256, enforce_eager=True,
        gpu_memory_utilization=0.1)
except Exception as e:
    print("RESULT refused" if "Refusing to serve CoconutGPT2LMHeadModel" in repr(e) else "RESULT other " + repr(e))
else:
    print("RESULT started")
"""
    res = _run(code, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert "RESULT refused" in res.stdout, (res.stdout[-2000:], res.stderr[-4000:])


def test_importing_engine_helpers_leaves_serialization_off():
    """``vllm_loop.testing.engines`` (imported by the demo and the examples) must not turn on
    pickled RPC for the whole process; ``worker_functions()`` turns it on for a block only."""
    res = _run(f"import os, vllm_loop.testing.engines; print('RESULT', os.environ.get({INSECURE_SERIALIZATION!r}))")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("RESULT", 1)[1].strip() == "None"


def test_worker_functions_is_scoped(monkeypatch):
    monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    with worker_functions():
        assert os.environ[INSECURE_SERIALIZATION] == "1"
    assert INSECURE_SERIALIZATION not in os.environ
    monkeypatch.setenv(INSECURE_SERIALIZATION, "0")
    with worker_functions():
        assert os.environ[INSECURE_SERIALIZATION] == "1"
    assert os.environ[INSECURE_SERIALIZATION] == "0"
