"""vLLM general plugin entry point (``vllm.general_plugins: loop = vllm_loop.plugin:register``).

vLLM calls ``register()`` in every process it starts (front end, engine core, each worker, the model
inspection subprocess), so it must be idempotent and must not depend on having run elsewhere.
"""

from __future__ import annotations

import os

from vllm_loop import get_logger
from vllm_loop.latent import LATENT_ARCHITECTURES

logger = get_logger(__name__)

# Architecture name in config.json -> "module:Class". Lazy strings: vLLM imports them on demand.
MODELS: dict[str, str] = {
    "OuroForCausalLM": "vllm_loop.models.ouro:OuroForCausalLM",  # replaces vLLM 0.26's in-tree Ouro
    "RavenForCausalLM": "vllm_loop.models.raven:RavenForCausalLM",
    **{arch: f"vllm_loop.latent.models:{arch}" for arch in LATENT_ARCHITECTURES},
}

_registered_in_pid: int | None = None


def register() -> None:
    global _registered_in_pid
    if _registered_in_pid == os.getpid():
        return
    from vllm import ModelRegistry

    from vllm_loop import vllm_patches
    from vllm_loop.configs import register_configs

    register_configs()
    models = MODELS
    if vllm_patches._check_version():
        vllm_patches.install()
    else:  # refuse to serve our architectures rather than serve them silently wrong
        import vllm

        from vllm_loop.unsupported import refusal

        logger.error("%s", refusal(vllm.__version__, sorted(MODELS)))
        models = dict.fromkeys(MODELS, "vllm_loop.unsupported:UnsupportedVLLM")
    for arch, target in models.items():
        ModelRegistry.register_model(arch, target)
    _registered_in_pid = os.getpid()


def registered() -> bool:
    """True once ``register()`` ran in this process (used by tests to prove it ran in a worker)."""
    return _registered_in_pid == os.getpid()
