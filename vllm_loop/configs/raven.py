"""``RavenConfig`` (model_type ``huginn_raven``): Huginn-0125 and the retrofitted-recurrence models.

Huginn-0125 and McLeish et al.'s retrofitted Llama / TinyLlama / OLMo-2 checkpoints share this
config type and the ``RavenForCausalLM`` architecture but differ in their block layout:

* ``huginn``: sandwich blocks (4 norms), fused Wqkv with ``qk_bias``, interleaved (GPT-J) RoPE from
  ``rope_base``, ``ln_f`` applied after the recurrence and again after the coda;
* ``llama``: pre-norm blocks (``norm_1``, ``norm_2``), GQA, Llama RoPE from ``rope_theta`` /
  ``rope_scaling``, no ``ln_f`` between recurrence and coda;
* ``olmo2``: post-norm blocks plus RMSNorm on the full q and k projections, OLMo-2 RoPE.

The config does not name its layout (the retrofits reuse Huginn's config and swap the modeling
file), so ``raven_layout`` infers it; ``block_layout`` (e.g. via ``hf_overrides``) overrides.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

LAYOUTS = ("huginn", "llama", "olmo2")
STATE_INITS = ("like-init", "zero", "seeded")


class RavenConfig(PretrainedConfig):
    model_type = "huginn_raven"
    attribute_map = {"num_attention_heads": "n_heads", "hidden_size": "n_embd", "num_hidden_layers": "n_layers"}

    def __init__(
        self,
        n_embd: int = 5280,
        n_heads: int = 55,
        n_layers: int = 8,
        block_size: int = 4096,
        vocab_size: int = 65536,
        padding_multiple: int = 4096,
        tie_embeddings: bool = True,
        intermediate_size: int = 17920,
        bias: bool = False,
        block_class_name: str = "SandwichBlock",
        norm_eps: float = 1e-6,
        state_init: str = "like-init",
        injection_type: str = "linear",
        n_layers_in_recurrent_block: int = 4,
        mean_recurrence: int = 32,
        n_layers_in_prelude: int = 2,
        n_layers_in_coda: int = 2,
        qk_bias: bool = True,
        rope_base: float = 50_000,
        init_values: dict | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        max_position_embeddings: int | None = None,
        **kwargs,
    ):
        self.n_embd = n_embd
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.padded_vocab_size = kwargs.pop("padded_vocab_size", vocab_size)
        self.padding_multiple = padding_multiple
        self.tie_embeddings = tie_embeddings
        self.intermediate_size = intermediate_size
        self.bias = bias
        self.block_class_name = block_class_name
        self.norm_eps = norm_eps
        self.state_init = state_init
        self.injection_type = injection_type
        self.n_layers_in_recurrent_block = n_layers_in_recurrent_block
        self.mean_recurrence = mean_recurrence
        self.n_layers_in_prelude = n_layers_in_prelude
        self.n_layers_in_coda = n_layers_in_coda
        self.qk_bias = qk_bias
        self.rope_base = rope_base
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else n_heads
        self.head_dim = head_dim if head_dim is not None else n_embd // n_heads
        # vLLM derives max_model_len from max_position_embeddings; Huginn calls it block_size.
        self.max_position_embeddings = max_position_embeddings if max_position_embeddings is not None else block_size
        if init_values is None:
            std = math.sqrt(2 / (5 * n_embd))
            init_values = {"std": std, "embedding": std, "embed_scale": math.sqrt(n_embd)}
        self.init_values = init_values
        # Huginn's own class runs test-time noise off by default; it is not a checkpoint key.
        self.test_time_noise = kwargs.pop("test_time_noise", 0)
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=tie_embeddings, **kwargs)


REQUIRED_KEYS = (
    "n_embd",
    "n_heads",
    "n_layers",
    "n_layers_in_prelude",
    "n_layers_in_recurrent_block",
    "n_layers_in_coda",
    "intermediate_size",
    "vocab_size",
    "norm_eps",
    "mean_recurrence",
    "init_values",
)


def raven_layout(config) -> str:
    """Which block layout a ``huginn_raven`` config describes (see module docstring)."""
    explicit = getattr(config, "block_layout", None)
    if explicit is not None:
        if explicit not in LAYOUTS:
            raise ValueError(f"block_layout={explicit!r} is not a Raven block layout; allowed: {', '.join(LAYOUTS)}")
        return explicit
    theta, scaling = raven_rope(config)
    if theta is None:
        return "huginn"  # only Huginn-0125 uses its own rope_base table
    if (scaling or {}).get("rope_type") == "llama3" or config.num_key_value_heads < config.n_heads:
        return "llama"  # Llama-3.2 (llama3 RoPE scaling) and TinyLlama (GQA)
    return "olmo2"  # OLMo-2-0425-1B: MHA, plain RoPE


def raven_rope(config) -> tuple[float | None, dict | None]:
    """The retrofits' HF RoPE settings ``(rope_theta, rope_scaling)``; ``(None, None)`` for Huginn-0125.

    transformers 5.x folds ``rope_theta`` into ``config.rope_parameters`` when the JSON also carries
    ``rope_scaling`` (then the ``rope_theta`` attribute is gone) and keeps it as a plain attribute
    otherwise, so both places are read here.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    if params.get("rope_type", params.get("type", "default")) == "default":
        return theta, None
    return theta, params


def raven_embed_scale(config, layout: str) -> float:
    """Huginn computes its scale as sqrt(n_embd) (``_init_func``), ignoring the JSON value; the
    retrofit modeling files read ``init_values["embed_scale"]`` (1.0 in their checkpoints)."""
    if layout == "huginn":
        return math.sqrt(config.n_embd)
    return float(config.init_values["embed_scale"])
