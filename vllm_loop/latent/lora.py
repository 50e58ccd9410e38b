"""PEFT LoRA folded into base weights: CODI checkpoints ship unmerged adapters.

Shared by the vLLM loader (``vllm_loop/latent/models.py``) and the CODI reference.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

CODI_PREFIX = "codi.base_model.model."
ADAPTER = "default"


def merge_lora(
    tensors: Mapping[str, torch.Tensor],
    *,
    lora_r: int,
    lora_alpha: float,
    fan_in_fan_out: bool,
    prefix: str = CODI_PREFIX,
) -> dict[str, torch.Tensor]:
    """Plain HF-named base weights with every PEFT LoRA pair folded in (fp32).

    Keys outside ``prefix`` (``prj.*``) are left out; ``…base_layer.X`` becomes ``….X``."""
    scale = float(lora_alpha) / float(lora_r)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.startswith(prefix) or ".lora_A." in name or ".lora_B." in name:
            continue
        name = name[len(prefix):]
        t = t.float()
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            if leaf == "weight":
                a = tensors[f"{prefix}{module}.lora_A.{ADAPTER}.weight"].float()  # [r, in]
                b = tensors[f"{prefix}{module}.lora_B.{ADAPTER}.weight"].float()  # [out, r]
                delta = (b @ a) * scale  # [out, in]
                t = t + (delta.T if fan_in_fan_out else delta)
            name = f"{module}.{leaf}"
        out[name] = t
    return out
