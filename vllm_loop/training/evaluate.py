"""Evaluate a trained looped checkpoint: what depth buys, and what LoopSpec gets out of it.

1. Held-out cross-entropy and perplexity at every depth r = 1..R (the trainable module on the
   device, Raven with the deployed ``seeded`` state init).
2. The LoopSpec tuner (``vllm_loop.loopspec.tune``) on held-out prompts: TV(p_r, p_R) per depth on the
   model's own sampled continuations (temperature 1, top-p 0.7, as the paper), the power-law envelope
   fit, Theorem 2's optimum and the best valid (d1, d2).
3. LoopSpec acceptance through the reference pipelined executor (plain PyTorch, CPU) on the held-out
   prompts, greedy and sampling, at the recommended schedule, the best two-proposal schedule and
   the paper's default for this R: gamma (eq. 9), commit shares, gate-open frequency; greedy output
   is checked token for token against ordinary full-depth decoding.

``evaluate(path, corpus, ...)`` returns a JSON-able dict; ``plot(result, png)`` draws it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vllm_loop.training.corpus import HELDOUT, Corpus
from vllm_loop.training.train import encode_works, eos_token, heldout_depth_losses, load_trained

PAPER_SCHEDULES = {4: (1, 2), 32: (2, 8)}  # the paper's settings for Ouro (R=4) and Raven (R=32)


def heldout_prompts(tok, corpus: Corpus, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_tokens`` tokens: the openings of held-out paragraphs, evenly spaced
    (the tokenizer adds BOS where the family's does)."""
    paragraphs = [p for text in corpus.heldout_texts() for p in text.split("\n\n")]
    encoded = [ids for ids in (e.ids for e in tok.encode_batch(paragraphs)) if len(ids) >= prompt_tokens]
    if len(encoded) < n:
        raise ValueError(f"only {len(encoded)} held-out paragraphs have {prompt_tokens} tokens")
    step = len(encoded) / n
    return [encoded[int(i * step)][:prompt_tokens] for i in range(n)]


def _schedules(tune_result, R: int) -> list[tuple[str, int, int | None]]:
    from vllm_loop.loopspec.schedule import LoopSpecSchedule

    out: list[tuple[str, int, int | None]] = []
    if tune_result is not None:
        out.append(("recommended", *tune_result.best))
        if R <= 8:  # deep models: the recommended and the paper's schedule only (executor time)
            out.append(("best two-proposal", *tune_result.best_two_proposals))
    if R in PAPER_SCHEDULES:
        out.append(("paper", *PAPER_SCHEDULES[R]))
    elif R >= 4:
        out.append(("d1=1,d2=2", 1, 2))
    seen, unique = set(), []
    for name, d1, d2 in out:
        try:
            LoopSpecSchedule(R, d1, d2)
        except ValueError:
            continue
        if (d1, d2) in seen:
            unique = [(n + " = " + name if (a, b) == (d1, d2) else n, a, b) for n, a, b in unique]
            continue
        seen.add((d1, d2))
        unique.append((name, d1, d2))
    return unique


def run_loopspec(ref, prompts, d1, d2, params, max_new_tokens: int, seed: int = 0, check_greedy: bool = True) -> dict:
    from vllm_loop.loopspec.executor import GenerationRequest, PipelinedExecutor, baseline_generate
    from vllm_loop.loopspec.schedule import LoopSpecSchedule

    reqs = [GenerationRequest(p, max_new_tokens, sampling=params, seed=seed + i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    out = PipelinedExecutor(ref, LoopSpecSchedule(ref.depth, d1, d2)).generate(reqs)
    s = out.summary()
    s["seconds"] = round(time.perf_counter() - t0, 2)
    s["tokens"] = out.tokens
    if check_greedy and params.greedy:
        s["greedy_identical_to_full_depth"] = out.tokens == [baseline_generate(ref, r) for r in reqs]
    return s


def evaluate(path, corpus: Corpus, *, device: str = "cpu", bf16: bool = False, seq_len: int = 128, batch: int = 16,
             eval_tokens: int | None = None, prompts: int = 8, prompt_tokens: int = 24, max_new_tokens: int = 32,
             tune_new_tokens: int = 32, top_p: float = 0.7, temperature: float = 1.0, say=print,
             deadline: float | None = None) -> dict:
    """``deadline``: a ``time.perf_counter()`` value; LoopSpec runs that would likely end after it
    are skipped (and listed under ``"skipped"``), so a time-limited job ends with its results."""
    from tokenizers import Tokenizer

    from vllm_loop.loopspec.proposals import SamplingParams
    from vllm_loop.loopspec.tune import format_result, measure_depth_profile, tune_profile
    from vllm_loop.reference import load_reference

    path = Path(path)
    family, model, config = load_trained(path, device)
    R = config["total_ut_steps"] if family == "ouro" else config["mean_recurrence"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    result: dict = {"checkpoint": str(path), "family": family, "R": R, "config": config}

    # 1. perplexity per depth
    t0 = time.perf_counter()
    held = encode_works(tok, corpus.heldout_texts(), tok.token_to_id(eos_token(family)))
    losses = heldout_depth_losses(family, model, held, seq_len, batch, range(1, R + 1), eval_tokens, bf16)
    rows = [{"depth": r, "ce": ce, "ppl": float(torch.tensor(ce).exp())} for r, ce in losses["ce"].items()]
    result["heldout"] = {"tokens": losses["tokens"], "depths": rows, "seconds": round(time.perf_counter() - t0, 2)}
    if "exit_pdf" in losses:
        result["heldout"]["exit_pdf"] = losses["exit_pdf"]
    say(f"held-out perplexity by depth ({losses['tokens']:,} tokens of {', '.join(HELDOUT)}):")
    for row in rows:
        pdf = losses.get("exit_pdf", {}).get(row["depth"])
        say(f"  r={row['depth']:<3d} CE {row['ce']:.4f}  ppl {row['ppl']:9.2f}" + ("" if pdf is None else f"  mean exit p {pdf:.3f}"))
    del model

    # 2. the tuner
    ref = load_reference(str(path))
    ids = heldout_prompts(tok, corpus, prompts, prompt_tokens)
    result["prompts"] = [tok.decode(p) for p in ids]
    params = SamplingParams(temperature, top_p=top_p)
    t0 = time.perf_counter()
    profile = measure_depth_profile(ref, ids, params, tune_new_tokens, seed=0)
    tune_result = None
    try:
        tune_result = tune_profile(profile)
        result["tune"] = tune_result.to_dict()
        say(format_result(tune_result))
    except ValueError as e:
        from dataclasses import asdict

        from vllm_loop.loopspec.tune import format_profile

        result["tune"] = {"error": str(e), "profile": asdict(profile)}
        say(format_profile(profile))
        say(f"tuner: cannot fit the envelope: {e}")
    result["tune_seconds"] = round(time.perf_counter() - t0, 2)

    # 3. LoopSpec acceptance
    result["loopspec"], result["skipped"] = [], []
    durations: list[float] = []
    for name, d1, d2 in _schedules(tune_result, R):
        for mode, p in (("greedy", SamplingParams(0.0)), (f"T={temperature} top-p={top_p}", params)):
            if deadline is not None:
                left = deadline - time.perf_counter()
                # the first run's cost is guessed from the tuner's (ordinary decoding of the same
                # prompts): the CPU executor has been 2-4x slower per token than that at R=32
                need = 1.3 * max(durations) if durations else max(20.0, 2.0 * result["tune_seconds"])
                if left < need:
                    result["skipped"].append({"d1": d1, "d2": d2, "mode": mode, "reason": f"deadline ({left:.0f} s left)"})
                    say(f"LoopSpec R={R} d1={d1} d2={d2 if d2 else '-'} ({name}), {mode}: skipped, {left:.0f} s left")
                    continue
            t_run = time.perf_counter()
            # greedy LoopSpec == ordinary decoding is checked once per model (it costs a full decode)
            check = p.greedy and not any("greedy_identical_to_full_depth" in r for r in result["loopspec"])
            s = run_loopspec(ref, ids, d1, d2, p, max_new_tokens, check_greedy=check)
            durations.append(time.perf_counter() - t_run)
            s.update(schedule_name=name, mode=mode)
            tokens = s.pop("tokens")
            if mode == "greedy" and "samples" not in result:
                result["samples"] = [{"prompt": tok.decode(pr), "continuation": tok.decode(t)}
                                     for pr, t in zip(ids[:4], tokens[:4])]
            result["loopspec"].append(s)
            sh = s["shares"]
            say(f"LoopSpec R={R} d1={d1} d2={d2 if d2 else '-'} ({name}), {mode}: gamma {s['gamma']:.3f} "
                f"(max {s['gamma_bound']:.0f}); commits first {sh['first']:.1%} second {sh['second']:.1%} "
                f"full {sh['full']:.1%}; gate open {s['gate_open_frequency']:.1%}"
                + (f"; identical to full depth: {s['greedy_identical_to_full_depth']}"
                   if "greedy_identical_to_full_depth" in s else "") + f"  ({s['seconds']:.0f} s)")
    for sample in result.get("samples", [])[:2]:
        say(f"sample: {sample['prompt']!r} -> {sample['continuation']!r}")
    return result


def plot(result: dict, png: Path, training: dict | None = None) -> bool:
    """Four panels: perplexity by depth, TV decay + envelope, commit shares, training curve.
    False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    name = f"{result['family']} (R={result['R']})"
    rows = result["heldout"]["depths"]
    ax[0, 0].plot([r["depth"] for r in rows], [r["ppl"] for r in rows], "o-")
    ax[0, 0].set(xlabel="recurrent depth r", ylabel="held-out perplexity", title=f"{name}: perplexity by depth")
    ax[0, 0].set_yscale("log")
    tune = result.get("tune", {})
    prof = tune.get("profile")
    if prof:
        rs = [r for r, v in zip(prof["depths"], prof["tv"]) if r < prof["R"] and v > 0]
        tv = dict(zip(prof["depths"], prof["tv"]))
        ax[0, 1].loglog(rs, [tv[r] for r in rs], "o", label="TV(p_r, p_R), T=1 top-p 0.7")
        if "beta" in tune:
            xs = torch.linspace(1, result["R"], 100).tolist()
            ax[0, 1].loglog(xs, [tune["beta"] * x ** -tune["alpha"] for x in xs], "-",
                            label=f"envelope {tune['beta']:.3f} r^-{tune['alpha']:.2f}")
            best = tune["best"]
            ax[0, 1].set_title(f"tuner: recommended d1={best['d1']} d2={best['d2']}")
        ax[0, 1].set(xlabel="recurrent depth r", ylabel="total variation")
        ax[0, 1].legend()
    runs = result.get("loopspec", [])
    if runs:
        labels = [f"{s['schedule']['d1'] if 'schedule' in s else s['d1']}:{s['d2'] or '-'}\n{s['mode'].split()[0]}"
                  for s in runs]
        first = [s["shares"]["first"] for s in runs]
        second = [s["shares"]["second"] for s in runs]
        full = [s["shares"]["full"] for s in runs]
        xs = range(len(runs))
        ax[1, 0].bar(xs, first, label="first proposal")
        ax[1, 0].bar(xs, second, bottom=first, label="second proposal")
        ax[1, 0].bar(xs, full, bottom=[a + b for a, b in zip(first, second)], label="full depth")
        for x, s in zip(xs, runs):
            ax[1, 0].text(x, 1.01, f"γ={s['gamma']:.2f}", ha="center", fontsize=8)
        ax[1, 0].set_xticks(list(xs), labels, fontsize=7)
        ax[1, 0].set(ylabel="share of committed tokens", ylim=(0, 1.1), title="LoopSpec commit shares (d1:d2)")
        ax[1, 0].legend(fontsize=7, loc="lower right")
    if training:
        hist = training.get("history", [])
        ax[1, 1].plot([h["step"] for h in hist], [h["loss"] for h in hist], label="training loss")
        ev = training.get("evals", [])
        if ev:
            ax[1, 1].plot([e["step"] for e in ev], [e["heldout_ce"] for e in ev], "o-", label="held-out CE (depth R)")
        ax[1, 1].set(xlabel="step", ylabel="nats / token", title=f"training ({training.get('seconds', 0):.0f} s)")
        ax[1, 1].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return True
