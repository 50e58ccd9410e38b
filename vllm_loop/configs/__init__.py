"""Hugging Face config classes for model types that transformers does not know."""

from __future__ import annotations

# model_type -> "module:Class"
CONFIGS: dict[str, str] = {
    "ouro": "vllm_loop.configs.ouro:OuroConfig",
    "huginn_raven": "vllm_loop.configs.raven:RavenConfig",
}


def register_configs() -> None:
    """Make ``AutoConfig`` (and so vLLM) load these model types without ``trust_remote_code``."""
    import importlib

    from transformers import AutoConfig

    for model_type, target in CONFIGS.items():
        module, cls = target.split(":")
        AutoConfig.register(model_type, getattr(importlib.import_module(module), cls), exist_ok=True)
