"""Exact and statistical checks of sampled token sequences (the lossless-sampling tests)."""

from __future__ import annotations

from collections import Counter

import torch

from vllm_loop.loopspec.proposals import SamplingParams, filter_probs


def exact_tree(model, prompt: list[int], params: SamplingParams, n_tokens: int):
    """Ordinary sampling's exact distribution of the first ``n_tokens`` tokens of a reference model,
    by enumerating the filtered tree: ({sequence: probability}, {prefix: next-token distribution})."""
    dist, cond = {(): 1.0}, {}
    for _ in range(n_tokens):
        nxt = {}
        for seq, pr in dist.items():
            logits = model.forward_depths(torch.tensor(prompt + list(seq)))[model.depth][-1]
            cond[seq] = probs = filter_probs(logits, params)
            for tok in torch.nonzero(probs).flatten().tolist():
                nxt[seq + (tok,)] = pr * float(probs[tok])
        dist = nxt
    return dist, cond


def chi2_gof(counts: Counter, exact: dict, n: int) -> float:
    """p-value of the observed sequence counts against exact probabilities (cells expected < 5 pooled)."""
    from scipy.stats import chisquare

    assert set(counts) <= set(exact), f"sequences of probability 0 were generated: {set(counts) - set(exact)}"
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * n >= 5]
    small = [c for c in cells if exact[c] * n < 5]
    obs = [counts[c] for c in big] + ([sum(counts[c] for c in small)] if small else [])
    exp = [exact[c] * n for c in big] + ([sum(exact[c] for c in small) * n] if small else [])
    return float(chisquare(obs, exp).pvalue)


def chi2_two_sample(a: Counter, b: Counter) -> float:
    """p-value of a chi-square test of homogeneity of two samples of sequences (cells < 10 pooled)."""
    from scipy.stats import chi2_contingency

    cells = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cells if a[c] + b[c] >= 10]
    rest = [c for c in cells if a[c] + b[c] < 10]
    rows = [[a[c] for c in big], [b[c] for c in big]]
    if rest:
        rows[0].append(sum(a[c] for c in rest))
        rows[1].append(sum(b[c] for c in rest))
    return float(chi2_contingency(rows).pvalue)
