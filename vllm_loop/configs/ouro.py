"""``OuroConfig`` (model_type ``ouro``): Qwen2's config plus the loop keys of ByteDance's Ouro.

Ouro ships only remote code; registering this class lets vLLM and transformers read a real Ouro
``config.json`` without ``trust_remote_code``.
"""

from __future__ import annotations

from transformers import Qwen2Config


class OuroConfig(Qwen2Config):
    model_type = "ouro"

    def __init__(
        self,
        total_ut_steps: int = 4,
        early_exit_threshold: float | None = 1.0,
        early_exit_step: int | None = None,
        **kwargs,
    ):
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        self.early_exit_step = early_exit_step
        super().__init__(**kwargs)


# Keys a real Ouro config.json carries that the model cannot do without (checked at start-up).
REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "vocab_size",
    "total_ut_steps",
)
