"""Load a latent checkpoint's reference: the family module (COCONUT, CODI, LOTUS) picked by its
``config.json``. Apart from ``latent.py`` (the shared base the family modules import), so that
nothing in ``reference/`` imports in a circle."""

from __future__ import annotations

from pathlib import Path

from vllm_loop.latent.spec import LatentSpec
from vllm_loop.reference.coconut import CoconutReference
from vllm_loop.reference.codi import CODIReference
from vllm_loop.reference.latent import (
    LATENT_ARCHITECTURES,
    LatentReference,
    eos_ids,
    make_decoder,
    read_checkpoint,
    strip_wrapper_prefix,
)
from vllm_loop.reference.lotus import LotusReference


def load_latent_reference(path: str | Path) -> LatentReference:
    """The reference for a latent checkpoint folder, chosen by ``config.json`` ``architectures[0]``."""
    config, tensors, gen = read_checkpoint(path)
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in LATENT_ARCHITECTURES:
        raise ValueError(f"architectures[0]={arch!r} is not a latent model; known: {', '.join(LATENT_ARCHITECTURES)}")
    family, base = LATENT_ARCHITECTURES[arch]
    spec = LatentSpec.from_config(config)
    if spec is None:
        raise ValueError(f"{path}: config.json has no 'latent_spec'")
    eos = eos_ids(config.get("eos_token_id"), (gen or {}).get("eos_token_id"))
    if family == "coconut":
        return CoconutReference(make_decoder(base, config, strip_wrapper_prefix(config, tensors)), spec, eos)
    if family == "lotus":
        mode = (config.get("lotus") or {}).get("latent_injection_mode", "add")
        return LotusReference(make_decoder(base, config, strip_wrapper_prefix(config, tensors)), spec, eos, mode=mode)
    return CODIReference.from_checkpoint(base, config, tensors, spec, eos)
