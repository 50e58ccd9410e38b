"""Ray failure behaviour on a GPU host (2+ NVIDIA GPUs and `pip install vllm-loop[ray]`; skipped elsewhere:
vLLM 0.26's CPU platform refuses the Ray executor).

A `vllm serve` of a looped model with LoopSpec, tensor-parallel over two Ray workers, loses one worker
(SIGKILL) while a request streams: the server must fail clearly -- the streaming client gets an error
or a cut stream, new requests are refused, and the server process exits non-zero -- instead of hanging.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.engine, pytest.mark.skipif(
    torch.cuda.device_count() < 2 or importlib.util.find_spec("ray") is None,
    reason="needs 2 NVIDIA GPUs and Ray (the CPU platform has no Ray executor)",
)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").strip()
    except OSError:
        return b""


def _ray_workers() -> list[tuple[int, str]]:
    """vLLM's Ray workers: the processes holding a CUDA context (the engine core does not, under Ray),
    with their command lines (Ray retitles actor processes ``ray::...``)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    workers = []
    for pid in sorted({int(p) for p in out.split() if p.strip().isdigit()}):
        cmd = _cmdline(pid).decode(errors="replace")
        if cmd and pid != os.getpid() and "EngineCore" not in cmd:
            workers.append((pid, cmd))
    if not workers:  # a container may hide the GPU's process list: Ray's actor titles instead
        workers = [(int(d), _cmdline(int(d)).decode(errors="replace")) for d in os.listdir("/proc")
                   if d.isdigit() and b"RayWorker" in _cmdline(int(d))]
    return workers


def test_killed_ray_worker_fails_the_server_clearly(tmp_path):
    from vllm_loop.testing.checkpoints import make_checkpoint
    from vllm_loop.testing.engines import Server, kill_while_streaming

    ckpt = make_checkpoint("ouro", tmp_path / "ouro", options={"agreement": "0.005"})
    server = Server(str(ckpt), "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
                    "--enforce-eager", "--gpu-memory-utilization", "0.2",
                    "--speculative-config", json.dumps({"method": "loopspec"}),
                    log_path=str(tmp_path / "server.log"), served_name="m", timeout=600)
    try:
        ok = server.post("/v1/completions", {"model": "m", "prompt": "A", "max_tokens": 8, "temperature": 0})
        assert ok.status_code == 200, ok.text
        workers = _ray_workers()
        ray_procs = [_cmdline(int(d))[:80] for d in os.listdir("/proc") if d.isdigit() and b"ray::" in _cmdline(int(d))]
        assert len(workers) >= 2, f"expected two Ray workers, found {workers}; ray:: processes: {ray_procs}"
        report = kill_while_streaming(server, workers[-1][0])
        report["killed"] = workers[-1]
        print(json.dumps(report))
        assert not report["client_hung"] and report["stream_cut"], report
        assert report["exit_code"] is not None, f"the server hung after losing a Ray worker: {report}"
        assert report["exit_code"] != 0, f"the server exited 0 after losing a Ray worker:\n{server.log_tail()}"
        assert report["new_request"] != 200
    finally:
        server.stop()
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)
