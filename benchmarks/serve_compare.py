"""`vllm serve` side by side, driven by vLLM's own `vllm bench serve`: in-tree Ouro, ours, ours + LoopSpec.

For each system one server (same checkpoint, same flags, ``--max-model-len`` sized for the requested
lengths; ``in-tree`` = vLLM 0.26's own OuroForCausalLM with this plugin not loaded, Ouro shapes
only). Each server first takes a warm-up request set (recorded as a ``warmup`` row: what the first
clients of a fresh server meet), then for every temperature x request rate x max concurrency one
``vllm bench serve`` run on the random dataset with a fixed seed (``steady`` rows). Per row: output
tok/s, TTFT / TPOT / ITL p50 and p99 (vLLM's numbers), the Triton compilations the server logged
while serving so far (vLLM's jit monitor), and for LoopSpec the acceptance the server measured during
that run (from ``/metrics``: gamma, commit shares, lanes per recurrent step); the LoopSpec server's
lanes-policy trace is kept beside the results (``trace-loopspec.jsonl``). A run in which any request
failed is an error: the count and the first error are printed, and no row is written. Writes
``results.json``, ``table.md`` and one PNG per temperature into ``--out``.

    python benchmarks/serve_compare.py --shape tiny-ouro --out benchmarks/results/serve-compare-cpu
    python benchmarks/serve_compare.py --shape ouro-1.4b --agreement 0.005 --concurrency 1 4 16 64 \\
        --num-prompts 128 --output-len 256 --out $OUT/serve      # GPU; add --tp 2 --ray for scale-out
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopspec_speed import SHAPES  # noqa: E402  (the same checkpoints as the offline benchmark)

from vllm_loop.loopspec.scheduler import TRACE_ENV  # noqa: E402
from vllm_loop.testing.engines import vllm_cli  # noqa: E402

PERCENTILES = "50,90,99"
JIT_LINE = "JIT compilation during inference"  # vLLM's jit monitor (vllm/utils/jit_monitor.py)


def jit_compiles(log_path: str) -> list[str]:
    """The kernels a server's log says were compiled while it served (vLLM warns once per kernel)."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return []
    return [line.split(JIT_LINE + ": ", 1)[-1].split(".")[0] for line in text.splitlines() if JIT_LINE in line]


def scrape(base: str) -> dict[str, float]:
    """LoopSpec counters from a server's /metrics (summed over label sets)."""
    import requests

    out: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm_loop:loopspec_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if "source=" in name:
                key += "_" + name.split('source="')[1].split('"')[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def acceptance(before: dict, after: dict, R: int) -> dict | None:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    first, second, full = (d.get(f"vllm_loop:loopspec_commits_total_{s}", 0.0) for s in ("first", "second", "full"))
    n, steps = first + second + full, d.get("vllm_loop:loopspec_request_steps_total", 0.0)
    if not n:
        return None
    rs = d.get("vllm_loop:loopspec_recurrent_steps_total", 0.0)
    return {"gamma": R * n / steps if steps else 0.0, "first": first / n, "second": second / n, "full": full / n,
            "lanes_per_step": d.get("vllm_loop:loopspec_lanes_advanced_total", 0.0) / rs if rs else 0.0,
            "commits": n}


class FailedRequests(SystemExit):
    """A benchmark run in which requests failed: never a row."""


def bench(base: str, name: str, ckpt: str, args, temperature: float, rate: str, conc: int, out: Path,
          num_prompts: int | None = None, tag: str = "") -> dict:
    num_prompts = num_prompts or args.num_prompts
    fname = f"bench-{name}{tag}-t{temperature:g}-r{rate}-c{conc}.json"
    cmd = [*vllm_cli(), "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", "m", "--tokenizer", ckpt,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "0", "--num-prompts", str(num_prompts),
           "--max-concurrency", str(conc), "--request-rate", rate, "--seed", str(args.seed), "--temperature",
           str(temperature), "--ignore-eos", "--save-result", "--result-dir", str(out), "--result-filename", fname,
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", PERCENTILES, "--disable-tqdm"]
    if temperature > 0 and args.top_p is not None:
        cmd += ["--top-p", str(args.top_p)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({name}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    res = json.loads((out / fname).read_text())
    check_complete(res, num_prompts, f"{name}{tag}, T={temperature:g}, rate {rate}, concurrency {conc}")
    return res


def check_complete(res: dict, num_prompts: int, what: str) -> None:
    """Raise ``FailedRequests`` (with the count and the first error) unless every request completed."""
    failed = res.get("failed", 0) or 0
    if failed or res.get("completed", 0) != num_prompts:
        errors = [e for e in res.get("errors") or [] if e]
        first = errors[0].strip()[:1000] if errors else "(no error text)"
        raise FailedRequests(f"{what}: {failed} of {num_prompts} requests failed "
                             f"({res.get('completed', 0)} completed); first error: {first}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny-ouro")
    ap.add_argument("--agreement", default="0.005")
    ap.add_argument("--checkpoint", default=None,
                    help="checkpoint folder (made there from --shape / --agreement when it does not exist)")
    ap.add_argument("--systems", default="in-tree,vanilla,loopspec")
    ap.add_argument("--spec", default=None, help="speculative config JSON (default: the shape's)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--top-p", type=float, default=0.7, help="top_p of the sampled runs (temperature > 0)")
    ap.add_argument("--request-rate", nargs="+", default=["inf"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="requests of each server's warm-up set, at the largest concurrency (default: that "
                         "concurrency; 0: no warm-up row)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size for every server")
    ap.add_argument("--ray", action="store_true", help="--distributed-executor-backend ray")
    ap.add_argument("--server-args", default="", help="extra `vllm serve` flags for every server")
    ap.add_argument("--together", action="store_true",
                    help="start every system's server at once (GPU: a memory share each), then run the "
                         "benchmarks one server at a time; start-up times then overlap")
    ap.add_argument("--out", required=True)
    ap.add_argument("--combine", nargs="+", default=None, metavar="DIR",
                    help="no runs: merge the results.json of earlier runs (e.g. TP=1 and TP=2) into one "
                         "table and plot in --out")
    args = ap.parse_args()
    if args.combine:
        combine([Path(d) for d in args.combine], Path(args.out))
        return 0

    from vllm_loop.testing.checkpoints import make_checkpoint
    from vllm_loop.testing.engines import Server, on_gpu

    family, options, overrides, spec = SHAPES[args.shape]
    spec = json.loads(args.spec) if args.spec else spec
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = args.checkpoint or str(Path(tempfile.mkdtemp()) / args.shape)
    if not Path(ckpt).exists():
        opts = dict(options) | ({"agreement": args.agreement} if float(args.agreement) > 0 else {})
        make_checkpoint(family, ckpt, options=opts, **overrides)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    R = cfg.get("total_ut_steps") or cfg.get("mean_recurrence")
    systems = [s for s in args.systems.split(",") if s != "in-tree" or family == "ouro"]
    # sized for the requested lengths (a request past max_model_len would fail, not be measured)
    max_len = args.input_len + args.output_len + 16
    common = ["--max-num-seqs", str(max(args.concurrency)), "--seed", str(args.seed), "--max-model-len", str(max_len)]
    common += ["--tensor-parallel-size", str(args.tp)] if args.tp > 1 else []
    common += ["--distributed-executor-backend", "ray"] if args.ray else []
    common += args.server_args.split() if args.server_args else []
    if not on_gpu():
        common += ["--kv-cache-memory-bytes", str(2**30)]
    if args.together and on_gpu():  # all servers side by side on the GPU(s): a share of memory each
        common += ["--gpu-memory-utilization", f"{0.85 / len(systems):.2f}"]

    def launch(system: str) -> Server:
        flags = list(common)
        saved = os.environ.get("VLLM_PLUGINS")
        if system == "in-tree":
            os.environ["VLLM_PLUGINS"] = "none"  # vLLM's own OuroForCausalLM (remote-code config)
            flags.append("--trust-remote-code")
        if system == "loopspec":
            flags += ["--speculative-config", json.dumps(spec)]
            os.environ[TRACE_ENV] = str(out / "trace-loopspec.jsonl")  # the lanes policy's choices, step by step
        try:
            return Server(ckpt, *flags, log_path=str(out / f"server-{system}.log"), served_name="m", wait=False)
        finally:
            os.environ.pop(TRACE_ENV, None)
            if saved is None:
                os.environ.pop("VLLM_PLUGINS", None)
            else:
                os.environ["VLLM_PLUGINS"] = saved

    def ready(server: Server, t0: float) -> float:
        server.wait_healthy(timeout=1200)
        return round(time.time() - t0, 1)

    servers: dict[str, tuple[Server, float]] = {}
    if args.together:  # start-ups overlap (they are mostly compilation); the runs below stay one at a time
        t0 = time.time()
        launched = {system: launch(system) for system in systems}
        servers = {system: (server, ready(server, t0)) for system, server in launched.items()}
    rows = []
    try:
        for system in systems:
            if system not in servers:
                t0 = time.time()
                server = launch(system)
                servers[system] = (server, ready(server, t0))
            server, startup = servers[system]
            log = str(out / f"server-{system}.log")

            def record(phase: str, temperature: float, rate: str, conc: int, num_prompts: int | None = None):
                before = scrape(server.base) if system == "loopspec" else {}
                res = bench(server.base, system, ckpt, args, temperature, rate, conc, out, num_prompts,
                            "-warmup" if phase == "warmup" else "")
                row = {"system": system, "phase": phase, "temperature": temperature, "request_rate": rate,
                       "concurrency": conc, "startup_s": startup, "output_tok_s": res["output_throughput"],
                       "completed": res["completed"], "jit_compiles": jit_compiles(log)}
                for metric in ("ttft", "tpot", "itl"):
                    row[f"mean_{metric}_ms"] = res[f"mean_{metric}_ms"]
                    for p in PERCENTILES.split(","):
                        row[f"p{p}_{metric}_ms"] = res[f"p{p}_{metric}_ms"]
                if system == "loopspec":
                    row["loopspec"] = acceptance(before, scrape(server.base), R)
                rows.append(row)
                print(json.dumps(row), flush=True)

            warmup = max(args.concurrency) if args.warmup_prompts is None else args.warmup_prompts
            if warmup:
                record("warmup", args.temperature[0], "inf", max(args.concurrency), warmup)
            for temperature in args.temperature:
                for rate in args.request_rate:
                    for conc in args.concurrency:
                        record("steady", temperature, rate, conc)
            if not args.together:
                server.stop()
    finally:
        for server, _ in servers.values():
            server.stop()
    for baseline in ("vanilla", "in-tree"):
        base = {(r["phase"], r["temperature"], r["request_rate"], r["concurrency"]): r for r in rows
                if r["system"] == baseline}
        for r in rows:
            b = base.get((r["phase"], r["temperature"], r["request_rate"], r["concurrency"]))
            r[f"vs_{baseline.replace('-', '_')}"] = r["output_tok_s"] / b["output_tok_s"] if b else None
    meta = {"shape": args.shape, "together": args.together, "checkpoint": ckpt, "R": R, "spec": spec, "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed, "tp": args.tp,
            "ray": args.ray, "top_p": args.top_p, "max_model_len": max_len, "device": _device()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    write_table(rows, out / "table.md")
    plot(rows, out)
    return 0


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _shares(ls: dict) -> str:
    return f"{ls['first']:.0%} / {ls['second']:.0%} / {ls['full']:.0%}" if ls else ""


def combine(dirs: list[Path], out: Path) -> None:
    """One table (``combined.md``) and one PNG (``combined.png``: output tok/s and TPOT p50 vs
    concurrency, one line per shape x TP x system) from several runs' ``results.json``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    lines = ["| shape | TP | Ray | system | T | concurrency | output tok/s | vs vanilla | TPOT p50 ms | gamma "
             "| commits first / second / full | lanes per step | server start s |", "|" + "---|" * 13]
    shapes: dict[str, list] = {}
    for d in dirs:
        run = json.loads((d / "results.json").read_text())
        meta = run["meta"]
        shapes.setdefault(meta["shape"], []).append(run)
        for r in run["rows"]:
            if r.get("phase", "steady") != "steady":
                continue
            ls = r.get("loopspec") or {}
            lines.append(
                f"| {meta['shape']} | {meta['tp']} | {'yes' if meta['ray'] else 'no'} | {r['system']} | "
                f"{r['temperature']:g} | {r['concurrency']} | {r['output_tok_s']:.1f} | "
                f"{'' if r['vs_vanilla'] is None else format(r['vs_vanilla'], '.2f')} | {r['p50_tpot_ms']:.2f} | "
                f"{format(ls['gamma'], '.2f') if ls else ''} | "
                f"{_shares(ls)} | "
                f"{format(ls['lanes_per_step'], '.1f') if ls else ''} | {r['startup_s']} |")
    (out / "combined.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 4 * len(shapes)), squeeze=False)
    for (shape, runs), (ax_tok, ax_tpot) in zip(shapes.items(), axes):
        for run in runs:
            tp = run["meta"]["tp"]
            for system in dict.fromkeys(r["system"] for r in run["rows"]):
                pts = sorted((r["concurrency"], r["output_tok_s"], r["p50_tpot_ms"]) for r in run["rows"]
                             if r["system"] == system and r["temperature"] == 0 and r.get("phase", "steady") == "steady")
                style = "o-" if tp == 1 else "s--"
                label = f"{system}, TP={tp}"
                ax_tok.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
                ax_tpot.plot([p[0] for p in pts], [p[2] for p in pts], style, label=label)
        for ax, title in ((ax_tok, "output tok/s"), (ax_tpot, "TPOT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max concurrency")
            ax.set_title(f"{shape}: {title}")
        ax_tok.legend()
    fig.tight_layout()
    fig.savefig(out / "combined.png", dpi=90)
    plt.close(fig)


def write_table(rows: list[dict], path: Path) -> None:
    lines = ["| system | phase | T | rate | concurrency | output tok/s | vs vanilla | vs in-tree | TTFT p50 / p99 ms "
             "| TPOT p50 / p99 ms | ITL p50 / p99 ms | JIT compiles logged | gamma | commits first / second / full |",
             "|" + "---|" * 14]

    def ratio(x):
        return "" if x is None else f"{x:.2f}"

    for r in rows:
        ls = r.get("loopspec") or {}
        gamma = f"{ls['gamma']:.2f}" if ls else ""
        lines.append(
            f"| {r['system']} | {r.get('phase', 'steady')} | {r['temperature']:g} | {r['request_rate']} | "
            f"{r['concurrency']} | {r['output_tok_s']:.1f} | {ratio(r.get('vs_vanilla'))} | "
            f"{ratio(r.get('vs_in_tree'))} | {r['p50_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | "
            f"{r['p50_tpot_ms']:.2f} / {r['p99_tpot_ms']:.2f} | {r['p50_itl_ms']:.2f} / {r['p99_itl_ms']:.2f} | "
            f"{len(r.get('jit_compiles', []))} | {gamma} | {_shares(ls)} |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_tok_s", "output tok/s"), ("p50_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
              ("p50_tpot_ms", "TPOT p50 (ms)"), ("p50_itl_ms", "ITL p50 (ms)"), ("p99_itl_ms", "ITL p99 (ms)")]
    for temperature in sorted({r["temperature"] for r in rows}):
        for rate in sorted({r["request_rate"] for r in rows}):
            sel = [r for r in rows if r["temperature"] == temperature and r["request_rate"] == rate
                   and r.get("phase", "steady") == "steady"]
            fig, axes = plt.subplots(2, 3, figsize=(13, 7))
            for ax, (key, label) in zip(axes.flat, panels):
                for system in dict.fromkeys(r["system"] for r in sel):
                    pts = sorted((r["concurrency"], r[key]) for r in sel if r["system"] == system)
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=system)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("max concurrency")
                ax.set_title(label)
            axes.flat[0].legend()
            fig.suptitle(f"vllm bench serve, temperature {temperature:g}, request rate {rate}")
            fig.tight_layout()
            fig.savefig(out / f"serve-t{temperature:g}-r{rate}.png", dpi=90)
            plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
