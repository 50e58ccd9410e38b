"""Every place vllm-loop reaches into vLLM internals, in one module, checked against the version.

Public extension points (``ModelRegistry``, ``AutoConfig.register``) are used from plugin.py; what
is here touches private vLLM objects that a vLLM upgrade may move, so it is pinned to 0.26.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.26."


def _check_version() -> bool:
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        logger.warning("vllm-loop is built for vLLM %sx, found %s: its vLLM hooks are not installed",
                       SUPPORTED_VLLM, vllm.__version__)
        return False
    return True


def install_config_verifiers() -> None:
    """Run our start-up checks in the front end: vLLM looks up per-architecture config hooks in the
    private dict ``MODELS_CONFIG_MAP`` (vllm/model_executor/models/config.py) while building
    ``VllmConfig``; there is no public registration for them."""
    from vllm.model_executor.models import config as model_configs

    from vllm_loop.configs.verify import VERIFIERS

    model_configs.MODELS_CONFIG_MAP.update(VERIFIERS)


def install() -> None:
    if not _check_version():
        return
    install_config_verifiers()
