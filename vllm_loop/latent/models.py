"""Latent-reasoning models in vLLM: vLLM's own GPT-2 and Llama, plus one inject path.

The only change to the model is right after the embedding lookup (the "Faster fuzzy minds" recipe):

    x = torch.where(latent_mask[:n, None], latent_embeds[:n], embed(input_ids))

``latent_mask`` / ``latent_embeds`` are persistent buffers that the latent driver fills before each
step (``vllm_loop/latent/driver.py``); a step without latent rows passes an all-false mask, so the
same code runs inside every captured CUDA graph. The vector at a latent position is the model's
``latent_feedback`` of the previous position's final hidden state: identity for COCONUT, CODI's
``prj`` head for CODI.

LOTUS needs one more thing, only in prefill steps that contain a latent block: ``loop_passes`` > 0
re-runs the whole step in place that many times, feeding ``E(<|latent|>) + h`` (or ``h``) back at
the block's rows; every pass rewrites the same KV slots, so only the last pass's KV remains, and
rows of requests that are done looping keep their last input, which makes re-running them a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.models.gpt2 import GPT2LMHeadModel
from vllm.model_executor.models.llama import LlamaForCausalLM

from vllm_loop.latent.spec import LatentSpec
from vllm_loop.models.layers import check_weights_loaded, stacked_target


class LatentInjectMixin:
    """Adds the inject buffers, the feedback hook and LOTUS's in-place passes to a vLLM causal LM.
    Put it first in the bases: ``class X(LatentInjectMixin, LlamaForCausalLM)``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        self.latent_spec = LatentSpec.from_config(config)
        rows = vllm_config.scheduler_config.max_num_batched_tokens
        hidden = config.hidden_size
        dtype = vllm_config.model_config.dtype
        feedback = self.latent_spec is not None and self.latent_spec.kind == "feedback"
        # Feedback models (COCONUT, CODI) inject at any row of a step: [max_num_batched_tokens, H]
        # (bounded by --max-num-batched-tokens). LOTUS injects nothing: no rows.
        inject_rows = rows if feedback else 0
        self.register_buffer("latent_mask", torch.zeros(inject_rows, dtype=torch.bool), persistent=False)
        self.register_buffer("latent_embeds", torch.zeros(inject_rows, hidden, dtype=dtype), persistent=False)
        # The decoder's input lives in a persistent buffer for the steps CUDA graphs replay (they read
        # fixed addresses): as many rows as the largest captured batch, none when running eager.
        # Larger steps (prefills: max_model_len rows for LOTUS, which runs without chunked prefill)
        # get a temporary copy instead of a [max_model_len, H] buffer held for the engine's life.
        self.register_buffer("decoder_input", torch.zeros(_graph_rows(vllm_config), hidden, dtype=dtype),
                             persistent=False)
        # LOTUS: rows of latent blocks, and how many in-place passes each row's request gets.
        self.register_buffer("loop_row_passes", torch.zeros(0 if feedback else rows, dtype=torch.int32),
                             persistent=False)
        self.loop_passes = 0  # set by the driver for the one forward that needs it; 0 = plain step
        self.loop_add = (getattr(config, "lotus", None) or {}).get("latent_injection_mode", "add") == "add"

    def latent_feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vector fed back at the next latent position (COCONUT: the hidden state itself)."""
        return hidden

    def load_weights(self, weights):
        # COCONUT / LOTUS training checkpoints wrap the HF model as ``base_causallm``.
        filled = self._load_base(_strip(weights, "base_causallm."))
        check_weights_loaded(self, filled)  # vLLM's own check passes a checkpoint missing a linear weight
        return {name for name, _ in filled}

    def _load_base(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, object]]:
        """Load HF-named tensors with the base model's own loader; returns ``(parameter, shard)``
        for each tensor it took (a fused q/k/v or gate/up parameter is filled shard by shard)."""
        seen: list[str] = []

        def record(it):
            for name, tensor in it:
                seen.append(name)
                yield name, tensor

        loaded = set(super().load_weights(record(weights)))
        filled = []
        for name in seen:
            param, shard = stacked_target(name)
            if param not in loaded and f"transformer.{param}" in loaded:  # vLLM's GPT-2 adds the prefix
                param = f"transformer.{param}"
            if param in loaded:
                filled.append((param, shard))
        return filled

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        n = inputs_embeds.shape[0]
        if self.latent_embeds.shape[0]:
            step_input = torch.where(self.latent_mask[:n, None], self.latent_embeds[:n], inputs_embeds)
        else:
            step_input = inputs_embeds
        if n <= self.decoder_input.shape[0]:
            x = self.decoder_input[:n]
            x.copy_(step_input)
        else:
            x = step_input.clone()  # never the caller's tensor: the decoder may write into its input
        hidden = super().forward(None, positions, intermediate_tensors, x)
        for p in range(1, self.loop_passes + 1):
            # The decoder may update its input buffer in place (fused residual add + norm), so the
            # next pass is built from our own copy of the last input, not from `x`.
            active = (self.loop_row_passes[:n] >= p)[:, None]
            fed = inputs_embeds + hidden if self.loop_add else hidden
            step_input = torch.where(active, fed, step_input)
            x.copy_(step_input)
            hidden = super().forward(None, positions, intermediate_tensors, x)
        return hidden


def _graph_rows(vllm_config: VllmConfig) -> int:
    """Rows of the largest batch a CUDA graph is captured for (0 when none are)."""
    cc = vllm_config.compilation_config
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", "NONE") == "NONE":
        return 0
    return min(int(cc.max_cudagraph_capture_size or 0), vllm_config.scheduler_config.max_num_batched_tokens)


def _strip(weights: Iterable[tuple[str, torch.Tensor]], prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield (name[len(prefix):] if name.startswith(prefix) else name), tensor


class CoconutGPT2LMHeadModel(LatentInjectMixin, GPT2LMHeadModel):
    pass


class CoconutLlamaForCausalLM(LatentInjectMixin, LlamaForCausalLM):
    pass


class LotusLlamaForCausalLM(LatentInjectMixin, LlamaForCausalLM):
    """LOTUS is a plain Llama with three added tokens; its behaviour is all in the driver."""


class LotusGPT2LMHeadModel(LatentInjectMixin, GPT2LMHeadModel):
    pass


class CodiProjection(nn.Module):
    """CODI's ``prj``: Linear(H, prj_dim) -> GELU (erf) -> Linear(prj_dim, H) [-> LayerNorm(H)].
    Submodule names follow the checkpoint (``prj.1``, ``prj.3``, ``prj.ln``; 0 was Dropout)."""

    def __init__(self, hidden: int, prj_dim: int, use_ln: bool):
        super().__init__()
        self.layers = nn.ModuleDict({"1": nn.Linear(hidden, prj_dim), "3": nn.Linear(prj_dim, hidden)})
        self.ln = nn.LayerNorm(hidden, eps=1e-5) if use_ln else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.layers["3"](nn.functional.gelu(self.layers["1"](h)))
        return self.ln(z) if self.ln is not None else z


class CodiMixin(LatentInjectMixin):
    """CODI: LoRA folded into the base weights at load time, and ``prj`` as the feedback head."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        self.codi = dict(config.codi)
        self.prj = CodiProjection(config.hidden_size, int(self.codi["prj_dim"]), not self.codi.get("prj_no_ln"))
        self.prj.to(dtype=vllm_config.model_config.dtype)

    def latent_feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.prj(hidden)

    def _load_base(self, weights):
        from vllm_loop.latent.lora import merge_lora

        tensors = dict(weights)  # LoRA pairs must be seen together; CODI checkpoints are small
        codi = self.codi
        merged = merge_lora(
            tensors, lora_r=codi["lora_r"], lora_alpha=codi["lora_alpha"],
            fan_in_fan_out=bool(codi.get("lora_fan_in_fan_out")), prefix=codi.get("weights_prefix", ""),
        )
        filled = super()._load_base(merged.items())
        params = dict(self.prj.named_parameters())
        for name, tensor in tensors.items():
            if name.startswith("prj."):
                key = name[len("prj."):]
                key = key if key.startswith("ln.") else f"layers.{key}"
                params[key].data.copy_(tensor.to(params[key].dtype))
                filled.append((f"prj.{key}", None))
        return filled


class CODIGPT2LMHeadModel(CodiMixin, GPT2LMHeadModel):
    pass


class CODILlamaForCausalLM(CodiMixin, LlamaForCausalLM):
    pass
