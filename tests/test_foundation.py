"""Foundation: the plugin is loaded by a real vLLM engine (not a mock) and generates tokens."""

from __future__ import annotations

import os

import pytest

from vllm_loop.testing.engines import start_llm, stop_llm, worker_facts, worker_functions


@pytest.fixture(scope="module")
def llama_llm(ckpt_factory):
    with worker_functions():  # collective_rpc(worker_facts) below
        llm = start_llm(ckpt_factory("llama"))
        yield llm
        stop_llm(llm)


@pytest.mark.engine
def test_plugin_runs_inside_engine_and_generates(llama_llm):
    from vllm import SamplingParams

    from vllm_loop import plugin

    outs = llama_llm.generate(
        ["The capital of France is", "Question: Tom has 3 apples"],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]

    (facts,) = llama_llm.collective_rpc(worker_facts)
    assert facts["pid"] != os.getpid(), "collective_rpc must run in vLLM's worker process"
    assert facts["registered"], "register() did not run in the worker process"
    # Architectures only the plugin registers resolve inside the engine's process.
    assert "RavenForCausalLM" in plugin.MODELS
    assert facts["plugin_archs"] == sorted(plugin.MODELS)
    assert facts["model_class"] == "LlamaForCausalLM"


def test_every_package_folder_is_shipped():
    """pyproject.toml lists its packages by hand (kernels/ ships as vllm_loop_kernels): the list must
    name every package folder, or a wheel would miss it."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "vllm_loop").rglob("__init__.py")}
    assert (root / "kernels" / "__init__.py").exists() and setup["package-dir"] == {"vllm_loop_kernels": "kernels"}
    assert set(setup["packages"]) == found | {"vllm_loop_kernels"}


def test_no_import_circle_among_the_references():
    """``vllm_loop/reference/``: no module imports (at any depth, lazily or not) one that imports it back."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "vllm_loop" / "reference"
    graph = {}
    for path in folder.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_loop.reference"):
                names.add(node.module.rsplit(".", 1)[-1] if node.module != "vllm_loop.reference" else "__init__")
        graph[path.stem] = names - {path.stem}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    circles = sorted(m for m in graph if reaches(m, m))
    assert not circles, f"import circles through {circles}: {graph}"
