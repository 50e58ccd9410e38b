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


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The references run tiny matmuls: on a shared 2-core box one intra-op thread is ~30x faster
    than two (OpenMP spin-waits). vLLM engines run in their own processes and are not affected."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
