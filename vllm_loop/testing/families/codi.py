"""CODI (``zhenyi4/codi``): GPT-2 or Llama-3.2 base + PEFT LoRA + the ``prj`` projection head.

Real model: ``zen-E/CODI-gpt2`` / ``zen-E/CODI-llama3.2-1b-Instruct`` are ``pytorch_model.bin``
state dicts of the whole ``CODI`` module: ``codi.base_model.model.<HF name>`` (LoRA'd linears as
``<module>.base_layer.weight/bias`` + ``<module>.lora_A.default.weight [r, in]`` +
``<module>.lora_B.default.weight [out, r]``) and ``prj.1.*``, ``prj.3.*``, ``prj.ln.*``. CODI adds
three ids after the base vocab V = ``config.vocab_size``: pad = V, bot = V+1, eot = V+2
(``resize_token_embeddings(V+3)``), and the tokenizer gets ``[PAD]`` (= V) when it has no pad.

The tiny folder keeps those tensor names (unmerged LoRA: the loader merges at load) in
``model.safetensors``. Deviations, all forced by the folder format: the tied head is stored as a
copy (``codi.base_model.model.lm_head.weight``; safetensors cannot alias), ``config.json`` is the
base model's with ``vocab_size`` = V+3, and the tokenizer also spells bot / eot as ``<|bot|>`` /
``<|eot|>`` (ids V+1 / V+2, so an engine can detokenize every id the model can emit; the
original tokenizer has no text for them -- read the ids from config, never from the tokenizer).

config.json: ``architectures`` ``["CODIGPT2LMHeadModel"]`` or ``["CODILlamaForCausalLM"]``,
``model_type`` ``gpt2`` / ``llama``, ``latent_spec`` (kind feedback, default 6, start = [bot]
(remove_eos) or [eos, bot], end = [eot] or [eot, eos], suppress = [eot]) and ``codi``::

    "codi": {"lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
             "lora_fan_in_fan_out" (true for GPT-2 Conv1D), "use_prj", "prj_dim", "prj_dropout",
             "prj_no_ln", "remove_eos", "pad_token_id", "bot_token_id", "eot_token_id",
             "weights_prefix": "codi.base_model.model."}

(names follow the original's command-line arguments; ``inf_latent_iterations`` is
``latent_spec.default_budget``). Options: ``base=gpt2|llama``, ``remove_eos=true|false``,
``prj_no_ln=false|true``, ``format=hf|original`` (``original``: what a released CODI run leaves,
which ``python -m vllm_loop.convert --family codi`` turns into the ``hf`` folder: the base model's
``config.json`` (vocabulary V, no plugin keys) and tokenizer (no ``[PAD]`` / bot / eot), plus
``pytorch_model.bin``, ``torch.save`` of the CODI module's state dict).
"""

from __future__ import annotations

import torch

from vllm_loop.latent.lora import CODI_PREFIX  # the real PEFT state-dict prefix
from vllm_loop.latent.spec import LatentSpec
from vllm_loop.testing.checkpoints import BuildContext, Checkpoint, TokenizerSpec, family
from vllm_loop.testing.families.coconut import base_checkpoint, base_tokenizer, generation_config, original_config

CODI_TOKENS = ["[PAD]", "<|bot|>", "<|eot|>"]  # ids V, V+1, V+2
LORA_TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"],
}


def codi_tokenizer(options) -> TokenizerSpec:
    spec = base_tokenizer(options, appended=CODI_TOKENS)
    spec.pad = "[PAD]"
    return spec


@family(
    "codi",
    doc="CODI: GPT-2 or Llama base + LoRA (unmerged, PEFT names) + prj head; bot/eot ids V+1/V+2",
    tokenizer=codi_tokenizer,
    options={"base": ("gpt2", "llama"), "remove_eos": ("true", "false"), "prj_no_ln": ("false", "true"),
             "format": ("hf", "original")},
    defaults={"base": "gpt2", "remove_eos": "true", "prj_no_ln": "false", "format": "hf"},
)
def build(ctx: BuildContext) -> Checkpoint:
    base = ctx.options["base"]
    remove_eos = ctx.options["remove_eos"] == "true"
    prj_no_ln = ctx.options["prj_no_ln"] == "true"
    pad, bot, eot = (ctx.token_ids[t] for t in CODI_TOKENS)
    eos_name = "<|endoftext|>" if base == "gpt2" else "<|end_of_text|>"
    eos = ctx.token_ids[eos_name]
    lora_r, lora_alpha = 8, 2  # scale alpha/r = 0.25, as the released r=128, alpha=32
    prj_dim = 192  # the released heads use prj_dim = H; a different size catches transposes
    spec = LatentSpec(
        kind="feedback",
        default_budget=6,  # inf_latent_iterations in the released test scripts
        c_thought=1,
        start_token_ids=(bot,) if remove_eos else (eos, bot),
        end_token_ids=(eot,) if remove_eos else (eot, eos),
        latent_token_id=None,
        max_budget=64,
        suppress_token_ids=(eot,),
    )
    knobs = {
        "lora_r": lora_r,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.1,
        "lora_target_modules": LORA_TARGETS[base],
        "lora_fan_in_fan_out": base == "gpt2",
        "use_prj": True,
        "prj_dim": prj_dim,
        "prj_dropout": 0.0,
        "prj_no_ln": prj_no_ln,
        "remove_eos": remove_eos,
        "pad_token_id": pad,
        "bot_token_id": bot,
        "eot_token_id": eot,
        "weights_prefix": CODI_PREFIX,
    }
    arch = "CODIGPT2LMHeadModel" if base == "gpt2" else "CODILlamaForCausalLM"
    cfg, plain = base_checkpoint(
        ctx, base, arch, tie_word_embeddings=True, latent_spec=spec.to_config(), codi=knobs
    )
    H = cfg["n_embd"] if base == "gpt2" else cfg["hidden_size"]
    targets = cfg["codi"]["lora_target_modules"]
    r = cfg["codi"]["lora_r"]

    tensors: dict[str, torch.Tensor] = {}
    for name, w in plain.items():
        module, leaf = name.rsplit(".", 1)
        in_layer = ".h." in f".{module}" or ".layers." in module
        if in_layer and module.rsplit(".", 1)[-1] in targets:
            tensors[f"{CODI_PREFIX}{module}.base_layer.{leaf}"] = w
            if leaf == "weight":
                n_in, n_out = (w.shape[0], w.shape[1]) if base == "gpt2" else (w.shape[1], w.shape[0])
                tensors[f"{CODI_PREFIX}{module}.lora_A.default.weight"] = ctx.randn(r, n_in, std=0.3)
                tensors[f"{CODI_PREFIX}{module}.lora_B.default.weight"] = ctx.randn(n_out, r, std=0.3)
        else:
            tensors[CODI_PREFIX + name] = w
    emb = "transformer.wte.weight" if base == "gpt2" else "model.embed_tokens.weight"
    tensors[f"{CODI_PREFIX}lm_head.weight"] = plain[emb].clone()

    P = cfg["codi"]["prj_dim"]
    tensors["prj.1.weight"] = ctx.randn(P, H, std=H**-0.5)
    tensors["prj.1.bias"] = ctx.randn(P, std=0.1)
    tensors["prj.3.weight"] = ctx.randn(H, P, std=P**-0.5)
    tensors["prj.3.bias"] = ctx.randn(H, std=0.1)
    if not cfg["codi"]["prj_no_ln"]:
        tensors["prj.ln.weight"] = ctx.norm_weight(H)
        tensors["prj.ln.bias"] = ctx.randn(H, std=0.1)
    if ctx.options["format"] == "original":
        return Checkpoint(config=original_config(cfg, len(CODI_TOKENS)), tensors=tensors,
                          generation_config=generation_config(cfg), weights_file="pytorch_model.bin",
                          tokenizer_without=tuple(CODI_TOKENS))
    return Checkpoint(config=cfg, tensors=tensors, generation_config=generation_config(cfg))
