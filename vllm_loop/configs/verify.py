"""Start-up checks of looped-model deployments, run in vLLM's front-end process.

vLLM calls ``verify_and_update_model_config(model_config)`` of the class registered for the
architecture (``MODELS_CONFIG_MAP``) while it builds the model config, before any engine process
starts. A bad
loop count, a checkpoint without a required key or a bad readout option therefore fails
``vllm serve`` / ``LLM(...)`` at once with a message naming the field, instead of a traceback from a
worker process.
"""

from __future__ import annotations

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from vllm_loop.configs import ouro as ouro_cfg
from vllm_loop.configs import raven as raven_cfg
from vllm_loop.looped import check_depth, check_required_keys


def _raw_config(model_config) -> dict | None:
    """config.json as written (before defaults), plus hf_overrides; None if it cannot be read."""
    from transformers import PretrainedConfig

    try:
        raw, _ = PretrainedConfig.get_config_dict(model_config.model, revision=model_config.revision)
    except Exception:  # not a local folder and no hub access: the model load will report it
        return None
    overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
    return {**raw, **overrides}


def _check_readout_depths(config, depth: int) -> None:
    from vllm_loop.models.readouts import parse_readout_depths

    parse_readout_depths(config, depth)


def _checked_loop_config(model_config, required: tuple[str, ...], model_type: str, depth_field: str):
    """Required keys present and a valid loop count: -> (hf_config, T)."""
    raw = _raw_config(model_config)
    if raw is not None:
        check_required_keys(raw, required, model_type)
    config = model_config.hf_config
    return config, check_depth(depth_field, getattr(config, depth_field))


class OuroVerify(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        config, depth = _checked_loop_config(model_config, ouro_cfg.REQUIRED_KEYS, "ouro", "total_ut_steps")
        step = getattr(config, "early_exit_step", None)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < depth):
            raise ValueError(f"early_exit_step={step!r} is invalid: allowed values 0..{depth - 1} or null")
        threshold = getattr(config, "early_exit_threshold", None)
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 < threshold <= 1.0):
            raise ValueError(f"early_exit_threshold={threshold!r} is invalid: allowed (0, 1] or null")
        _check_readout_depths(config, depth)


class RavenVerify(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        config, depth = _checked_loop_config(
            model_config, raven_cfg.REQUIRED_KEYS, "huginn_raven", "mean_recurrence")
        if config.state_init not in raven_cfg.STATE_INITS:
            raise ValueError(f"state_init={config.state_init!r} is invalid: allowed {', '.join(raven_cfg.STATE_INITS)}")
        raven_cfg.raven_layout(config)
        _check_readout_depths(config, depth)


class LatentVerify(VerifyAndUpdateConfig):
    """COCONUT / CODI / LOTUS: a valid ``latent_spec``, and the scheduling the latent driver needs."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        from vllm_loop.latent.spec import LatentSpec

        if LatentSpec.from_config(model_config.hf_config) is None:
            raise ValueError(f"{model_config.architecture} needs a 'latent_spec' object in config.json")

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        from vllm_loop.latent.spec import LatentSpec

        spec = LatentSpec.from_config(vllm_config.model_config.hf_config)
        sched = vllm_config.scheduler_config
        # Async scheduling is fine: the driver reads only each request's output *count*, which the
        # V1 runner keeps exact under async scheduling (it appends a placeholder per sampled token).
        if spec.kind == "looped":
            # A LOTUS block is re-forwarded in place within one step: its prefill must not be chunked.
            sched.enable_chunked_prefill = False
            sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, vllm_config.model_config.max_model_len)


def _verifiers() -> dict:
    from vllm_loop.latent import LATENT_ARCHITECTURES

    return {"OuroForCausalLM": OuroVerify, "RavenForCausalLM": RavenVerify,
            **{arch: LatentVerify for arch in LATENT_ARCHITECTURES}}


# Architecture -> checks, installed into vLLM's MODELS_CONFIG_MAP by the plugin.
VERIFIERS = _verifiers()
