"""Latent-reasoning support shared by the engine side and the references (see ``spec.py``)."""

from vllm_loop.latent.spec import CONFIG_KEY, LATENT_BUDGET_KEY, LatentSpec, resolve_latent_budget

# Architectures of latent models: their vLLM classes live in vllm_loop/latent/models.py.
LATENT_ARCHITECTURES = (
    "CoconutGPT2LMHeadModel",
    "CoconutLlamaForCausalLM",
    "CODIGPT2LMHeadModel",
    "CODILlamaForCausalLM",
    "LotusLlamaForCausalLM",
    "LotusGPT2LMHeadModel",
)

__all__ = ["LATENT_ARCHITECTURES", "CONFIG_KEY", "LATENT_BUDGET_KEY", "LatentSpec", "resolve_latent_budget"]
