"""Building blocks of the looped vLLM models: banked attention, gated MLP, weight loading.

``BankedAttention`` is the one place the recurrent-depth KV layout touches vLLM: a physical attention
layer that is applied at several depths owns one vLLM ``Attention`` per depth ("bank"), all sharing
its projection weights. vLLM sizes the KV cache from the registered ``Attention`` modules, so T
applications of L weight layers get T·L cache layers, in one KV-cache group and one block table.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader


# "0": lane calls run SiLU-and-mul and the down projection as vLLM's two kernels (the benchmark's
# ``-unfused`` systems, to time the fused kernel side by side); anything else: ``swiglu_down`` in
# ``GatedMLP.forward``
SWIGLU_ENV = "VLLM_LOOP_LANE_SWIGLU"

# LoopSpec runs batches of lanes whose rows sit at different depths. For the length of such a call
# the runner installs its lane attention here, and every ``bank`` argument is a tensor of per-row
# depths instead of one int: ``attend(bank_ids, depths [n], q [n, Hq, D], k, v [n, Hkv, D], scale, rope,
# bias)``, row i at global bank ``bank_ids[depths[i]]`` (the attention looks it up: one kernel less per
# layer), q and k without their bias (``bias``: (q bias, k bias) flat, or None) and not yet rotated
# (``rope = (rotary_emb, positions)``): the attention adds and applies them (the kernel fuses both where
# it can).
_lane_attention: Callable | None = None


@contextmanager
def lane_attention(attend: Callable):
    global _lane_attention
    previous, _lane_attention = _lane_attention, attend
    try:
        yield
    finally:
        _lane_attention = previous


def _fused_seam(x: torch.Tensor, *norms: nn.Module) -> bool:
    """Whether a sandwich seam runs as one Triton kernel (``kernels/norm_add_norm.py``): on CUDA and
    outside torch.compile, i.e. in lane calls and in vLLM's forward when it is not compiled (a
    LoopSpec engine's default on one GPU), where nothing else fuses the norms; a compiled forward
    traces the plain norms for Inductor to fuse (and the CPU runs them as written)."""
    return x.is_cuda and not torch.compiler.is_compiling() and all(
        getattr(m, "has_weight", False) and m.variance_size_override is None for m in norms)


def norm_add_norm(first: nn.Module, second: nn.Module, x: torch.Tensor,
                  residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``second(first(x), residual)`` of two vLLM ``RMSNorm``s: the normed sum and the new residual
    (Ouro's seams)."""
    if _fused_seam(x, first, second):
        from vllm_loop_kernels.norm_add_norm import norm_add_norm as fused

        return fused(x, residual, first.weight, first.variance_epsilon, second.weight, second.variance_epsilon)
    return second(first(x), residual)


def add_norm_norm(first: nn.Module, second: nn.Module, a: torch.Tensor,
                  x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = first(a + x)`` and ``second(y)`` of two vLLM ``RMSNorm``s (Huginn's seams: the stream
    is normed after each add, then normed again as the next sublayer's input)."""
    if _fused_seam(x, first, second):
        from vllm_loop_kernels.norm_add_norm import add_norm_norm as fused

        return fused(a, x, first.weight, first.variance_epsilon, second.weight, second.variance_epsilon)
    y = first(a + x)
    return y, second(y)


def bank_prefix(bank: int) -> str:
    """vLLM's KV layer name for a bank: exactly one integer (``extract_layer_index`` requires it)."""
    return f"model.layers.{bank}.self_attn.attn"


class HeadShards:
    """Which attention heads this tensor-parallel rank holds, the way vLLM's ``QKVParallelLinear``
    splits them: query heads in equal blocks; KV heads in equal blocks, or (fewer KV heads than
    ranks) one head per rank, ``tp // num_kv_heads`` consecutive ranks sharing each."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        self.tp = get_tensor_model_parallel_world_size()
        self.rank = get_tensor_model_parallel_rank() if self.tp > 1 else 0
        if num_heads % self.tp or (num_kv_heads % self.tp and self.tp % num_kv_heads):
            raise ValueError(f"{num_heads} query / {num_kv_heads} KV heads do not split over "
                             f"tensor_parallel_size={self.tp}")
        self.q_heads = num_heads // self.tp
        self.kv_heads = max(1, num_kv_heads // self.tp)
        self.q_first = self.rank * self.q_heads
        self.kv_first = self.rank // max(1, self.tp // num_kv_heads) * self.kv_heads

    def loader(self, kind: str, dim: int, per_head: int) -> Callable:
        """A ``weight_loader`` that copies this rank's heads (``kind`` "q" or "kv") of a full
        checkpoint tensor: along ``dim``, ``per_head`` entries per head."""
        first, count = (self.q_first, self.q_heads) if kind == "q" else (self.kv_first, self.kv_heads)

        def load(param: torch.Tensor, loaded: torch.Tensor) -> None:
            part = loaded.narrow(dim, first * per_head, count * per_head)
            if part.shape != param.shape:
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit this rank's "
                                 f"{tuple(param.shape)} (tensor_parallel_size={self.tp})")
            param.data.copy_(part)

        return load


class ShardedWeight(nn.Module):
    """A per-feature weight (``.weight``, a norm's gain) of which this rank holds its heads' slice."""

    def __init__(self, shards: HeadShards, kind: str, head_dim: int):
        super().__init__()
        heads = shards.q_heads if kind == "q" else shards.kv_heads
        self.weight = nn.Parameter(torch.ones(heads * head_dim), requires_grad=False)
        self.weight.weight_loader = shards.loader(kind, 0, head_dim)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the full q and the full k projections (all heads at once: OLMo-2) when each of
    ``tp`` ranks holds some of the heads (``q``, ``k``, the weights: this rank's slices).

    The statistics need every head, so the ranks all-reduce their per-row sums of squares, q and k
    together: one ``[n, 2]`` all-reduce per call. (vLLM 0.26 runs OLMo-2 on its Transformers backend;
    its OLMo-3 model all-gathers the whole of q and k, normalises and slices. The sums are all that
    is needed.) A replicated KV head (fewer KV heads
    than ranks) is summed by each of its ``tp // num_kv_heads`` ranks; dividing by ``tp`` times the
    local width accounts for that, and is the full width when nothing is replicated."""
    qf, kf = q.float(), k.float()
    sums = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=-1)  # [n, 2]
    if tp > 1:
        sums = tensor_model_parallel_all_reduce(sums)
    q_var, k_var = sums[:, :1] / (tp * q.shape[-1]), sums[:, 1:] / (tp * k.shape[-1])
    q = (qf * torch.rsqrt(q_var + eps)).to(q.dtype) * q_weight
    k = (kf * torch.rsqrt(k_var + eps)).to(k.dtype) * k_weight
    return q, k


class BankedAttention(nn.Module):
    """Self-attention with fused QKV, optional q/k bias and q/k RMSNorm, RoPE, and one KV bank
    per depth at which the layer is applied (``forward(..., bank=k)`` picks the k-th).

    Under tensor parallelism each rank holds its heads (``HeadShards``): of the projections, of the
    q/k bias and of the q/k norm weights; the KV banks hold this rank's KV heads."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        banks: Sequence[int],
        rope: dict,
        *,
        max_position: int,
        qkv_name: str = "qkv_proj",
        out_name: str = "o_proj",
        qk_bias: bool = False,
        qk_norm_eps: float | None = None,
        cache_config=None,
        quant_config=None,
        prefix: str = "",
    ):
        super().__init__()
        shards = HeadShards(num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads = shards.q_heads, shards.kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_name, self.out_name = qkv_name, out_name
        setattr(
            self,
            qkv_name,
            QKVParallelLinear(
                hidden_size, head_dim, num_heads, num_kv_heads, bias=False, quant_config=quant_config,
                prefix=f"{prefix}.{qkv_name}",
            ),
        )
        setattr(
            self,
            out_name,
            RowParallelLinear(
                num_heads * head_dim, hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.{out_name}"
            ),
        )
        # Huginn adds a learned bias to q and k before RoPE; stored as [2, 1, heads, head_dim]. Huginn is
        # MHA: the k bias has one entry per query head too, so both halves split like the query heads.
        self.qk_bias = None
        if qk_bias:
            if num_kv_heads != num_heads:
                raise ValueError(f"qk_bias needs as many KV heads as query heads ({num_kv_heads} != {num_heads})")
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.num_heads, head_dim), requires_grad=False)
            self.qk_bias.weight_loader = shards.loader("q", 2, 1)
        # OLMo-2 normalises the full q and k projections (all heads at once) before RoPE.
        self.tp, self.qk_norm_eps = shards.tp, qk_norm_eps
        self.q_norm = ShardedWeight(shards, "q", head_dim) if qk_norm_eps is not None else None
        self.k_norm = ShardedWeight(shards, "kv", head_dim) if qk_norm_eps is not None else None
        self.rotary_emb = get_rope(
            head_dim,
            max_position=max_position,
            is_neox_style=rope.get("is_neox_style", True),
            rope_parameters={k: v for k, v in rope.items() if k != "is_neox_style"},
        )
        self.head_dim, self.scale = head_dim, head_dim**-0.5
        self.banks = nn.ModuleList(
            Attention(
                self.num_heads, head_dim, self.scale, num_kv_heads=self.num_kv_heads, cache_config=cache_config,
                quant_config=quant_config, prefix=bank_prefix(b),
            )
            for b in banks
        )
        self.register_buffer("bank_ids", torch.tensor(list(banks), dtype=torch.long), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, bank: int | torch.Tensor) -> torch.Tensor:
        qkv = lane_linear(getattr(self, self.qkv_name), x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, k = qk_rms_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.qk_norm_eps, self.tp)
        # Huginn is MHA: one k bias per query head
        bias = None if self.qk_bias is None else (self.qk_bias[0].reshape(-1), self.qk_bias[1].reshape(-1))
        # a LoopSpec lane call: each row reads its own bank, and the q / k bias and RoPE are the lane
        # attention's (it may fuse them)
        if isinstance(bank, torch.Tensor):
            n, D = q.shape[0], self.head_dim
            attn = _lane_attention(self.bank_ids, bank, q.view(n, -1, D), k.view(n, -1, D), v.view(n, -1, D),
                                   self.scale, rope=(self.rotary_emb, positions), bias=bias).reshape(n, -1)
        else:
            if bias is not None:
                q, k = q + bias[0], k + bias[1]
            q, k = self.rotary_emb(positions, q, k)
            attn = self.banks[bank](q, k, v)
        return lane_linear(getattr(self, self.out_name), attn)


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused in one matrix (gate first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, up_name="gate_up_proj", down_name="down_proj",
                 quant_config=None, prefix: str = ""):
        super().__init__()
        self.up_name, self.down_name = up_name, down_name
        setattr(self, up_name, MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.{up_name}"))
        setattr(self, down_name, RowParallelLinear(
            intermediate_size, hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.{down_name}"))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = lane_linear(getattr(self, self.up_name), x)
        down = getattr(self, self.down_name)
        if _few_rows_lane_call(h, down, "SWIGLU_MAX_ROWS") and os.environ.get(SWIGLU_ENV) != "0":
            # SiLU-and-mul inside the down projection: at a few rows the activation's own launch costs
            # more than its work (``kernels/skinny_gemm.py: swiglu_down``)
            from vllm_loop_kernels.skinny_gemm import swiglu_down

            return swiglu_down(h, down.weight)
        out, _ = down(self.act(h))
        return out


def _few_rows_lane_call(x: torch.Tensor, layer: nn.Module, limit: str) -> bool:
    """Whether a lane call's ``layer(x)`` may run on a few-rows Triton GEMM (``kernels/skinny_gemm.py``):
    on CUDA, outside torch.compile (checked first: nothing else here is traced), at most
    ``skinny_gemm.<limit>`` rows, an unsharded, unquantized, bias-free layer of x's dtype. Anything
    else is vLLM's layer."""
    if _lane_attention is None or not x.is_cuda or torch.compiler.is_compiling():
        return False
    from vllm_loop_kernels import skinny_gemm

    return (x.shape[0] <= getattr(skinny_gemm, limit) and layer.tp_size == 1 and layer.bias is None
            and isinstance(layer.quant_method, UnquantizedLinearMethod) and layer.weight.dtype == x.dtype)


def lane_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """vLLM's linear ``layer(x)``, its output only (cuBLAS: as fast as a few-rows Triton GEMM at lane
    calls' rows, benchmarks/RESULTS.md)."""
    out, _ = layer(x)
    return out


# Checkpoint names of the shards of a fused parameter (Llama / Qwen2-style checkpoints store q, k, v
# and gate, up separately; vLLM loads them into one matrix, shard by shard).
STACKED_SOURCES: dict[str, dict] = {
    ".qkv_proj.": {"q": ".q_proj.", "k": ".k_proj.", "v": ".v_proj."},
    ".gate_up_proj.": {0: ".gate_proj.", 1: ".up_proj."},
}


def stacked_target(name: str) -> tuple[str, object]:
    """``(parameter name, shard id)`` a Llama-style checkpoint tensor loads into (shard None: the
    whole parameter), the inverse of ``STACKED_SOURCES``."""
    for fused, sources in STACKED_SOURCES.items():
        for shard, source in sources.items():
            if source in name:
                return name.replace(source, fused), shard
    return name, None


def _shards(module: nn.Module | None) -> tuple | None:
    """Shard ids a fused linear layer is loaded by, or None for a parameter loaded whole."""
    if isinstance(module, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(module, MergedColumnParallelLinear):
        return tuple(range(len(module.output_sizes)))
    return None


def _source_name(param: str, shard) -> str:
    for fused, sources in STACKED_SOURCES.items():
        if fused in param and shard in sources:
            return param.replace(fused, sources[shard])
    return f"{param} (shard {shard!r})"


def check_weights_loaded(model: nn.Module, loaded: Iterable[tuple[str, object]]) -> None:
    """Fail unless the checkpoint filled every parameter of ``model`` (every shard of a fused one).

    ``loaded``: ``(parameter name, shard id or None)`` of each tensor that was loaded. vLLM 0.26's
    own check (``DefaultModelLoader.track_weights_loading``) counts every parameter of a linear layer
    as loaded whether or not it was, so a checkpoint missing, say, one layer's ``down_proj`` would
    otherwise serve the random-initialised matrix. The error names the missing tensors the way the
    checkpoint spells them (``q_proj`` / ``gate_proj`` for a shard of a fused matrix)."""
    whole: set[str] = set()
    shards: dict[str, set] = defaultdict(set)
    for name, shard in loaded:
        (whole.add(name) if shard is None else shards[name].add(shard))
    modules = dict(model.named_modules())
    missing: list[str] = []
    for name, _ in model.named_parameters():
        if name in whole:
            continue
        expected, got = _shards(modules.get(name.rpartition(".")[0])), shards.get(name, set())
        if expected is None or (not got and not any(f in name for f in STACKED_SOURCES)):
            missing.append(name)  # a parameter the checkpoint stores as one tensor
        else:
            missing.extend(_source_name(name, s) for s in expected if s not in got)
    if missing:
        shown = ", ".join(missing[:12]) + (f", ... ({len(missing)} in all)" if len(missing) > 12 else "")
        raise ValueError(f"checkpoint is missing tensors this model needs: {shown}")


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename,
) -> set[str]:
    """Load checkpoint tensors by name. ``rename(hf_name) -> (param_name, shard_id) | None``
    (None skips the tensor, e.g. Huginn's stored RoPE table). Returns the parameters loaded;
    raises ``ValueError`` naming the tensors the checkpoint lacks (``check_weights_loaded``)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    filled: list[tuple[str, object]] = []
    for hf_name, tensor in weights:
        target = rename(hf_name)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise KeyError(f"checkpoint tensor {hf_name!r} maps to {name!r}, which this model does not have")
        param = params[name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(name)
        filled.append((name, shard))
    check_weights_loaded(model, filled)
    return loaded


class LoopedForCausalLM(nn.Module):
    """vLLM's causal-LM interface around a looped decoder: forward, logits, depth readouts.

    Subclasses set ``decoder_attr`` (the checkpoint's prefix: Ouro ``model``, Raven ``transformer``),
    build the decoder there, and call ``_init_head``.
    """

    decoder_attr: str

    @property
    def decoder(self) -> nn.Module:
        return getattr(self, self.decoder_attr)

    def _init_head(self, vocab_size: int, hidden_size: int, tie: bool, logical_vocab: int | None = None) -> None:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        self.lm_head = self.decoder.embed_tokens_module() if tie else ParallelLMHead(
            vocab_size, hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(vocab_size, logical_vocab or vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        return self.decoder(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def recorded_readouts(self) -> dict[int, torch.Tensor]:
        """Logits of every depth readout recorded in the last forward (``readout_depths``)."""
        return {r: self.compute_logits(h) for r, h in self.decoder.readouts.recorded.items()}

    # -- LoopSpec lanes: one row per lane, each row at its own depth (vllm_loop/loopspec/runner.py) --------
    # A lane's hidden state is one row of ``lane_state_width`` numbers; calls run under ``lane_attention``.
    @property
    def lane_state_width(self) -> int:
        return self.decoder.lane_state_width

    def lane_pre(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Depth-0 states of new lanes."""
        return self.decoder.lane_pre(tokens, positions)

    def lane_core(self, state: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """One core step for every row: depth ``depths[i]`` -> ``depths[i] + 1``."""
        return self.decoder.lane_core(state, positions, depths)

    def lane_logits(self, state: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """Logits of each row read out at its current depth (1..T)."""
        return self.compute_logits(self.decoder.lane_readout(state, positions, depths))
