"""Raven (``RavenForCausalLM``, model_type ``huginn_raven``): Huginn-0125 and the retrofitted models.

Options:

* ``layout``: ``huginn`` (Huginn-0125: exactly its config.json keys, sandwich blocks, qk_bias,
  interleaved RoPE, tied embeddings stored twice, the ``freqs_cis`` buffer in the checkpoint),
  ``llama`` or ``olmo2`` (McLeish et al.'s retrofits: Huginn's config updated the way
  ``convert_llama.py`` / ``convert_olmo.py`` update it, the retrofit modeling files' tensor names,
  Llama-3 tokenizer with matching bos/eos ids).
* ``state_init``: ``seeded`` (default: deterministic per position, so two implementations agree),
  ``zero``, or Huginn's ``like-init`` (random per forward), written into config key ``state_init``.
* ``agreement=S`` (default 0 = off): scales each core block's sublayer contributions by S (huginn,
  llama: the output projections ``attn.proj``, ``mlp.proj``; olmo2: its post-sublayer norm gains
  ``norm_1``, ``norm_2``, which would undo a projection scale) and the state half of the adapter by
  S, so the state depends little on the previous depth and converges within a few core steps:
  early-depth readouts mostly agree with the final one (LoopSpec speed tests). Same seed, same
  underlying random draws for every S.

Tiny geometry: n_embd 128, 4 heads x 32, 1 prelude / 2 core / 2 coda blocks, mean_recurrence 4.
"""

from __future__ import annotations

import math

import torch

from vllm_loop.configs.raven import LAYOUTS, STATE_INITS
from vllm_loop.reference.common import huginn_freqs_cis
from vllm_loop.testing.checkpoints import BuildContext, Checkpoint, TokenizerSpec, family
from vllm_loop.testing.families.llama import llama_tokenizer

HUGINN_SPECIAL = ["<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>", "<|pad|>"]

# Huginn's chat format (same output as the upstream template, without its {% generation %} markers).
HUGINN_CHAT = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{- bos_token -}}{%- endif -%}"
    "{%- set role = 'Huginn' if message['role'] in ('assistant', 'Huginn') else message['role'] -%}"
    "{{- '<|begin_header|>' + role + '<|end_header|>\\n\\n' + message['content'] | trim + '<|end_turn|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|begin_header|>Huginn<|end_header|>\\n\\n' -}}"
    "{%- else -%}{{- '<|end_text|>' -}}{%- endif -%}"
)

# The retrofits' llama3 RoPE dict, shrunk so a 2048-token context exercises all three frequency
# bands with head_dim 32 (real Llama-3.2: factor 32, original_max_position_embeddings 8192).
TINY_LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
    "rope_type": "llama3",
}


def raven_tokenizer(options) -> TokenizerSpec:
    if options.get("layout", "huginn") != "huginn":
        return llama_tokenizer(options)
    return TokenizerSpec(
        special=list(HUGINN_SPECIAL),
        bos="<|begin_text|>",
        eos="<|end_text|>",
        pad="<|pad|>",
        chat_template=HUGINN_CHAT,
        add_bos=True,
    )


def _token_ids(ctx: BuildContext, layout: str) -> dict[str, int]:
    """Config token ids from the layout's tokenizer (the real retrofits carry Huginn's ids, a bug)."""
    ids = ctx.token_ids
    if layout == "huginn":
        return {"bos": ids["<|begin_text|>"], "eos": ids["<|end_text|>"], "pad": ids["<|pad|>"],
                "end_turn": ids["<|end_turn|>"]}
    return {"bos": ids["<|begin_of_text|>"], "eos": ids["<|end_of_text|>"], "pad": ids["<|end_of_text|>"]}


def huginn_config(ctx: BuildContext, state_init: str, ids: dict[str, int]) -> dict:
    """Exactly the keys of Huginn-0125's config.json (same order), tiny values; derived values
    (n_layers, effective_expected_depth, init_values) follow the overridden sizes."""
    get = ctx.overrides.get
    n_embd, n_heads, T = get("n_embd", 128), get("n_heads", 4), get("mean_recurrence", 4)
    P, C, D = get("n_layers_in_prelude", 1), get("n_layers_in_recurrent_block", 2), get("n_layers_in_coda", 2)
    depth = P + D + C * T if isinstance(T, int) else P + D
    std = math.sqrt(2 / (5 * n_embd))
    return {
        "activation_checkpoint_impl": "per-iteration",
        "architecture_class_name": "RecurrentGPT",
        "architectures": ["RavenForCausalLM"],
        "auto_map": {
            "AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
        },
        "bias": False,
        "block_class_name": "SandwichBlock",
        "block_size": 1024,
        "effective_expected_depth": depth,
        "head_dim": n_embd // n_heads,
        "init_orthogonal": False,
        "init_strategy": "takase",
        "init_values": {
            "embed_scale": math.sqrt(n_embd),
            "embedding": std,
            "out_proj": std / math.sqrt(2 * depth),
            "std": std,
        },
        "injection_type": "linear",
        "intermediate_size": 256,
        "mean_backprop_depth": 2,
        "mean_recurrence": T,
        "mlp_class_name": "GatedMLP",
        "model_type": "huginn_raven",
        "n_embd": n_embd,
        "n_heads": n_heads,
        "n_layers": P + C + D,
        "n_layers_in_coda": D,
        "n_layers_in_prelude": P,
        "n_layers_in_recurrent_block": C,
        "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama",
        "norm_eps": 1e-06,
        "num_key_value_heads": n_heads,
        "padded_vocab_size": ctx.vocab_size,
        "padding_multiple": 64,
        "qk_bias": True,
        "rope_base": 50000,
        "sampling_scheme": "poisson-lognormal-filling",
        "state_init": state_init,
        "tie_embeddings": True,
        "torch_dtype": "float32",
        "transformers_version": "4.44.2",
        "vocab_size": ctx.vocab_size,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
    }


def retrofit_config(ctx: BuildContext, layout: str, state_init: str) -> dict:
    """Huginn's config with the keys ``convert_llama.py`` / ``convert_olmo.py`` update."""
    cfg = huginn_config(ctx, state_init, _token_ids(ctx, layout))
    llama, heads = layout == "llama", cfg["n_heads"]
    cfg.update(
        {
            "head_dim": cfg["n_embd"] // heads,
            # GQA with 2 query heads per KV head (Llama-3.2 / TinyLlama use 4 and 8); MHA for OLMo-2
            "num_key_value_heads": heads // 2 if llama and heads % 2 == 0 else heads,
            "norm_eps": 1e-05 if llama else 1e-06,
            "rope_base": 500000.0,
            "rope_theta": 500000.0,
            "tie_embeddings": False,
            "qk_bias": False,
            "max_position_embeddings": 2048,
        }
    )
    if llama:
        cfg["rope_scaling"] = dict(TINY_LLAMA3_SCALING)
    cfg["init_values"] = dict(cfg["init_values"], embed_scale=1.0)  # retrofits do not scale embeddings
    return cfg


def raven_tensors(ctx: BuildContext, cfg: dict, layout: str, agreement: float) -> dict[str, torch.Tensor]:
    """Random weights with the real names. Unit-ish activations everywhere and logits with a std of a
    few units (no near-ties for exact argmax comparisons)."""
    H, I, V, nH, nKV = cfg["n_embd"], cfg["intermediate_size"], cfg["padded_vocab_size"], cfg["n_heads"], \
        cfg["num_key_value_heads"]
    hd = cfg["head_dim"] if layout == "olmo2" else H // nH
    core_out = agreement if agreement > 0 else 1.0
    t: dict[str, torch.Tensor] = {}
    # Huginn multiplies the embedding by sqrt(n_embd) and ties it to the head: std 4/sqrt(H) gives
    # embeddings of rms ~4 and logits of std ~4. The retrofits (scale 1, untied) use std 1.
    t["transformer.wte.weight"] = ctx.randn(V, H, std=4 * H**-0.5 if layout == "huginn" else 1.0)

    # What "scale a sublayer's contribution" means per layout: OLMo-2 normalises the sublayer output
    # (norm_1 / norm_2), which would undo any scale of attn.proj / mlp.proj, so its gains are scaled.
    post_norm = layout == "olmo2"

    def block(prefix: str, out_scale: float) -> None:
        proj_scale, norm_scale = (1.0, out_scale) if post_norm else (out_scale, 1.0)
        t[prefix + "norm_1.weight"] = ctx.norm_weight(H) * norm_scale
        t[prefix + "attn.Wqkv.weight"] = ctx.randn((nH + 2 * nKV) * hd, H, std=H**-0.5)
        if cfg["qk_bias"]:
            t[prefix + "attn.qk_bias"] = ctx.randn(2, 1, nH, hd, std=0.5)  # large enough that its place shows
        if layout == "olmo2":
            t[prefix + "attn.q_norm.weight"] = ctx.norm_weight(nH * hd)
            t[prefix + "attn.k_norm.weight"] = ctx.norm_weight(nKV * hd)
        t[prefix + "attn.proj.weight"] = ctx.randn(H, nH * hd, std=(nH * hd) ** -0.5) * proj_scale
        t[prefix + "norm_2.weight"] = ctx.norm_weight(H) * norm_scale
        t[prefix + "mlp.fc.weight"] = ctx.randn(2 * I, H, std=H**-0.5)
        t[prefix + "mlp.proj.weight"] = ctx.randn(H, I, std=I**-0.5) * proj_scale
        if layout == "huginn":
            t[prefix + "norm_3.weight"] = ctx.norm_weight(H)
            t[prefix + "norm_4.weight"] = ctx.norm_weight(H)

    for i in range(cfg["n_layers_in_prelude"]):
        block(f"transformer.prelude.{i}.", 1.0)
    adapter = ctx.randn(H, 2 * H, std=(2 * H) ** -0.5)
    adapter[:, :H] *= core_out  # cat[state, prelude output]: the state half
    t["transformer.adapter.weight"] = adapter
    if cfg["bias"]:
        t["transformer.adapter.bias"] = ctx.randn(H, std=0.1)
    for i in range(cfg["n_layers_in_recurrent_block"]):
        block(f"transformer.core_block.{i}.", core_out)
    for i in range(cfg["n_layers_in_coda"]):
        block(f"transformer.coda.{i}.", 1.0)
    t["transformer.ln_f.weight"] = ctx.norm_weight(H)
    if layout == "huginn":
        t["lm_head.weight"] = t["transformer.wte.weight"].clone()  # tied, but stored again upstream
        t["freqs_cis"] = huginn_freqs_cis(H // nH, cfg["block_size"], cfg["rope_base"])
    else:
        t["lm_head.weight"] = ctx.randn(V, H, std=4 * H**-0.5)
    return t


@family(
    "huginn_raven",
    doc="Raven (RavenForCausalLM): Huginn-0125 or a retrofitted Llama / OLMo-2 recurrent-depth model",
    tokenizer=raven_tokenizer,
    options={"layout": LAYOUTS, "state_init": STATE_INITS, "agreement": ()},
    defaults={"layout": "huginn", "state_init": "seeded", "agreement": "0"},
)
def build(ctx: BuildContext) -> Checkpoint:
    layout, state_init = ctx.options["layout"], ctx.options["state_init"]
    agreement = ctx.float_option("agreement")
    ids = _token_ids(ctx, layout)
    base = huginn_config(ctx, state_init, ids) if layout == "huginn" else retrofit_config(ctx, layout, state_init)
    cfg = ctx.config(base)
    eos = [ids["eos"], ids["end_turn"]] if layout == "huginn" else ids["eos"]
    generation = {"_from_model_config": True, "bos_token_id": ids["bos"], "eos_token_id": eos,
                  "pad_token_id": ids["pad"], "transformers_version": cfg["transformers_version"], "use_cache": True}
    return Checkpoint(config=cfg, tensors=raven_tensors(ctx, cfg, layout, agreement), generation_config=generation)
