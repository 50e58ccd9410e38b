"""``python -m vllm_loop.convert``: released COCONUT, CODI and LOTUS checkpoints (written by the
factory in their original formats: base config and tokenizer, training state dicts) become the
folders the plugin serves -- the same config, tensors and tokenizer the factory writes natively,
which the engine tests serve (and ``test_latent_serve.py`` serves a converted folder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_loop.convert import ConvertError, convert
from vllm_loop.testing.inprocess import checkpoint_tensors

QUESTIONS = ["Question: Tom has 3 apples and buys 5 more.\n", "x\n"]
# name -> (family, options of both checkpoints, format of the released one, converter settings the
#          released files do not record: the tiny factory's choices)
CASES = {
    "coconut": ("coconut", {}, "original", {}),
    "coconut-llama": ("coconut", {"base": "llama"}, "original", {}),
    "codi-gpt2": ("codi", {}, "original", {"lora_alpha": 2}),
    "codi-llama": ("codi", {"base": "llama"}, "original", {"lora_alpha": 2}),
    "codi-keep-eos": ("codi", {"remove_eos": "false"}, "original", {"lora_alpha": 2, "keep_eos": True}),
    "lotus": ("lotus", {}, "original", {"c_thought": 3}),
    "lotus-model-pt": ("lotus", {}, "original-pt", {"c_thought": 3}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_converted_release_equals_the_native_folder(name, ckpt_factory, tmp_path):
    from transformers import AutoTokenizer

    from vllm_loop.reference.latent_loading import load_latent_reference

    family, options, fmt, settings = CASES[name]
    released = Path(ckpt_factory(family, options={**options, "format": fmt}))
    native = Path(ckpt_factory(family, options=options))
    raw = json.loads((released / "config.json").read_text())
    assert "latent_spec" not in raw and raw["architectures"][0] in ("GPT2LMHeadModel", "LlamaForCausalLM")
    weights = {"coconut": "checkpoint_6", "codi": "pytorch_model.bin", "lotus": "model.safetensors"}[family]
    assert (released / ("model.pt" if fmt == "original-pt" else weights)).is_file()

    out = convert(family, released, tmp_path / "converted", **settings)

    assert json.loads((out / "config.json").read_text()) == json.loads((native / "config.json").read_text())
    got, want = checkpoint_tensors(str(out)), checkpoint_tensors(str(native))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    tok_out, tok_native = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(native))
    assert len(tok_out) == len(tok_native)
    ids = list(range(len(tok_native) - 3, len(tok_native)))  # the added tokens
    assert tok_out.convert_ids_to_tokens(ids) == tok_native.convert_ids_to_tokens(ids)
    prompts = [tok_native(q).input_ids for q in QUESTIONS]
    assert [tok_out(q).input_ids for q in QUESTIONS] == prompts
    ref_out, ref_native = load_latent_reference(str(out)), load_latent_reference(str(native))
    assert ref_out.spec == ref_native.spec
    for budget in (0, 2):
        assert (ref_out.generate(prompts[0], latent_budget=budget, max_new_tokens=4)[0]
                == ref_native.generate(prompts[0], latent_budget=budget, max_new_tokens=4)[0])


def test_weights_file_with_base_folder(ckpt_factory, tmp_path):
    """The usual COCONUT case: the training checkpoint file plus the base model's folder."""
    released = Path(ckpt_factory("coconut", options={"format": "original"}))
    native = Path(ckpt_factory("coconut"))
    out = convert("coconut", released / "checkpoint_6", tmp_path / "converted", base=released)
    assert json.loads((out / "config.json").read_text()) == json.loads((native / "config.json").read_text())


def test_cli_and_errors(ckpt_factory, tmp_path):
    released = ckpt_factory("coconut", options={"format": "original"})
    dst = tmp_path / "coconut-gpt2"
    res = subprocess.run([sys.executable, "-m", "vllm_loop.convert", "--family", "coconut", released, str(dst)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "CoconutGPT2LMHeadModel" in res.stdout and (dst / "model.safetensors").is_file()
    with pytest.raises(ConvertError, match="already has a latent_spec"):
        convert("coconut", dst, tmp_path / "again")
    with pytest.raises(ConvertError, match=r"no codi\.base_model\.model\.\* tensors"):
        convert("codi", released, tmp_path / "wrong-family")
    with pytest.raises(ConvertError, match="no config.json"):
        convert("coconut", Path(released) / "checkpoint_6", tmp_path / "x", base=tmp_path)
    res = subprocess.run([sys.executable, "-m", "vllm_loop.convert", "--family", "codi", released, str(tmp_path / "y")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and res.stderr.startswith("error: ")
