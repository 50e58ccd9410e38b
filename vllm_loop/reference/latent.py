"""Shared pieces of the latent-reasoning references and the checkpoint loader.

The request protocol (tokens appended by the engine, what a latent position is fed, budget
semantics, what the output holds) is specified in ``vllm_loop/latent/spec.py``; this module and
``coconut.py`` / ``codi.py`` / ``lotus.py`` implement it in plain fp32 PyTorch, one request at a
time (a batch is a loop over requests: the engine must give every request the same result it would
get alone).

    from vllm_loop.reference.latent_loading import load_latent_reference
    ref = load_latent_reference("/tmp/tiny-coconut")
    answer, info = ref.generate(prompt_ids, latent_budget=3, max_new_tokens=16)

``answer`` holds the answer token ids only (EOS included when it stopped the request); ``info``
holds ``latent_budget``, ``latent_positions``, ``passes``, ``prompt_len``, ``sequence`` (every
token of the final sequence, ``None`` at latent positions), ``latent_inputs`` (``[positions, H]``:
the input embeddings the latent positions hold in the final KV, i.e. what an engine's embedding
ledger must hold), ``logits`` (``[len(answer), V]`` fp32 logits each answer token was picked from,
before suppression), ``min_margin`` (smallest top-1 minus top-2 logit gap over the answer: a tiny
value warns of a near-tie that kernel noise could flip) and ``finish_reason`` (``stop``/``length``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_loop.latent.spec import LATENT_BUDGET_KEY, LatentSpec, resolve_latent_budget
from vllm_loop.reference.kv import SequenceKV

# config.json "architectures"[0] -> (family, base decoder). The vLLM side registers the same names.
LATENT_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "CoconutGPT2LMHeadModel": ("coconut", "gpt2"),
    "CoconutLlamaForCausalLM": ("coconut", "llama"),
    "CODIGPT2LMHeadModel": ("codi", "gpt2"),
    "CODILlamaForCausalLM": ("codi", "llama"),
    "LotusLlamaForCausalLM": ("lotus", "llama"),
    "LotusGPT2LMHeadModel": ("lotus", "gpt2"),
}

# Prefix of the original training wrappers' state dicts (COCONUT / LOTUS ``torch.save`` of the
# wrapper module); an HF-format folder has no prefix.
WRAPPER_PREFIX = "base_causallm."


def make_decoder(base: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]):
    if base == "gpt2":
        from vllm_loop.reference.gpt2 import GPT2Reference

        return GPT2Reference(config, tensors)
    if base == "llama":
        from vllm_loop.reference.llama import LlamaReference

        return LlamaReference(config, tensors)
    raise ValueError(f"unknown base decoder {base!r}")


def eos_ids(*values: Any) -> tuple[int, ...]:
    """Union of eos ids given as ints or lists (config / generation_config ``eos_token_id``)."""
    out: list[int] = []
    for v in values:
        for t in [v] if isinstance(v, int) else list(v or []):
            if t not in out:
                out.append(int(t))
    return tuple(out)


class LatentReference:
    """One latent model: a decoder (``gpt2.py`` / ``llama.py`` interface), its ``LatentSpec`` and
    its EOS ids. Subclasses implement ``_latent_phase``."""

    family = "?"

    def __init__(self, decoder, spec: LatentSpec, eos_token_ids: Sequence[int] = ()):
        self.decoder, self.spec = decoder, spec
        self.eos_token_ids = tuple(eos_token_ids)

    # -- per family ---------------------------------------------------------------------------
    def _latent_phase(self, prompt: list[int], budget: int) -> tuple[SequenceKV, torch.Tensor, torch.Tensor]:
        """Run prompt, start tokens, the latent phase and the end tokens.

        Returns the KV of the whole sequence, the logits of the last end token (``[V]``) and the
        input embeddings the latent positions hold in that KV (``[latent_positions, H]``)."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------
    def resolve_budget(self, latent_budget: int | None) -> int:
        return resolve_latent_budget({LATENT_BUDGET_KEY: latent_budget}, self.spec)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        latent_budget: int | None = None,
        max_new_tokens: int = 64,
        eos_token_id: int | Sequence[int] | None = None,
        *,
        ignore_eos: bool = False,
    ) -> tuple[list[int], dict[str, Any]]:
        """Greedy generation of one request. ``latent_budget=None``: the model default;
        ``eos_token_id=None``: the model's EOS ids; ``ignore_eos``: never stop on EOS."""
        prompt = [int(t) for t in prompt_ids]
        budget = self.resolve_budget(latent_budget)
        kv, logits, latent_inputs = self._latent_phase(prompt, budget)
        eos = () if ignore_eos else (self.eos_token_ids if eos_token_id is None else eos_ids(eos_token_id))
        answer, info = greedy_decode(self.decoder, kv, logits, max_new_tokens, eos, self.spec.suppress_token_ids)
        spec = self.spec
        sequence = (
            prompt
            + list(spec.start_token_ids)
            + [None] * spec.latent_positions(budget)
            + list(spec.end_token_ids)
            + answer
        )
        info.update(
            latent_budget=budget,
            latent_positions=spec.latent_positions(budget),
            passes=spec.passes(budget),
            prompt_len=len(prompt),
            sequence=sequence,
            latent_inputs=latent_inputs,
        )
        return answer, info

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        latent_budgets: Sequence[int | None],
        max_new_tokens: int | Sequence[int] = 64,
        **kwargs,
    ) -> list[tuple[list[int], dict[str, Any]]]:
        """A batch is a loop over its requests (each may have its own budget and length)."""
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        return [
            self.generate(p, b, m, **kwargs) for p, b, m in zip(prompts, latent_budgets, max_new_tokens, strict=True)
        ]

    @torch.no_grad()
    def generate_plain(self, token_ids: Sequence[int], max_new_tokens: int = 64, *, ignore_eos: bool = False):
        """Ordinary greedy decoding of the base decoder after ``token_ids`` (no latent phase;
        ``suppress_token_ids`` still apply). Used to pin down budget-0 semantics."""
        kv = SequenceKV()
        h = self.decoder.forward(self.decoder.embed(list(token_ids)), kv)
        eos = () if ignore_eos else self.eos_token_ids
        return greedy_decode(
            self.decoder, kv, self.decoder.logits(h[-1]), max_new_tokens, eos, self.spec.suppress_token_ids
        )


def greedy_decode(decoder, kv: SequenceKV, logits: torch.Tensor, max_new_tokens: int, eos: Sequence[int], suppress=()):
    """Argmax decoding from ``logits`` (of the last position in ``kv``) until an EOS id (kept) or
    ``max_new_tokens`` tokens. Returns ``(tokens, {"logits", "min_margin", "finish_reason"})``."""
    tokens: list[int] = []
    seen: list[torch.Tensor] = []
    margin = float("inf")
    finish = "length"
    suppress = list(suppress)
    while len(tokens) < max_new_tokens:
        seen.append(logits)
        pick = logits.clone()
        if suppress:
            pick[suppress] = float("-inf")
        top2 = torch.topk(pick, 2).values
        margin = min(margin, float(top2[0] - top2[1]))
        tok = int(torch.argmax(pick))
        tokens.append(tok)
        if tok in eos:
            finish = "stop"
            break
        if len(tokens) == max_new_tokens:
            break
        logits = decoder.logits(decoder.forward(decoder.embed([tok]), kv))[-1]
    stacked = torch.stack(seen) if seen else torch.empty(0, logits.shape[-1])
    return tokens, {"logits": stacked, "min_margin": margin, "finish_reason": finish}


# -- loading -----------------------------------------------------------------------------------
def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any] | None]:
    """``(config, tensors, generation_config)`` of an HF-format folder (single file or sharded)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(path / f)))
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return config, tensors, gen


def strip_wrapper_prefix(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names from an original-style wrapper state dict (``base_causallm.`` prefix); a tied
    ``lm_head.weight`` copy is dropped."""
    if not any(k.startswith(WRAPPER_PREFIX) for k in tensors):
        return dict(tensors)
    out = {k[len(WRAPPER_PREFIX):]: v for k, v in tensors.items() if k.startswith(WRAPPER_PREFIX)}
    if config.get("tie_word_embeddings", config.get("model_type") == "gpt2"):
        out.pop("lm_head.weight", None)
    return out
