"""Plugin models built with vLLM's own constructors, no engine (in a subprocess:
``vllm_loop.testing.inprocess``): what they refuse at load time and what they allocate.

* Every model refuses a checkpoint that lacks a tensor it needs, naming it. vLLM 0.26's loader
  counts every parameter of a linear layer as loaded whether or not it was, so without our own
  check a checkpoint missing one ``down_proj`` serves a random matrix.
* LOTUS runs without chunked prefill (max_num_batched_tokens = max_model_len): its persistent
  buffers must not grow with the context length.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each test builds every plugin model in a subprocess (~20 s)

# (family, options, tensor dropped from the checkpoint, the name the error must give)
CASES = [
    ("ouro", {}, "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
    ("ouro", {}, "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight"),
    ("huginn_raven", {"layout": "huginn"}, "transformer.core_block.1.mlp.proj.weight",
     "transformer.core_block.1.mlp.proj.weight"),
    ("huginn_raven", {"layout": "olmo2"}, "transformer.coda.0.attn.Wqkv.weight", "transformer.coda.0.attn.Wqkv.weight"),
    ("huginn_raven", {"layout": "llama"}, "transformer.adapter.weight", "transformer.adapter.weight"),
    ("coconut", {}, "transformer.h.1.mlp.c_proj.weight", "transformer.h.1.mlp.c_proj.weight"),
    ("coconut", {"base": "llama"}, "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight"),
    ("codi", {}, "codi.base_model.model.transformer.h.0.attn.c_attn.base_layer.weight",
     "transformer.h.0.attn.c_attn.weight"),
    ("codi", {}, "prj.3.weight", "prj.layers.3.weight"),
    ("codi", {"base": "llama"}, "codi.base_model.model.model.layers.0.mlp.gate_proj.base_layer.weight",
     "model.layers.0.mlp.gate_proj.weight"),
    ("lotus", {}, "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
    ("lotus", {"format": "wrapper"}, "base_causallm.model.layers.0.self_attn.o_proj.weight",
     "model.layers.0.self_attn.o_proj.weight"),
]

CHECK = """
import json, sys
from vllm_loop.testing.inprocess import build_model, checkpoint_tensors
results = []
for path, drop in json.loads(sys.argv[1]):
    model = build_model(path)
    tensors = checkpoint_tensors(path)
    assert drop in tensors, (drop, sorted(tensors)[:20])
    full = sorted(model.load_weights(tensors.items()))
    try:
        model.load_weights((k, v) for k, v in tensors.items() if k != drop)
        error = None
    except ValueError as e:
        error = str(e)
    results.append({"model": type(model).__name__, "loaded": len(full), "error": error})
print("RESULT" + json.dumps(results))
"""


def test_missing_tensor_fails_naming_it(ckpt_factory):
    jobs = [(ckpt_factory(family, options=options), drop) for family, options, drop, _ in CASES]
    res = subprocess.run([sys.executable, "-c", CHECK, json.dumps(jobs)], capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    results = json.loads(res.stdout.split("RESULT", 1)[1])
    for (family, options, drop, named), got in zip(CASES, results):
        assert got["loaded"] > 0
        assert got["error"] is not None, f"{got['model']} ({family} {options}) loaded without {drop}"
        assert "checkpoint is missing" in got["error"] and named in got["error"], (family, options, got["error"])
    models = {got["model"] for got in results}
    assert {"OuroForCausalLM", "RavenForCausalLM", "CoconutGPT2LMHeadModel", "CoconutLlamaForCausalLM",
            "CODIGPT2LMHeadModel", "CODILlamaForCausalLM", "LotusLlamaForCausalLM"} <= models


BUFFERS = """
import json, sys
from vllm_loop.testing.inprocess import build_model
out = {}
for name, path, context in json.loads(sys.argv[1]):
    model = build_model(path, max_model_len=context, hf_overrides={"max_position_embeddings": context})
    config = model.vllm_config
    out[name] = {
        "rows": config.scheduler_config.max_num_batched_tokens,
        "hidden": config.model_config.hf_config.hidden_size,
        "buffers": {n: b.numel() * b.element_size() for n, b in model.named_buffers()
                    if n in ("latent_mask", "latent_embeds", "decoder_input", "loop_row_passes")},
    }
print("RESULT" + json.dumps(out))
"""


def test_latent_buffers_do_not_scale_with_context(ckpt_factory):
    """LOTUS at a 131072-token context (eager): no [max_model_len, hidden] buffers (before: two of
    them, 2 x 131072 x hidden x 4 bytes; a 3B model in bf16 would hold about 1.6 GB); only the int32
    pass count per row. COCONUT keeps one [max_num_batched_tokens, hidden] inject buffer."""
    context = 131072
    jobs = [("lotus", ckpt_factory("lotus"), context), ("coconut", ckpt_factory("coconut"), 4096)]
    res = subprocess.run([sys.executable, "-c", BUFFERS, json.dumps(jobs)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    lotus, coconut = out["lotus"], out["coconut"]
    assert lotus["rows"] >= context  # no chunked prefill: one step may hold a whole prompt
    assert lotus["buffers"] == {"latent_mask": 0, "latent_embeds": 0, "decoder_input": 0,
                                "loop_row_passes": 4 * lotus["rows"]}
    assert coconut["buffers"]["latent_embeds"] == coconut["rows"] * coconut["hidden"] * 4
    assert coconut["buffers"]["decoder_input"] == 0 and coconut["buffers"]["loop_row_passes"] == 0
