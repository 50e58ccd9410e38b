"""The tiny-checkpoint factory: determinism, the real config keys and tensor names, options, CLI errors.

Real metadata lives in tests/data/reference_checkpoints (verbatim config.json files; params.txt
lists the real state-dict names with shapes; provenance in its SOURCES.md).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_loop.configs.ouro import OuroConfig
from vllm_loop.configs.raven import RavenConfig, raven_layout
from vllm_loop.testing.checkpoints import FAMILIES, CheckpointError, _load_families, make_checkpoint

ROOT = Path(__file__).resolve().parents[1]  # the repository
REAL = Path(__file__).resolve().parent / "data" / "reference_checkpoints"
OURO_REAL = REAL / "ByteDance__Ouro-1.4B"
HUGINN_REAL = REAL / "tomg-group-umd__huginn-0125"
PYTHON = str(Path(sys.executable))

# (family, options) for every family and variant the factory has
_load_families()
VARIANTS = [(name, {}) for name in sorted(FAMILIES) if name != "huginn_raven"]
if "huginn_raven" in FAMILIES:
    VARIANTS += [("huginn_raven", {"layout": layout}) for layout in ("huginn", "llama", "olmo2")]




def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize(("family", "options"), VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(v.values()))
def test_same_seed_same_bytes_different_seed_different_weights(family, options, tmp_path):
    a = make_checkpoint(family, tmp_path / "a", seed=3, options=options)
    b = make_checkpoint(family, tmp_path / "b", seed=3, options=options)
    c = make_checkpoint(family, tmp_path / "c", seed=4, options=options)
    assert _files(a) == _files(b)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "config.json").read_bytes() == (c / "config.json").read_bytes()


# -- config keys ----------------------------------------------------------------------------------


def _config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def test_ouro_config_has_exactly_the_real_keys(ckpt_factory):
    real, tiny = _config(OURO_REAL), _config(ckpt_factory("ouro"))
    assert set(tiny) == set(real)
    assert list(tiny) == list(real), "same key order as the real file"
    assert tiny["model_type"] == "ouro" and tiny["architectures"] == ["OuroForCausalLM"]
    assert tiny["layer_types"] == ["full_attention"] * tiny["num_hidden_layers"]
    assert (tiny["hidden_size"], tiny["num_attention_heads"], tiny["head_dim"]) == (128, 4, 32)
    assert tiny["num_key_value_heads"] == 4 and tiny["total_ut_steps"] == 4 and tiny["torch_dtype"] == "float32"
    config = OuroConfig(**tiny)  # readable by our config class
    assert config.total_ut_steps == 4 and config.early_exit_threshold == 1.0


def test_ouro_config_follows_layer_count_override(ckpt_factory):
    tiny = _config(ckpt_factory("ouro", num_hidden_layers=3, total_ut_steps=2))
    assert tiny["layer_types"] == ["full_attention"] * 3 and tiny["max_window_layers"] == 3
    assert tiny["total_ut_steps"] == 2


def test_huginn_config_has_exactly_the_real_keys(ckpt_factory):
    real, tiny = _config(HUGINN_REAL), _config(ckpt_factory("huginn_raven", options={"layout": "huginn"}))
    assert list(tiny) == list(real)
    assert tiny["n_layers"] == tiny["n_layers_in_prelude"] + tiny["n_layers_in_recurrent_block"] + tiny[
        "n_layers_in_coda"]
    assert tiny["init_values"]["embed_scale"] == pytest.approx(math.sqrt(tiny["n_embd"]))
    assert tiny["init_values"]["std"] == pytest.approx(math.sqrt(2 / (5 * tiny["n_embd"])))
    assert tiny["effective_expected_depth"] == 1 + 2 + 2 * tiny["mean_recurrence"]
    assert tiny["state_init"] == "seeded" and tiny["mean_recurrence"] == 4 and tiny["block_size"] == 1024
    assert raven_layout(RavenConfig(**tiny)) == "huginn"


@pytest.mark.parametrize("layout", ["llama", "olmo2"])
def test_retrofit_configs_update_huginn_keys_like_the_converters(layout, ckpt_factory):
    real, tiny = _config(HUGINN_REAL), _config(ckpt_factory("huginn_raven", options={"layout": layout}))
    added = {"rope_theta", "max_position_embeddings"} | ({"rope_scaling"} if layout == "llama" else set())
    assert set(tiny) == set(real) | added
    assert tiny["tie_embeddings"] is False and tiny["qk_bias"] is False
    assert tiny["init_values"]["embed_scale"] == 1.0
    assert tiny["head_dim"] == tiny["n_embd"] // tiny["n_heads"]
    assert tiny["num_key_value_heads"] == (2 if layout == "llama" else tiny["n_heads"])
    if layout == "llama":
        assert tiny["rope_scaling"]["rope_type"] == "llama3"
    assert raven_layout(RavenConfig(**tiny)) == layout


@pytest.mark.parametrize("layout", ["huginn", "llama", "olmo2"])
def test_raven_token_ids_match_the_tokenizer(layout, ckpt_factory):
    from tokenizers import Tokenizer

    path = Path(ckpt_factory("huginn_raven", options={"layout": layout}))
    cfg, gen = _config(path), json.loads((path / "generation_config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos, eos = ("<|begin_text|>", "<|end_text|>") if layout == "huginn" else ("<|begin_of_text|>", "<|end_of_text|>")
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.token_to_id(bos), tok.token_to_id(eos))
    assert gen["bos_token_id"] == cfg["bos_token_id"]
    if layout == "huginn":  # the current hub generation_config also stops at <|end_turn|>
        assert gen["eos_token_id"] == [cfg["eos_token_id"], tok.token_to_id("<|end_turn|>")]
        assert cfg["pad_token_id"] == tok.token_to_id("<|pad|>")
    assert tok.encode("hello").ids[0] == cfg["bos_token_id"]


def test_ouro_tokenizer_specials_and_chat_template(ckpt_factory):
    from transformers import PreTrainedTokenizerFast

    path = ckpt_factory("ouro")
    tok = PreTrainedTokenizerFast.from_pretrained(path)  # what tokenizer_config.json names
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    assert tok.convert_tokens_to_ids(specials) == [0, 1, 2, 3, 4]
    cfg = _config(path)
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == tok.eos_token_id == tok.bos_token_id == 0
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
                                   tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"


# -- tensor names and shapes ----------------------------------------------------------------------


def _params(path: Path) -> dict[str, list[int]]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, shape, _dtype = line.split()
            out[name] = json.loads(shape)
    return out


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".{i}.", name)


# Shape of each tensor pattern from a config: checked against the real params.txt with the real
# config, then against the tiny checkpoint with its config.
OURO_SHAPES = {
    "lm_head.weight": lambda c: [c["vocab_size"], c["hidden_size"]],
    "model.embed_tokens.weight": lambda c: [c["vocab_size"], c["hidden_size"]],
    "model.norm.weight": lambda c: [c["hidden_size"]],
    "model.early_exit_gate.weight": lambda c: [1, c["hidden_size"]],
    "model.early_exit_gate.bias": lambda c: [1],
    "model.layers.{i}.self_attn.q_proj.weight": lambda c: [c["num_attention_heads"] * c["head_dim"], c["hidden_size"]],
    "model.layers.{i}.self_attn.k_proj.weight": lambda c: [c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]],
    "model.layers.{i}.self_attn.v_proj.weight": lambda c: [c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]],
    "model.layers.{i}.self_attn.o_proj.weight": lambda c: [c["hidden_size"], c["num_attention_heads"] * c["head_dim"]],
    "model.layers.{i}.mlp.gate_proj.weight": lambda c: [c["intermediate_size"], c["hidden_size"]],
    "model.layers.{i}.mlp.up_proj.weight": lambda c: [c["intermediate_size"], c["hidden_size"]],
    "model.layers.{i}.mlp.down_proj.weight": lambda c: [c["hidden_size"], c["intermediate_size"]],
    **{f"model.layers.{{i}}.{n}.weight": (lambda c: [c["hidden_size"]]) for n in
       ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")},
}


def _raven_block_shapes(layout: str) -> dict:
    def qkv(c):
        return [(c["n_heads"] + 2 * c["num_key_value_heads"]) * c["head_dim"], c["n_embd"]]

    shapes = {
        "norm_1.weight": lambda c: [c["n_embd"]],
        "norm_2.weight": lambda c: [c["n_embd"]],
        "attn.Wqkv.weight": qkv,
        "attn.proj.weight": lambda c: [c["n_embd"], c["n_heads"] * c["head_dim"]],
        "mlp.fc.weight": lambda c: [2 * c["intermediate_size"], c["n_embd"]],
        "mlp.proj.weight": lambda c: [c["n_embd"], c["intermediate_size"]],
    }
    if layout == "huginn":
        shapes |= {"norm_3.weight": shapes["norm_1.weight"], "norm_4.weight": shapes["norm_1.weight"],
                   "attn.qk_bias": lambda c: [2, 1, c["n_heads"], c["head_dim"]]}
    if layout == "olmo2":  # raven_modeling_minimal_olmo.py: RMSNorm over the full q / k projections
        shapes |= {"attn.q_norm.weight": lambda c: [c["n_heads"] * c["head_dim"]],
                   "attn.k_norm.weight": lambda c: [c["num_key_value_heads"] * c["head_dim"]]}
    return shapes


def raven_shapes(layout: str) -> dict:
    shapes = {
        "transformer.wte.weight": lambda c: [c["padded_vocab_size"], c["n_embd"]],
        "transformer.adapter.weight": lambda c: [c["n_embd"], 2 * c["n_embd"]],
        "transformer.ln_f.weight": lambda c: [c["n_embd"]],
        "lm_head.weight": lambda c: [c["padded_vocab_size"], c["n_embd"]],
    }
    if layout == "huginn":
        shapes["freqs_cis"] = lambda c: [1, c["block_size"], 1, c["head_dim"] // 2, 2]
    for part in ("prelude", "core_block", "coda"):
        shapes |= {f"transformer.{part}.{{i}}.{k}": f for k, f in _raven_block_shapes(layout).items()}
    return shapes


def _check_against(shapes: dict, config: dict, tensors: dict[str, list[int]]) -> None:
    assert {_pattern(n) for n in tensors} == set(shapes)
    for name, shape in tensors.items():
        assert list(shape) == shapes[_pattern(name)](config), name


def test_ouro_tensor_names_and_shapes_follow_params_txt(ckpt_factory):
    real = _params(OURO_REAL / "params.txt")
    assert len(real) == 269
    _check_against(OURO_SHAPES, _config(OURO_REAL), real)
    path = Path(ckpt_factory("ouro"))
    tiny = {n: list(t.shape) for n, t in load_file(str(path / "model.safetensors")).items()}
    _check_against(OURO_SHAPES, _config(path), tiny)
    assert len(tiny) == 11 * _config(path)["num_hidden_layers"] + 5


@pytest.mark.parametrize("layout", ["huginn", "llama", "olmo2"])
def test_raven_tensor_names_and_shapes(layout, ckpt_factory):
    if layout == "huginn":  # the real index: 77 names
        real = _params(HUGINN_REAL / "params.txt")
        assert len(real) == 77
        _check_against(raven_shapes("huginn"), _config(HUGINN_REAL), real)
    path = Path(ckpt_factory("huginn_raven", options={"layout": layout}))
    cfg = _config(path)
    tensors = load_file(str(path / "model.safetensors"))
    _check_against(raven_shapes(layout), cfg, {n: list(t.shape) for n, t in tensors.items()})
    if layout == "huginn":
        assert torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"]), "tied, stored twice"
    else:
        assert not torch.equal(tensors["lm_head.weight"][:, :4], tensors["transformer.wte.weight"][:, :4])


# -- options -----------------------------------------------------------------------------------------


def _agreement(ref, depth: int, prompts: int = 4, length: int = 48) -> float:
    g = torch.Generator().manual_seed(11)
    same = total = 0
    for _ in range(prompts):
        toks = torch.randint(8, ref.vocab_size, (length,), generator=g)
        out = ref.forward_depths(toks, depths=[depth, ref.depth])
        same += int((out[depth].argmax(-1) == out[ref.depth].argmax(-1)).sum())
        total += length
    return same / total


@pytest.mark.parametrize(("family", "options", "T", "d"), [
    ("ouro", {"agreement": "0.005"}, 4, 1),
    ("huginn_raven", {"layout": "huginn", "agreement": "0.1"}, 8, 2),
    ("huginn_raven", {"layout": "llama", "agreement": "0.1"}, 32, 2),
    ("huginn_raven", {"layout": "olmo2", "agreement": "0.1"}, 8, 2),
])
def test_agreement_option_makes_early_depths_agree(family, options, T, d, ckpt_factory):
    from vllm_loop.reference import load_reference

    off = {k: v for k, v in options.items() if k != "agreement"}
    on = load_reference(ckpt_factory(family, options=options), depth=T)
    assert _agreement(on, d) >= 0.9
    assert _agreement(load_reference(ckpt_factory(family, options=off), depth=T), d) < 0.5


def test_state_init_option_is_written_to_config(ckpt_factory):
    for mode in ("like-init", "zero", "seeded"):
        assert _config(ckpt_factory("huginn_raven", options={"state_init": mode}))["state_init"] == mode


def test_bad_options_raise_one_named_error(tmp_path):
    with pytest.raises(CheckpointError, match="agreement"):
        make_checkpoint("ouro", tmp_path / "x", options={"agreement": "lots"})
    with pytest.raises(CheckpointError, match="layout"):
        make_checkpoint("huginn_raven", tmp_path / "x", options={"layout": "gpt2"})
    with pytest.raises(CheckpointError, match="no such option"):
        make_checkpoint("ouro", tmp_path / "x", options={"depth": "3"})
    assert not (tmp_path / "x").exists()


def test_ouro_remote_code_loads_with_trust_remote_code(ckpt_factory, tmp_path):
    path = Path(ckpt_factory("ouro", options={"remote_code": "true"}))
    assert (path / "configuration_ouro.py").exists()
    assert not (Path(ckpt_factory("ouro")) / "configuration_ouro.py").exists()
    code = (
        "import sys; from transformers import AutoConfig;"
        "c = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True);"
        "print(type(c).__module__, c.model_type, c.total_ut_steps, c.early_exit_threshold, c.num_hidden_layers)"
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    out = subprocess.run([PYTHON, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    module, model_type, steps, threshold, layers = out.stdout.split()
    assert module.endswith("configuration_ouro") and model_type == "ouro"
    assert (int(steps), float(threshold), int(layers)) == (4, 1.0, 2)


# -- CLI ---------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "vllm_loop.testing.checkpoints", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize(("args", "needle"), [
    (["--family", "nope", "--out", "{tmp}/x"], "nope"),
    (["--family", "ouro"], "--out"),
    (["--family", "huginn_raven", "--out", "{tmp}/x", "--option", "layout=gpt2"], "layout"),
])
def test_cli_errors_are_one_line_and_exit_2(args, needle, tmp_path):
    out = _cli(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert needle in out.stderr
    assert not (tmp_path / "x").exists()


def test_cli_writes_a_checkpoint(tmp_path):
    out = _cli("--family", "huginn_raven", "--out", str(tmp_path / "c"), "--option", "layout=olmo2",
               "--set", "mean_recurrence=6")
    assert out.returncode == 0, out.stderr
    assert _config(tmp_path / "c")["mean_recurrence"] == 6
