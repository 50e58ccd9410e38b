"""Trainable looped LMs whose ``state_dict()`` is the real checkpoint: same tensor names and shapes.

* ``OuroLM``: Ouro's ``OuroForCausalLM`` (sandwich-norm Qwen2 layers looped T times, final norm after
  every loop, learned exit gate, untied head), names ``model.layers.{i}.self_attn.q_proj.weight`` ...
* ``RavenLM``: Huginn-0125's ``RavenForCausalLM`` (layout ``huginn``: embedding times sqrt(n_embd),
  prelude / adapter + core blocks looped / ln_f + coda, sandwich blocks with fused ``Wqkv`` and
  ``qk_bias``, interleaved RoPE, tied head), names ``transformer.core_block.{i}.attn.Wqkv.weight`` ...

Batched ``[B, S]`` training forms of what ``vllm_loop.reference`` computes one sequence at a time; the
math comes from the same functions (``reference.common``), and a CPU test checks logits of an
exported checkpoint against the reference. Dropout is training-only (not part of the checkpoint).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_loop.looped import ouro_exit_pdf, seeded_state
from vllm_loop.reference.common import apply_interleaved_rope, apply_neox_rope, rms_norm, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def _causal_attention(q, k, v, dropout: float) -> torch.Tensor:
    """``[B, S, h, d]`` q/k/v -> ``[B, S, h*d]`` causal softmax attention (scale d^-0.5)."""
    B, S, h, d = q.shape
    rep = h // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=rep > 1)
    return out.transpose(1, 2).reshape(B, S, h * d)


# -- Ouro ----------------------------------------------------------------------------------------------
class OuroAttention(nn.Module):
    def __init__(self, H, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(H, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(H, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(H, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, H, bias=False)

    def forward(self, x, positions, inv_freq, dropout):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim)
        q, k = apply_neox_rope(q, positions, inv_freq), apply_neox_rope(k, positions, inv_freq)
        return self.o_proj(_causal_attention(q, k, v, dropout))


class SwiGLU(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroLayer(nn.Module):
    def __init__(self, H, heads, kv_heads, head_dim, I, eps):
        super().__init__()
        self.self_attn = OuroAttention(H, heads, kv_heads, head_dim)
        self.mlp = SwiGLU(H, I)
        self.input_layernorm = RMSNorm(H, eps)
        self.input_layernorm_2 = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm_2 = RMSNorm(H, eps)

    def forward(self, x, positions, inv_freq, dropout):
        h = self.self_attn(self.input_layernorm(x), positions, inv_freq, dropout if self.training else 0.0)
        x = x + self.input_layernorm_2(_drop(h, dropout, self.training))
        h = self.mlp(self.post_attention_layernorm(x))
        return x + self.post_attention_layernorm_2(_drop(h, dropout, self.training))


def _drop(x, p, training):
    return F.dropout(x, p, training) if p > 0 and training else x


class OuroLM(nn.Module):
    """``forward(tokens [B, S]) -> (states, gate_logits)``: the T normed per-depth states ``[B, S, H]``
    and the exit-gate logits ``[T, B, S]``; ``logits(state)`` applies the LM head."""

    def __init__(self, cfg: dict, dropout: float = 0.0):
        super().__init__()
        H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        hd = cfg["head_dim"]
        self.depth, self.dropout = cfg["total_ut_steps"], dropout
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        self.model.layers = nn.ModuleList(
            OuroLayer(H, cfg["num_attention_heads"], cfg["num_key_value_heads"], hd, cfg["intermediate_size"],
                      cfg["rms_norm_eps"]) for _ in range(L))
        self.model.norm = RMSNorm(H, cfg["rms_norm_eps"])
        self.model.early_exit_gate = nn.Linear(H, 1, bias=True)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(hd, cfg["rope_theta"]), persistent=False)
        self._init(cfg.get("initializer_range", 0.02), L)

    def _init(self, std: float, layers: int):
        """Normal(std) projections, zero gate bias, unit gains, and unit-variance embeddings: every
        sublayer output is RMS-normalised (sandwich norm) before it joins the residual stream, so an
        embedding of the usual std 0.02 would be drowned by the first sublayer."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                continue
            if name.endswith("embed_tokens.weight"):
                nn.init.normal_(p, std=1.0)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, depth: int | None = None):
        T = depth or self.depth
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.model.embed_tokens(tokens)
        states, gates = [], []
        for _ in range(T):
            for layer in self.model.layers:
                x = layer(x, positions, self.inv_freq, self.dropout)
            x = self.model.norm(x)
            states.append(x)
            gates.append(self.model.early_exit_gate(x).squeeze(-1).float())
        return states, torch.stack(gates)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(state)

    @staticmethod
    def exit_pdf(gate_logits: torch.Tensor) -> torch.Tensor:
        return ouro_exit_pdf(gate_logits)


# -- Raven (Huginn layout) ---------------------------------------------------------------------------------
class HuginnAttention(nn.Module):
    def __init__(self, H, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.Wqkv = nn.Linear(H, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, heads, head_dim))
        self.proj = nn.Linear(heads * head_dim, H, bias=False)

    def forward(self, x, positions, inv_freq, dropout):
        B, S, _ = x.shape
        hd = self.head_dim
        q, k, v = self.Wqkv(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        q, k, v = q.view(B, S, self.heads, hd), k.view(B, S, self.kv_heads, hd), v.view(B, S, self.kv_heads, hd)
        q, k = q + self.qk_bias[0].to(q.dtype), k + self.qk_bias[1].to(k.dtype)
        q, k = apply_interleaved_rope(q, positions, inv_freq), apply_interleaved_rope(k, positions, inv_freq)
        return self.proj(_causal_attention(q, k, v, dropout))


class GatedMLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.fc = nn.Linear(H, 2 * I, bias=False)  # cat[gate, up]
        self.proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    def __init__(self, H, heads, kv_heads, head_dim, I, eps):
        super().__init__()
        self.norm_1 = RMSNorm(H, eps)
        self.attn = HuginnAttention(H, heads, kv_heads, head_dim)
        self.norm_2 = RMSNorm(H, eps)
        self.mlp = GatedMLP(H, I)
        self.norm_3 = RMSNorm(H, eps)
        self.norm_4 = RMSNorm(H, eps)

    def forward(self, x, positions, inv_freq, dropout):
        a = self.attn(self.norm_1(x), positions, inv_freq, dropout if self.training else 0.0)
        x = self.norm_2(_drop(a, dropout, self.training) + x)
        return self.norm_4(_drop(self.mlp(self.norm_3(x)), dropout, self.training) + x)


class RavenLM(nn.Module):
    """Huginn's forward in three pieces: ``embed`` (embedding x sqrt(n_embd), prelude),
    ``initial_state``, ``core`` (adapter on cat[state, embedded], core blocks: one recurrence) and
    ``readout`` (ln_f, coda, ln_f, tied head)."""

    def __init__(self, cfg: dict, dropout: float = 0.0):
        super().__init__()
        H, V, nh = cfg["n_embd"], cfg["padded_vocab_size"], cfg["n_heads"]
        nkv, hd, I, eps = cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["norm_eps"]
        self.depth, self.dropout = cfg["mean_recurrence"], dropout
        self.embed_scale = math.sqrt(H)
        self.state_std = float(cfg["init_values"]["std"])
        self.state_seed = int(cfg.get("state_init_seed", 0) or 0)

        def blocks(n):
            return nn.ModuleList(SandwichBlock(H, nh, nkv, hd, I, eps) for _ in range(n))

        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(V, H)
        self.transformer.prelude = blocks(cfg["n_layers_in_prelude"])
        self.transformer.adapter = nn.Linear(2 * H, H, bias=False)
        self.transformer.core_block = blocks(cfg["n_layers_in_recurrent_block"])
        self.transformer.coda = blocks(cfg["n_layers_in_coda"])
        self.transformer.ln_f = RMSNorm(H, eps)
        self.register_buffer("inv_freq", rope_inv_freq(hd, cfg["rope_base"]), persistent=False)
        self._init(cfg["init_values"])

    def _init(self, values: dict):
        """Huginn's scaled init: ``std`` for projections in, ``out_proj`` for projections out."""
        std, out, emb = values["std"], values["out_proj"], values["embedding"]
        for name, p in self.named_parameters():
            if name.endswith("qk_bias"):
                nn.init.zeros_(p)
            elif ".norm_" in name or "ln_f" in name:
                continue
            elif name.endswith("wte.weight"):
                nn.init.normal_(p, std=emb)
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                nn.init.normal_(p, std=out)
            else:
                nn.init.normal_(p, std=std)

    def _run(self, blocks, x, positions):
        for blk in blocks:
            x = blk(x, positions, self.inv_freq, self.dropout)
        return x

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self._run(self.transformer.prelude, self.transformer.wte(tokens) * self.embed_scale, positions)

    def initial_state(self, e: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``generator`` given: Huginn's random init (truncated normal, +-3 std, times the embedding
        scale), as in training; None: the deployment's ``state_init: seeded`` (a function of the
        position, identical in the reference and vLLM)."""
        std = self.state_std
        if generator is not None:
            x = torch.empty(e.shape, device=e.device, dtype=torch.float32)
            nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
            return (x * self.embed_scale).to(e.dtype)
        positions = torch.arange(e.shape[1], device=e.device)
        s = seeded_state(positions, e.shape[-1], std, self.state_seed) * self.embed_scale
        return s.to(e.dtype).unsqueeze(0).expand(e.shape[0], -1, -1)

    def core(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        x = self.transformer.adapter(torch.cat([x, e], dim=-1))
        return self._run(self.transformer.core_block, x, positions)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        x = self._run(self.transformer.coda, self.transformer.ln_f(x), positions)
        return F.linear(self.transformer.ln_f(x), self.transformer.wte.weight)

    def forward_depths(self, tokens: torch.Tensor, depths, generator=None) -> dict[int, torch.Tensor]:
        """Logits at each readout depth in ``depths`` (one pass through max(depths) recurrences)."""
        depths = sorted(set(depths))
        e = self.embed(tokens)
        x = self.initial_state(e, generator)
        out = {}
        for r in range(1, depths[-1] + 1):
            x = self.core(x, e)
            if r in depths:
                out[r] = self.readout(x)
        return out
