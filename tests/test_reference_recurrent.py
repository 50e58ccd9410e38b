"""The recurrent-depth reference models (Ouro, Huginn, Raven-Llama, Raven-OLMo-2), pure PyTorch.

* KV bookkeeping: incremental decoding == one-shot forward; depth-r readouts == a model run with T=r
  (Raven's coda keeps per-depth banks); LoopSpec lanes (``LaneKV``) == the committed sequence.
* The oracle itself: each layout against an independent dense transcription of the original
  modeling code (whole sequence, no KV cache, batch dimension, SDPA), written here from the
  upstream formulas and not sharing any code with ``vllm_loop.reference``.
* Ouro's exit gate and readout selection; config validation.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vllm_loop.looped import seeded_state
from vllm_loop.reference import LaneKV, SequenceKV, load_reference

LAYOUTS = {
    "ouro": ("ouro", {}),
    "huginn": ("huginn_raven", {"layout": "huginn"}),
    "raven-llama": ("huginn_raven", {"layout": "llama"}),
    "raven-olmo2": ("huginn_raven", {"layout": "olmo2"}),
}
ATOL = 1e-4  # fp32; logits have a std of ~4




@pytest.fixture(params=list(LAYOUTS))
def ckpt(request, ckpt_factory):
    family, options = LAYOUTS[request.param]
    return ckpt_factory(family, options=options)


def _tokens(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(8, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _decode_in_chunks(ref, tokens, chunks, depths=None) -> dict[int, torch.Tensor]:
    """Feed ``tokens`` through one SequenceKV in pieces; logits per depth, concatenated."""
    kv, outs, start = SequenceKV(), [], 0
    for size in chunks:
        outs.append(ref.forward_depths(tokens[start : start + size], kv, depths=depths))
        start += size
    assert start == len(tokens)
    return {r: torch.cat([o[r] for o in outs]) for r in outs[0]}


# -- (a) incremental == one-shot ----------------------------------------------------------------


def test_incremental_decoding_equals_one_shot_forward(ckpt):
    ref = load_reference(ckpt)
    tokens = _tokens(14, ref.vocab_size)
    full = ref.forward_depths(tokens)[ref.depth]
    stepped = _decode_in_chunks(ref, tokens, [5, 1, 3, 1, 1, 3])[ref.depth]
    assert full.shape == (14, ref.vocab_size)
    torch.testing.assert_close(stepped, full, atol=ATOL, rtol=0)
    assert torch.equal(stepped.argmax(-1), full.argmax(-1))


def test_raven_zero_state_init_also_decodes_incrementally(ckpt_factory):
    ref = load_reference(ckpt_factory("huginn_raven", options={"layout": "huginn"}), state_init="zero")
    tokens = _tokens(9, ref.vocab_size, seed=3)
    torch.testing.assert_close(
        _decode_in_chunks(ref, tokens, [4, 1, 4])[ref.depth], ref.forward_depths(tokens)[ref.depth], atol=ATOL, rtol=0
    )


# -- (b) depth-r readouts == a model with T=r ---------------------------------------------------


def test_each_depth_readout_equals_a_model_run_at_that_depth(ckpt):
    deep = load_reference(ckpt)
    T = deep.depth
    tokens = _tokens(10, deep.vocab_size, seed=1)
    chunks = [6, 1, 2, 1]  # incremental too: Raven's coda banks must hold depth-r history per r
    every_depth = _decode_in_chunks(deep, tokens, chunks, depths=range(1, T + 1))
    assert sorted(every_depth) == list(range(1, T + 1))
    for r in range(1, T + 1):
        shallow = load_reference(ckpt, depth=r)
        torch.testing.assert_close(every_depth[r], _decode_in_chunks(shallow, tokens, chunks)[r], atol=ATOL, rtol=0)
    assert not torch.allclose(every_depth[1], every_depth[T], atol=1e-2), "depths must differ without agreement"


def test_readout_depths_must_be_the_same_for_every_forward_of_a_sequence(ckpt_factory):
    ref = load_reference(ckpt_factory("huginn_raven", options={"layout": "llama"}))
    kv = SequenceKV()
    ref.forward_depths(_tokens(4, ref.vocab_size), kv)  # writes coda banks of depth T only
    with pytest.raises(ValueError, match=r"KV bank \('coda', 2, 0\)"):
        ref.forward_depths(_tokens(1, ref.vocab_size), kv, depths=[2, ref.depth])


# -- (c) LoopSpec lanes == committed sequence ---------------------------------------------------


def test_lane_kv_steps_reproduce_the_sequence(ckpt):
    ref = load_reference(ckpt)
    T, prefix_len = ref.depth, 5
    tokens = _tokens(prefix_len + 4, ref.vocab_size, seed=2)
    depths = list(range(1, T + 1))
    expected = ref.forward_depths(tokens[:-1], depths=depths)  # prefix + 3 lane tokens in one go

    committed = SequenceKV()
    ref.forward_depths(tokens[:prefix_len], committed, depths=depths)
    lane_tokens = tokens[prefix_len:-1]
    owns: list[dict] = [{} for _ in lane_tokens]
    kvs = [LaneKV(committed, owns[:i], owns[i]) for i in range(len(lane_tokens))]
    positions = [torch.tensor([prefix_len + i]) for i in range(len(lane_tokens))]
    states = [ref.pre(lane_tokens[i : i + 1], positions[i], kvs[i]) for i in range(len(lane_tokens))]
    for t in range(T):  # depth-major, lanes in order: an ancestor always ran a bank first
        for i in range(len(lane_tokens)):
            states[i] = ref.core_step(states[i], t, positions[i], kvs[i])
            got = ref.readout(states[i], t + 1, positions[i], kvs[i])
            torch.testing.assert_close(got[0], expected[t + 1][prefix_len + i], atol=ATOL, rtol=0)

    # Committing the lanes' own KV continues the sequence exactly.
    for own in owns:
        for bank, (k, v) in own.items():
            committed.append(bank, k, v)
    nxt = ref.forward_depths(tokens[-1:], committed, depths=depths)
    whole = ref.forward_depths(tokens, depths=depths)
    for r in depths:
        torch.testing.assert_close(nxt[r][0], whole[r][-1], atol=ATOL, rtol=0)


# -- (d) independent dense transcriptions of the original forwards ------------------------------


def _norm(x, w, eps):  # upstream RMSNorm: fp32 normalise, cast back, times the gain
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def _hf_cos_sin(head_dim, seq_len, theta, scaling):
    """HF ``LlamaRotaryEmbedding`` (default and llama3 ``rope_init_fn``), [1, S, hd]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None:
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        llama = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv_freq = torch.where(medium, smoothed, llama)
    pos = torch.arange(seq_len)[None, :]
    freqs = (inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _sdpa(q, k, v):  # [B, S, h, d] in, [B, S, h*d] out, causal
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True)
    return y.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def _dense_ouro(path, ids, *, exit_threshold=None, exit_step=None):
    """HF ``OuroForCausalLM.forward`` (eager math), batch 1."""
    c, w = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    nh, nkv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    cos, sin = _hf_cos_sin(hd, ids.shape[1], c["rope_theta"], None)
    cos, sin = cos[:, None], sin[:, None]  # unsqueeze_dim=1 on [B, h, S, d]
    h = w["model.embed_tokens.weight"][ids]
    B, S, _ = h.shape
    hidden_list, gate_list = [], []
    for _ut in range(c["total_ut_steps"]):
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            res = h
            x = _norm(h, w[p + "input_layernorm.weight"], eps)
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(B, S, -1, hd).transpose(1, 2)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(B, S, -1, hd).transpose(1, 2)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(B, S, -1, hd).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            scores = (q @ k.transpose(2, 3)) * hd**-0.5 + torch.full((S, S), float("-inf")).triu(1)
            a = (torch.softmax(scores, dim=-1, dtype=torch.float32) @ v).transpose(1, 2).reshape(B, S, -1)
            h = res + _norm(a @ w[p + "self_attn.o_proj.weight"].T, w[p + "input_layernorm_2.weight"], eps)
            res = h
            x = _norm(h, w[p + "post_attention_layernorm.weight"], eps)
            m = (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T))
            h = res + _norm(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_attention_layernorm_2.weight"], eps)
        h = _norm(h, w["model.norm.weight"], eps)
        hidden_list.append(h)
        gate_list.append(h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"])
    pdf, remaining = [], torch.ones_like(gate_list[0].squeeze(-1))
    for i, g in enumerate(gate_list):
        lam = torch.sigmoid(g.squeeze(-1))
        if i < len(gate_list) - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            pdf.append(remaining)
    pdf = torch.stack(pdf, dim=2)  # [B, S, T]
    if exit_step is not None:
        chosen = hidden_list[exit_step]
    elif exit_threshold is not None:
        mask = torch.cumsum(pdf, dim=2) >= exit_threshold
        steps = torch.argmax(mask.float(), dim=2)
        steps[~mask.any(dim=2)] = pdf.shape[2] - 1
        stacked = torch.stack(hidden_list, dim=2)
        chosen = torch.gather(stacked, 2, steps[..., None, None].expand(-1, -1, 1, stacked.shape[-1])).squeeze(2)
    else:
        chosen = hidden_list[-1]
    return (chosen @ w["lm_head.weight"].T)[0], pdf[0].T


def _dense_raven(path, ids, layout, state):
    """``RavenForCausalLM.forward`` of raven_modeling_minimal{,_llama,_olmo}.py, batch 1.

    ``state(e)`` makes the initial state (upstream: ``initialize_state``) from the prelude output.
    """
    c, w = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    H, nh, nkv, eps = c["n_embd"], c["n_heads"], c["num_key_value_heads"], c["norm_eps"]
    hd = c["head_dim"] if layout == "olmo2" else H // nh
    S = ids.shape[1]
    if layout == "huginn":  # precompute_freqs_cis + apply_rotary_emb_complex_like
        inv = 1.0 / (c["rope_base"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        f = torch.outer(torch.arange(c["block_size"], dtype=torch.float32), inv)
        freqs_cis = torch.stack([f.cos()[None, :, None, :], f.sin()[None, :, None, :]], dim=4)
        torch.testing.assert_close(freqs_cis, w["freqs_cis"], atol=0, rtol=0)  # the stored buffer is Huginn's
        freqs_cis = freqs_cis[:, :S]

        def rope(q, k):
            qk = torch.cat([q, k], dim=2).unflatten(dim=-1, sizes=(-1, 2)).float()
            rot = torch.stack([qk[..., 0] * freqs_cis[..., 0] - qk[..., 1] * freqs_cis[..., 1],
                               qk[..., 1] * freqs_cis[..., 0] + qk[..., 0] * freqs_cis[..., 1]], -1).flatten(3)
            return torch.split(rot.type_as(q), q.shape[2], dim=2)
    else:  # HF Llama / OLMo-2 rotary, applied after the (B, h, S, d) transpose
        scaling = c.get("rope_scaling")
        cos, sin = _hf_cos_sin(hd, S, c["rope_theta"], scaling)
        cos, sin = cos[:, :, None], sin[:, :, None]  # on (B, S, h, d)

        def rope(q, k):
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def attn(x, p):
        B = x.shape[0]
        q, k, v = (x @ w[p + "attn.Wqkv.weight"].T).split([nh * hd, nkv * hd, nkv * hd], dim=2)
        if layout == "olmo2":
            q, k = _norm(q, w[p + "attn.q_norm.weight"], eps), _norm(k, w[p + "attn.k_norm.weight"], eps)
        q, k, v = q.view(B, S, nh, hd), k.view(B, S, nkv, hd), v.view(B, S, nkv, hd)
        if c["qk_bias"]:
            q_bias, k_bias = w[p + "attn.qk_bias"].split(1, dim=0)
            q, k = q + q_bias, k + k_bias
        q, k = rope(q, k)
        return _sdpa(q, k, v) @ w[p + "attn.proj.weight"].T

    def mlp(x, p):
        a, b = (x @ w[p + "mlp.fc.weight"].T).chunk(2, dim=-1)
        return (F.silu(a) * b) @ w[p + "mlp.proj.weight"].T

    def block(x, p):
        n = lambda name, h: _norm(h, w[p + name + ".weight"], eps)  # noqa: E731
        if layout == "huginn":  # SandwichBlock
            x = n("norm_2", attn(n("norm_1", x), p) + x)
            return n("norm_4", mlp(n("norm_3", x), p) + x)
        if layout == "llama":
            x = attn(n("norm_1", x), p) + x
            return mlp(n("norm_2", x), p) + x
        x = n("norm_1", attn(x, p)) + x
        return n("norm_2", mlp(x, p)) + x

    emb_scale = math.sqrt(H) if layout == "huginn" else c["init_values"]["embed_scale"]
    e = w["transformer.wte.weight"][ids] * emb_scale
    for i in range(c["n_layers_in_prelude"]):
        e = block(e, f"transformer.prelude.{i}.")
    x = state(e)
    for _step in range(c["mean_recurrence"]):
        x = torch.cat([x, e], dim=-1) @ w["transformer.adapter.weight"].T
        for i in range(c["n_layers_in_recurrent_block"]):
            x = block(x, f"transformer.core_block.{i}.")
    if layout == "huginn":
        x = _norm(x, w["transformer.ln_f.weight"], eps)
    for i in range(c["n_layers_in_coda"]):
        x = block(x, f"transformer.coda.{i}.")
    x = _norm(x, w["transformer.ln_f.weight"], eps)
    head = w["transformer.wte.weight"] if c["tie_embeddings"] else w["lm_head.weight"]
    return (x @ head.T).float()[0]


def _seeded(c, layout, positions):
    scale = math.sqrt(c["n_embd"]) if layout == "huginn" else c["init_values"]["embed_scale"]
    return lambda e: (seeded_state(positions, e.shape[-1], c["init_values"]["std"], 0) * scale)[None]


@pytest.mark.parametrize("layout", ["huginn", "llama", "olmo2"])
def test_raven_matches_dense_transcription_of_upstream(layout, ckpt_factory):
    from pathlib import Path

    path = Path(ckpt_factory("huginn_raven", options={"layout": layout}))
    c = json.loads((path / "config.json").read_text())
    ref = load_reference(path)
    ids = _tokens(12, ref.vocab_size, seed=4)
    dense = _dense_raven(path, ids[None], layout, _seeded(c, layout, torch.arange(12)))
    ours = ref.forward_depths(ids)[ref.depth]
    torch.testing.assert_close(ours, dense, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), dense.argmax(-1))


def test_huginn_like_init_draws_the_state_like_upstream(ckpt_factory):
    from pathlib import Path

    path = Path(ckpt_factory("huginn_raven", options={"layout": "huginn", "state_init": "like-init"}))
    c = json.loads((path / "config.json").read_text())
    std, scale = c["init_values"]["std"], math.sqrt(c["n_embd"])

    def initialize_state(e):  # upstream: randn_like, then trunc_normal_ in place, then * emb_scale
        x = torch.randn_like(e)
        torch.nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std)
        return x * scale

    ref = load_reference(path)
    ids = _tokens(7, ref.vocab_size, seed=5)
    torch.manual_seed(123)
    dense = _dense_raven(path, ids[None], "huginn", initialize_state)
    torch.manual_seed(123)
    ours = ref.forward_depths(ids)[ref.depth]
    torch.testing.assert_close(ours, dense, atol=ATOL, rtol=0)
    torch.manual_seed(124)
    assert not torch.allclose(ref.forward_depths(ids)[ref.depth], ours, atol=1e-3), "like-init is random"


def test_ouro_matches_dense_transcription_of_upstream(ckpt_factory):
    from pathlib import Path

    path = Path(ckpt_factory("ouro"))
    ref = load_reference(path)
    ids = _tokens(12, ref.vocab_size, seed=6)
    dense, _ = _dense_ouro(path, ids[None])
    ours = ref.forward_depths(ids)[ref.depth]
    torch.testing.assert_close(ours, dense, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), dense.argmax(-1))


# -- (e) Ouro's exit gate and readout selection -------------------------------------------------


def test_ouro_exit_pdf_and_threshold_selection_match_upstream(ckpt_factory):
    from pathlib import Path

    path = Path(ckpt_factory("ouro"))
    ref = load_reference(path, early_exit_threshold=0.5)
    ids = _tokens(16, ref.vocab_size, seed=7)
    result = ref.forward_with_exit(ids)
    torch.testing.assert_close(result.pdf.sum(0), torch.ones(16), atol=1e-6, rtol=0)
    dense_logits, dense_pdf = _dense_ouro(path, ids[None], exit_threshold=0.5)
    torch.testing.assert_close(result.pdf, dense_pdf, atol=1e-6, rtol=0)
    expected_depths = (result.pdf.cumsum(0) >= 0.5).int().argmax(0) + 1
    assert torch.equal(result.depths, expected_depths)
    assert len(set(result.depths.tolist())) > 1, "the tiny gate must spread exits over several depths"
    per_depth = ref.forward_depths(ids, depths=range(1, ref.depth + 1))
    for pos, depth in enumerate(result.depths.tolist()):
        torch.testing.assert_close(result.logits[pos], per_depth[depth][pos], atol=ATOL, rtol=0)
    torch.testing.assert_close(result.logits, dense_logits, atol=ATOL, rtol=0)


def test_ouro_exit_step_and_default_threshold_select_depths(ckpt_factory):
    from pathlib import Path

    path = Path(ckpt_factory("ouro"))
    ids = _tokens(9, load_reference(path).vocab_size, seed=8)
    at_step = load_reference(path, early_exit_step=1).forward_with_exit(ids)  # 0-based upstream index
    assert at_step.depths.tolist() == [2] * 9
    torch.testing.assert_close(at_step.logits, _dense_ouro(path, ids[None], exit_step=1)[0], atol=ATOL, rtol=0)
    full = load_reference(path)  # early_exit_threshold 1.0: full depth
    assert full.forward_with_exit(ids).depths.tolist() == [full.depth] * 9
    # Ordinary decoding reads the selected depth: with exit step 0 it follows the depth-1 argmax.
    shallow = load_reference(path, early_exit_step=0)
    generated = shallow.generate(ids[:5].tolist(), 3)
    expected = load_reference(path, depth=1).generate(ids[:5].tolist(), 3)
    assert generated == expected


def test_generate_stops_at_any_of_several_eos_ids(ckpt_factory):
    ref = load_reference(ckpt_factory("huginn_raven", options={"layout": "huginn"}))
    prompt = _tokens(6, ref.vocab_size, seed=9).tolist()
    free = ref.generate(prompt, 6)
    stop_at = free[2]
    assert ref.generate(prompt, 6, eos_token_id=[10**6, stop_at]) == free[: free.index(stop_at) + 1]


# -- (f) config validation ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True])
def test_bad_depth_override_names_the_field(bad, ckpt_factory):
    with pytest.raises(ValueError, match="total_ut_steps"):
        load_reference(ckpt_factory("ouro"), depth=bad)
    with pytest.raises(ValueError, match="mean_recurrence"):
        load_reference(ckpt_factory("huginn_raven", options={"layout": "olmo2"}), depth=bad)


def test_bad_depth_in_config_names_the_field(ckpt_factory):
    with pytest.raises(ValueError, match="total_ut_steps"):
        load_reference(ckpt_factory("ouro"), total_ut_steps=0)
    with pytest.raises(ValueError, match="mean_recurrence"):
        load_reference(ckpt_factory("huginn_raven"), mean_recurrence=-1)


@pytest.mark.parametrize(("family", "options", "key"), [
    ("ouro", {}, "total_ut_steps"),
    ("ouro", {}, "rms_norm_eps"),
    ("huginn_raven", {"layout": "huginn"}, "mean_recurrence"),
    ("huginn_raven", {"layout": "llama"}, "init_values"),
])
def test_missing_required_key_names_it(family, options, key, ckpt_factory, tmp_path):
    src = ckpt_factory(family, options=options)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg[key]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key):
        load_reference(dst)


def test_unknown_state_init_and_wrong_tensor_names_are_refused(ckpt_factory):
    with pytest.raises(ValueError, match="state_init"):
        load_reference(ckpt_factory("huginn_raven"), state_init="random")
    # An OLMo-2 retrofit read as a Llama retrofit has extra q_norm / k_norm tensors.
    with pytest.raises(ValueError, match="q_norm"):
        load_reference(ckpt_factory("huginn_raven", options={"layout": "olmo2"}), block_layout="llama")
