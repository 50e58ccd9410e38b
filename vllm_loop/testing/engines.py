"""Start and stop real vLLM engines for tests, examples and the demo.

Engine start-up costs about a minute on a 2-core CPU, so tests start one engine per module and
share it; ``stop_llm`` frees its processes before the next module starts another.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager

INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"


@contextmanager
def worker_functions():
    """Let ``LLM.collective_rpc(fn)`` send our functions (``worker_facts``, ``kv_cache_layout``, ...)
    to the engines started inside this block: vLLM pickles a callable only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which its engine processes read once at start-up and
    the front end reads at each call. Start the engine, call it and stop it inside the block; the
    variable is restored on exit, so nothing else in the process runs with pickling enabled."""
    before = os.environ.get(INSECURE_SERIALIZATION)
    os.environ[INSECURE_SERIALIZATION] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INSECURE_SERIALIZATION, None)
        else:
            os.environ[INSECURE_SERIALIZATION] = before


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


def check_ouro_early_exit(llm, path: str, prompts: list[str], max_tokens: int, threshold: float) -> set[int]:
    """Greedy decoding of an engine started with ``early_exit_threshold=threshold`` must equal the
    reference's; returns the depths the reference selected along the way (a test should see several)."""
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_loop.reference import load_reference

    ref, tok = load_reference(path, early_exit_threshold=threshold), AutoTokenizer.from_pretrained(path)
    ids = [tok(p).input_ids for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    depths: set[int] = set()
    for prompt, out in zip(ids, outs):
        got = list(out.outputs[0].token_ids)
        assert got == ref.generate(prompt, max_tokens), f"early exit {threshold}: prompt {prompt[:6]}..."
        depths |= set(ref.forward_with_exit(torch.tensor(prompt + got)).depths.tolist())
    return depths


# Functions run inside vLLM's worker process with ``llm.collective_rpc(fn)`` (``fn(worker)``), for
# engines started inside ``worker_functions()``.


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
    readouts = worker.model_runner.get_model().recorded_readouts()
    return {r: logits.float().cpu() for r, logits in readouts.items()}


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


class Server:
    """``vllm serve MODEL`` in a subprocess on a free local port, for HTTP tests and examples."""

    def __init__(self, model: str, *args: str, log_path: str, served_name: str = "tiny", timeout: float = 300):
        import socket
        import subprocess
        import sys
        import time
        from pathlib import Path

        import requests

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        vllm = str(Path(sys.executable).with_name("vllm"))
        cpu = [] if on_gpu() else ["--dtype", "float32", "--gpu-memory-utilization", "0.1", "--enforce-eager"]
        cmd = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
               "--max-num-seqs", "8", "--served-model-name", served_name, *cpu, *args]
        env = dict(os.environ, VLLM_NO_USAGE_STATS="1")
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited early:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"vllm serve did not become healthy in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def post(self, path: str, body: dict):
        import requests

        return requests.post(f"{self.base}{path}", json=body, timeout=120)

    def stop(self) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
