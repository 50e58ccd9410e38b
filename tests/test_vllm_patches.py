"""The hooks' installer (``vllm_loop.vllm_patches.patch``): once per hook, in any order."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_loop.vllm_patches import installed, patch


def _owner():
    return SimpleNamespace(f=lambda x: [x])


def _wrap(owner, tag: str):
    original = owner.f
    return lambda x: original(x) + [tag]


def test_a_hook_installs_once_and_others_stack_in_any_order():
    for order in (("a", "b"), ("b", "a")):
        owner = _owner()
        for name in order + order:  # each hook asked twice
            patch(owner, "f", name, _wrap(owner, name))
        assert owner.f(0) == [0, *order]  # each ran once, in the order installed
        assert installed(owner, "f") == order


def test_install_is_idempotent_for_the_real_hooks():
    """Installing the plugin's hooks again (a second ``register`` in the same process) changes nothing."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_loop import vllm_patches

    vllm_patches.install()
    before = {name: getattr(GPUModelRunner, name) for name in ("execute_model", "sample_tokens", "_sample")}
    vllm_patches.install()
    assert {name: getattr(GPUModelRunner, name) for name in before} == before
    assert set(installed(GPUModelRunner, "execute_model")) == {"latent.runner", "loopspec.runner"}
    assert {"latent.runner", "loopspec.coupled_sampling"} <= set(installed(GPUModelRunner, "_sample"))
