"""Engine start of a looped model with LoopSpec on, cold and warm, phase by phase.

Every start runs in its own process. ``cold``: vLLM's, Inductor's and Triton's compile caches
(``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) point at a fresh empty folder;
``warm``: the same engine again on the folder its cold start filled. Start = the wall time of
``LLM(...)``; then one request (32-token prompt, 64 new tokens) is timed twice: the first pays for
whatever is built on first use (lane graphs, where the lanes policy runs lanes), the second does not. vLLM's log
lines give the phases (weights, Dynamo, Inductor, the whole compile, graph capture, ``init engine``).

``--variants`` picks settings to compare on the same checkpoint: ``default`` (a
LoopSpec engine on one GPU starts without torch.compile, ``loopspec/config.py:
fast_start_compilation``); ``compiled`` (``compilation_config={"mode": 3}``: vLLM's torch.compile, as
every variant below asks for it too, so the runs before the fast start compare with these);
``no-aot`` (``VLLM_USE_AOT_COMPILE=0``: no ahead-of-time compiled artifact is serialized; a warm
start re-runs Dynamo and loads Inductor's cached graphs instead); ``capture-256``
(``compilation_config.max_cudagraph_capture_size`` 256 given explicitly: what vLLM picks for 128
sequences without speculative decoding, and the plugin's default for LoopSpec engines;
before it, vLLM's draft-model size, 512); ``no-aot-capture-256`` (both); ``inline-save``,
``no-gc-freeze``, ``one-compile-thread``, ``vllm-startup``: the plugin's start-up changes
(``vllm_patches.startup.install_compiled_model_startup``: the compiled forward saved from a child process, no
full collections while compiling, Inductor's Triton kernels built by a pool of processes) turned off,
one of them or all. A warm start waits for its cold start's saved artifact, and reports whether vLLM
loaded it (``aot_loaded``) and whether its request's tokens equal the cold start's (``same_tokens``).
The JSON also holds a timeline: the seconds from the worker's first log line to each of vLLM's start-up
milestones. ``--probe``: every start also records its full garbage collections and Triton compiles
(``startup_probe/``; seconds, counts, and the kernels compiled). ``--cprofile``: each cold start also
runs once more with the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) under
``cProfile``, its functions by cumulative and own time in ``*.cprofile.txt`` (the profiler slows
Python-heavy phases such as Dynamo: read shares, not seconds).

    python3 benchmarks/engine_start.py --shape ouro-1.4b --variants default,vllm-startup --probe --out OUT/engine-start.json
    python3 benchmarks/engine_start.py --shape tiny-ouro --variants default --out /tmp/start.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import loopspec_speed  # noqa: E402  (the shapes and their factory checkpoints)

NO_AOT, INLINE_SAVE, NO_FREEZE, ONE_THREAD = {"VLLM_USE_AOT_COMPILE": "0"}, {"VLLM_LOOP_AOT_SAVE": "inline"}, \
    {"VLLM_LOOP_GC_FREEZE": "0"}, {"VLLM_LOOP_COMPILE_THREADS": "1"}
# vLLM's torch.compile asked for: a LoopSpec engine skips it by default
COMPILED = {"compilation_config": {"mode": 3}}
CAPTURE_256 = {"compilation_config": {"mode": 3, "max_cudagraph_capture_size": 256}}
VARIANTS = {  # name -> (environment, engine keyword arguments)
    "default": ({}, {}), "compiled": ({}, COMPILED), "no-aot": (NO_AOT, COMPILED), "capture-256": ({}, CAPTURE_256),
    "no-aot-capture-256": (NO_AOT, CAPTURE_256),
    # the plugin's start-up changes for compiled engines (vllm_patches.startup.install_compiled_model_startup)
    # turned off, one or all
    "inline-save": (INLINE_SAVE, COMPILED), "no-gc-freeze": (NO_FREEZE, COMPILED),
    "one-compile-thread": (ONE_THREAD, COMPILED), "vllm-startup": (INLINE_SAVE | NO_FREEZE | ONE_THREAD, COMPILED)}
MILESTONES = ("Resolved architecture", "Initializing a V1 LLM engine", "Starting to load model", "Model loading took",
              "Dynamo bytecode transform time", "Compiling a graph for compile range", "saved AOT compiled function",
              "torch.compile took", "torch.compile and initial", "Initial profiling/warmup run took",
              "Profiling CUDA graph memory", "Available KV cache memory", "Graph capturing finished", "init engine",
              "compiled forward saved for later starts")
PROBE = Path(__file__).with_name("startup_probe")  # sitecustomize.py: full collections and Triton compiles
PHASES = {  # name -> the vLLM 0.26 log line that carries it (seconds), summed where it repeats
    "weights_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "inductor_s": r"Compiling a graph for compile range .* takes ([\d.]+) s",
    "inductor_cached_s": r"Directly load the compiled graph\(s\) for compile range .* took ([\d.]+) s",
    "compile_s": r"torch\.compile (?:and initial profiling/warmup run together )?took ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}


def phases(log: str) -> dict:
    out = {}
    for name, pattern in PHASES.items():
        found = [float(x) for x in re.findall(pattern, log)]
        if found:
            out[name] = round(sum(found), 2)
    return out


def timeline(log: str) -> list:
    """``[seconds since the first timestamped line, milestone]`` for each start-up milestone (vLLM's log
    timestamps have one-second resolution)."""
    stamps = [(m.group(1), line) for line in log.splitlines()
              if (m := re.search(r"(?:INFO|WARNING|DEBUG) \d\d-\d\d (\d\d:\d\d:\d\d) ", line))]
    if not stamps:
        return []

    def sec(hms: str) -> int:
        h, m, s = map(int, hms.split(":"))
        return 3600 * h + 60 * m + s

    t0, out = sec(stamps[0][0]), []
    for hms, line in stamps:
        hit = next((x for x in MILESTONES if x in line), None)
        if hit:
            out.append([(sec(hms) - t0) % 86400, hit])
    return out


def worker(args) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    gpu = torch.cuda.is_available()
    kw = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=args.max_num_seqs, seed=0, enforce_eager=not gpu,
              speculative_config=json.loads(args.spec)) | VARIANTS[args.variant][1]
    kw |= dict(gpu_memory_utilization=0.8) if gpu else dict(kv_cache_memory_bytes=2**30)
    t0 = time.time()
    if args.cprofile:
        import cProfile
        import io
        import pstats

        with cProfile.Profile() as prof:
            llm = LLM(args.checkpoint, **kw)
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(80)
        stats.sort_stats("tottime").print_stats(50)
        Path(args.cprofile).write_text(text.getvalue())
    else:
        llm = LLM(args.checkpoint, **kw)
    start = time.time() - t0
    prompt = [{"prompt_token_ids": [(13 * j) % 400 + 5 for j in range(32)]}]
    sp = SamplingParams(max_tokens=64, min_tokens=64, ignore_eos=True, temperature=0, detokenize=False)
    times = []
    for _ in range(2):
        t = time.time()
        out = llm.generate(prompt, sp, use_tqdm=False)
        times.append(time.time() - t)
    return {"start_s": round(start, 1), "first_request_s": round(times[0], 2), "second_request_s": round(times[1], 2),
            "tokens": list(out[0].outputs[0].token_ids), "started_at": t0}


def probe_summary(path: Path, t0: float, t1: float) -> dict:
    """The probe's events between ``t0`` and ``t1`` (wall clock: the engine's start), full collections and
    Triton compiles; ``events`` gives each one's seconds after ``t0`` and process (0: the front end)."""
    events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    events = [e for e in events if t0 <= e["t"] <= t1]
    gcs = [e for e in events if e["kind"] == "gc"]
    builds = [e for e in events if e["kind"] == "triton" and not e["hit"]]
    pids = sorted({e["pid"] for e in events})
    return {"gc_full_n": len(gcs), "gc_full_s": round(sum(e["s"] for e in gcs), 2),
            "gc_full_s_by_process": [round(sum(e["s"] for e in gcs if e["pid"] == pid), 2) for pid in pids],
            "gc_full_max_s": max((e["s"] for e in gcs), default=0),
            "triton_builds_n": len(builds), "triton_builds_s": round(sum(e["s"] for e in builds), 2),
            "triton_hits_n": sum(e["kind"] == "triton" and e["hit"] for e in events),
            "triton_built": sorted({e["name"] for e in builds}),
            "events": [[round(e["t"] - t0, 2), pids.index(e["pid"]), e["kind"], e.get("name"), e["s"]]
                       for e in events if e["kind"] == "triton" or e["s"] >= 0.05]}


def saved_artifact(cache: Path) -> Path | None:
    """vLLM's saved AOT-compiled forward under a start's cache, if any."""
    return next(iter((cache / "vllm" / "torch_compile_cache" / "torch_aot_compile").glob("*/rank_*/model")), None)


def run_one(args, variant: str, cache: Path, log: Path, cprofile: Path | None = None) -> dict:
    env = dict(os.environ) | VARIANTS[variant][0] | ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if cprofile else {})
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("TRITON_CACHE_DIR", "triton")):
        env[var] = str(cache / sub)
    probe = log.with_suffix(".probe.jsonl") if args.probe else None
    if probe:
        probe.unlink(missing_ok=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE), env.get("PYTHONPATH")]))
        env["LOOP_STARTUP_PROBE"] = str(probe)
    cmd = [sys.executable, __file__, "--worker", "--shape", args.shape, "--checkpoint", args.checkpoint,
           "--spec", args.spec, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--out", args.out,
           "--variant", variant] + \
        (["--cprofile", str(cprofile)] if cprofile else [])
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t0
    log.write_text(proc.stdout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-4000:], file=sys.stderr)
        raise SystemExit(f"{variant}: the start-up worker failed (exit {proc.returncode}); log {log}")
    row = json.loads(line[len("RESULT "):]) | {"process_s": round(wall, 1)} | phases(proc.stdout) | \
        {"aot_loaded": "Directly load AOT compilation" in proc.stdout, "timeline": timeline(proc.stdout)}
    if probe:
        row["probe"] = probe_summary(probe, row["started_at"], row["started_at"] + row["start_s"])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(loopspec_speed.SHAPES), default="ouro-1.4b")
    ap.add_argument("--agreement", default=None, help="factory agreement option (default: the shape's)")
    ap.add_argument("--spec", default=None, help="speculative config JSON (default: the shape's, lanes auto)")
    ap.add_argument("--variants", default="default", help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--starts", default="cold,warm", help="cold, warm or both (warm follows its variant's cold)")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="as loopspec_speed.py's engines at c <= 128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--checkpoint", default=None, help="the checkpoint folder (made there if missing)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="default", help=argparse.SUPPRESS)  # the worker's
    ap.add_argument("--probe", action="store_true", help="record full collections and Triton compiles (startup_probe/)")
    ap.add_argument("--cprofile", nargs="?", const="yes", default=None,
                    help="also profile each cold start in-process (cProfile; the worker's own: the output file)")
    args = ap.parse_args()
    args.spec = args.spec or json.dumps(loopspec_speed.SHAPES[args.shape][3] | {"lanes": "auto"})
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; allowed: {', '.join(VARIANTS)}")
    starts = args.starts.split(",")
    if not set(starts) <= {"cold", "warm"}:
        ap.error(f"--starts {args.starts!r}: allowed cold, warm or cold,warm")
    if args.checkpoint is None or not Path(args.checkpoint).exists():  # made here (into --checkpoint if given)
        folder = Path(args.checkpoint or Path(tempfile.mkdtemp()) / args.shape)
        agreement = args.agreement or loopspec_speed.AGREEMENT.get(args.shape, "0.005")
        folder.parent.mkdir(parents=True, exist_ok=True)
        loopspec_speed.make_shape_checkpoint(args.shape, folder, agreement)
        args.checkpoint = str(folder)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant in args.variants.split(","):
        cache = Path(tempfile.mkdtemp(prefix=f"engine-start-{variant}-"))
        for start in ("cold", "warm"):
            if start not in starts and not (start == "cold" and "warm" in starts):
                continue  # a warm start needs its cold start first (it is measured, and reported, too)
            row = {"variant": variant, "start": start}
            cold = next((r for r in reversed(rows) if r["variant"] == variant and r["start"] == "cold"
                         and not r.get("cprofile")), {})
            if start == "warm" and cold.get("dynamo_s") and "VLLM_USE_AOT_COMPILE" not in VARIANTS[variant][0]:
                t = time.time()  # the cold start's artifact may still be on its way (saved by a child process)
                while saved_artifact(cache) is None and time.time() - t < 180:
                    time.sleep(1)
                row["waited_for_artifact_s"] = round(time.time() - t, 1)
            row |= run_one(args, variant, cache, out.with_suffix(f".{variant}.{start}.log"))
            if start == "warm":
                row["same_tokens"] = row["tokens"] == cold["tokens"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.cprofile and start == "cold":  # another cold start, in-process, under the profiler
                pcache = Path(tempfile.mkdtemp(prefix=f"engine-start-{variant}-profiled-"))
                name = f".{variant}.{start}.cprofile"
                prow = run_one(args, variant, pcache, out.with_suffix(name + ".log"), out.with_suffix(name + ".txt"))
                rows.append({"variant": variant, "start": start, "cprofile": True} | prow)
                print(json.dumps(rows[-1]), flush=True)
    out.write_text(json.dumps({"shape": args.shape, "spec": json.loads(args.spec), "max_num_seqs": args.max_num_seqs,
                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
