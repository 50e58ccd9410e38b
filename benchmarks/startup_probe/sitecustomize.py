"""Start-up probe for ``benchmarks/engine_start.py --probe``: every Python process started with this
folder on ``PYTHONPATH`` and ``LOOP_STARTUP_PROBE=FILE`` appends to FILE one JSON line per full
garbage collection (generation 2) and per Triton compile (cache misses and hits), with wall-clock
times, so a start's collector and kernel-compile seconds can be placed on vLLM's timeline. Not part
of the package: a benchmark's instrument.
"""

import gc
import json
import os
import time

_PATH = os.environ.get("LOOP_STARTUP_PROBE")


def _write(event: dict) -> None:
    with open(_PATH, "a") as f:  # one short line per event, appended: safe across the engine's processes
        f.write(json.dumps(event | {"pid": os.getpid()}) + "\n")


def _on_gc(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _on_gc.started = time.time()
    elif getattr(_on_gc, "started", None) is not None:
        _write({"kind": "gc", "t": _on_gc.started, "s": round(time.time() - _on_gc.started, 4),
                "collected": info.get("collected")})
        _on_gc.started = None


def _on_triton_compile(*, src, metadata, metadata_group, times, cache_hit) -> None:
    _write({"kind": "triton", "t": time.time(), "name": metadata.get("name"), "hit": cache_hit,
            "s": round(times.total / 1e6, 4)})


def _install() -> None:
    gc.callbacks.append(_on_gc)
    try:
        from triton import knobs
    except Exception:  # no Triton (CPU builds): collections only
        return
    knobs.compilation.listener = _on_triton_compile


if _PATH:
    _install()
