"""Every place vllm-loop reaches into vLLM internals, one module per group of hooks, pinned to 0.26.

Public extension points (``ModelRegistry``, ``AutoConfig.register``) are used from ``plugin.py``;
what is here changes private vLLM objects that a vLLM upgrade may move:

* ``startup``  -- config checks, in-process inspection and the compiled start-up of the plugin's models;
* ``latent``   -- the latent-reasoning driver's seams (front end, V1 runner, outputs);
* ``loopspec`` -- LoopSpec's front door, async scheduling, packed KV, lane steps, coupled sampling;
* ``graphs``   -- vLLM's full CUDA graphs for a LoopSpec engine's 1-token decode steps;
* ``warmup``   -- what a LoopSpec engine compiles and captures at start-up;
* ``upstream`` -- fixes of vLLM 0.26 bugs that touch every model (each says when it can go).

Every hook is installed through ``patch``: once per process whatever the order, by name.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_loop.unsupported import SUPPORTED_VLLM


def _check_version() -> bool:
    """True on the vLLM these hooks are written for. On any other, ``plugin.register`` maps the
    plugin's architectures to a model that refuses to start (``vllm_loop/unsupported.py``)."""
    import vllm

    return vllm.__version__.startswith(SUPPORTED_VLLM)


def patch(owner, name: str, hook: str, replacement: Callable) -> bool:
    """Set ``owner.name = replacement`` unless the hook named ``hook`` is there already: the
    replacement records its name with the names of the hooks it wraps, so installing a hook again
    changes nothing, while hooks of other names stack on the same attribute in any order. A hook reads
    ``original = owner.name`` before it builds its replacement (which is dropped when the hook is
    already installed). Returns whether it installed."""
    installed = getattr(getattr(owner, name), "_vllm_loop_hooks", ())
    if hook in installed:
        return False
    replacement._vllm_loop_hooks = (*installed, hook)
    setattr(owner, name, replacement)
    return True


def installed(owner, name: str) -> tuple[str, ...]:
    """The names of the hooks on ``owner.name`` (tests and diagnostics)."""
    return getattr(getattr(owner, name), "_vllm_loop_hooks", ())


def install() -> None:
    if not _check_version():
        return
    from vllm_loop.vllm_patches import graphs, latent, loopspec, startup, upstream, warmup

    startup.install()
    latent.install()
    loopspec.install()
    graphs.install()
    warmup.install()
    upstream.install()
