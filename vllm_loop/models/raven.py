"""Huginn-0125 and the retrofitted Raven models (``RavenForCausalLM``, model_type ``huginn_raven``).

prelude blocks -> state init -> T x [adapter(cat[state, prelude_out]) -> core blocks] -> coda -> head.
KV banks: prelude l -> l; core depth t, block l -> P + t*C + l; coda (per readout depth) after them
(see ``BankLayout``). The three block layouts differ only inside ``RavenBlock`` (and ``blocks``,
which joins Huginn's sandwich seams across blocks) and in whether ``ln_f`` also runs before the coda
(Huginn does, the retrofits do not).

The initial recurrent state follows ``state_init``: ``like-init`` (Huginn's default: a fresh
truncated normal draw per forward), ``zero``, or ``seeded`` (the same distribution, but a pure
function of (seed, position): reproducible across runs, batches and devices).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from vllm_loop.configs.raven import raven_embed_scale, raven_layout, raven_rope
from vllm_loop.looped import BankLayout, check_depth, seeded_state
from vllm_loop.loopspec.config import readout_depths as loopspec_readout_depths
from vllm_loop.models.layers import BankedAttention, GatedMLP, LoopedForCausalLM, add_norm_norm, load_named_weights
from vllm_loop.models.readouts import ReadoutRecorder, parse_readout_depths


def _rope(config, layout: str) -> dict:
    if layout == "huginn":  # GPT-J style (interleaved pairs), table from rope_base
        return {"rope_type": "default", "rope_theta": config.rope_base, "is_neox_style": False}
    theta, scaling = raven_rope(config)  # HF NeoX RoPE, llama3-scaled for Llama-3.2
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    scaling = dict(scaling)
    return {"rope_type": scaling.pop("rope_type", scaling.pop("type", "default")), "rope_theta": theta, **scaling}


class RavenBlock(nn.Module):
    """One transformer block in the checkpoint's layout; ``banks`` = its KV banks, one per depth."""

    def __init__(self, config, layout: str, banks: list[int], cache_config, quant_config, prefix: str):
        super().__init__()
        H, eps = config.n_embd, config.norm_eps
        self.layout = layout
        self.norm_1 = RMSNorm(H, eps=eps)
        self.attn = BankedAttention(
            H, config.n_heads, config.num_key_value_heads, config.head_dim, banks, _rope(config, layout),
            max_position=config.max_position_embeddings, qkv_name="Wqkv", out_name="proj",
            qk_bias=bool(config.qk_bias), qk_norm_eps=eps if layout == "olmo2" else None,
            cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn",
        )
        self.norm_2 = RMSNorm(H, eps=eps)
        self.mlp = GatedMLP(H, config.intermediate_size, up_name="fc", down_name="proj", quant_config=quant_config,
                            prefix=f"{prefix}.mlp")
        if layout == "huginn":
            self.norm_3 = RMSNorm(H, eps=eps)
            self.norm_4 = RMSNorm(H, eps=eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, bank: int) -> torch.Tensor:
        if self.layout == "huginn":  # (a stack of them runs through ``sandwich``, which fuses the seams)
            x, pending = self.sandwich(positions, x, None, bank, None)
            return self.norm_4(pending + x)
        if self.layout == "llama":  # pre-norm
            x = x + self.attn(positions, self.norm_1(x), bank)
            return x + self.mlp(self.norm_2(x))
        x = x + self.norm_1(self.attn(positions, x, bank))  # olmo2: post-norm
        return x + self.norm_2(self.mlp(x))

    def sandwich(self, positions: torch.Tensor, x: torch.Tensor, pending: torch.Tensor | None, bank,
                 before: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Huginn's block, ``x = norm_2(attn(norm_1(x)) + x)``, ``x = norm_4(mlp(norm_3(x)) + x)``, with
        its last add and norm left to the caller: returns ``(x, mlp output)``. ``pending``: the block
        before's MLP output, not yet added (its ``norm_4`` is ``before``), or None. So every seam
        (add, the norm that closes a sublayer, the norm that opens the next) is one ``add_norm_norm``."""
        if pending is None:
            h = self.norm_1(x)
        else:
            x, h = add_norm_norm(before, self.norm_1, pending, x)
        x, h = add_norm_norm(self.norm_2, self.norm_3, self.attn(positions, h, bank), x)
        return x, self.mlp(h)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class RavenModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.depth = check_depth("mean_recurrence", config.mean_recurrence)
        self.block_layout = raven_layout(config)
        readout_depths = parse_readout_depths(config, self.depth)
        self.readouts = ReadoutRecorder(readout_depths, vllm_config)
        P, C, D = config.n_layers_in_prelude, config.n_layers_in_recurrent_block, config.n_layers_in_coda
        # LoopSpec reads out at d1 and d2 too: their coda banks exist, and the ordinary forward fills them
        # for every token (the lanes of later positions attend over them).
        self.kv_readouts = tuple(r for r in loopspec_readout_depths(vllm_config) if r != self.depth)
        extra = sorted(set(readout_depths) | set(self.kv_readouts))
        coda_depths = (self.depth,) + tuple(r for r in extra if r != self.depth)
        self.layout = BankLayout(prelude=P, core=C, coda=D, depth=self.depth, coda_depths=coda_depths)
        # depths without coda banks of their own (a logits call's padding rows, at depth 0) read the depth-R
        # set: the Triton lane kernel looks ``bank_ids[depth]`` up unchecked, and -1 read out of bounds (an
        # illegal address on the H200 once late re-proposals added coda banks)
        coda_index = torch.zeros((self.depth + 1,), dtype=torch.long)
        for k, r in enumerate(coda_depths):
            coda_index[r] = k
        self.register_buffer("coda_index", coda_index, persistent=False)  # readout depth -> coda bank set
        H = config.n_embd
        self.embed_scale = raven_embed_scale(config, self.block_layout)
        self.state_std = float(config.init_values["std"])
        self.state_init = config.state_init
        self.state_seed = int(getattr(config, "state_init_seed", 0))

        def block(name: str, l: int, banks: list[int]) -> RavenBlock:
            return RavenBlock(config, self.block_layout, banks, vllm_config.cache_config, vllm_config.quant_config,
                              f"{prefix}.{name}.{l}")

        lay = self.layout
        self.wte = VocabParallelEmbedding(config.padded_vocab_size, H, prefix=f"{prefix}.wte")
        self.prelude = nn.ModuleList(block("prelude", l, [lay.prelude_bank(l)]) for l in range(P))
        self.adapter = ReplicatedLinear(2 * H, H, bias=bool(config.bias), prefix=f"{prefix}.adapter")
        self.core_block = nn.ModuleList(
            block("core_block", l, [lay.core_bank(t, l) for t in range(self.depth)]) for l in range(C)
        )
        self.coda = nn.ModuleList(block("coda", l, [lay.coda_bank(r, l) for r in coda_depths]) for l in range(D))
        self.ln_f = RMSNorm(H, eps=config.norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)

    def embed_tokens_module(self) -> nn.Module:
        return self.wte

    # The three pieces of a looped model (see vllm_loop/looped.py).
    def pre(self, positions: torch.Tensor, embeds: torch.Tensor, bank: int | torch.Tensor = 0):
        """-> (initial state, prelude output that every core step re-injects)."""
        e = self.blocks(self.prelude, positions, embeds * self.embed_scale, bank)
        return self.initial_state(positions, e), e

    def blocks(self, stack: nn.ModuleList, positions: torch.Tensor, x: torch.Tensor, bank) -> torch.Tensor:
        """``x`` through the blocks of ``stack`` at KV bank ``bank`` (one per row in lane calls)."""
        if self.block_layout != "huginn":
            for blk in stack:
                x = blk(positions, x, bank)
            return x
        pending, before = None, None
        for blk in stack:
            x, pending = blk.sandwich(positions, x, pending, bank, before)
            before = blk.norm_4
        return x if before is None else before(pending + x)

    def initial_state(self, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        std = self.state_std
        if self.state_init == "zero" or std == 0:
            return torch.zeros_like(like)
        if self.state_init == "seeded":
            x = seeded_state(positions, like.shape[-1], std, self.state_seed, dtype=torch.float32)
        else:  # like-init: truncated normal at +-3 std by inverse CDF, as torch's trunc_normal_
            lo = 0.5 * (1 + math.erf(-3 / math.sqrt(2)))
            u = torch.rand(like.shape, device=like.device, dtype=torch.float32)
            x = torch.erfinv((2 * lo - 1) + (2 - 4 * lo) * u) * (std * math.sqrt(2.0))
            x = x.clamp(-3 * std, 3 * std)
        return (x * self.embed_scale).to(like.dtype)

    def core_step(self, positions: torch.Tensor, x: torch.Tensor, inject: torch.Tensor, t: int | torch.Tensor):
        x, _ = self.adapter(torch.cat([x, inject], dim=-1))
        return self.blocks(self.core_block, positions, x, t)

    def post(self, positions: torch.Tensor, x: torch.Tensor, r: int | torch.Tensor) -> torch.Tensor:
        """Readout at depth r up to the LM head: [ln_f (Huginn)] -> coda (depth-r banks) -> ln_f.
        ``r``: one depth, or one per row (lanes)."""
        if self.block_layout == "huginn":
            x = self.ln_f(x)
        k = self.coda_index[r] if isinstance(r, torch.Tensor) else self.layout.coda_depths.index(r)
        return self.ln_f(self.blocks(self.coda, positions, x, k))

    # LoopSpec lanes: the state is [x | inject] (the prelude output travels with the lane).
    @property
    def lane_state_width(self) -> int:
        return 2 * self.config.n_embd

    def lane_pre(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, inject = self.pre(positions, self.wte(tokens), torch.zeros_like(positions))
        return torch.cat([x, inject], dim=-1)

    def lane_core(self, state: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        x, inject = state.chunk(2, dim=-1)
        return torch.cat([self.core_step(positions, x, inject, depths), inject], dim=-1)

    def lane_readout(self, state: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        return self.post(positions, state.chunk(2, dim=-1)[0], depths)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        embeds = inputs_embeds if inputs_embeds is not None else self.wte(input_ids)
        x, inject = self.pre(positions, embeds)
        for t in range(self.depth):
            x = self.core_step(positions, x, inject, t)
            if self.readouts.wants(t + 1) and t + 1 != self.depth:
                self.readouts.record(t + 1, self.post(positions, x, t + 1))
            elif t + 1 in self.kv_readouts:
                self.post(positions, x, t + 1)  # only for its coda KV (LoopSpec lanes read it)
        out = self.post(positions, x, self.depth)
        if self.readouts.wants(self.depth):
            self.readouts.record(self.depth, out)
        return out


class RavenForCausalLM(LoopedForCausalLM):
    decoder_attr = "transformer"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.transformer = RavenModel(vllm_config=vllm_config, prefix="transformer")
        self._init_head(config.padded_vocab_size, config.n_embd, config.tie_embeddings, config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str):
            if name == "freqs_cis":  # Huginn stores its RoPE table; vLLM computes its own
                return None
            if name == "lm_head.weight" and self.config.tie_embeddings:  # stored twice although tied
                return None
            return name, None

        return load_named_weights(self, weights, rename)
