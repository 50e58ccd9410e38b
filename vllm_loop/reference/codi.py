"""CODI reference (Shen et al., arXiv 2502.21074; ``zhenyi4/codi``), KV-cached.

The original ``test.py``: encode ``question | bot`` (``remove_eos=True``; else ``question | eos |
bot``) with a cache, ``z = prj(hidden_states[-1][:, -1])`` (post-final-norm); repeat
``inf_latent_iterations`` (6) times: feed ``z`` as one new position (``inputs_embeds``) and set
``z = prj(new last hidden)`` (the last ``z`` is dropped); feed ``eot`` (else ``eot | eos``); then
decode, taking logits ``[:, -1, :vocab_size - 1]`` so that ``eot`` (the last id) is never picked,
keeping the EOS token and stopping there. Budget n = ``inf_latent_iterations`` (``0``: bot then eot).

``prj`` = ``Sequential(Dropout, Linear(H, prj_dim), GELU, Linear(prj_dim, H))`` plus ``prj.ln`` =
``LayerNorm(H)`` (eps 1e-5) unless ``prj_no_ln`` -> tensors ``prj.1.*``, ``prj.3.*``, ``prj.ln.*``.
``nn.GELU()`` is the exact (erf) GELU. Dropout is inactive at inference.

Weights: the whole ``CODI`` module's state dict -- ``codi.base_model.model.<HF name>`` with PEFT
LoRA on the target linears (``<module>.base_layer.weight/bias``, ``<module>.lora_A.default.weight``
``[r, in]``, ``<module>.lora_B.default.weight`` ``[out, r]``) and ``prj.*``. ``merge_lora`` folds
``W += (B @ A) * lora_alpha / lora_r`` (transposed for GPT-2's ``Conv1D``, whose weight is
``[in, out]``: PEFT's ``fan_in_fan_out``). The knobs live in config.json under ``"codi"``
(see ``vllm_loop/testing/families/codi.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from vllm_loop.latent.lora import CODI_PREFIX, merge_lora
from vllm_loop.latent.spec import LatentSpec
from vllm_loop.reference.coconut import FeedbackReference
from vllm_loop.reference.latent import make_decoder


class Projection:
    """CODI's ``prj`` head at inference (Dropout is the identity)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, use_ln: bool, eps: float = 1e-5, prefix: str = "prj."):
        w = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
        self.w1, self.b1, self.w2, self.b2 = w["1.weight"], w["1.bias"], w["3.weight"], w["3.bias"]
        self.ln = (w["ln.weight"], w["ln.bias"]) if use_ln else None
        self.eps = eps

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        x = F.linear(F.gelu(F.linear(h, self.w1, self.b1)), self.w2, self.b2)
        if self.ln is not None:
            x = F.layer_norm(x, (x.shape[-1],), self.ln[0], self.ln[1], self.eps)
        return x


class CODIReference(FeedbackReference):
    family = "codi"

    def __init__(self, decoder, spec: LatentSpec, eos_token_ids: Sequence[int] = (), prj: Projection | None = None):
        super().__init__(decoder, spec, eos_token_ids)
        self.prj = prj  # None: use_prj=False (raw hidden state fed back)

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.prj is None else self.prj(hidden)

    @classmethod
    def from_checkpoint(
        cls, base: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], spec: LatentSpec, eos
    ) -> CODIReference:
        knobs = config.get("codi") or {}
        merged = merge_lora(
            tensors,
            lora_r=knobs["lora_r"],
            lora_alpha=knobs["lora_alpha"],
            fan_in_fan_out=knobs.get("lora_fan_in_fan_out", base == "gpt2"),
            prefix=knobs.get("weights_prefix", CODI_PREFIX),
        )
        prj = Projection(tensors, use_ln=not knobs.get("prj_no_ln", False)) if knobs.get("use_prj", True) else None
        return cls(make_decoder(base, config, merged), spec, eos, prj)
