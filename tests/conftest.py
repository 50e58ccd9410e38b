"""Shared fixtures. Engines are module-scoped: one real vLLM engine per test module."""

from __future__ import annotations

import pytest

from vllm_loop.testing.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """``ckpt_factory(family, **kw) -> path``: tiny checkpoints, built once per session per spec."""
    cache: dict[str, str] = {}

    def make(family: str, *, seed: int = 0, options: dict | None = None, **overrides) -> str:
        key = repr((family, seed, sorted((options or {}).items()), sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(family.replace("_", "-"))
            cache[key] = str(make_checkpoint(family, out / "ckpt", seed=seed, options=options, **overrides))
        return cache[key]

    return make
