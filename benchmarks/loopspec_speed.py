"""Decode speed with LoopSpec on vs off, side by side in one run, with the acceptance measured.

One checkpoint (factory-made, real tensors: ``--agreement`` makes early depths agree with the final
one, so proposals get accepted; 0 = random weights), one engine per system, each in its own
subprocess with the same vLLM settings (defaults: bf16, CUDA graphs on a GPU; torch.compile for every
engine but LoopSpec's, which skips it by default, see ``SYSTEM-compiled`` below):

* ``vanilla``  -- this plugin's model, ordinary decoding;
* ``vanilla-sync`` -- the same with ``async_scheduling=False`` (it shows what vLLM's asynchronous
  scheduling alone is worth);
* ``vanilla-v1`` -- the same on vLLM's V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``): on CUDA vLLM
  0.26 runs vanilla Ouro on its V2 runner, while every LoopSpec engine runs on V1 (V2 has no custom
  speculative methods), so this is what LoopSpec's plain steps can be at best;
* ``loopspec`` -- the same with ``speculative_config={"method": "loopspec", ...}``, lanes always on,
  the defaults otherwise (on a GPU: lane calls replayed from CUDA graphs, the Triton lane attention,
  vLLM's CUDA custom ops and C RMSNorm in the lane calls);
* ``loopspec-nographs`` -- the same with eager lane calls (``"lane_graphs": "off"``);
* ``loopspec-torch`` -- the same with the PyTorch lane attention (``"lane_attention": "torch"``);
* ``vanilla-fused`` / ``loopspec-auto-fused`` -- ``vanilla`` / ``loopspec-auto`` with
  ``compilation_config.custom_ops = ["all"]``: vLLM's forward with its CUDA custom ops instead of the
  native ops Inductor fuses (vLLM's default under torch.compile, and a LoopSpec
  engine's too: its lane calls take the CUDA ops themselves, ``lane_graphs.cuda_custom_ops``; before,
  a LoopSpec engine on CUDA set "all" for the whole engine);
* ``loopspec-triton`` / ``loopspec-fused`` / ``loopspec-triton-fused`` -- lanes on with the Triton
  lane attention named explicitly (the default on CUDA) / ``custom_ops = ["all"]`` / both;
* ``loopspec-auto`` -- the defaults with ``"lanes": "auto"`` (the policy picks lanes or plain decoding;
  on a GPU with async scheduling: plain steps pipelined, lanes-mode steps as barriers);
* ``loopspec-auto-sync`` -- the same with ``async_scheduling=False`` (how every LoopSpec engine
  scheduled before async scheduling);
* ``loopspec-serial`` / ``loopspec-auto-serial`` -- ``loopspec`` / ``loopspec-auto`` with
  ``"lane_overlap": "off"``: each recurrent step of a lane step enqueued only after the host has
  decided the one before (how every lane step ran before overlap);
* ``loopspec-chain`` / ``loopspec-auto-chain`` -- ``loopspec`` / ``loopspec-auto`` with
  ``"step_tokens": 0``: a request's drafts are its lane chain alone, so a lane step commits at most
  1 + ceil(R / d1) tokens a request (the default pads the chain to 16 drafts);
* ``loopspec-pad`` / ``loopspec-auto-pad`` / ``loopspec-auto-pad32`` -- ``"step_tokens"`` 16 (the
  default; named for the runs before it was) / 32;
* ``loopspec-tuned`` -- ``loopspec`` with the schedule the tuner recommends for this checkpoint:
  ``--tuned FILE`` is the JSON of ``python -m vllm_loop.tune CHECKPOINT ... --json FILE`` (its
  ``best`` d1 / d2 replace the spec's);
* ``loopspec-tuned-late`` -- ``loopspec-tuned`` with greedy late re-proposals at the depths of
  ``--late`` (``"late": [...]``, ``vllm_loop/loopspec/schedule.py``);
* ``SYSTEM-unfused`` (a LoopSpec system above) -- the same engine with the lane calls' SiLU-and-mul and
  down projection as vLLM's two kernels (``VLLM_LOOP_LANE_SWIGLU=0``; the default fuses
  them, ``kernels/skinny_gemm.py: swiglu_down``);
* ``SYSTEM-stepN`` (a LoopSpec system above; suffixes in any order, e.g. ``loopspec-tuned-step64-unfused``)
  -- ``"step_tokens": N``: up to N drafts a request a step, and, while no
  request waits to join, lane steps of up to max(R, 16, N) recurrent steps (``runner.LOCKSTEP``);
* ``SYSTEM-plainonly`` (a LoopSpec system above) -- the same engine deciding plain decoding for every
  step (the lanes policy's test pattern, ``VLLM_LOOP_LANES_PATTERN=P``): what a LoopSpec engine's plain
  steps cost against ``vanilla`` with no lane step at all (``loopspec-auto`` against it: what the
  policy's lane steps cost or gain);
* ``SYSTEM-torchsample`` (a LoopSpec system above) -- coupled sampling through ``noise.py``'s PyTorch code
  on the GPU instead of the one-kernel sampler (``VLLM_LOOP_COUPLED_KERNEL=0``, ``kernels/coupled_sample.py``);
* ``SYSTEM-cascade`` (a LoopSpec system above) -- sampled requests verified by the paper's cascade on the
  host (``"sampling": "cascade"``) instead of coupled sampling on the GPU (the default; ``noise.py``);
* ``in-tree``  -- vLLM 0.26's own OuroForCausalLM (Ouro shapes only; plugins off, remote-code config);
* ``SYSTEM-nocompile`` (any system above) -- the same engine without ``torch.compile``:
  ``compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}`` (vLLM's forward eager
  with its CUDA custom ops, decode steps still replayed from vLLM's full CUDA graphs; LoopSpec's lane
  graphs unchanged). It starts without Dynamo / Inductor (most of a looped model's cold start). From
  this was a LoopSpec engine's default on one CUDA GPU before full graphs for mixed steps;
* ``SYSTEM-compiled`` -- the same engine with vLLM's ``torch.compile`` asked for
  (``compilation_config={"mode": 3}``): vanilla's default, and a LoopSpec engine's before its fast start;
* ``SYSTEM-fullgraphs`` -- no ``torch.compile`` and vLLM's full CUDA graphs for every step of up to 512
  tokens, prefills and mixed steps included (``{"mode": 0, "cudagraph_mode": "FULL",
  "max_cudagraph_capture_size": 512}``; vLLM falls back to decode-only graphs where the attention
  backend cannot replay mixed steps). A LoopSpec engine keeps its decode graphs apart from the mixed
  ones (``vllm_patches.graphs.install_loopspec_decode_graphs``); this is its default on one CUDA
  GPU (``config.fast_start_compilation``; at ``max_model_len`` >= 512 the same engine).

For each concurrency c: c requests with 32-token prompts, greedy (or ``--temperature`` / ``--top-p`` /
``--top-k``), ``ignore_eos``; the decode rate is c x 512 / (t(576 new tokens) - t(64 new tokens)) (prefill and
start-up cancel), median of ``--runs``. ``--texts K``: K different prompt sets of c requests each, one after
another, their times summed (rate K x c x 512 / the summed difference): on random weights the greedy text
decides how much a LoopSpec request accepts, and a change that only rounds differently (a kernel's summation
order) can move a one-text ratio by ~10 %; K texts average that out. For LoopSpec the engine's own counters
over the long runs give gamma (tokens a request commits per R recurrent steps), the commit shares, the lanes
per recurrent step, the time in lane steps (``lane_step_s``) and the engine's time between two consecutive
lane steps (``gap_ms``). Every ratio is taken against ``vanilla`` from the same run, and against ``in-tree``
too when it ran (``speedup_vs_in_tree``). Writes the JSON and, beside it, a PNG (tok/s vs concurrency, one
line per system) and each system's engine log (``*.SYSTEM.log``). ``--profile``: one more LoopSpec engine
(lanes on, in-process) decodes one request (``--profile-requests N``: N at once) under ``torch.profiler``; the
op table per lane step goes to ``*.profile.txt``. ``--policy-trace``: each LoopSpec system's engine writes its
lanes policy's trace (``VLLM_LOOP_POLICY_TRACE``: one JSON line per engine step, with the mode, rows, tokens,
seconds, whether it was a sample, mean context and the rates then) to ``*.SYSTEM.trace.jsonl``.

    python benchmarks/loopspec_speed.py --shape ouro-1.4b --concurrency 1 4 \\
        --out benchmarks/results/loopspec-speed-ouro-1.4b-h200.json
    python benchmarks/loopspec_speed.py --shape tiny-ouro --concurrency 1 4 --out /tmp/speed.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HUGINN_0125 = dict(n_embd=5280, n_heads=55, n_layers_in_prelude=2, n_layers_in_recurrent_block=4,
                   n_layers_in_coda=2, intermediate_size=17920, vocab_size=65536, padded_vocab_size=65536,
                   mean_recurrence=32, block_size=4096, torch_dtype="bfloat16")
SHAPES = {  # name -> (family, options, config overrides, default speculative config)
    "ouro-1.4b": ("ouro", {"remote_code": "true"}, dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, head_dim=128, vocab_size=49152, max_position_embeddings=65536,
        total_ut_steps=4, torch_dtype="bfloat16"), {"method": "loopspec", "d1": 1, "d2": 2, "lanes": "on"}),
    # Huginn-0125's sizes (3.5B: n_embd 5280, 2 prelude / 4 core / 2 coda sandwich blocks, FFN 17920,
    # vocab 65536, R=32). "-tp2": 44 heads of 120 instead of 55 of 96 (the same weights' shapes and
    # parameter count) because 55 heads do not split over 2 GPUs.
    "huginn-0125": ("huginn_raven", {"layout": "huginn", "state_init": "seeded"}, HUGINN_0125,
                    {"method": "loopspec", "d1": 2, "d2": 8, "lanes": "on"}),
    "huginn-0125-tp2": ("huginn_raven", {"layout": "huginn", "state_init": "seeded"}, HUGINN_0125 | {"n_heads": 44},
                        {"method": "loopspec", "d1": 2, "d2": 8, "lanes": "on"}),
    # the trained Raven's sizes (train_looped.py's h200 preset: 32 M parameters, R=32), for what does not
    # depend on its weights (a step's cost) without training first
    "raven-32m": ("huginn_raven", {"layout": "llama", "state_init": "seeded"}, dict(
        n_embd=512, n_heads=8, n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
        intermediate_size=1536, vocab_size=8192, padded_vocab_size=8192, mean_recurrence=32, block_size=2048,
        torch_dtype="bfloat16"), {"method": "loopspec", "d1": 2, "d2": 8, "lanes": "on"}),
    "tiny-ouro": ("ouro", {"remote_code": "true"}, {}, {"method": "loopspec", "d1": 1, "d2": 2, "lanes": "on"}),
    "tiny-raven": ("huginn_raven", {"layout": "llama", "state_init": "seeded"}, {"mean_recurrence": 32},
                   {"method": "loopspec", "d1": 2, "d2": 8, "lanes": "on"}),
}
# The factory's agreement that puts >= 95 % of first proposals within reach on the full-size shapes
# (issue 10's condition): 0.005 gave Ouro-1.4B only ~78 % in bf16; 0.001 gave 96.9 %
# (benchmarks/probes/agreement_probe.py) and 97.9 % / 98.6 % (Ouro / Huginn) on the H200.
AGREEMENT = {"ouro-1.4b": "0.001", "huginn-0125": "0.001", "huginn-0125-tp2": "0.001"}
SYSTEMS = ("vanilla", "vanilla-sync", "vanilla-v1", "vanilla-fused", "loopspec", "loopspec-auto", "loopspec-auto-sync",
           "loopspec-serial", "loopspec-auto-serial", "loopspec-pad", "loopspec-auto-pad", "loopspec-auto-pad32",
           "loopspec-chain", "loopspec-auto-chain", "loopspec-auto-fused",
           "loopspec-nographs", "loopspec-torch", "loopspec-triton", "loopspec-fused", "loopspec-triton-fused",
           "loopspec-tuned", "loopspec-tuned-late", "in-tree")
# suffixes to any system: its engine without / with vLLM's torch.compile (the docstring)
COMPILATION = {"-nocompile": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, "-compiled": {"mode": 3},
               "-fullgraphs": {"mode": 0, "cudagraph_mode": "FULL", "max_cudagraph_capture_size": 512}}
# suffixes to a LoopSpec system (any order, split_system): one variable of its engine's environment, for
# its lane kernels or its lanes policy (``-plainonly``: the policy's test pattern "P"; the docstring)
ENGINE_ENV = {"-unfused": ("VLLM_LOOP_LANE_SWIGLU", "0"), "-plainonly": ("VLLM_LOOP_LANES_PATTERN", "P"),
              "-torchsample": ("VLLM_LOOP_COUPLED_KERNEL", "0")}


def split_system(system: str) -> tuple[str, dict | None, dict[str, str], int | None]:
    """The system without its suffixes; the compilation suffix's config (None: none), the
    environment its lane-kernel and plain-only suffixes set, and the ``step_tokens`` of a ``-stepN``
    suffix (None: the system's own). The suffixes may come in any order."""
    compilation, env, step_tokens = None, {}, None
    while True:
        if suffix := next((x for x in ENGINE_ENV if system.endswith(x)), None):
            key, value = ENGINE_ENV[suffix]
            system, env[key] = system.removesuffix(suffix), value
        elif suffix := next((x for x in COMPILATION if system.endswith(x)), None):
            system, compilation = system.removesuffix(suffix), COMPILATION[suffix]
        elif match := re.fullmatch(r"(loopspec.*)-step(\d+)", system):
            system, step_tokens = match[1], int(match[2])
        else:
            return system, compilation, env, step_tokens


def sampling_suffix(system: str) -> tuple[str, str | None]:
    """``SYSTEM-cascade`` (a LoopSpec system): the paper's cascade for sampled requests instead of the
    default coupled sampling (``"sampling": "cascade"``). -> (the system without it, the mode or None)."""
    if system.startswith("loopspec") and "-cascade" in system:
        return system.replace("-cascade", "", 1), "cascade"
    return system, None


PROMPT_LEN, SHORT, LONG = 32, 64, 576


def policy_trace_path(out: str, system: str) -> Path:
    """Where ``--policy-trace`` puts ``system``'s trace: beside ``--out``, as its engine log is."""
    return Path(out).with_suffix(f".{system}.trace.jsonl")


def ensure_checkpoint(shape: str, folder: Path, agreement: str) -> None:
    """``make_shape_checkpoint`` into ``folder`` unless it exists. Written beside it and renamed when
    whole, so a run cut short leaves nothing a later run would take for a checkpoint."""
    if folder.exists():
        return
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    make_shape_checkpoint(shape, partial, agreement)
    partial.rename(folder)
    print(f"checkpoint {folder} written in {time.time() - t0:.0f} s", flush=True)


def make_shape_checkpoint(shape: str, folder: Path, agreement: str) -> None:
    """The factory checkpoint of ``SHAPES[shape]`` in ``folder``; ``agreement`` "0": random weights."""
    from vllm_loop.testing.checkpoints import make_checkpoint

    family, options, overrides, _ = SHAPES[shape]
    make_checkpoint(family, folder, options=dict(options) | ({"agreement": agreement} if float(agreement) > 0 else {}),
                    **overrides)


def _prompts(n: int, vocab: int, kind: str = "synthetic", checkpoint: str | None = None,
             length: int = PROMPT_LEN, first: int = 0) -> list[dict]:
    """Prompts ``first .. first + n - 1``. ``synthetic``: ``length`` arbitrary token ids each;
    ``heldout``: lines of the held-out works (for a model trained on the corpus:
    ``benchmarks/train_looped.py``), tokenized."""
    if kind == "heldout":
        from transformers import AutoTokenizer

        from vllm_loop.testing.trained import heldout_prompts

        tok = AutoTokenizer.from_pretrained(checkpoint)
        return [{"prompt_token_ids": tok(text).input_ids} for text in heldout_prompts(first + n)[first:]]
    return [{"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(length)]}
            for i in range(first, first + n)]


def decode_rate(c: int, texts: int, t_short: float, t_long: float) -> float:
    """Output tokens a second between the 64th and the 576th token: ``c`` requests of each of ``texts``
    prompt sets; ``t_short`` / ``t_long``: the seconds for all of them (medians of the runs)."""
    return texts * c * (LONG - SHORT) / (t_long - t_short)


def tuned_depths(path: str | None) -> dict:
    """``{"d1": .., "d2": ..}`` (no d2: single proposal) the tuner's JSON recommends (its ``best``)."""
    if not path:
        raise SystemExit("loopspec-tuned needs --tuned FILE (python -m vllm_loop.tune CHECKPOINT ... --json FILE)")
    best = json.loads(Path(path).read_text())["best"]
    return {"d1": best["d1"]} | ({"d2": best["d2"]} if best["d2"] is not None else {})


def _start(args, system: str, max_num_seqs: int):
    """The engine of one system on the benchmark's settings: ``(llm, engine kwargs, config.json, R,
    start-up seconds)``."""
    import torch
    from vllm import LLM

    gpu = torch.cuda.is_available()
    cfg = json.loads((Path(args.checkpoint) / "config.json").read_text())
    R = cfg.get("total_ut_steps") or cfg.get("mean_recurrence")
    if args.policy_trace and system.startswith("loopspec"):
        from vllm_loop.loopspec.scheduler import TRACE_ENV

        trace = policy_trace_path(args.out, system)
        trace.unlink(missing_ok=True)  # the scheduler appends: a rerun must not mix into an old trace
        os.environ[TRACE_ENV] = str(trace)
    system, sampling = sampling_suffix(system)
    system, compilation, env, step_tokens = split_system(system)
    os.environ.update(env)  # read by the lane calls, in the engine's processes (started below)
    kw = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=max_num_seqs, seed=0,
              enforce_eager=system in args.eager.split(",") or not gpu, trust_remote_code=system == "in-tree")
    kw |= dict(gpu_memory_utilization=0.8) if gpu else dict(kv_cache_memory_bytes=2**30)
    if system.endswith("-sync"):
        kw["async_scheduling"] = False
    if system.startswith("loopspec"):
        spec = json.loads(args.spec)
        spec["lanes"] = "auto" if system.startswith("loopspec-auto") else "on"
        if sampling:
            spec["sampling"] = sampling
        kw["speculative_config"] = spec
    if system.endswith("-serial"):
        kw["speculative_config"]["lane_overlap"] = "off"
    if system.endswith("-chain"):
        kw["speculative_config"]["step_tokens"] = 0
    elif "-pad" in system:  # -pad: 16, -pad32: 32
        kw["speculative_config"]["step_tokens"] = int(system.split("-pad")[1] or 16)
    if step_tokens is not None:
        kw["speculative_config"]["step_tokens"] = step_tokens
    if system.startswith("loopspec-tuned"):  # the tuner's depths replace the spec's (no d2: single proposal)
        kw["speculative_config"] = {k: v for k, v in kw["speculative_config"].items() if k not in ("d1", "d2")} | \
            tuned_depths(args.tuned)
    if system.endswith("-late"):
        if not args.late:
            raise SystemExit(f"{system} needs --late DEPTH ...")
        kw["speculative_config"]["late"] = args.late
    if system == "loopspec-nographs":
        kw["speculative_config"]["lane_graphs"] = "off"
    if system in ("loopspec-triton", "loopspec-triton-fused"):
        kw["speculative_config"]["lane_attention"] = "triton"
    if system == "loopspec-torch":
        kw["speculative_config"]["lane_attention"] = "torch"
    if system.endswith("-fused"):
        kw["compilation_config"] = {"custom_ops": ["all"]}
    if compilation and gpu:  # no compile: vLLM then takes its CUDA custom ops ("all") by itself
        kw["compilation_config"] = kw.get("compilation_config", {}) | compilation
    t0 = time.time()
    llm = LLM(args.checkpoint, **kw)
    return llm, kw, cfg, R, time.time() - t0


def worker(args) -> dict:
    """One system: start its engine, measure every concurrency, print one JSON line."""
    if split_system(args.worker)[0] == "in-tree":
        os.environ["VLLM_PLUGINS"] = "none"  # no general plugin: vLLM's own OuroForCausalLM
    if split_system(args.worker)[0] == "vanilla-v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    import torch
    from vllm import SamplingParams

    gpu = torch.cuda.is_available()
    llm, kw, cfg, R, startup = _start(args, args.worker, max(args.concurrency))
    engine_totals = None
    if args.worker.startswith("loopspec"):
        from vllm_loop.loopspec.stat_logger import engine_totals

    def run(n: int, out_len: int, texts: int = args.texts) -> tuple[float, list[list[int]]]:
        """Seconds for ``texts`` prompt sets of ``n`` requests, one set after another, and their tokens."""
        sp = SamplingParams(max_tokens=out_len, ignore_eos=True, detokenize=False, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k)
        dt, tokens = 0.0, []
        for text in range(texts):
            prompts = _prompts(n, cfg["vocab_size"], args.prompts, args.checkpoint, first=text * n)
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt += time.perf_counter() - t
            assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
            tokens += [list(o.outputs[0].token_ids) for o in outs]
        return dt, tokens

    run(1, 16, 1), run(max(args.concurrency), 16, 1)  # warm-up
    rows = []
    for c in args.concurrency:
        firsts = [run(c, 1, 1)[0] for _ in range(args.runs)]  # one prompt set's prefill and first token
        shorts = [run(c, SHORT)[0] for _ in range(args.runs)]
        before = engine_totals() if engine_totals else None
        longs, tokens = [], None
        for _ in range(args.runs):
            dt, tokens = run(c, LONG)
            longs.append(dt)
        t_short, t_long = statistics.median(shorts), statistics.median(longs)
        row = {"concurrency": c, "t_first_s": statistics.median(firsts), "t_short_s": t_short, "t_long_s": t_long,
               "tok_s": decode_rate(c, args.texts, t_short, t_long), "tokens": tokens}
        row["ms_per_token_per_request"] = 1000 * c / row["tok_s"]
        if before is not None:
            delta = engine_totals().minus(before)
            row["loopspec"] = delta.summary(R) | {"counters": vars(delta)}
        rows.append(row)
    return {"system": args.worker, "startup_s": round(startup, 1), "rows": rows,
            "model_module": llm.llm_engine.vllm_config.model_config.architecture,
            "enforce_eager": kw["enforce_eager"], "device": torch.cuda.get_device_name() if gpu else "cpu",
            "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
            "compilation": {"mode": llm.llm_engine.vllm_config.compilation_config.mode.name,
                            "cudagraph_mode": llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name},
            "model_runner": "V2" if llm.llm_engine.vllm_config.use_v2_model_runner else "V1"}


def _core_weight_bytes(worker) -> int:
    """Bytes of the weights one recurrent step reads: the shared block (Ouro: every layer; Raven: the core)."""
    model = worker.model_runner.model
    core = "core_block." if hasattr(model, "transformer") else "layers."
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if core in n)


def _lane_attention_mode(worker) -> str:
    return worker.model_runner.drafter.attention_mode


# The profiled request's prompt: its 64 decode steps then read 320-384 positions, the benchmark's
# average context (32-token prompts, 64 to 576 tokens decoded).
PROFILE_PROMPT = 320
# nominal HBM bandwidth (bytes/s) by the GPU's name, for the profile's floor: the H100 SXM's 3.35 TB/s,
# the H200's 4.8 (the floor used to say 4.8 on every GPU)
NOMINAL_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def nominal_bandwidth(device_name: str) -> tuple[float, str]:
    """(bytes/s, label) of the first ``NOMINAL_BANDWIDTH`` GPU named in ``device_name``; else the H200's."""
    gpu = next((g for g in NOMINAL_BANDWIDTH if g in device_name), "H200")
    return NOMINAL_BANDWIDTH[gpu], f"{gpu}'s nominal {NOMINAL_BANDWIDTH[gpu] / 1e12:g} TB/s"


def profile(args) -> None:
    """``--profile-requests`` requests (default one; ``PROFILE_PROMPT``-token prompts) decode 64 tokens
    each with lanes on (engine in this process): once plainly timed, once under ``torch.profiler``: ms
    per recurrent step, GPU kernel time per step, against the floor of one pass over the shared block's
    weights at the GPU's nominal bandwidth (``nominal_bandwidth``); the runner's host ranges; the op
    table. Many requests show whether a lane step waits for the host (its per-request decisions) or for the GPU."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile
    from vllm import SamplingParams

    from vllm_loop.loopspec.stat_logger import engine_totals

    gpu = torch.cuda.is_available()
    n = args.profile_requests
    llm, kw, cfg, R, startup = _start(args, args.profile_system, max_num_seqs=max(4, n))
    sp = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0, detokenize=False)
    prompt = _prompts(n, cfg["vocab_size"], length=PROFILE_PROMPT)
    llm.generate(prompt, sp, use_tqdm=False)  # warm-up (and lane graph capture)
    before = engine_totals()
    t = time.perf_counter()
    llm.generate(prompt, sp, use_tqdm=False)
    plain = time.perf_counter() - t
    d_plain = engine_totals().minus(before)
    before = engine_totals()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    t = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        llm.generate(prompt, sp, use_tqdm=False)
        if gpu:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t
    d = engine_totals().minus(before)
    steps = max(d.recurrent_steps, 1)
    events = prof.key_averages()
    # kernels only: ops would count them twice, and the runner's ``loopspec.*`` ranges also appear
    # as device-side events spanning their kernels
    kernel_ms = sum(e.self_device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("loopspec.")) / 1000
    bandwidth, bandwidth_label = nominal_bandwidth(torch.cuda.get_device_name() if gpu else "")
    floor_ms = llm.collective_rpc(_core_weight_bytes)[0] / bandwidth * 1000
    sort = "cuda_time_total" if gpu else "cpu_time_total"
    graphs = "graphs" if kw.get("speculative_config", {}).get("lane_graphs", "auto") != "off" and gpu and \
        not kw["enforce_eager"] else "eager"
    attention = llm.collective_rpc(_lane_attention_mode)[0]
    compilation = llm.llm_engine.vllm_config.compilation_config.mode.name  # a LoopSpec engine's default: NONE
    head = (f"{args.shape}, {'one request' if n == 1 else f'{n} requests'}, {PROFILE_PROMPT}-token prompt"
            f"{'' if n == 1 else 's'}, 64 tokens, {args.profile_system}: lanes "
            f"on, lane calls {graphs}, lane "
            f"attention {attention}, {'GPU' if gpu else 'CPU'}, "
            f"{'enforce_eager' if kw['enforce_eager'] else 'compilation ' + compilation} engine:\n"
            # the benchmark's engines ran before in this run: vLLM's compile caches are warm when one
            # of them had this engine's settings (--systems has --profile-system)
            f"  engine start {startup:.1f} s (after the benchmark's engines; max_num_seqs {max(4, n)})\n"
            f"  unprofiled: {plain * 1000:.1f} ms, {d_plain.recurrent_steps} recurrent steps, "
            f"{plain * 1000 / max(d_plain.recurrent_steps, 1):.2f} ms per recurrent step (whole engine time / steps)\n"
            f"  profiled: {wall * 1000:.1f} ms wall, {d.lane_steps} lane steps, {d.recurrent_steps} recurrent steps, "
            f"{d.lanes_advanced / steps:.2f} lanes per step, gamma {d.summary(R)['gamma']:.2f}\n"
            f"  GPU kernel time {kernel_ms / steps:.3f} ms per recurrent step; floor (one pass over the shared "
            f"block's weights at the {bandwidth_label}) {floor_ms:.3f} ms\n")
    # host-side ranges the runner marks (record_function "loopspec.*"), per recurrent step, under the
    # profiler (which slows the host): "read" includes waiting for the GPU to finish the step
    ranges = {e.key[len("loopspec."):]: e.cpu_time_total / 1000 / steps for e in events
              if e.key.startswith("loopspec.") and e.device_type == torch.autograd.DeviceType.CPU}
    if ranges:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(ranges.items(), key=lambda kv: -kv[1]))
        head += (f"  host ms per recurrent step in the runner's ranges: {parts}; engine outside lane steps "
                 f"{wall * 1000 / steps - ranges.get('lane_step', 0):.3f}\n")
    head += (f"  unprofiled: {d_plain.lane_step_gaps} gaps between consecutive lane steps, "
             f"{d_plain.lane_step_gap_ms:.3f} ms each (the engine's "
             f"scheduler, output and loop; no lane work on the GPU)\n")
    table = f"  ops sorted by {sort}:\n" + events.table(sort_by=sort, row_limit=40)
    Path(args.out).with_suffix(".profile.txt").write_text(head + table + "\n")
    print(head, flush=True)


def side_by_side(results: dict[str, dict], runs: int) -> list[dict]:
    """One row per (system, concurrency) from the workers' results: tok/s, the ratios against
    ``vanilla`` and, when it ran, against ``in-tree`` (issue 10's Ouro targets are stated against
    vLLM's own OuroForCausalLM), the short-run flag, and a LoopSpec engine's counters per long run (all of
    its ``--texts`` prompt sets)."""
    from vllm_loop.loopspec.metrics import EngineCounters

    base = {r["concurrency"]: r for r in results["vanilla"]["rows"]} if "vanilla" in results else {}
    in_tree = {r["concurrency"]: r for r in results["in-tree"]["rows"]} if "in-tree" in results else {}
    table = []
    for system, res in results.items():
        for r in res["rows"]:
            row = {"system": system, "concurrency": r["concurrency"], "tok_s": round(r["tok_s"], 1),
                   "ms_per_token_per_request": round(r["ms_per_token_per_request"], 3)}
            if "t_first_s" in r:  # (absent from older results)
                row["first_token_ms"] = round(1000 * r["t_first_s"], 1)
            if r["concurrency"] in base:
                b = base[r["concurrency"]]
                row["speedup_vs_vanilla"] = round(r["tok_s"] / b["tok_s"], 3)
                # the long runs alone (prefill included): a cross-check of the difference above
                row["long_run_speedup"] = round(b["t_long_s"] / r["t_long_s"], 3)
                same = sum(x == y for x, y in zip(r["tokens"], b["tokens"]))
                row["same_tokens_as_vanilla"] = f"{same}/{len(b['tokens'])} requests"
            if r["concurrency"] in in_tree and system != "in-tree":
                b = in_tree[r["concurrency"]]
                row["speedup_vs_in_tree"] = round(r["tok_s"] / b["tok_s"], 3)
                row["long_run_speedup_vs_in_tree"] = round(b["t_long_s"] / r["t_long_s"], 3)
            if r["t_short_s"] / SHORT > 1.5 * r["t_long_s"] / LONG:
                # a short run slower per token than the long one (e.g. a one-off stall in it) inflates
                # tok_s, which is the difference of the two: trust long_run_speedup for this row
                row["short_run_outlier"] = True
            if "loopspec" in r:
                ls, n = r["loopspec"], r["loopspec"]["counters"]
                row |= {"gamma": round(ls["gamma"], 3), "first": round(ls["shares"]["first"], 3),
                        "second": round(ls["shares"]["second"], 3), "late": round(ls["shares"]["late"], 3),
                        "full": round(ls["shares"]["full"], 3),
                        "lanes_per_step": round(ls["lanes_per_step"], 2),
                        # per long run (all its prompt sets): where a LoopSpec engine's steps went
                        "lane_steps": n["lane_steps"] / runs, "plain_steps": n["plain_steps"] / runs,
                        "drains": n["drains"] / runs, "recurrent_steps": n["recurrent_steps"] / runs,
                        "overlap_wasted": n["overlap_wasted"] / runs,
                        "overlap_lagged": n["overlap_lagged"] / runs,
                        "lane_step_s": round(n["lane_step_seconds"] / runs, 3),
                        # the engine between two consecutive lane steps (the GPU has no lane work then)
                        "gap_ms": round(EngineCounters(**n).lane_step_gap_ms, 3)}
            table.append(row)
    return table


def plot(table: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(r["system"] for r in table):
        pts = sorted((r["concurrency"], r["tok_s"]) for r in table if r["system"] == system)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency (requests)")
    ax.set_ylabel("output tok/s")
    spec = {k: v for k, v in json.loads(args.spec).items() if k != "lanes"}  # each system sets its own (_start)
    ax.set_title(f"{args.shape}: decode speed, {spec}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="ouro-1.4b")
    ap.add_argument("--agreement", default=None, help="factory agreement option (0: random weights; default: "
                    "the shape's, " + ", ".join(f"{k} {v}" for k, v in AGREEMENT.items()) + ", else 0.005)")
    ap.add_argument("--spec", default=None, help="speculative config JSON (default: the shape's)")
    ap.add_argument("--systems", default="vanilla,loopspec",
                    help="comma-separated: " + ", ".join(SYSTEMS))
    ap.add_argument("--profile", action="store_true", help="also profile lane steps (torch.profiler)")
    ap.add_argument("--profile-system", default="loopspec", help="the LoopSpec system --profile runs")
    ap.add_argument("--profile-requests", type=int, default=1, help="requests the --profile run decodes at once")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompts", choices=["synthetic", "heldout"], default="synthetic",
                    help="heldout: held-out corpus lines (for trained checkpoints)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--texts", type=int, default=1, help="prompt sets timed one after another at each concurrency "
                    "(their times summed; default 1: the same prompts as every earlier run)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0: off")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", default="", help="comma-separated systems to run with enforce_eager (vLLM's "
                    "forward and the lane calls eager: saves compile time at start-up)")
    ap.add_argument("--checkpoint", default=None, help="this folder's checkpoint (made there first, and kept, "
                    "if it does not exist; default: one made in a temp folder and removed at exit)")
    ap.add_argument("--tuned", default=None,
                    help="the tuner's JSON for loopspec-tuned (python -m vllm_loop.tune CHECKPOINT ... --json FILE)")
    ap.add_argument("--late", type=int, nargs="*", default=[],
                    help="late re-proposal depths of the *-late systems (e.g. --late 8 12 16 20)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy-trace", action="store_true",
                    help="each LoopSpec system's lanes-policy trace to OUT.SYSTEM.trace.jsonl (a line per engine step)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.texts < 1:
        ap.error(f"--texts {args.texts}: allowed: an integer >= 1")
    spec = SHAPES[args.shape][3]
    args.spec = args.spec or json.dumps(spec)
    args.agreement = args.agreement or AGREEMENT.get(args.shape, "0.005")
    if args.worker == "profile":
        profile(args)
        return 0
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    unknown = [x for x in args.systems.split(",") + [args.profile_system]
               if split_system(sampling_suffix(x)[0])[0] not in SYSTEMS]
    if unknown:
        ap.error(f"--systems / --profile-system: unknown {', '.join(unknown)}; allowed: {', '.join(SYSTEMS)} "
                 f"(each also as SYSTEM{' or SYSTEM'.join(COMPILATION)})")

    # no --checkpoint: one of our own, removed at exit (a 3.5B-shape one is ~7 GB)
    made = None if args.checkpoint else Path(tempfile.mkdtemp())
    if made:
        args.checkpoint = str(made / args.shape)
    try:
        ensure_checkpoint(args.shape, Path(args.checkpoint), args.agreement)
        return compare(args)
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)


def compare(args) -> int:
    """Each of ``--systems`` in its own worker process on ``--checkpoint``, side by side; then the
    ``--profile`` run."""
    # the LoopSpec systems' schedule options, as every worker process gets them
    schedule_args = (["--tuned", args.tuned] if args.tuned else []) + (["--late", *map(str, args.late)] if args.late else [])
    results, failed = {}, []
    for system in args.systems.split(","):
        cmd = [sys.executable, __file__, "--worker", system, "--shape", args.shape, "--spec", args.spec,
               "--checkpoint", args.checkpoint, "--runs", str(args.runs), "--texts", str(args.texts),
               "--dtype", args.dtype, "--out", args.out,
               "--eager", args.eager, "--prompts", args.prompts, "--temperature", str(args.temperature),
               "--top-p", str(args.top_p), "--top-k", str(args.top_k), "--concurrency", *map(str, args.concurrency)] + \
              schedule_args + (["--policy-trace"] if args.policy_trace else [])
        # the engine's log goes to a file beside --out as it runs: a run cut short still shows how far it got
        log = Path(args.out).with_suffix(f".{system}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as err:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        with open(log, "a") as err:  # vLLM logs to stdout: its start-up times (compile, graphs) belong here
            err.write(proc.stdout)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:  # keep the other systems' numbers; report this one
            print(proc.stdout[-3000:], log.read_text()[-6000:], file=sys.stderr)
            print(f"{system}: the benchmark worker failed (exit {proc.returncode})", file=sys.stderr, flush=True)
            failed.append(system)
            continue
        results[system] = json.loads(line[len("RESULT "):])
        print(f"{system}: " + json.dumps([{k: r[k] for k in ("concurrency", "tok_s")} for r in results[system]["rows"]]),
              flush=True)
    table = side_by_side(results, args.runs)
    for res in results.values():
        for r in res["rows"]:
            r.pop("tokens")
    out = {"shape": args.shape, "checkpoint": args.checkpoint, "prompts": args.prompts,
           "agreement": float(args.agreement), "spec": json.loads(args.spec),
           "tuned": tuned_depths(args.tuned) if args.tuned else None, "late": args.late,
           "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
           "prompt_len": PROMPT_LEN, "decode_tokens": LONG - SHORT, "runs": args.runs, "texts": args.texts,
           "table": table,
           "systems": results, "failed": failed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(table, args, Path(args.out).with_suffix(".png"))
    if args.profile:
        cmd = [sys.executable, __file__, "--worker", "profile", "--shape", args.shape, "--spec", args.spec,
               "--checkpoint", args.checkpoint, "--dtype", args.dtype, "--out", args.out, "--eager", args.eager,
               "--profile-system", args.profile_system, "--profile-requests", str(args.profile_requests)] + schedule_args
        proc = subprocess.run(cmd, capture_output=True, text=True)
        Path(args.out).with_suffix(".profile.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"profile: the worker failed (exit {proc.returncode})")
        print(Path(args.out).with_suffix(".profile.txt").read_text())
    for row in table:
        print(json.dumps(row))
    if failed:
        print(f"failed systems: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
