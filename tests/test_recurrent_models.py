"""Recurrent-depth models through the real vLLM engine, checked against the plain-PyTorch reference.

One engine per checkpoint (module-scoped, parametrized): Ouro, Huginn-0125, Raven-Llama, Raven-OLMo-2.
Each engine records readouts at every depth (``readout_depths``), which needs eager mode. One more
engine checks Ouro's per-token depth selection (``early_exit_threshold``).
"""

from __future__ import annotations

import pytest
import torch

from vllm_loop.testing.engines import (
    check_ouro_early_exit,
    kv_cache_layout,
    recorded_readouts,
    start_llm,
    stop_llm,
    worker_functions,
)
from vllm_loop.testing.prompts import PARITY_PROMPTS as PROMPTS

CHECKPOINTS = {
    "ouro": ("ouro", {}),
    "huginn": ("huginn_raven", {"layout": "huginn", "state_init": "seeded"}),
    "raven-llama": ("huginn_raven", {"layout": "llama", "state_init": "seeded"}),
    "raven-olmo2": ("huginn_raven", {"layout": "olmo2", "state_init": "seeded"}),
}
ATOL = 2e-4  # fp32 logits, vLLM kernels vs the reference's plain einsum attention


def _depth(config: dict) -> int:
    return config.get("total_ut_steps") or config["mean_recurrence"]


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def engine(request, ckpt_factory):
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from vllm_loop.reference import load_reference

    family, options = CHECKPOINTS[request.param]
    path = ckpt_factory(family, options=options)
    config = json.loads((Path(path) / "config.json").read_text())
    T = _depth(config)
    with worker_functions():  # collective_rpc(recorded_readouts / kv_cache_layout) below
        llm = start_llm(path, hf_overrides={"readout_depths": list(range(1, T + 1))}, enable_prefix_caching=False)
        tok = AutoTokenizer.from_pretrained(path)
        yield {"name": request.param, "llm": llm, "ref": load_reference(path), "tok": tok, "T": T, "config": config}
        stop_llm(llm)


@pytest.mark.engine
def test_greedy_batch_matches_reference(engine):
    from vllm import SamplingParams

    tok, ref = engine["tok"], engine["ref"]
    prompts = [tok(p).input_ids for p in PROMPTS]
    assert len({len(p) for p in prompts}) >= 6, "prompts must have different lengths"
    outs = engine["llm"].generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
    )
    for prompt, out in zip(prompts, outs):
        expected = ref.greedy_generate(prompt, 32)
        assert list(out.outputs[0].token_ids) == expected, f"{engine['name']}: prompt {prompt[:6]}..."


@pytest.mark.engine
def test_readouts_at_every_depth_match_reference(engine):
    from vllm import SamplingParams

    tok, ref, T = engine["tok"], engine["ref"], engine["T"]
    prompt = tok(PROMPTS[1]).input_ids
    # Prefill only: the recorded readouts cover every prompt position.
    engine["llm"].generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0))
    (got,) = engine["llm"].collective_rpc(recorded_readouts)
    want = ref.forward_depths(torch.tensor(prompt), depths=range(1, T + 1))
    assert sorted(got) == list(range(1, T + 1))
    for r in range(1, T + 1):
        torch.testing.assert_close(got[r], want[r].float(), atol=ATOL, rtol=0, msg=lambda m: f"depth {r}: {m}")

    # A decode step: the last forward computes one new position per request, reading the KV banks.
    out = engine["llm"].generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0.0))
    seq = prompt + list(out[0].outputs[0].token_ids)
    (got,) = engine["llm"].collective_rpc(recorded_readouts)
    want = ref.forward_depths(torch.tensor(seq[:-1]), depths=range(1, T + 1))
    for r in range(1, T + 1):
        torch.testing.assert_close(got[r][-1], want[r][-1].float(), atol=ATOL, rtol=0)


@pytest.mark.engine
def test_kv_cache_has_one_bank_per_depth_and_layer(engine):
    (kv,) = engine["llm"].collective_rpc(kv_cache_layout)
    cfg, T = engine["config"], engine["T"]
    if cfg["model_type"] == "ouro":
        banks = T * cfg["num_hidden_layers"]
        heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    else:  # prelude + T x core + coda once per readout depth (all T depths are read out here)
        banks = cfg["n_layers_in_prelude"] + T * cfg["n_layers_in_recurrent_block"] + T * cfg["n_layers_in_coda"]
        heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    assert len(kv["groups"]) == 1, "all banks share one KV-cache group (one block table)"
    names = kv["groups"][0]
    assert len(names) == banks == len(set(names))
    assert sorted(int(n.split(".")[2]) for n in names) == list(range(banks))
    per_layer_bytes_per_token = 2 * heads * head_dim * 4  # K and V, fp32
    assert kv["page_size_bytes"] == per_layer_bytes_per_token * kv["block_size"]
    bytes_per_token = kv["tensor_bytes"] / (kv["num_blocks"] * kv["block_size"])
    assert bytes_per_token == banks * per_layer_bytes_per_token


@pytest.mark.engine
def test_ouro_early_exit_threshold_matches_reference(ckpt_factory):
    """``early_exit_threshold`` < 1: each token reads the first depth whose exit CDF reaches it."""
    path = ckpt_factory("ouro")
    llm = start_llm(path, hf_overrides={"early_exit_threshold": 0.5})
    try:
        depths = check_ouro_early_exit(llm, path, PROMPTS[:4], max_tokens=16, threshold=0.5)
    finally:
        stop_llm(llm)
    assert len(depths) > 1, f"the exits must spread over several depths to test the selection, got {depths}"
