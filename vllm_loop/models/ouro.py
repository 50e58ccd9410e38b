"""Ouro (ByteDance) in vLLM: L Qwen2-like sandwich layers looped T = ``total_ut_steps`` times.

Depth t of layer l reads and writes KV bank ``t*L + l``. The final RMSNorm runs after every loop and
its output feeds the next loop. The learned exit gate is loaded and usable as an exact readout
selector: all T loops always run; ``early_exit_step`` (read that 0-based loop) or
``early_exit_threshold`` < 1 (per token, the first loop whose exit CDF reaches it) only choose
which state the LM head reads, as in Ouro's own modeling code.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from vllm_loop.looped import BankLayout, check_depth, ouro_exit_depth, ouro_exit_pdf
from vllm_loop.models.layers import BankedAttention, GatedMLP, LoopedForCausalLM, load_named_weights, norm_add_norm
from vllm_loop.models.readouts import ReadoutRecorder, parse_readout_depths


class OuroLayer(nn.Module):
    """``x += norm_2(attn(norm_1(x)))``, ``x += norm_4(mlp(norm_3(x)))`` (Ouro's sandwich norms)."""

    def __init__(self, config, layout: BankLayout, layer: int, cache_config, quant_config, prefix: str):
        super().__init__()
        H = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
        rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": config.rope_theta})
        self.self_attn = BankedAttention(
            H, config.num_attention_heads, config.num_key_value_heads, head_dim,
            banks=[layout.core_bank(t, layer) for t in range(layout.depth)], rope=rope,
            max_position=config.max_position_embeddings, cache_config=cache_config, quant_config=quant_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = GatedMLP(H, config.intermediate_size, quant_config=quant_config, prefix=f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps=eps)
        self.input_layernorm_2 = RMSNorm(H, eps=eps)
        self.post_attention_layernorm = RMSNorm(H, eps=eps)
        self.post_attention_layernorm_2 = RMSNorm(H, eps=eps)

    def forward(self, positions, x, residual, t: int, before: RMSNorm | None = None):
        """``x``: the loop's input (``residual`` None), or the layer before's MLP output, whose norm
        (``before``, its ``post_attention_layernorm_2``) runs here, fused with this layer's first:
        every seam between sublayers is one norm -> add -> norm (``norm_add_norm``). Returns this
        layer's MLP output, not yet normed, and the residual stream."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = norm_add_norm(before, self.input_layernorm, x, residual)
        h, residual = norm_add_norm(self.input_layernorm_2, self.post_attention_layernorm,
                                    self.self_attn(positions, h, t), residual)
        return self.mlp(h), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class OuroModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.depth = check_depth("total_ut_steps", config.total_ut_steps)
        L = config.num_hidden_layers
        self.layout = BankLayout(prelude=0, core=L, coda=0, depth=self.depth)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            OuroLayer(config, self.layout, l, vllm_config.cache_config, vllm_config.quant_config, f"{prefix}.layers.{l}")
            for l in range(L)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.early_exit_gate = ReplicatedLinear(config.hidden_size, 1, bias=True, prefix=f"{prefix}.early_exit_gate")
        self.exit_step = getattr(config, "early_exit_step", None)
        threshold = getattr(config, "early_exit_threshold", None)
        self.exit_threshold = 1.0 if threshold is None else float(threshold)
        if self.exit_step is not None and not 0 <= self.exit_step < self.depth:
            raise ValueError(f"early_exit_step={self.exit_step!r} is invalid: allowed 0..{self.depth - 1}")
        self.readouts = ReadoutRecorder(parse_readout_depths(config, self.depth), vllm_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def embed_tokens_module(self) -> nn.Module:
        return self.embed_tokens

    # The three pieces of a looped model (see vllm_loop/looped.py).
    def pre(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def core_step(self, positions: torch.Tensor, h: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        residual, before = None, None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, t, before)
            before = layer.post_attention_layernorm_2
        h, _ = norm_add_norm(before, self.norm, h, residual)
        return h

    # LoopSpec lanes: the state is h itself; the final norm already ran, so a readout is the LM head.
    @property
    def lane_state_width(self) -> int:
        return self.embed_tokens.embedding_dim

    def lane_pre(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.pre(tokens)

    def lane_core(self, state: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        return self.core_step(positions, state, depths)

    def lane_readout(self, state: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        return state

    def exit_pdf(self, states: list[torch.Tensor]) -> torch.Tensor:
        """Per-token exit probabilities over depths, ``[T, n]``, from the gate on each depth's state."""
        gate = torch.stack([self.early_exit_gate(s)[0].squeeze(-1) for s in states])
        return ouro_exit_pdf(gate)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        h = inputs_embeds if inputs_embeds is not None else self.pre(input_ids)
        select = self.exit_step is not None or self.exit_threshold < 1.0
        states = []
        for t in range(self.depth):
            h = self.core_step(positions, h, t)
            if select:
                states.append(h.clone())  # the next loop's fused add+norm updates h in place (GPU)
            if self.readouts.wants(t + 1):
                self.readouts.record(t + 1, h)
        if self.exit_step is not None:
            return states[self.exit_step]
        if select:
            chosen = ouro_exit_depth(self.exit_pdf(states), self.exit_threshold)  # [n]
            stacked = torch.stack(states)  # [T, n, H]
            return stacked.gather(0, chosen.view(1, -1, 1).expand(1, -1, h.shape[-1])).squeeze(0)
        return h


class OuroForCausalLM(LoopedForCausalLM):
    decoder_attr = "model"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = OuroModel(vllm_config=vllm_config, prefix="model")
        self._init_head(config.vocab_size, config.hidden_size, config.tie_word_embeddings)

    _STACKED = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
                ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str):
            if name.startswith("lm_head.") and self.config.tie_word_embeddings:
                return None
            for old, (new, shard) in self._STACKED.items():
                if old in name:
                    return name.replace(old, new), shard
            return name, None

        return load_named_weights(self, weights, rename)
