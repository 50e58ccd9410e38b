"""Latent-reasoning support shared by the engine side and the references (see ``spec.py``)."""

from vllm_loop.latent.spec import CONFIG_KEY, LATENT_BUDGET_KEY, LatentSpec, resolve_latent_budget

__all__ = ["CONFIG_KEY", "LATENT_BUDGET_KEY", "LatentSpec", "resolve_latent_budget"]
