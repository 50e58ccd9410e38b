"""LOTUS (``yingfan-bot/lotus``): a plain causal LM with COCONUT's three added tokens, looped block.

Real model: ``yingfanbot/gsm-lotus-llama3b`` is a plain ``LlamaForCausalLM`` (Llama-3.2-3B-Instruct,
tied head) with vocab ``len(tokenizer)`` = V+3 after ``add_tokens`` of ``<|start-latent|>``,
``<|end-latent|>``, ``<|latent|>`` (ids V, V+1, V+2); the looped behaviour lives in the ``Lotus``
wrapper, which has no parameters at inference. ``eval.py`` defaults: ``n_looped_iters`` 6,
``c_thought`` 25 (Llama) / 13 (GPT-2).

The tiny folder is HF format with ``architectures: ["LotusLlamaForCausalLM"]`` (``model_type``
``llama``), a ``latent_spec`` (kind looped, default_budget 6 = n_looped_iters, c_thought 3 to
keep it tiny, max_budget 16) and ``"lotus": {"latent_injection_mode": "add"}``. Options:
``base=llama|gpt2`` (GPT-2: ``LotusGPT2LMHeadModel``), ``injection=add|replace``,
``format=hf|wrapper|original|original-pt`` (``wrapper``: ``base_causallm.`` names;
``original``: the released folder, a plain ``LlamaForCausalLM`` -- no plugin keys, vocabulary and
tokenizer already holding the three tokens; ``original-pt``: the same config and tokenizer with the
local training checkpoint ``model.pt``, ``base_causallm.`` names plus a ``teacher_model.*`` copy).
``python -m vllm_loop.convert --family lotus`` turns both originals into the ``hf`` folder.
"""

from __future__ import annotations

from vllm_loop.latent.spec import LatentSpec
from vllm_loop.testing.checkpoints import BuildContext, Checkpoint, TokenizerSpec, family
from vllm_loop.testing.families.coconut import (
    LATENT_TOKENS,
    base_checkpoint,
    base_tokenizer,
    generation_config,
    original_config,
    wrapper_format,
)


def lotus_tokenizer(options) -> TokenizerSpec:
    return base_tokenizer({"base": options.get("base", "llama")}, appended=LATENT_TOKENS)


@family(
    "lotus",
    doc="LOTUS: Llama (or GPT-2) + COCONUT's latent tokens; block re-forwarded in place 1+n times",
    tokenizer=lotus_tokenizer,
    options={"base": ("llama", "gpt2"), "injection": ("add", "replace"),
             "format": ("hf", "wrapper", "original", "original-pt")},
    defaults={"base": "llama", "injection": "add", "format": "hf"},
)
def build(ctx: BuildContext) -> Checkpoint:
    base = ctx.options["base"]
    start, end, latent = (ctx.token_ids[t] for t in LATENT_TOKENS)
    spec = LatentSpec(
        kind="looped",
        default_budget=6,  # n_looped_iters
        c_thought=3,  # real: 25 (Llama) / 13 (GPT-2)
        start_token_ids=(start,),
        end_token_ids=(end,),
        latent_token_id=latent,
        max_budget=16,
    )
    arch = "LotusLlamaForCausalLM" if base == "llama" else "LotusGPT2LMHeadModel"
    cfg, tensors = base_checkpoint(
        ctx,
        base,
        arch,
        tie_word_embeddings=True,
        latent_spec=spec.to_config(),
        lotus={"latent_injection_mode": ctx.options["injection"]},
    )
    fmt = ctx.options["format"]
    if fmt == "original":
        return Checkpoint(config=original_config(cfg), tensors=tensors, generation_config=generation_config(cfg))
    if fmt == "original-pt":
        state = wrapper_format(cfg, tensors)
        state.update({"teacher_model." + k: v.clone() for k, v in tensors.items()})  # training-only copy
        return Checkpoint(config=original_config(cfg), tensors=state, generation_config=generation_config(cfg),
                          weights_file="model.pt")
    if fmt == "wrapper":
        tensors = wrapper_format(cfg, tensors)
    return Checkpoint(config=cfg, tensors=tensors, generation_config=generation_config(cfg))
