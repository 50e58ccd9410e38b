"""vllm-loop: looped and latent-reasoning LMs in vLLM."""

import logging


def get_logger(name: str) -> logging.Logger:
    """A logger inside vLLM's ``vllm`` logger tree, so our lines get vLLM's handler, format and
    ``VLLM_LOGGING_*`` settings (vLLM configures only that tree; ``vllm_loop.*`` would be dropped)."""
    return logging.getLogger(f"vllm.plugins.{name}")
