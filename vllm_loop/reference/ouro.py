"""Reference Ouro (ByteDance ``OuroForCausalLM``): the whole decoder stack is the looped core.

Per depth (core step t, banks ``("core", t, l)``), each of the L shared layers is a sandwich block

    x = x + input_layernorm_2(attn(input_layernorm(x)))
    x = x + post_attention_layernorm_2(mlp(post_attention_layernorm(x)))

and after the L layers ``x = model.norm(x)``: the normed x is both that depth's output and the next
depth's input. ``pre`` is the plain embedding (no scale); ``readout(r)`` is ``lm_head`` (untied) on the
depth-r state. NeoX RoPE from ``rope_theta``, positions identical at every depth. The learned exit
gate ``early_exit_gate`` (Linear(H, 1) with bias) scores each depth's normed state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_loop.configs.ouro import OuroConfig
from vllm_loop.looped import ouro_exit_depth, ouro_exit_pdf
from vllm_loop.reference.base import LoopedReference, LoopState
from vllm_loop.reference.common import apply_neox_rope, gated_mlp, rms_norm, rope_inv_freq
from vllm_loop.reference.kv import SequenceKV

_LAYER_TENSORS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "input_layernorm_2.weight",
    "post_attention_layernorm.weight",
    "post_attention_layernorm_2.weight",
)


def ouro_tensor_names(config: OuroConfig) -> list[str]:
    """The state-dict names an Ouro checkpoint must hold (HF ``OuroForCausalLM``)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.early_exit_gate.weight"]
    names += ["model.early_exit_gate.bias", "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        names += [f"model.layers.{i}.{t}" for t in _LAYER_TENSORS]
    return names


@dataclass
class ExitForward:
    """An ordinary Ouro forward with the configured readout selection."""

    logits: torch.Tensor  # [n, V] fp32, each token read at its selected depth
    depths: torch.Tensor  # [n] selected readout depth per token, 1-based
    pdf: torch.Tensor  # [T, n] learned exit distribution


def select_exit_depths(pdf: torch.Tensor, early_exit_step: int | None, threshold: float | None) -> torch.Tensor:
    """Readout depth per token (1-based) as ``OuroForCausalLM.forward`` selects it.

    ``early_exit_step`` is a 0-based index into the per-depth states and wins when it is in range
    (out of range: ignored, as upstream); else ``threshold`` picks the first depth whose exit CDF
    reaches it (1.0 = full depth, see ``ouro_exit_depth``); with neither, the last depth.
    """
    T, n = pdf.shape
    if early_exit_step is not None and 0 <= early_exit_step < T:
        return torch.full((n,), early_exit_step + 1, dtype=torch.long)
    if threshold is not None:
        return ouro_exit_depth(pdf, threshold) + 1
    return torch.full((n,), T, dtype=torch.long)


class OuroReference(LoopedReference):
    def __init__(self, config: OuroConfig, weights: dict[str, torch.Tensor], depth: int):
        super().__init__()
        self.config, self.w, self.depth = config, weights, depth
        self.vocab_size = weights["lm_head.weight"].shape[0]
        self.eps = config.rms_norm_eps
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        # HF Ouro reads head_dim from the config (hidden_size // heads only as a fallback).
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        rope = dict(config.rope_parameters)
        self.inv_freq = rope_inv_freq(self.head_dim, rope.pop("rope_theta"), rope)

    # -- the three pieces ----------------------------------------------------------------------
    def pre(self, tokens, positions, kv) -> LoopState:
        return LoopState(h=F.embedding(tokens, self.w["model.embed_tokens.weight"]))

    def core_step(self, state, t, positions, kv) -> LoopState:
        x = state.h
        for layer in range(self.config.num_hidden_layers):
            x = self._layer(x, layer, ("core", t, layer), positions, kv)
        return LoopState(h=rms_norm(x, self.w["model.norm.weight"], self.eps))

    def readout(self, state, r, positions, kv) -> torch.Tensor:
        return F.linear(state.h, self.w["lm_head.weight"]).float()

    # -- exit gate -------------------------------------------------------------------------------
    def gate_logits(self, state: LoopState) -> torch.Tensor:
        """``[n]`` exit-gate logit of one depth's (normed) state."""
        w, b = self.w["model.early_exit_gate.weight"], self.w["model.early_exit_gate.bias"]
        return F.linear(state.h, w, b).squeeze(-1).float()

    def exit_pdf(self, states: list[LoopState]) -> torch.Tensor:
        """``[T, n]`` learned exit distribution over the given per-depth states (sums to 1 per token)."""
        return ouro_exit_pdf(torch.stack([self.gate_logits(s) for s in states]))

    @torch.no_grad()
    def forward_with_exit(self, tokens: torch.Tensor, kv: SequenceKV | None = None) -> ExitForward:
        """Run all T depths (KV for every depth is written, as upstream) and read each token at the
        depth the config selects (``early_exit_step`` / ``early_exit_threshold``)."""
        kv = SequenceKV() if kv is None else kv
        start = kv.length(self.position_bank())
        positions = torch.arange(start, start + tokens.shape[0])
        state = self.pre(tokens, positions, kv)
        states = []
        for t in range(self.depth):
            state = self.core_step(state, t, positions, kv)
            states.append(state)
        pdf = self.exit_pdf(states)
        step = getattr(self.config, "early_exit_step", None)
        depths = select_exit_depths(pdf, step, getattr(self.config, "early_exit_threshold", None))
        chosen = torch.stack([s.h for s in states])[depths - 1, torch.arange(tokens.shape[0])]
        logits = self.readout(LoopState(h=chosen), self.depth, positions, kv)
        return ExitForward(logits=logits, depths=depths, pdf=pdf)

    def final_logits(self, tokens, kv=None) -> torch.Tensor:
        return self.forward_with_exit(tokens, kv).logits

    # -- blocks ----------------------------------------------------------------------------------
    def _layer(self, x, layer, bank, positions, kv):
        w, p, eps = self.w, f"model.layers.{layer}.", self.eps
        h = self._attention(rms_norm(x, w[p + "input_layernorm.weight"], eps), p + "self_attn.", bank, positions, kv)
        x = x + rms_norm(h, w[p + "input_layernorm_2.weight"], eps)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        h = gated_mlp(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
        return x + rms_norm(h, w[p + "post_attention_layernorm_2.weight"], eps)

    def _attention(self, x, p, bank, positions, kv):
        n, hd = x.shape[0], self.head_dim
        q = F.linear(x, self.w[p + "q_proj.weight"]).view(n, self.n_heads, hd)
        k = F.linear(x, self.w[p + "k_proj.weight"]).view(n, self.n_kv, hd)
        v = F.linear(x, self.w[p + "v_proj.weight"]).view(n, self.n_kv, hd)
        q = apply_neox_rope(q, positions, self.inv_freq)
        k = apply_neox_rope(k, positions, self.inv_freq)
        out = kv.attend(bank, q, k, v, hd**-0.5)
        return F.linear(out.reshape(n, self.n_heads * hd), self.w[p + "o_proj.weight"])
