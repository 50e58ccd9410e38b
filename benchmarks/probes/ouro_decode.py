"""Decode speed of an Ouro-1.4B-shaped model through vLLM: ours vs vLLM 0.26's in-tree Ouro.

Random bf16 weights (``load_format="dummy"``) on the real Ouro-1.4B shape (24 layers, hidden 2048,
16 heads x 128, FFN 5632, vocab 49152, T = total_ut_steps), vLLM's defaults (torch.compile + CUDA
graphs), 32-token prompts, ``ignore_eos``:

* single-stream decode rate = 512 / (t(576 new tokens) - t(64 new tokens)), median of 3 (prefill
  and start-up costs cancel);
* batch-32 rate = 32 x 512 output tokens / wall time (prefill included), median of 2;
* the memory-bandwidth floor of single-stream decode: weight bytes read per token (the looped
  layers T times, the LM head once) over the measured device-to-device copy bandwidth.

    python benchmarks/probes/ouro_decode.py --impl vllm-loop --out results/ouro-ours.json
    python benchmarks/probes/ouro_decode.py --impl in-tree  --out results/ouro-intree.json

``--impl in-tree`` runs vLLM without this plugin (``VLLM_PLUGINS`` excludes it), loading the folder's
``configuration_ouro.py`` with ``trust_remote_code`` as upstream Ouro checkpoints require.
Needs an NVIDIA GPU.

Engine start-up includes torch.compile, whose caches (vLLM's, Inductor's, Triton's) persist between
runs, so start times compare only between runs with the same cache state. ``--compile-cache cold``
(the default) points all three at a fresh empty folder, so every run compiles from scratch;
``--compile-cache warm`` first starts and stops the same engine once in a child process, then
measures a start on the caches it left. The JSON records which.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

OURO_14B = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=16, head_dim=128, vocab_size=49152, max_position_embeddings=65536,
    torch_dtype="bfloat16",
)


def weight_bytes_per_token(cfg: dict, T: int, dtype_bytes: int = 2) -> int:
    """Bytes of weights one single-stream decode step reads: looped layers T times, head once."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    layer = H * (q + 2 * kv) + q * H + 3 * H * I + 4 * H
    return dtype_bytes * (T * cfg["num_hidden_layers"] * layer + V * H + H)


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device memory bandwidth in bytes/s from a large device-to-device copy (read + write)."""
    import torch

    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["vllm-loop", "in-tree"], required=True)
    ap.add_argument("--total-ut-steps", type=int, default=4)
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--single-runs", type=int, default=3)
    ap.add_argument("--batch-runs", type=int, default=2)
    ap.add_argument("--compile-cache", choices=["cold", "warm"], default="cold",
                    help="compile caches for the measured start: fresh (cold) or primed by a first start (warm)")
    ap.add_argument("--cache-root", default=None, help=argparse.SUPPRESS)  # set by the warm-mode parent
    ap.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)  # the warm-mode priming run
    args = ap.parse_args()
    cache_root = args.cache_root or tempfile.mkdtemp(prefix="ouro-decode-cache-")
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ[var] = str(Path(cache_root) / sub)  # this run's caches only: cold unless primed below
    if args.compile_cache == "warm" and not args.startup_only:
        import subprocess

        cmd = [sys.executable, __file__, "--impl", args.impl, "--total-ut-steps", str(args.total_ut_steps),
               "--out", os.devnull, "--startup-only", "--cache-root", cache_root]
        subprocess.run(cmd, check=True)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # for collective_rpc below
    if args.impl == "in-tree":
        os.environ["VLLM_PLUGINS"] = "none"  # load no general plugin: vLLM's own OuroForCausalLM

    import torch

    from vllm import LLM, SamplingParams

    from vllm_loop.testing.checkpoints import make_checkpoint

    T = args.total_ut_steps
    folder = Path(tempfile.mkdtemp()) / "ouro-1.4b-shape"
    make_checkpoint("ouro", folder, weights=False, options={"remote_code": "true"}, total_ut_steps=T, **OURO_14B)
    cfg = json.loads((folder / "config.json").read_text())
    bw = copy_bandwidth()

    t0 = time.time()
    llm = LLM(
        str(folder), load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=64, seed=0,
        gpu_memory_utilization=0.8, trust_remote_code=args.impl == "in-tree",
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32, 48, 64]},
    )
    startup = time.time() - t0
    if args.startup_only:
        return 0
    model_cls = llm.collective_rpc(lambda w: type(w.model_runner.model).__module__)[0]

    def run(n: int, out_len: int) -> float:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 400 + 5 for j in range(32)]} for i in range(n)]
        sp = SamplingParams(max_tokens=out_len, min_tokens=out_len, ignore_eos=True, temperature=0, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
        return dt

    run(1, 16), run(32, 16)  # warm-up
    short = statistics.median(run(1, 64) for _ in range(args.single_runs))
    long_ = statistics.median(run(1, 576) for _ in range(args.single_runs))
    batch = statistics.median(run(32, 512) for _ in range(args.batch_runs))
    single = 512 / (long_ - short)
    per_token = weight_bytes_per_token(cfg, T)
    floor = bw / per_token
    result = {
        "impl": args.impl, "model_module": model_cls, "total_ut_steps": T, "gpu": torch.cuda.get_device_name(),
        "startup_s": round(startup, 1), "compile_cache": args.compile_cache, "single_stream_tok_s": round(single, 1),
        "single_stream_ms_per_token": round(1000 / single, 3), "batch32_tok_s": round(32 * 512 / batch, 1),
        "weight_bytes_per_token": per_token, "copy_bandwidth_GBps": round(bw / 1e9, 1),
        "floor_tok_s": round(floor, 1), "fraction_of_floor": round(single / floor, 3),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
