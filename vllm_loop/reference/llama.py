"""Reference Llama decoder (HF ``LlamaForCausalLM`` semantics), fp32, with a KV cache.

Pre-norm RMSNorm blocks, GQA attention with NeoX-style RoPE (rotate the two halves of each head;
plain or ``llama3``-scaled frequencies), SwiGLU MLP, final ``model.norm``; head ``lm_head.weight``
or tied to ``model.embed_tokens``. Same decoder interface as ``gpt2.py``: ``embed``, ``forward``
(post-final-norm hidden states, KV appended to the given ``SequenceKV``), ``logits``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from vllm_loop.reference.kv import SequenceKV


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """``{"rope_type", "rope_theta", ...}`` from either transformers-5 ``rope_parameters`` or the
    classic ``rope_theta`` + ``rope_scaling`` keys."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        out = dict(params)
    else:
        out = dict(config.get("rope_scaling") or {})
        out["rope_theta"] = config.get("rope_theta", 10000.0)
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    return out


def inverse_frequencies(head_dim: int, params: Mapping[str, Any]) -> torch.Tensor:
    theta = float(params["rope_theta"])
    # float32 throughout, as HF and vLLM compute it (keeps angles bit-comparable)
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = params["rope_type"]
    if kind == "default":
        return inv
    if kind == "llama3":
        factor = float(params["factor"])
        lo, hi = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old / lo, inv / factor, blended)  # long waves: fully scaled
        out = torch.where(wavelen < old / hi, inv, out)  # short waves: untouched
        return out
    raise NotImplementedError(f"rope_type {kind!r}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of ``x [n, heads, d]`` with ``cos, sin [n, d/2]``."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class LlamaReference:
    def __init__(self, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]):
        self.config = c = dict(config)
        self.hidden_size = int(c["hidden_size"])
        self.num_heads = int(c["num_attention_heads"])
        self.num_kv_heads = int(c.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(c.get("head_dim") or self.hidden_size // self.num_heads)
        self.num_layers = int(c["num_hidden_layers"])
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        if c.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {c.get('hidden_act')!r}")
        self.inv_freq = inverse_frequencies(self.head_dim, rope_parameters(c))
        self.w = {k: v.detach().float() for k, v in tensors.items()}
        self.embed_tokens = self.w["model.embed_tokens.weight"]
        self.vocab_size = self.embed_tokens.shape[0]
        tied = c.get("tie_word_embeddings", False)
        self.lm_head = self.embed_tokens if tied or "lm_head.weight" not in self.w else self.w["lm_head.weight"]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]

    def embed(self, ids) -> torch.Tensor:
        return self.embed_tokens[torch.as_tensor(ids, dtype=torch.long)]

    def forward(self, embeds: torch.Tensor, kv: SequenceKV) -> torch.Tensor:
        n = embeds.shape[0]
        start = kv.length(0)
        angles = torch.arange(start, start + n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        x = embeds.float()
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            h = self._rms(x, p + "input_layernorm")
            q = self._linear(h, p + "self_attn.q_proj").reshape(n, self.num_heads, self.head_dim)
            k = self._linear(h, p + "self_attn.k_proj").reshape(n, self.num_kv_heads, self.head_dim)
            v = self._linear(h, p + "self_attn.v_proj").reshape(n, self.num_kv_heads, self.head_dim)
            a = kv.attend(i, rotate(q, cos, sin), rotate(k, cos, sin), v, self.head_dim**-0.5)
            x = x + self._linear(a.reshape(n, -1), p + "self_attn.o_proj")
            h = self._rms(x, p + "post_attention_layernorm")
            gate, up = self._linear(h, p + "mlp.gate_proj"), self._linear(h, p + "mlp.up_proj")
            x = x + self._linear(F.silu(gate) * up, p + "mlp.down_proj")
        return self._rms(x, "model.norm")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.T
