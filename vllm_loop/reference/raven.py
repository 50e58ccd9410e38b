"""Reference Raven (``RavenForCausalLM``): Huginn-0125 and the retrofitted Llama / OLMo-2 models.

    pre:        e = wte(tokens) * embed_scale; e = prelude blocks (banks ("pre", l)); s0 = initial state
    core_step:  x = adapter(cat[state, e]); x = core blocks (banks ("core", t, l))
    readout(r): x = state_r; [huginn: x = ln_f(x)]; x = coda blocks (banks ("coda", r, l));
                logits = lm_head(ln_f(x)) in fp32

Block layouts (``raven_layout``):

* huginn (SandwichBlock):  x = norm_2(attn(norm_1(x)) + x);  x = norm_4(mlp(norm_3(x)) + x)
* llama (pre-norm):        x = x + attn(norm_1(x));           x = x + mlp(norm_2(x))
* olmo2 (post-norm):       x = x + norm_1(attn(x));           x = x + norm_2(mlp(x))

Attention: fused ``Wqkv`` split ``[nH*hd, nKV*hd, nKV*hd]``; olmo2 RMS-normalises the full projected q
and k (``q_norm``, ``k_norm``) before the head reshape; ``qk_bias`` (``[2, 1, nH, hd]``, huginn) is
added to q and k before RoPE; RoPE is interleaved (GPT-J) from ``rope_base`` for huginn and NeoX
(HF Llama, optionally llama3-scaled) from ``rope_theta`` / ``rope_scaling`` for the retrofits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_loop.configs.raven import STATE_INITS, RavenConfig, raven_embed_scale, raven_layout, raven_rope
from vllm_loop.looped import seeded_state
from vllm_loop.reference.base import LoopedReference, LoopState
from vllm_loop.reference.common import apply_interleaved_rope, apply_neox_rope, gated_mlp, rms_norm, rope_inv_freq

_BLOCK_TENSORS = {
    "huginn": ("norm_1", "attn.Wqkv", "attn.qk_bias", "attn.proj", "norm_2", "mlp.fc", "mlp.proj", "norm_3", "norm_4"),
    "llama": ("norm_1", "attn.Wqkv", "attn.proj", "norm_2", "mlp.fc", "mlp.proj"),
    "olmo2": ("norm_1", "attn.Wqkv", "attn.q_norm", "attn.k_norm", "attn.proj", "norm_2", "mlp.fc", "mlp.proj"),
}


def _block_tensor_names(layout: str, prefix: str, qk_bias: bool) -> list[str]:
    names = []
    for t in _BLOCK_TENSORS[layout]:
        if t == "attn.qk_bias":
            if qk_bias:
                names.append(prefix + t)
        else:
            names.append(prefix + t + ".weight")
    return names


def raven_tensor_names(config: RavenConfig, layout: str) -> list[str]:
    """The state-dict names the reference reads (``freqs_cis`` and a tied duplicate ``lm_head`` are
    allowed extras; see ``IGNORED_TENSORS``)."""
    names = ["transformer.wte.weight", "transformer.adapter.weight", "transformer.ln_f.weight"]
    if config.bias:
        names.append("transformer.adapter.bias")
    if not config.tie_embeddings:
        names.append("lm_head.weight")
    for part, count in (
        ("prelude", config.n_layers_in_prelude),
        ("core_block", config.n_layers_in_recurrent_block),
        ("coda", config.n_layers_in_coda),
    ):
        for i in range(count):
            names += _block_tensor_names(layout, f"transformer.{part}.{i}.", config.qk_bias)
    return names


# Stored in real checkpoints but not read: Huginn's RoPE table (recomputed from positions) and the
# second copy of the tied embedding.
IGNORED_TENSORS = ("freqs_cis", "lm_head.weight")


class RavenReference(LoopedReference):
    def __init__(self, config: RavenConfig, weights: dict[str, torch.Tensor], depth: int):
        super().__init__()
        self.config, self.w, self.depth = config, weights, depth
        self.layout = raven_layout(config)
        if config.state_init not in STATE_INITS:
            raise ValueError(f"state_init={config.state_init!r} is invalid; allowed: {', '.join(STATE_INITS)}")
        self.n_heads, self.n_kv = config.n_heads, config.num_key_value_heads
        self.head_dim = self._head_dim(config)
        self.eps = config.norm_eps
        self.embed_scale = raven_embed_scale(config, self.layout)
        self.head_weight = weights["transformer.wte.weight" if config.tie_embeddings else "lm_head.weight"]
        self.vocab_size = self.head_weight.shape[0]
        if self.layout == "huginn":
            self.inv_freq, self.rope = rope_inv_freq(self.head_dim, config.rope_base), apply_interleaved_rope
        else:
            theta, scaling = raven_rope(config)
            self.inv_freq, self.rope = rope_inv_freq(self.head_dim, theta, scaling), apply_neox_rope

    def _head_dim(self, config: RavenConfig) -> int:
        # Huginn and the Llama retrofit derive it as n_embd // n_heads (and split q as n_embd wide);
        # only the OLMo-2 file reads config.head_dim. Refuse configs where these disagree.
        derived = config.n_embd // config.n_heads
        if self.layout == "olmo2":
            return config.head_dim
        if config.head_dim != derived or derived * config.n_heads != config.n_embd:
            raise ValueError(
                f"head_dim={config.head_dim} but the {self.layout} layout uses n_embd // n_heads = {derived}"
            )
        return derived

    # -- the three pieces ----------------------------------------------------------------------
    def pre(self, tokens, positions, kv) -> LoopState:
        e = F.embedding(tokens, self.w["transformer.wte.weight"])
        if self.embed_scale != 1:
            e = e * self.embed_scale
        for layer in range(self.config.n_layers_in_prelude):
            e = self._block(e, f"transformer.prelude.{layer}.", ("pre", layer), positions, kv)
        return LoopState(h=self.initial_state(e, positions), inject=e)

    def core_step(self, state, t, positions, kv) -> LoopState:
        x = F.linear(torch.cat([state.h, state.inject], dim=-1), self.w["transformer.adapter.weight"],
                     self.w.get("transformer.adapter.bias"))
        for layer in range(self.config.n_layers_in_recurrent_block):
            x = self._block(x, f"transformer.core_block.{layer}.", ("core", t, layer), positions, kv)
        return LoopState(h=x, inject=state.inject)

    def readout(self, state, r, positions, kv) -> torch.Tensor:
        ln_f = self.w["transformer.ln_f.weight"]
        x = rms_norm(state.h, ln_f, self.eps) if self.layout == "huginn" else state.h
        for layer in range(self.config.n_layers_in_coda):
            x = self._block(x, f"transformer.coda.{layer}.", ("coda", r, layer), positions, kv)
        return F.linear(rms_norm(x, ln_f, self.eps), self.head_weight).float()

    # -- initial recurrent state -------------------------------------------------------------------
    def initial_state(self, e: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The state before depth 1, per position (``config.state_init``):

        * ``like-init`` (Huginn): trunc-normal(0, std, +-3 std) from torch's global RNG, drawn the way
          Huginn's ``initialize_state`` draws it, times embed_scale: random per forward;
        * ``zero``: zeros (Huginn's ``init_scale=0``);
        * ``seeded``: ``seeded_state(positions, H, std, state_init_seed)`` times embed_scale, computed
          in fp32 and cast once: a pure function of the position, so any implementation agrees.
        """
        std = float(self.config.init_values["std"])
        mode = self.config.state_init
        if mode == "zero" or std == 0:
            return torch.zeros_like(e)
        if mode == "like-init":
            x = torch.randn_like(e)  # Huginn draws (and discards) a normal sample first; keep RNG parity
            torch.nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std)
            return x * self.embed_scale if self.embed_scale != 1 else x
        seed = int(getattr(self.config, "state_init_seed", 0) or 0)
        return (seeded_state(positions, e.shape[-1], std, seed) * self.embed_scale).to(e.dtype)

    # -- blocks ----------------------------------------------------------------------------------
    def _block(self, x, p, bank, positions, kv):
        w, eps = self.w, self.eps

        def norm(name, h):
            return rms_norm(h, w[p + name + ".weight"], eps)

        def mlp(h):
            gate, up = w[p + "mlp.fc.weight"].chunk(2, dim=0)
            return gated_mlp(h, gate, up, w[p + "mlp.proj.weight"])

        def attn(h):
            return self._attention(h, p + "attn.", bank, positions, kv)

        if self.layout == "huginn":
            x = norm("norm_2", attn(norm("norm_1", x)) + x)
            return norm("norm_4", mlp(norm("norm_3", x)) + x)
        if self.layout == "llama":
            x = attn(norm("norm_1", x)) + x
            return mlp(norm("norm_2", x)) + x
        x = norm("norm_1", attn(x)) + x  # olmo2: post-norm on the sublayer output
        return norm("norm_2", mlp(x)) + x

    def _attention(self, x, p, bank, positions, kv):
        n, hd, w = x.shape[0], self.head_dim, self.w
        q, k, v = F.linear(x, w[p + "Wqkv.weight"]).split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        if self.layout == "olmo2":  # RMSNorm over the full projected q / k, before the head reshape
            q = rms_norm(q, w[p + "q_norm.weight"], self.eps)
            k = rms_norm(k, w[p + "k_norm.weight"], self.eps)
        q, k, v = q.reshape(n, self.n_heads, hd), k.reshape(n, self.n_kv, hd), v.reshape(n, self.n_kv, hd)
        if self.config.qk_bias:  # [2, 1, nH, hd]: added before RoPE
            bias = w[p + "qk_bias"]
            q, k = q + bias[0], k + bias[1]
        q, k = self.rope(q, positions, self.inv_freq), self.rope(k, positions, self.inv_freq)
        out = kv.attend(bank, q, k, v, hd**-0.5)
        return F.linear(out.reshape(n, self.n_heads * hd), w[p + "proj.weight"])
