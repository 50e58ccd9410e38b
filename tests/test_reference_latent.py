"""Latent-reasoning references (COCONUT, CODI, LOTUS): pure PyTorch, no engine.

Each family's KV-cached reference loop (``vllm_loop/reference/{coconut,codi,lotus}.py``) is checked
against a transcription of the original repository's inference code, written here independently on
top of Hugging Face ``transformers`` models loaded from the same tiny checkpoint folder (COCONUT and
LOTUS without any KV cache; CODI both with HF's cache, as its ``test.py`` does, and without).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer
import transformers
from torch import nn

from vllm_loop.latent import LatentSpec, resolve_latent_budget
from vllm_loop.reference.codi import merge_lora
from vllm_loop.reference.kv import SequenceKV
from vllm_loop.reference.latent_loading import load_latent_reference
from vllm_loop.testing.checkpoints import make_checkpoint

# the CODI transcription passes ``past_key_values`` exactly as the original does
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

TEXTS = [
    "hi\n",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\n",
    "Q: 12 + 7 = ?\n",
]
MAX_NEW = 10
ATOL = 2e-4  # fp32 logits (|logit| ~ 10) of two implementations


def prompts(path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return [tok.encode(t).ids for t in TEXTS]


def hf_model(path):
    """The base HF model (``GPT2LMHeadModel`` / ``LlamaForCausalLM``) of an HF-format folder."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def greedy(step, first_logits, max_new, suppress=None):
    """Transcribed decode loop: argmax, no EOS stop; ``step(tok) -> next logits``."""
    tokens, seen, logits = [], [], first_logits
    for _ in range(max_new):
        seen.append(logits)
        pick = logits if suppress is None else logits[:suppress]
        tok = int(torch.argmax(pick))
        tokens.append(tok)
        if len(tokens) < max_new:
            logits = step(tok)
    return tokens, torch.stack(seen)


def assert_same(ref_out, orig_out):
    (ans, info), (tokens, logits) = ref_out, orig_out
    assert ans == tokens
    torch.testing.assert_close(info["logits"], logits, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------
# LatentSpec / resolve_latent_budget
# ---------------------------------------------------------------------------------------------------
SPEC = LatentSpec(kind="feedback", default_budget=6, start_token_ids=(1,), end_token_ids=(2,), max_budget=64)


def test_resolve_latent_budget_defaults_and_values():
    assert resolve_latent_budget(None, SPEC) == 6
    assert resolve_latent_budget({}, SPEC) == 6
    assert resolve_latent_budget({"latent_budget": None, "other": 1}, SPEC) == 6
    assert [resolve_latent_budget({"latent_budget": n}, SPEC) for n in (0, 1, 64)] == [0, 1, 64]
    assert resolve_latent_budget(None, None) is None


@pytest.mark.parametrize("bad", [-1, 65, 1.5, 6.0, "3", True, False, [3]])
def test_resolve_latent_budget_errors_name_field_and_range(bad):
    with pytest.raises(ValueError) as e:
        resolve_latent_budget({"latent_budget": bad}, SPEC)
    assert "latent_budget" in str(e.value) and "[0, 64]" in str(e.value)


def test_plain_model_rejects_a_budget():
    with pytest.raises(ValueError, match="latent_budget.*not a latent"):
        resolve_latent_budget({"latent_budget": 3}, None)


def test_latent_spec_validation_and_config_round_trip(ckpt_factory):
    looped = LatentSpec(kind="looped", default_budget=6, c_thought=3, start_token_ids=[5], end_token_ids=[6], latent_token_id=7)
    assert LatentSpec.from_config({"latent_spec": looped.to_config()}) == looped
    assert (looped.latent_positions(4), looped.passes(4), looped.appended_tokens(4)) == (12, 5, 14)
    assert (SPEC.latent_positions(4), SPEC.passes(4)) == (4, 4)
    assert LatentSpec.from_config({"model_type": "llama"}) is None
    for bad in (
        dict(kind="loop", default_budget=1, start_token_ids=[1], end_token_ids=[2]),
        dict(kind="looped", default_budget=1, start_token_ids=[1], end_token_ids=[2]),  # no latent token
        dict(kind="feedback", default_budget=9, max_budget=8, start_token_ids=[1], end_token_ids=[2]),
        dict(kind="feedback", default_budget=1, c_thought=2, start_token_ids=[1], end_token_ids=[2]),
        dict(kind="feedback", default_budget=1, start_token_ids=[], end_token_ids=[2]),
    ):
        with pytest.raises(ValueError):
            LatentSpec(**bad)
    with pytest.raises(ValueError, match="unknown keys"):
        LatentSpec.from_config({"latent_spec": {**SPEC.to_config(), "budget": 3}})
    # transformers keeps the nested object on its own config class (model_type gpt2 / llama)
    for fam, opts in (("coconut", {}), ("codi", {"base": "llama"}), ("lotus", {})):
        cfg = transformers.AutoConfig.from_pretrained(ckpt_factory(fam, options=opts))
        assert isinstance(LatentSpec.from_config(cfg), LatentSpec)


# ---------------------------------------------------------------------------------------------------
# Base decoders vs Hugging Face
# ---------------------------------------------------------------------------------------------------
LLAMA32_ROPE = {  # Llama-3.2's scaled RoPE (the real CODI-Llama / LOTUS bases)
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


@pytest.mark.parametrize(
    "fam,opts,overrides",
    [("coconut", {}, {}), ("lotus", {}, {}), ("coconut", {"base": "llama"}, {}), ("lotus", {}, LLAMA32_ROPE)],
)
def test_decoders_match_hf_and_folders_load_in_hf(ckpt_factory, fam, opts, overrides):
    path = ckpt_factory(fam, options=opts, **overrides)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(1000, model.config.hidden_size)  # 1000 zero embeddings first: far positions, where long RoPE waves matter
    with torch.no_grad():
        want = model(inputs_embeds=torch.cat([pad, model.get_input_embeddings()(ids)])[None]).logits[0, 1000:]
    dec = load_latent_reference(path).decoder
    kv = SequenceKV()
    dec.forward(pad, kv)
    got = [dec.logits(dec.forward(dec.embed(ids[:15]), kv))]  # prefill, then one token at a time
    got += [dec.logits(dec.forward(dec.embed(ids[i : i + 1]), kv)) for i in range(15, 23)]
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------
# COCONUT
# ---------------------------------------------------------------------------------------------------
def coconut_original(model, input_ids, latent_id, max_new):
    """``Coconut.forward`` + ``generate`` without any KV cache: each pass recomputes everything
    before the next latent and fills it with ``hidden_states[-1][p - 1]``; ``generate`` re-runs the
    whole sequence for every new token."""
    emb = model.get_input_embeddings()
    with torch.no_grad():
        embeds = emb(torch.tensor(input_ids))
        for p in [i for i, t in enumerate(input_ids) if t == latent_id]:
            hidden = model(inputs_embeds=embeds[None, :p], output_hidden_states=True).hidden_states[-1]
            embeds = torch.cat([embeds[:p], hidden[0, p - 1 : p], embeds[p + 1 :]])

        def step(tok):
            nonlocal embeds
            embeds = torch.cat([embeds, emb(torch.tensor([tok]))])
            return model(inputs_embeds=embeds[None]).logits[0, -1]

        return greedy(step, model(inputs_embeds=embeds[None]).logits[0, -1], max_new)


@pytest.mark.parametrize("opts", [{}, {"base": "llama"}])
def test_coconut_matches_original(ckpt_factory, opts):
    path = ckpt_factory("coconut", options=opts)
    ref, model = load_latent_reference(path), hf_model(path)
    start, end, latent = ref.spec.start_token_ids[0], ref.spec.end_token_ids[0], ref.spec.latent_token_id
    for prompt, n in zip(prompts(path), (0, 6, 10), strict=True):
        ids = prompt + [start] + [latent] * n + [end]
        got = ref.generate(prompt, n, MAX_NEW, ignore_eos=True)
        assert_same(got, coconut_original(model, ids, latent, MAX_NEW))
        assert got[1]["latent_positions"] == n and got[1]["latent_inputs"].shape == (n, model.config.hidden_size)


def test_coconut_wrapper_format_equals_hf_format(ckpt_factory):
    hf_path, wrap_path = ckpt_factory("coconut"), ckpt_factory("coconut", options={"format": "wrapper"})
    names = set(load_file(str(Path(wrap_path) / "model.safetensors")))
    assert all(k.startswith("base_causallm.") for k in names) and "base_causallm.lm_head.weight" in names
    a, b = load_latent_reference(hf_path), load_latent_reference(wrap_path)
    p = prompts(hf_path)[1]
    assert a.generate(p, 3, MAX_NEW)[0] == b.generate(p, 3, MAX_NEW)[0]


# ---------------------------------------------------------------------------------------------------
# CODI
# ---------------------------------------------------------------------------------------------------
def codi_original_modules(path):
    """The original ``CODI`` pieces rebuilt with torch/transformers: base model with PEFT-style
    unmerged LoRA (``base(x) + B(A(x)) * alpha / r`` as forward hooks) and ``prj`` as
    ``Sequential(Dropout, Linear, GELU, Linear)`` + ``ln``."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    knobs, tensors = cfg["codi"], load_file(str(Path(path) / "model.safetensors"))
    prefix = knobs["weights_prefix"]
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path), dtype=torch.float32)
    base = {k[len(prefix):].replace(".base_layer.", "."): v for k, v in tensors.items() if k.startswith(prefix) and ".lora_" not in k}
    missing, unexpected = model.load_state_dict(base, strict=False)
    assert not missing and not unexpected
    model.eval()
    scale = knobs["lora_alpha"] / knobs["lora_r"]
    hooks = []
    for name, module in model.named_modules():
        a = tensors.get(f"{prefix}{name}.lora_A.default.weight")
        if a is not None:
            b = tensors[f"{prefix}{name}.lora_B.default.weight"]
            hooks.append(module.register_forward_hook(lambda m, i, o, a=a, b=b: o + F.linear(F.linear(i[0], a), b) * scale))
    H = model.config.hidden_size
    prj = nn.Sequential(nn.Dropout(knobs["prj_dropout"]), nn.Linear(H, knobs["prj_dim"]), nn.GELU(), nn.Linear(knobs["prj_dim"], H))
    if not knobs["prj_no_ln"]:
        prj.add_module("ln", nn.LayerNorm(H))
    prj.load_state_dict({k[len("prj."):]: v for k, v in tensors.items() if k.startswith("prj.")})
    return model, prj.eval(), knobs, hooks, cfg


def codi_original(model, prj, knobs, eos, prompt, n, max_new, use_cache=True):
    """``test.py``'s loop for one question (batch 1). ``use_cache=False`` recomputes the whole
    sequence of input embeddings at every step instead of using HF's cache."""
    emb = model.get_input_embeddings()
    bot, eot = knobs["bot_token_id"], knobs["eot_token_id"]
    ids = torch.tensor([prompt + ([bot] if knobs["remove_eos"] else [eos, bot])])
    tail = [eot] if knobs["remove_eos"] else [eot, eos]
    with torch.no_grad():
        if use_cache:
            state = {"pkv": None}

            def run(**kw):
                out = model(**kw, use_cache=True, output_hidden_states=True, past_key_values=state["pkv"])
                state["pkv"] = out.past_key_values
                return out
        else:
            state = {"embeds": torch.empty(1, 0, model.config.hidden_size)}

            def run(input_ids=None, inputs_embeds=None):
                new = emb(input_ids) if inputs_embeds is None else inputs_embeds
                state["embeds"] = torch.cat([state["embeds"], new], dim=1)
                out = model(inputs_embeds=state["embeds"], output_hidden_states=True)
                n_new = new.shape[1]
                out.logits = out.logits[:, -n_new:]
                out.hidden_states = tuple(h[:, -n_new:] for h in out.hidden_states)
                return out

        outputs = run(input_ids=ids)
        latent_embd = prj(outputs.hidden_states[-1][:, -1, :].unsqueeze(1))
        for _ in range(n):
            outputs = run(inputs_embeds=latent_embd)
            latent_embd = prj(outputs.hidden_states[-1][:, -1, :].unsqueeze(1))
        first = run(inputs_embeds=emb(torch.tensor(tail)).unsqueeze(0)).logits[0, -1]
        vocab = model.config.vocab_size
        return greedy(lambda tok: run(inputs_embeds=emb(torch.tensor([[tok]]))).logits[0, -1], first, max_new, suppress=vocab - 1)


@pytest.mark.parametrize("opts", [{"base": "gpt2"}, {"base": "llama"}, {"base": "gpt2", "remove_eos": "false", "prj_no_ln": "true"}])
def test_codi_matches_original(ckpt_factory, opts):
    path = ckpt_factory("codi", options=opts)
    ref = load_latent_reference(path)
    model, prj, knobs, hooks, cfg = codi_original_modules(path)
    assert len(hooks) == cfg["n_layer" if opts["base"] == "gpt2" else "num_hidden_layers"] * (4 if opts["base"] == "gpt2" else 7)
    eos = cfg["eos_token_id"]
    for prompt, n, cache in zip(prompts(path), (0, 6, 9), (True, False, True), strict=True):
        got = ref.generate(prompt, n, MAX_NEW, ignore_eos=True)
        assert_same(got, codi_original(model, prj, knobs, eos, prompt, n, MAX_NEW, use_cache=cache))
        assert knobs["eot_token_id"] not in got[0]
    # the same loop without the LoRA deltas gives other logits: the merge is not a no-op
    for h in hooks:
        h.remove()
    prompt = prompts(path)[1]
    without = codi_original(model, prj, knobs, eos, prompt, 6, 2)[1]
    assert (ref.generate(prompt, 6, 2, ignore_eos=True)[1]["logits"] - without).abs().max() > 0.1


@pytest.mark.parametrize("base", ["gpt2", "llama"])
def test_lora_merge_equals_unmerged_lora(ckpt_factory, base):
    tensors = load_file(str(Path(ckpt_factory("codi", options={"base": base})) / "model.safetensors"))
    knobs = json.loads((Path(ckpt_factory("codi", options={"base": base})) / "config.json").read_text())["codi"]
    merged = merge_lora(tensors, lora_r=knobs["lora_r"], lora_alpha=knobs["lora_alpha"], fan_in_fan_out=base == "gpt2")
    scale = knobs["lora_alpha"] / knobs["lora_r"]
    p = knobs["weights_prefix"]
    modules = ["transformer.h.1.attn.c_attn", "transformer.h.0.mlp.c_proj"] if base == "gpt2" else ["model.layers.1.self_attn.k_proj", "model.layers.0.mlp.down_proj"]
    for mod in modules:
        w, a, b = tensors[f"{p}{mod}.base_layer.weight"], tensors[f"{p}{mod}.lora_A.default.weight"], tensors[f"{p}{mod}.lora_B.default.weight"]
        x = torch.randn(5, a.shape[1], generator=torch.Generator().manual_seed(2))
        lora = (x @ a.T) @ b.T * scale
        if base == "gpt2":  # Conv1D: y = x @ W + bias, W [in, out]
            bias = tensors[f"{p}{mod}.base_layer.bias"]
            want, got = x @ w + bias + lora, x @ merged[f"{mod}.weight"] + merged[f"{mod}.bias"]
        else:
            want, got = x @ w.T + lora, x @ merged[f"{mod}.weight"].T
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert lora.abs().max() > 0.05
    assert not any(".lora_" in k or ".base_layer." in k or k.startswith(p) for k in merged)
    assert not any(k.startswith("prj.") for k in merged)


# ---------------------------------------------------------------------------------------------------
# LOTUS
# ---------------------------------------------------------------------------------------------------
def lotus_original(model, input_ids, latent_id, n_looped_iters, mode, max_new):
    """``Lotus.forward`` + ``generate`` without any KV cache. Region = [first latent - 1, last
    latent + 1); every pass recomputes prefix + region from scratch (the same as a fresh copy of
    the prefix KV); latent inputs = E + h (same position) of the previous pass; the suffix sees
    the region as the LAST pass computed it."""
    emb = model.get_input_embeddings()
    with torch.no_grad():
        original = emb(torch.tensor(input_ids))
        embeds = original.clone()
        lat = [i for i, t in enumerate(input_ids) if t == latent_id]
        if lat and n_looped_iters > 0:
            loop_start, loop_end = lat[0] - 1, lat[-1] + 1
            mask = torch.zeros(len(input_ids), dtype=torch.bool)
            mask[lat[0] : lat[-1] + 1] = True

            def region_pass(e):
                return model(inputs_embeds=e[None, :loop_end], output_hidden_states=True).hidden_states[-1][0]

            hidden = region_pass(embeds)  # absolute positions 0 .. loop_end-1
            pad = torch.zeros(len(input_ids) - loop_end, hidden.shape[1])
            for _ in range(n_looped_iters):
                h = torch.cat([hidden, pad])
                embeds = torch.where(mask[:, None], original + h if mode == "add" else h, embeds)
                hidden = region_pass(embeds)
            assert loop_start >= 0

        def step(tok):
            nonlocal embeds
            embeds = torch.cat([embeds, emb(torch.tensor([tok]))])
            return model(inputs_embeds=embeds[None]).logits[0, -1]

        return greedy(step, model(inputs_embeds=embeds[None]).logits[0, -1], max_new)


@pytest.mark.parametrize("opts", [{}, {"injection": "replace"}, {"base": "gpt2"}])
def test_lotus_matches_original(ckpt_factory, opts):
    path = ckpt_factory("lotus", options=opts)
    ref, model = load_latent_reference(path), hf_model(path)
    spec = ref.spec
    mode = json.loads((Path(path) / "config.json").read_text())["lotus"]["latent_injection_mode"]
    for prompt, n in zip(prompts(path), (0, 6, 9), strict=True):
        ids = prompt + [spec.start_token_ids[0]] + [spec.latent_token_id] * (n * spec.c_thought) + [spec.end_token_ids[0]]
        got = ref.generate(prompt, n, MAX_NEW, ignore_eos=True)
        assert_same(got, lotus_original(model, ids, spec.latent_token_id, n, mode, MAX_NEW))
        assert got[1]["passes"] == 1 + n and got[1]["latent_positions"] == n * spec.c_thought


# ---------------------------------------------------------------------------------------------------
# Protocol: budget 0, batches, EOS, info
# ---------------------------------------------------------------------------------------------------
ALL = [("coconut", {}), ("codi", {"base": "gpt2"}), ("codi", {"base": "llama"}), ("lotus", {})]


@pytest.mark.parametrize("fam,opts", ALL)
def test_budget_zero_is_plain_decoding_after_start_and_end(ckpt_factory, fam, opts):
    path = ckpt_factory(fam, options=opts)
    ref = load_latent_reference(path)
    for prompt in prompts(path):
        ans, info = ref.generate(prompt, 0, MAX_NEW, ignore_eos=True)
        plain, _ = ref.generate_plain(prompt + list(ref.spec.start_token_ids + ref.spec.end_token_ids), MAX_NEW, ignore_eos=True)
        assert ans == plain and info["latent_positions"] == 0 and info["latent_inputs"].shape[0] == 0


@pytest.mark.parametrize("fam,opts", ALL)
def test_batch_of_mixed_budgets_equals_single_requests(ckpt_factory, fam, opts):
    path = ckpt_factory(fam, options=opts)
    ref = load_latent_reference(path)
    ps = prompts(path)
    budgets = [0, None, ref.spec.default_budget + 3, 2]
    batch = ref.generate_batch([ps[0], ps[1], ps[2], ps[1]], budgets, [MAX_NEW, 4, MAX_NEW, MAX_NEW], ignore_eos=True)
    assert [info["latent_budget"] for _, info in batch] == [0, ref.spec.default_budget, ref.spec.default_budget + 3, 2]
    assert batch[2][0] == ref.generate(ps[2], ref.spec.default_budget + 3, MAX_NEW, ignore_eos=True)[0]
    assert len(batch[1][0]) == 4 and batch[1][1]["finish_reason"] == "length"
    # the budget changes the answer of one prompt
    outs = {tuple(ref.generate(ps[1], b, MAX_NEW, ignore_eos=True)[0]) for b in (0, ref.spec.default_budget, 11)}
    assert len(outs) >= 2
    with pytest.raises(ValueError, match="latent_budget"):
        ref.generate(ps[0], ref.spec.max_budget + 1, 2)


@pytest.mark.parametrize("fam,opts", ALL)
def test_eos_stops_and_is_kept(ckpt_factory, fam, opts):
    path = ckpt_factory(fam, options=opts)
    ref = load_latent_reference(path)
    prompt = prompts(path)[1]
    full, _ = ref.generate(prompt, None, MAX_NEW, ignore_eos=True)
    stop = full[3]
    ans, info = ref.generate(prompt, None, MAX_NEW, eos_token_id=[stop])
    assert ans == full[: full.index(stop) + 1] and info["finish_reason"] == "stop"
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert ref.eos_token_ids == (cfg["eos_token_id"],)
    seq = info["sequence"]
    n = info["latent_positions"]
    assert len(seq) == len(prompt) + ref.spec.appended_tokens(info["latent_budget"]) + len(ans)
    assert seq[len(prompt) + len(ref.spec.start_token_ids) :][:n] == [None] * n


# ---------------------------------------------------------------------------------------------------
# Factory families
# ---------------------------------------------------------------------------------------------------
def gpt2_names(n_layer, prefix="transformer."):
    names = {f"{prefix}wte.weight", f"{prefix}wpe.weight", f"{prefix}ln_f.weight", f"{prefix}ln_f.bias"}
    for i in range(n_layer):
        for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names |= {f"{prefix}h.{i}.{m}.weight", f"{prefix}h.{i}.{m}.bias"}
    return names


def llama_names(n_layer):
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"} | {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    return names


def codi_names(base_names, targets, with_ln=True):
    out = {"codi.base_model.model.lm_head.weight", "prj.1.weight", "prj.1.bias", "prj.3.weight", "prj.3.bias"}
    out |= {"prj.ln.weight", "prj.ln.bias"} if with_ln else set()
    for name in base_names:
        module, leaf = name.rsplit(".", 1)
        if module.rsplit(".", 1)[-1] in targets and (".h." in module or ".layers." in module):
            out.add(f"codi.base_model.model.{module}.base_layer.{leaf}")
            if leaf == "weight":
                out |= {f"codi.base_model.model.{module}.lora_{x}.default.weight" for x in "AB"}
        else:
            out.add("codi.base_model.model." + name)
    return out


GPT2_KEYS = {"activation_function", "n_embd", "n_head", "n_layer", "n_positions", "n_ctx", "layer_norm_epsilon", "vocab_size", "tie_word_embeddings", "model_type"}
LLAMA_KEYS = {"hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim", "rms_norm_eps", "rope_theta", "vocab_size", "model_type"}


@pytest.mark.parametrize(
    "fam,opts,arch,names",
    [
        ("coconut", {}, "CoconutGPT2LMHeadModel", gpt2_names(2)),
        ("codi", {"base": "gpt2"}, "CODIGPT2LMHeadModel", codi_names(gpt2_names(2), ["c_attn", "c_proj", "c_fc"])),
        ("codi", {"base": "llama"}, "CODILlamaForCausalLM", codi_names(llama_names(2), ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"])),
        ("lotus", {}, "LotusLlamaForCausalLM", llama_names(2)),
    ],
)
def test_factory_names_config_and_tokens(ckpt_factory, fam, opts, arch, names):
    path = Path(ckpt_factory(fam, options=opts))
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    assert set(tensors) == names
    assert cfg["architectures"] == [arch] and cfg["torch_dtype"] == "float32"
    assert (GPT2_KEYS if cfg["model_type"] == "gpt2" else LLAMA_KEYS) <= set(cfg)
    assert cfg["model_type"] == ("gpt2" if "GPT2" in arch else "llama") and cfg["vocab_size"] == 512
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    spec = LatentSpec.from_config(cfg)
    if fam == "codi":  # pad, bot, eot = V, V+1, V+2 with V + 3 = vocab_size
        k = cfg["codi"]
        assert (k["pad_token_id"], k["bot_token_id"], k["eot_token_id"]) == (509, 510, 511)
        assert spec.start_token_ids == (510,) and spec.end_token_ids == (511,) and spec.suppress_token_ids == (511,)
        assert tok.token_to_id("[PAD]") == 509
        H = cfg.get("n_embd") or cfg["hidden_size"]
        assert tensors["prj.1.weight"].shape == (k["prj_dim"], H) and tensors["prj.3.weight"].shape == (H, k["prj_dim"])
    else:  # add_tokens order: start, end, latent = V, V+1, V+2
        ids = [tok.token_to_id(t) for t in ("<|start-latent|>", "<|end-latent|>", "<|latent|>")]
        assert ids == [509, 510, 511] == [*spec.start_token_ids, *spec.end_token_ids, spec.latent_token_id]
        assert spec.kind == ("looped" if fam == "lotus" else "feedback")
    if cfg["model_type"] == "gpt2":
        assert tensors["transformer.h.0.attn.c_attn.weight" if fam == "coconut" else "codi.base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"].shape == (128, 384)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


@pytest.mark.parametrize("fam,opts", ALL)
def test_factory_is_deterministic(tmp_path, fam, opts):
    a = make_checkpoint(fam, tmp_path / "a", seed=3, options=opts)
    b = make_checkpoint(fam, tmp_path / "b", seed=3, options=opts)
    c = make_checkpoint(fam, tmp_path / "c", seed=4, options=opts)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_loader_refuses_a_plain_model(ckpt_factory):
    with pytest.raises(ValueError, match="not a latent model"):
        load_latent_reference(ckpt_factory("llama"))
