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


def vllm_cli() -> list[str]:
    """The ``vllm`` command of this interpreter (its console script need not sit beside it)."""
    import sys

    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


class Server:
    """``vllm serve MODEL`` in a subprocess on a free local port, for HTTP tests and examples."""

    def __init__(self, model: str, *args: str, log_path: str, served_name: str = "tiny", timeout: float = 300,
                 wait: bool = True):
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cpu = [] if on_gpu() else ["--dtype", "float32", "--gpu-memory-utilization", "0.1", "--enforce-eager"]
        cmd = [*vllm_cli(), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
               "--max-num-seqs", "8", "--served-model-name", served_name, *cpu, *args]
        env = dict(os.environ, VLLM_NO_USAGE_STATS="1")
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 300) -> None:
        """Until ``/health`` answers 200; a server that exits or stays unhealthy raises with its log."""
        import time

        import requests

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

    def stop(self) -> int | None:
        """SIGTERM (vLLM's graceful shutdown); the exit code, or None when it had to be killed."""
        import subprocess

        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


# -- requests the lanes do not serve, next to lane requests -------------------------------------------------
MIXED_PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]


def mixed_batch() -> list[tuple[list[int], object]]:
    """(prompt, sampling params): each of ``MIXED_PROMPTS`` with logprobs, a repetition penalty,
    min_tokens, presence / frequency penalties, allowed tokens, and seeded sampling with bad words
    (requests LoopSpec leaves to vLLM's path), then each as a greedy request the lanes serve."""
    from vllm import SamplingParams

    special = [
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=12),
        SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5),
        SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=list(range(50, 90))),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=5, seed=1, bad_words=["x"]),
    ]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [(p, sp) for sp in special for p in MIXED_PROMPTS] + [(p, plain) for p in MIXED_PROMPTS]


def generate_mixed(llm) -> list[tuple[list[int], bool]]:
    """``mixed_batch()`` in one ``generate``: per request, its tokens and whether it has logprobs."""
    batch = mixed_batch()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs is not None) for o in outs]


# -- driving an engine step by step (requests arriving while others decode, aborts) ------------------------
class Job:
    """One request of a scripted run: submitted before engine step ``at``, aborted before step ``abort_at``."""

    def __init__(self, request_id: str, prompt: list[int], params, at: int = 0, abort_at: int | None = None):
        self.request_id, self.prompt, self.params, self.at, self.abort_at = request_id, prompt, params, at, abort_at


def greedy_jobs(seed: int = 0, n: int = 16, vocab: int = 400, aborts: int = 0) -> list[Job]:
    """``n`` greedy requests: prompts of 1..40 tokens (every fourth starts with the same 20 tokens, for
    the prefix cache), 4..40 new tokens, submitted over the first 30 engine steps; ``aborts`` of them are
    aborted a few steps after they arrive."""
    import random

    from vllm import SamplingParams

    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(20)]
    jobs = []
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 40))]
        if i % 4 == 3:
            prompt = shared + prompt
        params = SamplingParams(max_tokens=rng.randrange(4, 40), temperature=0.0, ignore_eos=True)
        at = rng.randrange(0, 30)
        jobs.append(Job(f"r{i}", prompt, params, at=at, abort_at=at + rng.randrange(3, 10) if i < aborts else None))
    return jobs


def run_jobs(llm, jobs: list[Job], max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step ``llm``'s engine, submitting and aborting jobs on schedule; -> request id -> output tokens
    (aborted requests: what they had produced)."""
    engine = llm.llm_engine
    tokens: dict[str, list[int]] = {}
    pending = sorted(jobs, key=lambda j: j.at)
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].at <= step:
            job = pending.pop(0)
            engine.add_request(job.request_id, {"prompt_token_ids": job.prompt}, job.params)
            tokens[job.request_id] = []
        aborts = [j.request_id for j in jobs if j.abort_at == step and j.request_id in tokens]
        if aborts:
            engine.abort_request(aborts)
        # an idle multiprocess engine would wait for outputs that never come: only step with work
        for out in engine.step() if engine.has_unfinished_requests() else ():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        if step > max_steps:
            raise RuntimeError(f"engine did not finish in {max_steps} steps")
    return tokens


def engine_core(llm):
    """The in-process engine core (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = llm.llm_engine.engine_core
    return getattr(core, "engine_core", core)


def free_kv_blocks(llm) -> int:
    return engine_core(llm).scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def lane_census(worker) -> dict:
    """Live LoopSpec requests, lanes and free lane slots of a worker (``collective_rpc``)."""
    return worker.model_runner.drafter.lane_census()


def runner_totals(llm) -> dict:
    """The LoopSpec runner's running ``EngineCounters`` of the first worker, as a dict (the engine must
    be started inside ``worker_functions()``)."""
    return dict(llm.collective_rpc(lambda w: vars(w.model_runner.drafter.totals))[0])


# -- failure: a process of the engine dies while a request streams ----------------------------------------
def kill_while_streaming(server: Server, pid: int, *, exit_timeout: float = 180) -> dict:
    """Stream a long completion from ``server``, SIGKILL ``pid`` (a worker of its engine) once the first
    chunk arrived, and report what a client and a supervisor see: the stream's end (error event,
    exception, or [DONE]), the server's exit code and how long it took (None: still running after
    ``exit_timeout`` s, i.e. hung), and whether a new request is refused."""
    import json
    import signal
    import subprocess
    import threading
    import time

    import requests

    seen: dict = {"chunks": 0}

    def stream() -> None:
        body = {"model": "m", "prompt": "A looped model", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with requests.post(f"{server.base}/v1/completions", json=body, stream=True, timeout=300) as r:
                seen["status"] = r.status_code
                for line in r.iter_lines():
                    if line == b"data: [DONE]":
                        seen["done"] = True
                    elif line.startswith(b"data: "):
                        payload = json.loads(line[6:])
                        if "error" in payload:
                            seen["error"] = payload["error"]
                        seen["chunks"] += 1
        except requests.RequestException as e:
            seen["exception"] = repr(e)

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    deadline = time.time() + 120
    while not seen["chunks"] and time.time() < deadline:
        time.sleep(0.05)
    if not seen["chunks"]:
        raise RuntimeError(f"no streamed token within 120 s: {seen}\n{server.log_tail()}")
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    client.join(timeout=exit_timeout)
    report = {"stream": seen, "client_hung": client.is_alive(), "exit_code": None, "exit_after_s": None}
    try:
        report["exit_code"] = server.proc.wait(timeout=exit_timeout)
        report["exit_after_s"] = round(time.time() - killed_at, 1)
    except subprocess.TimeoutExpired:
        pass
    try:
        after = requests.post(f"{server.base}/v1/completions", timeout=10,
                              json={"model": "m", "prompt": "A", "max_tokens": 4})
        report["new_request"] = after.status_code
    except requests.RequestException as e:
        report["new_request"] = type(e).__name__
    report["stream_cut"] = bool(seen.get("error") or seen.get("exception")
                                or (not seen.get("done") and seen["chunks"] < 400))
    return report
