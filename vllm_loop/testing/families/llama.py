"""Plain Llama (``LlamaForCausalLM``): the non-looped control, and the base of LOTUS and CODI-Llama."""

from __future__ import annotations

import torch

from vllm_loop.testing.checkpoints import BuildContext, Checkpoint, TokenizerSpec, family

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


def llama_tokenizer(options, appended=()) -> TokenizerSpec:
    return TokenizerSpec(
        special=list(LLAMA3_SPECIAL),
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        appended=list(appended),
        add_bos=True,
    )


def llama_config(ctx: BuildContext, **extra) -> dict:
    """Real ``LlamaForCausalLM`` config.json keys, tiny values (head_dim 32: vLLM's CPU attention minimum)."""
    base = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ctx.token_ids["<|begin_of_text|>"],
        "eos_token_id": ctx.token_ids["<|end_of_text|>"],
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": ctx.vocab_size,
    }
    base.update(extra)
    return ctx.config(base)


def attention_mlp_tensors(ctx: BuildContext, p: str, H: int, q: int, kv: int, I: int) -> dict[str, torch.Tensor]:
    """One Llama/Qwen2-style layer's projections (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``),
    random with 1/sqrt(fan_in) scales, in a fixed draw order."""
    return {
        p + "self_attn.q_proj.weight": ctx.randn(q, H, std=H**-0.5),
        p + "self_attn.k_proj.weight": ctx.randn(kv, H, std=H**-0.5),
        p + "self_attn.v_proj.weight": ctx.randn(kv, H, std=H**-0.5),
        p + "self_attn.o_proj.weight": ctx.randn(H, q, std=q**-0.5),
        p + "mlp.gate_proj.weight": ctx.randn(I, H, std=H**-0.5),
        p + "mlp.up_proj.weight": ctx.randn(I, H, std=H**-0.5),
        p + "mlp.down_proj.weight": ctx.randn(H, I, std=I**-0.5),
    }


def llama_tensors(ctx: BuildContext, cfg: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """HF Llama state dict (``model.*`` and ``lm_head``), random, shaped from ``cfg``."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    t: dict[str, torch.Tensor] = {f"{prefix}model.embed_tokens.weight": ctx.randn(V, H, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}model.layers.{i}."
        t.update(attention_mlp_tensors(ctx, p, H, q, kv, I))
        t[p + "input_layernorm.weight"] = ctx.norm_weight(H)
        t[p + "post_attention_layernorm.weight"] = ctx.norm_weight(H)
    t[f"{prefix}model.norm.weight"] = ctx.norm_weight(H)
    if not cfg.get("tie_word_embeddings"):
        t[f"{prefix}lm_head.weight"] = ctx.randn(V, H, std=H**-0.5)
    return t


@family("llama", doc="plain LlamaForCausalLM (non-looped control)", tokenizer=llama_tokenizer)
def build(ctx: BuildContext) -> Checkpoint:
    cfg = llama_config(ctx)
    return Checkpoint(config=cfg, tensors=llama_tensors(ctx, cfg))
