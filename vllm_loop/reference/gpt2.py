"""Reference GPT-2 decoder (HF ``GPT2LMHeadModel`` semantics), fp32, with a KV cache.

Weights use the HF names: ``transformer.wte/wpe``, ``transformer.h.{i}.ln_1``,
``attn.c_attn`` / ``attn.c_proj`` (``Conv1D``: weight ``[in, out]``, y = x @ W + b), ``ln_2``,
``mlp.c_fc`` / ``mlp.c_proj`` with ``gelu_new``, ``transformer.ln_f``, head tied to ``wte`` unless
an untied ``lm_head.weight`` is given. The ``transformer.`` prefix is optional (the hub's
``openai-community/gpt2`` stores names without it).

Decoder interface (shared with ``llama.py``, used by the latent loops):
``embed(ids) -> [n, H]`` token embeddings only (GPT-2 adds ``wpe`` inside ``forward``),
``forward(embeds [n, H], kv) -> [n, H]`` post-final-norm hidden states of positions
``kv.length .. kv.length+n-1`` (their KV is appended to ``kv``), ``logits(hidden) -> [n, V]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from vllm_loop.reference.kv import SequenceKV


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh-approximated GELU."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


_ACTS = {
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": gelu_new,
    "gelu": lambda x: F.gelu(x),
    "relu": torch.relu,
}


class GPT2Reference:
    def __init__(self, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]):
        self.config = dict(config)
        c = self.config
        if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn") or c.get("add_cross_attention"):
            raise NotImplementedError("GPT-2 variants with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn / cross attention")
        self.hidden_size = int(c["n_embd"])
        self.num_heads = int(c["n_head"])
        self.num_layers = int(c["n_layer"])
        self.head_dim = self.hidden_size // self.num_heads
        self.eps = float(c.get("layer_norm_epsilon", 1e-5))
        self.scale = self.head_dim**-0.5 if c.get("scale_attn_weights", True) else 1.0
        act = c.get("activation_function", "gelu_new")
        if act not in _ACTS:
            raise NotImplementedError(f"GPT-2 activation_function {act!r}")
        self.act = _ACTS[act]

        w = {k[len("transformer."):] if k.startswith("transformer.") else k: v.detach().float() for k, v in tensors.items()}
        self.w = w
        self.wte, self.wpe = w["wte.weight"], w["wpe.weight"]
        self.vocab_size = self.wte.shape[0]
        tied = c.get("tie_word_embeddings", True)
        self.lm_head = self.wte if tied or "lm_head.weight" not in w else w["lm_head.weight"]

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps)

    def _conv1d(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.w[f"{name}.weight"] + self.w[f"{name}.bias"]

    def embed(self, ids) -> torch.Tensor:
        return self.wte[torch.as_tensor(ids, dtype=torch.long)]

    def forward(self, embeds: torch.Tensor, kv: SequenceKV) -> torch.Tensor:
        n, H = embeds.shape
        start = kv.length(0)
        x = embeds.float() + self.wpe[start : start + n]
        for i in range(self.num_layers):
            p = f"h.{i}."
            h = self._ln(x, p + "ln_1")
            q, k, v = self._conv1d(h, p + "attn.c_attn").split(H, dim=-1)
            shape = (n, self.num_heads, self.head_dim)
            a = kv.attend(i, q.reshape(shape), k.reshape(shape), v.reshape(shape), self.scale)
            x = x + self._conv1d(a.reshape(n, H), p + "attn.c_proj")
            h = self._ln(x, p + "ln_2")
            x = x + self._conv1d(self.act(self._conv1d(h, p + "mlp.c_fc")), p + "mlp.c_proj")
        return self._ln(x, "ln_f")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.T
