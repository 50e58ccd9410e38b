"""Serve a looped model with LoopSpec over a one-host Ray cluster, tensor-parallel, and query it.

    pip install 'vllm-loop[ray]'
    python examples/ray_serve.py ./Ouro-1.4B --tp 2 --spec '{"method": "loopspec", "d1": 1, "d2": 2}'
    python examples/ray_serve.py --tiny --tp 2          # a factory-made tiny Ouro (no weights to download)

Starts a local Ray head with the host's GPUs (`ray start --head`), then
`vllm serve MODEL --tensor-parallel-size N --distributed-executor-backend ray --speculative-config ...`,
waits for /health, sends one completion and one chat request, prints them with the LoopSpec lines
of /metrics, and stops the server and the Ray head. Needs N NVIDIA GPUs: vLLM 0.26's CPU platform
refuses the Ray executor (use `--distributed-executor-backend mp` there, see the README).
"""

from __future__ import annotations

import argparse
import json
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="checkpoint folder")
    ap.add_argument("--tiny", action="store_true", help="serve a factory-made tiny Ouro instead")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--spec", default='{"method": "loopspec"}', help="speculative config JSON ('' for none)")
    ap.add_argument("--port", type=int, default=8011)
    args = ap.parse_args()

    import torch

    if torch.cuda.device_count() < args.tp:
        print(f"error: --tp {args.tp} needs {args.tp} NVIDIA GPUs, found {torch.cuda.device_count()} "
              "(vLLM's CPU platform does not support the Ray executor)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("ray") is None:
        print("error: Ray is not installed: pip install 'vllm-loop[ray]'", file=sys.stderr)
        return 2
    from vllm_loop.testing.engines import vllm_cli

    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command, wherever pip put it
    model = args.model
    if args.tiny:
        from vllm_loop.testing.checkpoints import make_checkpoint

        model = str(make_checkpoint("ouro", Path(tempfile.mkdtemp()) / "tiny-ouro", options={"agreement": "0.005"}))
    if model is None:
        ap.error("give a checkpoint folder or --tiny")

    subprocess.run([*ray_cli, "start", "--head", f"--num-gpus={torch.cuda.device_count()}"], check=True)
    cmd = [*vllm_cli(), "serve", model, "--served-model-name", "m",
           "--port", str(args.port), "--tensor-parallel-size", str(args.tp), "--distributed-executor-backend", "ray"]
    if args.spec:
        cmd += ["--speculative-config", args.spec]
    server = subprocess.Popen(cmd)
    try:
        import requests

        base = f"http://127.0.0.1:{args.port}"
        deadline = time.time() + 900
        while True:
            if server.poll() is not None:
                print(f"error: vllm serve exited with {server.returncode}", file=sys.stderr)
                return 1
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                print("error: the server did not become healthy in 15 minutes", file=sys.stderr)
                return 1
            time.sleep(2)
        body = {"model": "m", "prompt": "A looped language model", "max_tokens": 32, "temperature": 0}
        print(json.dumps(requests.post(f"{base}/v1/completions", json=body, timeout=300).json()["choices"][0], indent=1))
        chat = {"model": "m", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16}
        print(json.dumps(requests.post(f"{base}/v1/chat/completions", json=chat, timeout=300).json()["choices"][0]))
        for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm_loop:"):
                print(line)
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
        subprocess.run([*ray_cli, "stop"], check=False)


if __name__ == "__main__":
    sys.exit(main())
