"""What the latent inject path costs a request that does not think: decode time per token of a
latent_budget=0 request in a latent engine vs the same weights served as vanilla vLLM Llama.

Both engines use vLLM's defaults (torch.compile + CUDA graphs), random bf16 weights
(``load_format="dummy"``) on a Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads / 8 KV heads,
FFN 8192, vocab 128256 + COCONUT's 3 tokens). Per-token decode time = (t(576 new tokens) -
t(64 new tokens)) / 512, median of 3, so prefill, the forced start/end tokens and start-up cancel.

    python benchmarks/probes/latent_inject_overhead.py --out results/latent-overhead.json      # GPU
    python benchmarks/probes/latent_inject_overhead.py --out results/latent-overhead-cpu.json --small   # CPU

``--scheduling default`` leaves scheduling to vLLM for both engines (async scheduling on the GPU,
synchronous on the CPU); ``sync`` turns async scheduling off for both; ``both`` measures the two
pairs in one run. On the CPU both engines are eager and fp32, so the ratio isolates the inject
path and the driver; only the GPU gives absolute times.
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

SMALL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, vocab_size=32003,
             torch_dtype="float32")
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, vocab_size=128259,
                torch_dtype="bfloat16")


def decode_ms_per_token(llm, extra_args, runs: int = 3) -> float:
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": [(13 * j) % 400 + 5 for j in range(32)]}

    def run(n: int) -> float:
        sp = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0, detokenize=False,
                            extra_args=extra_args)
        t = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t

    run(16)
    short = statistics.median(run(64) for _ in range(runs))
    long_ = statistics.median(run(576) for _ in range(runs))
    return 1000 * (long_ - short) / 512


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="a small shape (hidden 512, 8 layers) for the CPU")
    ap.add_argument("--scheduling", choices=("default", "sync", "both"), default="default",
                    help="default: vLLM decides (async on GPU); sync: async scheduling off for both engines")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc below
    # Latent models run on vLLM's V1 model runner; pin vanilla to it too so only the inject path differs.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

    import torch
    from vllm import LLM

    from vllm_loop.testing.checkpoints import make_checkpoint

    gpu = torch.cuda.is_available()
    shape = SMALL if args.small else LLAMA_1B
    folder = Path(tempfile.mkdtemp()) / "coconut-llama"
    make_checkpoint("coconut", folder, weights=False, options={"base": "llama"}, **shape)
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "shape": "small" if args.small else
              "Llama-3.2-1B", "dtype": shape["torch_dtype"], "runs": []}
    engine = dict(load_format="dummy", dtype=shape["torch_dtype"], max_model_len=1024, seed=0)
    engine.update(gpu_memory_utilization=0.5) if gpu else engine.update(gpu_memory_utilization=0.25, enforce_eager=True)
    modes = ("default", "sync") if args.scheduling == "both" else (args.scheduling,)
    for mode in modes:
        pair = {"scheduling": mode}
        for key, overrides, extra in (("vanilla", {"architectures": ["LlamaForCausalLM"]}, None),
                                      ("latent_budget_0", None, {"latent_budget": 0})):
            llm = LLM(str(folder), hf_overrides=overrides, **engine,
                      **({"async_scheduling": False} if mode == "sync" else {}))
            pair[key] = {
                "decode_ms_per_token": round(decode_ms_per_token(llm, extra), 4),
                "model": llm.collective_rpc(lambda w: type(w.model_runner.get_model()).__name__)[0],
                "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            }
            llm.llm_engine.engine_core.shutdown()
            del llm
        base, latent = pair["vanilla"]["decode_ms_per_token"], pair["latent_budget_0"]["decode_ms_per_token"]
        pair["overhead_percent"] = round(100 * (latent - base) / base, 2)
        pair["ratio_latent_over_vanilla"] = round(latent / base, 4)
        print("PAIR " + json.dumps(pair), flush=True)
        result["runs"].append(pair)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
