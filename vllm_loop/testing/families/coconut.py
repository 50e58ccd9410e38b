"""COCONUT (``facebookresearch/coconut``): a plain causal LM with three added tokens.

Real model: ``openai-community/gpt2`` + ``tokenizer.add_tokens`` of ``<|start-latent|>``,
``<|end-latent|>``, ``<|latent|>`` (in that order: ids V, V+1, V+2) and
``resize_token_embeddings(V+3)``; the looped behaviour lives in the ``Coconut`` wrapper, which has no
parameters of its own. The tiny folder is HF format (``transformer.*`` names, tied head, no
``lm_head.weight``) with ``architectures: ["CoconutGPT2LMHeadModel"]`` (``model_type`` stays
``gpt2``) and a ``latent_spec`` object (see ``vllm_loop/latent/spec.py``).

Options: ``base=gpt2|llama`` (the paper also ran Llama-3; architecture
``CoconutLlamaForCausalLM``), ``format=hf|wrapper|original`` (``wrapper``: the original training
checkpoint's names, every key under ``base_causallm.`` and the tied ``lm_head.weight`` stored as
a copy, as ``torch.save(model.state_dict())`` of the wrapper has them; ``original``: what a
released COCONUT run leaves, which ``python -m vllm_loop.convert --family coconut`` turns into the
``hf`` folder: the base model's ``config.json`` (``GPT2LMHeadModel``, vocabulary V, no plugin keys)
and tokenizer (without the three latent tokens, which ``run.py`` adds at run time), plus the
training checkpoint ``checkpoint_6`` -- ``torch.save`` of the wrapper's state dict, embeddings
resized to V+3).

This module also holds the GPT-2 building blocks shared by the ``codi`` and ``lotus`` families.
"""

from __future__ import annotations

import torch

from vllm_loop.latent.spec import LatentSpec
from vllm_loop.testing.checkpoints import BuildContext, Checkpoint, TokenizerSpec, family
from vllm_loop.testing.families.llama import llama_config, llama_tensors, llama_tokenizer

LATENT_TOKENS = ["<|start-latent|>", "<|end-latent|>", "<|latent|>"]  # COCONUT / LOTUS add_tokens order
GPT2_EOS = "<|endoftext|>"
WRAPPER_PREFIX = "base_causallm."

# Random weights with unit-scale token embeddings and a tied head just copy their last input token
# (its embedding dominates the final hidden state). A smaller embedding and stronger block outputs
# make greedy outputs depend on the context, hence on the latent phase and the budget.
EMBED_STD = 0.3
OUT_GAIN = 3.0


# -- GPT-2 building blocks ------------------------------------------------------------------------
def gpt2_tokenizer(options, appended=()) -> TokenizerSpec:
    """GPT-2 style: one special ``<|endoftext|>`` (bos = eos = unk), no BOS prepended."""
    return TokenizerSpec(special=[GPT2_EOS], bos=GPT2_EOS, eos=GPT2_EOS, unk=GPT2_EOS, appended=list(appended))


def gpt2_config(ctx: BuildContext, **extra) -> dict:
    """Real ``GPT2LMHeadModel`` config.json keys (as ``save_pretrained`` writes them), tiny values:
    head_dim = n_embd / n_head = 32 (vLLM's CPU attention minimum)."""
    eos = ctx.token_ids[GPT2_EOS]
    base = {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": eos,
        "embd_pdrop": 0.1,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 128,
        "n_head": 4,
        "n_inner": None,
        "n_layer": 2,
        "n_positions": 1024,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.1,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": ctx.vocab_size,
    }
    base.update(extra)
    return ctx.config(base)


def gpt2_tensors(ctx: BuildContext, cfg: dict, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    """HF GPT-2 state dict (``Conv1D`` weights ``[in, out]``), random, shaped from ``cfg``;
    tied head (no ``lm_head.weight``) unless ``tie_word_embeddings`` is false."""
    H, V, P = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    inner = cfg.get("n_inner") or 4 * H
    t: dict[str, torch.Tensor] = {
        f"{prefix}wte.weight": ctx.randn(V, H, std=EMBED_STD),
        f"{prefix}wpe.weight": ctx.randn(P, H, std=0.3),
    }

    def ln(name: str) -> None:
        t[f"{name}.weight"] = ctx.norm_weight(H)
        t[f"{name}.bias"] = ctx.randn(H, std=0.1)

    def conv1d(name: str, n_in: int, n_out: int, gain: float = 1.0) -> None:
        t[f"{name}.weight"] = ctx.randn(n_in, n_out, std=gain * n_in**-0.5)
        t[f"{name}.bias"] = ctx.randn(n_out, std=0.05)

    for i in range(cfg["n_layer"]):
        p = f"{prefix}h.{i}."
        ln(p + "ln_1")
        conv1d(p + "attn.c_attn", H, 3 * H)
        conv1d(p + "attn.c_proj", H, H, OUT_GAIN)
        ln(p + "ln_2")
        conv1d(p + "mlp.c_fc", H, inner)
        conv1d(p + "mlp.c_proj", inner, H, OUT_GAIN)
    ln(f"{prefix}ln_f")
    if not cfg.get("tie_word_embeddings", True):
        t["lm_head.weight"] = ctx.randn(V, H, std=H**-0.5)
    return t


def base_tokenizer(options, appended=()) -> TokenizerSpec:
    if options.get("base", "gpt2") == "gpt2":
        return gpt2_tokenizer(options, appended)
    return llama_tokenizer(options, appended)


def base_checkpoint(ctx: BuildContext, base: str, architecture: str, **extra) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, HF-named tensors) of a GPT-2 or Llama base under a latent ``architecture`` name."""
    if base == "gpt2":
        cfg = gpt2_config(ctx, architectures=[architecture], **extra)
        return cfg, gpt2_tensors(ctx, cfg)
    cfg = llama_config(ctx, architectures=[architecture], **extra)
    tensors = llama_tensors(ctx, cfg)
    for name in tensors:  # same rescaling as gpt2_tensors (see EMBED_STD)
        if name.endswith("embed_tokens.weight"):
            tensors[name] = tensors[name] * EMBED_STD
        elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensors[name] = tensors[name] * OUT_GAIN
    return cfg, tensors


def original_config(cfg: dict, added: int = 0) -> dict:
    """The base model's own config.json under a latent model's: plain architecture, none of this
    project's keys, and the vocabulary before ``added`` tokens were appended by the training run."""
    base = {k: v for k, v in cfg.items() if k not in ("latent_spec", "codi", "lotus")}
    base["architectures"] = ["GPT2LMHeadModel" if cfg["model_type"] == "gpt2" else "LlamaForCausalLM"]
    base["vocab_size"] = cfg["vocab_size"] - added
    return base


def generation_config(cfg: dict) -> dict:
    return {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}


def wrapper_format(cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original COCONUT / LOTUS training checkpoint's names: ``base_causallm.`` + HF names,
    tied head stored as its own copy."""
    out = {WRAPPER_PREFIX + k: v for k, v in tensors.items()}
    if cfg.get("tie_word_embeddings", True) and "lm_head.weight" not in tensors:
        emb = "transformer.wte.weight" if cfg["model_type"] == "gpt2" else "model.embed_tokens.weight"
        out[WRAPPER_PREFIX + "lm_head.weight"] = tensors[emb].clone()
    return out


# -- the family -------------------------------------------------------------------------------------
def coconut_tokenizer(options) -> TokenizerSpec:
    return base_tokenizer(options, appended=LATENT_TOKENS)


@family(
    "coconut",
    doc="COCONUT: GPT-2 (or Llama) + <|start-latent|>/<|end-latent|>/<|latent|>; feedback latent",
    tokenizer=coconut_tokenizer,
    options={"base": ("gpt2", "llama"), "format": ("hf", "wrapper", "original")},
    defaults={"base": "gpt2", "format": "hf"},
)
def build(ctx: BuildContext) -> Checkpoint:
    base = ctx.options["base"]
    start, end, latent = (ctx.token_ids[t] for t in LATENT_TOKENS)
    spec = LatentSpec(
        kind="feedback",
        default_budget=6,  # GSM8K: c_thought 2 x max_latent_stage 3
        c_thought=1,
        start_token_ids=(start,),
        end_token_ids=(end,),
        latent_token_id=latent,
        max_budget=64,
    )
    arch = "CoconutGPT2LMHeadModel" if base == "gpt2" else "CoconutLlamaForCausalLM"
    cfg, tensors = base_checkpoint(ctx, base, arch, latent_spec=spec.to_config())
    if ctx.options["format"] == "original":
        return Checkpoint(config=original_config(cfg, len(LATENT_TOKENS)), tensors=wrapper_format(cfg, tensors),
                          generation_config=generation_config(cfg), weights_file="checkpoint_6",
                          tokenizer_without=tuple(LATENT_TOKENS))
    if ctx.options["format"] == "wrapper":
        tensors = wrapper_format(cfg, tensors)
    return Checkpoint(config=cfg, tensors=tensors, generation_config=generation_config(cfg))
