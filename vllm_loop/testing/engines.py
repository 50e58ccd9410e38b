"""Start and stop real vLLM engines for tests, examples and the demo.

Engine start-up costs about a minute on a 2-core CPU, so tests start one engine per module and
share it; ``stop_llm`` frees its processes before the next module starts another.
"""

from __future__ import annotations

import gc
import os

# Tests call small functions inside the worker (``LLM.collective_rpc``) to read engine state;
# vLLM sends such callables only with this opt-in.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def start_llm(model: str, **kwargs):
    """``vllm.LLM`` with defaults that suit tiny checkpoints: fp32, small context, few sequences,
    eager on CPU (compilation would cost more than the whole test)."""
    from vllm import LLM

    if on_gpu():
        # The test process has touched CUDA (torch.cuda.is_available and friends); a forked engine
        # process could not use it.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    defaults = dict(
        dtype="float32",
        max_model_len=512,
        max_num_seqs=16,
        gpu_memory_utilization=0.1 if not on_gpu() else 0.3,
        enforce_eager=not on_gpu(),
        seed=0,
    )
    defaults.update(kwargs)
    if on_gpu() and defaults["dtype"] == "float32":
        # fp32 runs are for exact comparisons: FlashAttention has no fp32 kernels, and Triton's fp32
        # dot products default to TF32 (10-bit mantissa) unless told otherwise.
        defaults.setdefault("attention_backend", "TRITON_ATTN")
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    return LLM(model, **defaults)


def stop_llm(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()


# Functions run inside vLLM's worker process with ``llm.collective_rpc(fn)`` (``fn(worker)``).


def worker_facts(worker) -> dict:
    """Which process this is, whether the plugin registered there, and what model it runs."""
    from vllm import ModelRegistry

    from vllm_loop import plugin

    return {
        "pid": os.getpid(),
        "registered": plugin.registered(),
        "plugin_archs": sorted(set(plugin.MODELS) & set(ModelRegistry.get_supported_archs())),
        "model_class": type(worker.model_runner.model).__name__,
    }


def recorded_readouts(worker) -> dict:
    """Logits of every depth readout recorded in the last forward pass (``readout_depths``)."""
    model = worker.model_runner.model
    inner = getattr(model, "model", None) or model.transformer
    return {r: model.readout_logits(r).float().cpu() for r in inner.readouts.recorded}


def kv_cache_layout(worker) -> dict:
    """The engine's KV-cache configuration: groups, layer names and byte sizes."""
    cfg = worker.model_runner.kv_cache_config
    spec = cfg.kv_cache_groups[0].kv_cache_spec
    return {
        "groups": [list(g.layer_names) for g in cfg.kv_cache_groups],
        "num_blocks": cfg.num_blocks,
        "block_size": spec.block_size,
        "page_size_bytes": spec.page_size_bytes,
        "tensor_bytes": sum(t.size for t in cfg.kv_cache_tensors),
    }
