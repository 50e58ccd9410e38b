"""Ouro (``OuroForCausalLM``, model_type ``ouro``): the real Ouro-1.4B config keys and tensor names.

Options:

* ``agreement=S`` (default 0 = off): multiplies the post-sublayer sandwich norm gains
  (``input_layernorm_2``, ``post_attention_layernorm_2``) by S and shrinks the final norm's gain
  deviation from 1 (``model.norm``, applied after every loop, so its gains compound) by S, so every
  loop changes the hidden state only a little and early-depth readouts mostly agree with the final
  one (LoopSpec speed tests). Scaling the projections instead would do nothing: the sandwich norms
  undo any scale of their input. Same seed, same underlying random draws for every S.
* ``remote_code=true``: also writes ``configuration_ouro.py`` (our own small Qwen2Config subclass)
  next to config.json, whose ``auto_map`` already names it, so that ``trust_remote_code=True``
  loaders (vLLM <= 0.26's in-tree Ouro) can read the folder without our plugin.
"""

from __future__ import annotations

import torch

from vllm_loop.testing.checkpoints import BuildContext, Checkpoint, TokenizerSpec, family
from vllm_loop.testing.families.llama import attention_mlp_tensors

OURO_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML with Ouro's default system prompt (same output as the upstream template).
CHATML = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- set rest = messages[1:] -%}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- set rest = messages -%}"
    "{%- endif -%}"
    "{%- for message in rest -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

REMOTE_CONFIG = '''"""Ouro configuration for a tiny random test checkpoint (written by vllm-loop's checkpoint factory).

Ouro is Qwen2's configuration plus the loop count and the exit threshold.
"""

from transformers import Qwen2Config


class OuroConfig(Qwen2Config):
    model_type = "ouro"

    def __init__(self, total_ut_steps=4, early_exit_threshold=1.0, **kwargs):
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        super().__init__(**kwargs)
'''


def ouro_tokenizer(options) -> TokenizerSpec:
    eot = "<|endoftext|>"
    return TokenizerSpec(special=list(OURO_SPECIAL), bos=eot, eos=eot, unk=eot, chat_template=CHATML)


def ouro_config(ctx: BuildContext) -> dict:
    """Exactly the keys of Ouro-1.4B's config.json (same order), tiny values."""
    eot = ctx.token_ids["<|endoftext|>"]
    layers = ctx.overrides.get("num_hidden_layers", 2)  # layer_types and max_window_layers follow it
    base = {
        "architectures": ["OuroForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModel": "modeling_ouro.OuroModel",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        },
        "pad_token_id": eot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 2048,
        "max_window_layers": layers,
        "model_type": "ouro",
        "num_attention_heads": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "transformers_version": "4.55.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": ctx.vocab_size,
    }
    return ctx.config(base)


def ouro_tensors(ctx: BuildContext, cfg: dict, agreement: float) -> dict[str, torch.Tensor]:
    """Random weights: unit-variance embeddings, 1/sqrt(fan_in) projections, gains near 1, and an
    LM head giving logits with a std of a few units (no near-ties for exact argmax comparisons)."""
    H, I, V, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    sandwich = agreement if agreement > 0 else 1.0
    t = {"model.embed_tokens.weight": ctx.randn(V, H, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(attention_mlp_tensors(ctx, p, H, q, kv, I))
        t[p + "input_layernorm.weight"] = ctx.norm_weight(H)
        t[p + "input_layernorm_2.weight"] = ctx.norm_weight(H) * sandwich
        t[p + "post_attention_layernorm.weight"] = ctx.norm_weight(H)
        t[p + "post_attention_layernorm_2.weight"] = ctx.norm_weight(H) * sandwich
    # The final norm runs after every loop, so its gains compound (g^T); with agreement on, its
    # deviation from 1 shrinks by the same factor or depths could never agree.
    t["model.norm.weight"] = 1.0 + (ctx.norm_weight(H) - 1.0) * sandwich
    # Gate logits of order 1 spread the exit pdf over all depths (exercises readout selection).
    t["model.early_exit_gate.weight"] = ctx.randn(1, H, std=H**-0.5)
    t["model.early_exit_gate.bias"] = ctx.randn(1, std=0.5)
    t["lm_head.weight"] = ctx.randn(V, H, std=4 * H**-0.5)
    return t


@family(
    "ouro",
    doc="Ouro (OuroForCausalLM): sandwich-norm layers looped total_ut_steps times, learned exit gate",
    tokenizer=ouro_tokenizer,
    options={"agreement": (), "remote_code": ("true", "false")},
    defaults={"agreement": "0", "remote_code": "false"},
)
def build(ctx: BuildContext) -> Checkpoint:
    agreement = ctx.float_option("agreement")
    cfg = ouro_config(ctx)
    files = {"configuration_ouro.py": REMOTE_CONFIG} if ctx.options["remote_code"] == "true" else {}
    return Checkpoint(config=cfg, tensors=ouro_tensors(ctx, cfg, agreement), files=files)
