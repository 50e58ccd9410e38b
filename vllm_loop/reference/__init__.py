"""Plain-PyTorch reference (oracle) implementations of the looped LMs.

    from vllm_loop.reference import load_reference
    ref = load_reference("/tmp/tiny-ouro", depth=4)
    logits = ref.forward_depths(torch.tensor(prompt), depths=[1, 4])

``load_reference`` reads a checkpoint folder the way the real model would: ``config.json`` through
our config classes (validated), tensors by their real names from ``model.safetensors`` (or the
shards of ``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_loop.looped import check_depth, check_required_keys
from vllm_loop.reference.base import LoopedReference, LoopState
from vllm_loop.reference.kv import LaneKV, SequenceKV

__all__ = ["LaneKV", "LoopState", "LoopedReference", "SequenceKV", "load_reference", "read_tensors"]

# model_type -> the config key holding T
DEPTH_KEYS = {"ouro": "total_ut_steps", "huginn_raven": "mean_recurrence"}


def load_reference(path, *, depth: int | None = None, dtype=torch.float32, **config_overrides) -> LoopedReference:
    """The reference model of the checkpoint at ``path``; ``depth`` overrides T, ``config_overrides``
    replace config.json values (e.g. ``state_init="zero"``, ``early_exit_threshold=0.5``)."""
    # Imported here: the config classes pull in transformers, which the KV / base modules do not need.
    from vllm_loop.configs import ouro as ouro_config
    from vllm_loop.configs import raven as raven_config
    from vllm_loop.reference.ouro import OuroReference, ouro_tensor_names
    from vllm_loop.reference.raven import IGNORED_TENSORS, RavenReference, raven_tensor_names

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(config_overrides)
    model_type = raw.get("model_type")
    if model_type not in DEPTH_KEYS:
        raise ValueError(f"model_type={model_type!r} has no reference implementation; known: {', '.join(DEPTH_KEYS)}")
    depth_key = DEPTH_KEYS[model_type]
    required = ouro_config.REQUIRED_KEYS if model_type == "ouro" else raven_config.REQUIRED_KEYS
    check_required_keys(raw, required, model_type)
    raw[depth_key] = check_depth(depth_key, raw[depth_key] if depth is None else depth)

    tensors = read_tensors(path)
    for name in list(tensors):  # one at a time, so a large checkpoint is held once, not twice (bf16 + fp32)
        tensors[name] = tensors.pop(name).to(dtype)
    if model_type == "ouro":
        config = ouro_config.OuroConfig(**raw)
        _check_names(tensors, ouro_tensor_names(config), ignored=())
        return OuroReference(config, tensors, raw[depth_key]).eval()
    config = raven_config.RavenConfig(**raw)
    layout = raven_config.raven_layout(config)
    _check_names(tensors, raven_tensor_names(config, layout), ignored=IGNORED_TENSORS)
    return RavenReference(config, tensors, raw[depth_key]).eval()


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: one ``model.safetensors`` or the shards of its index."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(load_file(str(path / shard)))
        return tensors
    return load_file(str(path / "model.safetensors"))


def _check_names(tensors: dict, expected: list[str], ignored: tuple[str, ...]) -> None:
    missing = [n for n in expected if n not in tensors]
    unexpected = [n for n in tensors if n not in expected and n not in ignored]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint tensors do not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
