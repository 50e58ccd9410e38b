"""A `vllm serve` that loses a worker fails clearly instead of hanging: the streaming client gets an
error event, new requests are refused, the server exits non-zero (vLLM itself exits 0 there:
``vllm_patches.upstream.install_server_exit_status``). Tensor-parallel over vLLM's multiprocessing executor,
the executor this CPU platform has; the same over Ray on GPUs: tests/test_ray_gpu.py.
"""

from __future__ import annotations

import json

import psutil
import pytest

from vllm_loop.testing.checkpoints import make_checkpoint
from vllm_loop.testing.engines import Server, kill_while_streaming

pytestmark = pytest.mark.engine


def _workers(server: Server) -> list[tuple[int, str]]:
    """The engine's worker processes (vLLM titles them ``VLLM::Worker_TP<rank>``)."""
    found = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "Worker" in cmd:
            found.append((proc.pid, cmd))
    return found


def test_killed_worker_fails_the_server_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker (see test_tensor_parallel)
    ckpt = make_checkpoint("ouro", tmp_path / "ouro", options={"agreement": "0.005"})
    server = Server(str(ckpt), "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                    "--kv-cache-memory-bytes", str(2**28), "--max-num-seqs", "2",
                    "--speculative-config", json.dumps({"method": "loopspec"}),
                    log_path=str(tmp_path / "server.log"), served_name="m", timeout=600)
    try:
        workers = _workers(server)
        assert len(workers) == 2, f"expected two workers, found {workers}"
        report = kill_while_streaming(server, workers[-1][0])
        assert not report["client_hung"] and report["stream_cut"], report
        assert report["exit_code"] is not None, f"the server hung after losing a worker: {report}"
        assert report["exit_code"] != 0, f"exit status 0 after losing a worker: {report}\n{server.log_tail()}"
        assert report["new_request"] != 200, report
        log = server.log_tail(10**7)
        assert "the engine died while serving (see above); exiting with status 1" in log, log[-3000:]
        assert "AttributeError" not in log, log[-3000:]
    finally:
        server.stop()
