"""The Triton lane attention kernel against the PyTorch lane attention, on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``; the GPU runs the same tests compiled: tests/test_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_loop.loopspec.lane_kv import LaneAttention, LaneRows, LaneScratch, PagedBanks


def lane_attention_case(layout: str, device: str, dtype=torch.float32, seed: int = 0, heads=(4, 2), D=32):
    """Paged banks in ``layout`` ("split-last" or vLLM's CPU "cpu-kt"), two requests' committed
    prefixes at every bank, a lane pool with ancestors, and rows at different banks (some padded the
    way lane graphs pad them). -> (paged, scratch, rows, banks, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    Hq, H = heads
    NB, S, B = 9, 3, 16
    backing = torch.zeros(NB, S, H, B, 2 * D, dtype=dtype)
    order = [2, 0, 1]
    caches = [backing[:, order[b]] for b in range(S)]
    paged = PagedBanks(caches)
    if layout == "cpu-kt":  # vLLM's CPU layout: per head K transposed [D, B], then V [B, D]
        flat = paged.pages.reshape(NB, S, H, 2 * B * D)
        paged.layout = layout
        paged.k = flat[..., : B * D].unflatten(-1, (D, B)).transpose(-1, -2)
        paged.v = flat[..., B * D:].unflatten(-1, (B, D))
    prefix = {0: 37, 1: 5}
    tables = {0: [3, 1, 7, 0], 1: [5, 0, 0, 0]}
    for r, n in prefix.items():
        pos = torch.arange(n)
        for bank in range(S):
            paged.write(torch.tensor(tables[r])[pos // B], torch.full((n,), bank), pos % B,
                        torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
    scratch = LaneScratch(S, 8, H, D, 4, dtype, "cpu")
    scratch.kv.copy_(torch.randn(scratch.kv.shape, generator=g))
    # rows: request, own slot, bank, ancestors; the last row is padding (pad slot, no prefix)
    spec = [(0, 1, 2, [6, 2]), (1, 3, 0, []), (0, 5, 1, [4]), (None, scratch.pad_slot, 0, [])]
    width = 3
    rows = LaneRows(
        slots=torch.tensor([s for _, s, _, _ in spec]),
        prefix=torch.tensor([prefix[r] if r is not None else 0 for r, *_ in spec]),
        block_rows=torch.tensor([tables[r] if r is not None else [0] * 4 for r, *_ in spec]),
        ancestors=torch.tensor([a + [-1] * (width - len(a)) for *_, a in spec]),
        context=64,
    )
    banks = torch.tensor([b for _, _, b, _ in spec])
    n = len(spec)
    qkv = torch.randn(n, (Hq + 2 * H) * D, generator=g).to(dtype)
    move = lambda t: t.to(device)  # noqa: E731
    paged.pages, paged.k, paged.v, paged.page_of = (move(x) for x in (paged.pages, paged.k, paged.v, paged.page_of))
    scratch.kv, scratch.states = move(scratch.kv), move(scratch.states)
    rows = LaneRows(*(move(x) for x in (rows.slots, rows.prefix, rows.block_rows, rows.ancestors)), rows.context)
    q, k, v = move(qkv).split([Hq * D, H * D, H * D], dim=-1)  # as the model passes them: strided views
    return paged, scratch, rows, move(banks), q.view(n, Hq, D), k.view(n, H, D), v.view(n, H, D)


def compare(kernel, layout: str, device: str, dtype=torch.float32, heads=(4, 2), D=32, tol=1e-5):
    paged, scratch, rows, banks, q, k, v = lane_attention_case(layout, device, dtype, heads=heads, D=D)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    before = scratch.kv.clone()
    want = LaneAttention(paged, scratch, rows)(banks, q, k, v, D**-0.5)
    kv_torch = scratch.kv.clone()
    scratch.kv.copy_(before)
    scratch.kv[banks, rows.slots] = float("nan")  # the kernel must store the rows' own K/V itself
    got = LaneAttention(paged, scratch, rows, kernel=kernel)(banks, q, k, v, D**-0.5)
    assert torch.equal(scratch.kv, kv_torch)  # both write the rows' own K/V the same way
    torch.testing.assert_close(got[:-1].float(), want[:-1].float(), atol=tol, rtol=tol)  # real rows
    assert torch.isfinite(got).all()  # the padding row attends to itself only: finite, unused


CASES = [(layout, heads, D) for layout in ("split-last", "cpu-kt") for heads, D in (((4, 2), 32), ((3, 3), 24))]


def test_triton_lane_attention_equals_the_torch_path():
    """GQA and MHA, a head size that is not a power of two (Huginn's 96 is not either), both
    in-page layouts, a prefix spanning three non-contiguous blocks, ancestors, a padding row.

    In a fresh process: Triton's interpreter must be on before anything imports Triton (vLLM does)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("OK") == len(CASES), proc.stdout


def test_triton_lane_attention_in_the_engine(ckpt_factory):
    """A CPU engine whose lanes attend with the kernel (interpreted; lane calls padded to the graph
    shapes): 8 staggered greedy requests equal the reference token for token, nothing leaks."""
    path = ckpt_factory("ouro", options={"agreement": "0.005"})
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, __file__, "engine", path], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ENGINE OK" in proc.stdout, proc.stdout[-3000:]


def _engine_run(path: str) -> None:
    from vllm_loop.reference import load_reference
    from vllm_loop.testing.engines import greedy_jobs, lane_census, run_jobs, start_llm, stop_llm, worker_functions

    jobs = greedy_jobs(n=8)
    spec = {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2, "lane_attention": "triton", "lane_graphs": "on"}
    with worker_functions():
        llm = start_llm(path, speculative_config=spec, max_model_len=128, block_size=16,
                        kv_cache_memory_bytes=2**28)
        try:
            got = run_jobs(llm, jobs)
            census = llm.collective_rpc(lane_census)[0]
            totals = dict(llm.collective_rpc(lambda w: vars(w.model_runner.drafter.totals))[0])
        finally:
            stop_llm(llm)
    ref = load_reference(path)
    for job in jobs:
        assert got[job.request_id] == ref.greedy_generate(job.prompt, job.params.max_tokens), job.request_id
    assert totals["lane_steps"] > 0 and census["lanes"] == 0 and census["free_slots"] == census["slots"]
    print(f"ENGINE OK: {totals['lane_steps']} lane steps, {totals['recurrent_steps']} recurrent steps", flush=True)


if __name__ == "__main__":  # the interpreted runs (TRITON_INTERPRET=1 set by the tests above)
    if sys.argv[1:2] == ["engine"]:
        _engine_run(sys.argv[2])
        sys.exit(0)
    from vllm_loop_kernels.lane_attention import lane_attention

    for layout, heads, D in CASES:
        compare(lane_attention, layout, "cpu", heads=heads, D=D)
        print(f"OK {layout} heads={heads} D={D}", flush=True)


CUSTOM_OPS = """
import json, sys
from vllm_loop.loopspec.lane_graphs import cuda_custom_ops, custom_ops_of
from vllm_loop.testing.inprocess import build_model
out = {}
for name, path in json.loads(sys.argv[1]):
    model = build_model(path)
    ops = custom_ops_of(model)
    before = [op._forward_method for op in ops]
    with cuda_custom_ops(model, False):
        untouched = all(op._forward_method == b for op, b in zip(ops, before))
    with cuda_custom_ops(model, True):
        inside = all(op._forward_method == op.forward_cuda for op in ops)
    out[name] = {"kinds": sorted({type(op).__name__ for op in ops}), "untouched": untouched, "inside": inside,
                 "restored": all(op._forward_method == b for op, b in zip(ops, before)),
                 "was_cuda": any(b == op.forward_cuda for op, b in zip(ops, before))}
print("RESULT" + json.dumps(out))
"""


def test_lane_calls_take_vllms_cuda_custom_ops(ckpt_factory):
    """Lane calls run the layers outside vLLM's compiled forward: on CUDA they dispatch every custom op
    (SiLU-and-mul, rotary, RMSNorm) to vLLM's CUDA implementation for their length, whatever the
    engine's ``custom_ops``, and restore the engine's dispatch afterwards; off CUDA nothing changes.
    Checked on the real models (here on CPU, where the engine's dispatch is not the CUDA one, so the
    swap is visible)."""
    import json

    jobs = [("ouro", ckpt_factory("ouro")), ("raven", ckpt_factory("huginn_raven", options={"layout": "llama"}))]
    res = subprocess.run([sys.executable, "-c", CUSTOM_OPS, json.dumps(jobs)], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    for name, got in out.items():
        assert {"SiluAndMul", "RMSNorm"} <= set(got["kinds"]) and any("Rotary" in k for k in got["kinds"]), (name, got)
        assert not got["was_cuda"] and got["untouched"] and got["inside"] and got["restored"], (name, got)
