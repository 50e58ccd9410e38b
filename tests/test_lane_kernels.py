"""The Triton lane attention kernel against the PyTorch lane attention, on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``; the GPU runs the same tests compiled: tests/test_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_loop.loopspec.lane_kv import LaneAttention, LaneRows, LaneScratch, PagedBanks


def lane_attention_case(layout: str, device: str, dtype=torch.float32, seed: int = 0, heads=(4, 2), D=32,
                        prefix0: int = 37):
    """Paged banks in ``layout`` ("split-last" or vLLM's CPU "cpu-kt"), two requests' committed
    prefixes (``prefix0`` and 5 positions) at every bank, a lane pool with ancestors, and rows at
    different banks (some padded the way lane graphs pad them). -> (paged, scratch, rows, bank_ids,
    depths, q, k, v): row i at bank ``bank_ids[depths[i]]``."""
    g = torch.Generator().manual_seed(seed)
    Hq, H = heads
    S, B = 3, 16
    blocks0 = max(4, -(-prefix0 // B))
    NB = blocks0 + 6
    backing = torch.zeros(NB, S, H, B, 2 * D, dtype=dtype)
    order = [2, 0, 1]
    caches = [backing[:, order[b]] for b in range(S)]
    paged = PagedBanks(caches)
    if layout == "cpu-kt":  # vLLM's CPU layout: per head K transposed [D, B], then V [B, D]
        flat = paged.pages.reshape(NB, S, H, 2 * B * D)
        paged.layout = layout
        paged.k = flat[..., : B * D].unflatten(-1, (D, B)).transpose(-1, -2)
        paged.v = flat[..., B * D:].unflatten(-1, (B, D))
    prefix = {0: prefix0, 1: 5}
    order0 = [3, 1, 7] + [b for b in range(NB - 1, 0, -1) if b not in (3, 1, 7, 5)]  # scattered blocks
    tables = {0: order0[:blocks0], 1: [5] + [0] * (blocks0 - 1)}
    for r, n in prefix.items():
        pos = torch.arange(n)
        for bank in range(S):
            paged.write(torch.tensor(tables[r])[pos // B], torch.full((n,), bank), pos % B,
                        torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
    scratch = LaneScratch(S, 8, H, D, 4, dtype, "cpu")
    scratch.kv.copy_(torch.randn(scratch.kv.shape, generator=g))
    # rows: request, own slot, bank, ancestors; the last row is padding (pad slot, no prefix). Row 0 has
    # a deep ancestry (as at R=32): more than the kernel's BLOCK_N at a time, with a hole in it
    deep = [6, 2, 4, 0, 7] * 3 + [6, 2, -1, 4, 0]
    spec = [(0, 1, 2, deep), (1, 3, 0, []), (0, 5, 1, [4]), (None, scratch.pad_slot, 0, [])]
    width = len(deep) + 1
    rows = LaneRows(
        slots=torch.tensor([s for _, s, _, _ in spec]),
        prefix=torch.tensor([prefix[r] if r is not None else 0 for r, *_ in spec]),
        block_rows=torch.tensor([tables[r] if r is not None else [0] * blocks0 for r, *_ in spec]),
        ancestors=torch.tensor([a + [-1] * (width - len(a)) for *_, a in spec]),
        context=blocks0 * B,
    )
    banks = torch.tensor([b for _, _, b, _ in spec])
    bank_ids = torch.tensor([1, 2, 0])  # a layer's banks, not in order: the lookup must be the kernel's
    depths = (banks - 1) % S
    assert torch.equal(bank_ids[depths], banks)
    n = len(spec)
    qkv = torch.randn(n, (Hq + 2 * H) * D, generator=g).to(dtype)
    move = lambda t: t.to(device)  # noqa: E731
    paged.pages, paged.k, paged.v, paged.page_of = (move(x) for x in (paged.pages, paged.k, paged.v, paged.page_of))
    scratch.kv, scratch.states = move(scratch.kv), move(scratch.states)
    rows = LaneRows(*(move(x) for x in (rows.slots, rows.prefix, rows.block_rows, rows.ancestors)), rows.context)
    q, k, v = move(qkv).split([Hq * D, H * D, H * D], dim=-1)  # as the model passes them: strided views
    return (paged, scratch, rows, move(bank_ids), move(depths), q.view(n, Hq, D), k.view(n, H, D),
            v.view(n, H, D))


def rotary_case(D: int, rope: str, device: str, dtype):
    """vLLM's RotaryEmbedding: "neox" over the whole head, "gptj" (pairs) over half of it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        rotary = RotaryEmbedding(D, D if rope == "neox" else D // 2, 1024, 10000.0, rope == "neox", dtype)
    return rotary.to(device)


def kernel_of(lane_attention, options: dict):
    """A case's kernel (``lane_attention`` with the case's split / pieces / merge) and whether it has a
    q / k bias (``options["bias"]``), as ``compare`` takes them."""
    from functools import partial

    options = dict(options)
    bias = options.pop("bias", False)
    return partial(lane_attention, **options), bias


def compare(kernel, bias: bool, layout: str, device: str, dtype=torch.float32, heads=(4, 2), D=32, tol=1e-5,
            prefix0=37, rope: str | None = None):
    """The kernel against the PyTorch lane attention; ``rope`` ("neox" / "gptj"): q and k come
    unrotated with vLLM's rotary embedding, which the kernel applies itself; ``bias``: a q and a k
    bias (Huginn's) that the kernel adds as it loads them, before RoPE."""
    paged, scratch, rows, bank_ids, depths, q, k, v = lane_attention_case(layout, device, dtype, heads=heads, D=D,
                                                                          prefix0=prefix0)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    rope_args = bias_args = None
    if rope is not None:
        positions = (rows.prefix + torch.arange(rows.prefix.shape[0], device=rows.prefix.device)) % 1024
        rope_args = (rotary_case(D, rope, device, dtype), positions)
    if bias:  # large enough that its place (before RoPE) shows
        g = torch.Generator().manual_seed(7)
        bias_args = tuple((torch.randn(h * D, generator=g) * 0.5).to(dtype).to(device) for h in heads)
    inputs = (q.clone(), k.clone(), v)  # vLLM's rotary rotates in place on some devices
    before = scratch.kv.clone()
    want = LaneAttention(paged, scratch, rows)(bank_ids, depths, *inputs, D**-0.5, rope=rope_args, bias=bias_args)
    kv_torch = scratch.kv.clone()
    scratch.kv.copy_(before)
    scratch.kv[bank_ids[depths], rows.slots] = float("nan")  # the kernel must store the rows' own K/V itself
    got = LaneAttention(paged, scratch, rows, kernel=kernel)(bank_ids, depths, q, k, v, D**-0.5, rope=rope_args,
                                                             bias=bias_args)
    if rope is None and not bias:
        assert torch.equal(scratch.kv, kv_torch)  # both write the rows' own K/V the same way
    else:  # the biased, rotated K the same up to the rotation's rounding
        torch.testing.assert_close(scratch.kv, kv_torch, atol=tol, rtol=tol)
    torch.testing.assert_close(got[:-1].float(), want[:-1].float(), atol=tol, rtol=tol)  # real rows
    assert torch.isfinite(got).all()  # the padding row attends to itself only: finite, unused


# (layout, (query heads, KV heads), head size, the long prefix, how the prefix is split over programs,
# RoPE in the kernel)
CASES = [(layout, heads, D, 37, split, None) for layout in ("split-last", "cpu-kt")
         for heads, D in (((4, 2), 32), ((3, 3), 24)) for split in ({}, {"split": 32})] + \
        [("split-last", (4, 2), 32, 600, {"split": 32}, None), ("split-last", (4, 2), 32, 100, {"split": 32}, "neox"),
         ("cpu-kt", (3, 3), 24, 37, {}, "gptj"),
         # a fixed number of programs per (lane, head): 3 over 600 positions (longer pieces than split),
         # 8 over 37 (pieces of split; some programs with nothing to do)
         ("split-last", (4, 2), 32, 600, {"split": 16, "pieces": 3}, None),
         ("cpu-kt", (3, 3), 24, 37, {"split": 16, "pieces": 8}, "neox"),
         # the two-pass merge (a second kernel) beside the default one-pass merge (the last program)
         ("split-last", (4, 2), 32, 600, {"split": 32, "merge": "two-pass"}, None),
         ("cpu-kt", (3, 3), 24, 37, {"split": 16, "pieces": 8, "merge": "two-pass"}, "neox"),
         # Huginn's q / k bias added by the kernel (before its RoPE, or with none)
         ("split-last", (4, 4), 32, 100, {"split": 32, "bias": True}, "neox"),
         ("cpu-kt", (3, 3), 24, 37, {"bias": True}, None)]


@pytest.mark.slow
def test_triton_lane_attention_equals_the_torch_path():
    """GQA and MHA, a head size that is not a power of two (Huginn's 96 is not either), both
    in-page layouts, a prefix spanning three non-contiguous blocks, ancestors, a padding row; the
    prefix in one piece and split over programs (two pieces; 19, more than one merge step), or over
    a fixed number of programs (each walking more than ``split``; some with nothing to walk); RoPE
    applied by the kernel (NeoX over the whole head, GPT-J pairs over half of it); a q / k bias added
    by the kernel; merged by the last program of each (lane, head) and, two-pass, by a second kernel.

    In a fresh process: Triton's interpreter must be on before anything imports Triton (vLLM does)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("OK") == len(CASES), proc.stdout


def norm_add_norm_case(device: str, dtype, n: int = 5, H: int = 96, seed: int = 0):
    """Two vLLM RMSNorms with random weights (different epsilons) and a batch of rows."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(seed)
    with set_current_vllm_config(VllmConfig()):
        first, second = RMSNorm(H, eps=1e-6), RMSNorm(H, eps=1e-5)
    for norm in (first, second):
        norm.weight.data = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype).to(device)
    x = (3 * torch.randn(n, H, generator=g)).to(dtype).to(device)
    residual = torch.randn(n, H, generator=g).to(dtype).to(device)
    return first, second, x, residual


# bf16: a rounding that flips one ulp in the first norm moves the sum, and the second norm scales it up
BF16_NORM_TOL = 6e-2


def compare_norm_add_norm(device: str, dtype, H: int = 96, tol: float = 1e-6):
    """The kernel against vLLM's native norms (``forward_native``: ``vllm.ir``'s PyTorch arithmetic)."""
    from vllm_loop_kernels.norm_add_norm import norm_add_norm

    first, second, x, residual = norm_add_norm_case(device, dtype, H=H)
    want, want_res = second.forward_native(first.forward_native(x), residual.clone())
    got, got_res = norm_add_norm(x, residual, first.weight, first.variance_epsilon, second.weight,
                                 second.variance_epsilon)
    assert got_res is residual  # updated in place, as vLLM's fused add-norm does
    torch.testing.assert_close(got_res, want_res, atol=tol, rtol=tol)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def compare_add_norm_norm(device: str, dtype, H: int = 96, tol: float = 1e-6):
    """Huginn's seam against vLLM's native norms and PyTorch's add."""
    from vllm_loop_kernels.norm_add_norm import add_norm_norm

    first, second, a, x = norm_add_norm_case(device, dtype, H=H, seed=1)
    want_x = first.forward_native(a + x)
    want_h = second.forward_native(want_x)
    got_x, got_h = add_norm_norm(a, x, first.weight, first.variance_epsilon, second.weight, second.variance_epsilon)
    torch.testing.assert_close(got_x, want_x, atol=tol, rtol=tol)
    torch.testing.assert_close(got_h, want_h, atol=tol, rtol=tol)


def test_triton_norm_add_norm_equals_vllms_norms():
    """The sandwich seams in one kernel each, interpreted: Ouro's (norm -> add -> norm) and Huginn's
    (add -> norm -> norm); fp32 and bf16, a width that is not a power of two."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "norms"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("NORMS OK") == 4, proc.stdout


def compare_skinny_gemm(device: str, dtype, shapes=((1, 40, 72), (5, 24, 300), (16, 33, 64), (40, 20, 1100))):
    """``skinny_gemm`` in every configuration of ``CONFIGS``, against an fp64 product:
    rows 1-64, output and input widths that fill no tile exactly (K slices that end inside an
    iteration, slices left empty), a strided ``x``; twice, so a split-K launch finds its arrival
    counters re-armed by the one before. fp32 to 1e-5 of the product's scale: TF32 would miss that."""
    from vllm_loop_kernels.skinny_gemm import CONFIGS, skinny_gemm

    g = torch.Generator().manual_seed(0)
    for m, n, k in shapes:
        x = torch.randn(m, 2 * k, generator=g).to(dtype).to(device)[:, ::2]  # a strided view
        w = torch.randn(n, k, generator=g).to(dtype).to(device)
        want = (x.double() @ w.double().T).to(dtype)
        atol, rtol = (1e-5 * k ** 0.5, 1e-5) if dtype == torch.float32 else (3e-2 * k ** 0.5 / 8, 1e-2)
        for config in CONFIGS:
            for _ in range(2):
                got = skinny_gemm(x, w, config)
                torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol,
                                           msg=lambda e: f"{(m, n, k)} {config}: {e}")


def compare_swiglu_down(device: str, dtype, shapes=((1, 40, 72), (4, 24, 300), (16, 33, 200))):
    """``swiglu_down`` (SiLU-and-mul formed inside the split-K GEMM) against SiLU-and-mul as vLLM
    rounds it (``silu(gate)`` to the dtype, then the product) followed by an fp64 product; rows 1-16,
    widths that fill no tile, ``h`` a strided view; its default and both configurations, the
    activation loaded ahead or not; each twice (the arrival counters re-arm)."""
    from vllm_loop_kernels.skinny_gemm import SWIGLU_NARROW, SWIGLU_WIDE, swiglu_down

    g = torch.Generator().manual_seed(1)
    for m, n, f in shapes:
        h = (torch.randn(m, 4 * f, generator=g) * 2).to(dtype).to(device)[:, ::2]  # [gate | up], strided
        w = torch.randn(n, f, generator=g).to(dtype).to(device)
        gate, up = h[:, :f].float(), h[:, f:].float()
        act = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
        want = (act.double() @ w.double().T).to(dtype)
        atol, rtol = (1e-5 * f ** 0.5, 1e-5) if dtype == torch.float32 else (3e-2 * f ** 0.5 / 8, 1e-2)
        for config, prefetch in ((None, True), (SWIGLU_NARROW, True), (SWIGLU_WIDE, True), (SWIGLU_WIDE, False)):
            for _ in range(2):
                got = swiglu_down(h, w, config, prefetch)
                torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol,
                                           msg=lambda e: f"swiglu_down {(m, n, f)} {config} prefetch {prefetch}: {e}")
    with pytest.raises(ValueError, match="gated=True"):
        swiglu_down(torch.zeros(2, 7, dtype=dtype, device=device), torch.zeros(3, 3, dtype=dtype, device=device))


def compare_coupled_sample(device: str, vocab: int = 1000, rows: int = 64, broken: bool = False) -> int:
    """The one-kernel coupled sampler against ``noise.coupled_sample``'s PyTorch code (sort-based
    filter, the same noise): greedy rows (ties among them), temperature alone, top-k and top-p alone
    and together, edge values (k = 1, k >= vocab, top-p 0.3 and 0.99); the same token on every row.
    ``broken``: the kernel fed noise of the next position (a sampler that ignores the coupling), which
    must differ. -> the rows compared."""
    from vllm_loop.loopspec import noise
    from vllm_loop_kernels.coupled_sample import coupled_sample

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    logits[4] = 0.0  # a greedy row of equal logits: the first token
    logits[8, 17] = logits[8, vocab - 1] = logits[8].max() + 1  # a greedy row's two equal maxima, far apart
    cycle = rows // 8
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * (rows // 4), device=device)
    top_k = torch.tensor([0, 0, 50, 5, 0, 1, vocab - 1, vocab] * cycle, device=device)
    top_p = torch.tensor([1.0, 0.7, 0.9, 1.0, 0.3, 0.95, 0.5, 0.99] * cycle, device=device)
    key = (torch.arange(rows) * 7919 + 3).to(device)
    position = (torch.arange(rows) + 100).to(device)
    want = noise.coupled_sample(logits.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu(), key.cpu(), position.cpu())
    got = coupled_sample(logits, temperature, top_k, top_p, key, position + int(broken)).cpu()
    assert want[4] == 0 and want[8] == 17, "greedy rows break ties to the lowest token id"
    assert torch.equal(got, want), f"rows {torch.nonzero(got != want).flatten().tolist()} differ"
    return rows


@pytest.mark.slow
def test_triton_skinny_gemm_equals_torch():
    """The few-rows split-K GEMM of the lanes' linear layers, plain and with SiLU-and-mul fused
    (``swiglu_down``), interpreted: fp16 and fp32 (the interpreter's numbers are NumPy's)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "gemm"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "GEMM OK" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_triton_coupled_sampler_equals_the_torch_path():
    """The one-kernel coupled sampler (``kernels/coupled_sample.py``), interpreted, gives
    ``noise.coupled_sample``'s token on every row of every filter combination; fed the noise of the
    wrong position it does not (the comparison can fail)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "coupled"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "COUPLED OK" in proc.stdout, proc.stdout
    assert "BROKEN FAILS" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_lane_kernels_compile_for_hopper():
    """Every lane kernel compiled (not run: no GPU here) for the H200's sm_90, as the engine would
    launch it at Ouro-1.4B's and Huginn-0125's shapes, and the coupled sampler at Ouro-1.4B's
    vocabulary: Triton and ptxas accept them. The GPU runs them in tests/test_gpu.py."""
    proc = subprocess.run([sys.executable, __file__, "hopper"], env={k: v for k, v in os.environ.items()
                                                                    if k != "TRITON_INTERPRET"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "HOPPER OK" in proc.stdout, proc.stdout


def _compile_for_hopper() -> None:
    """Point Triton at an sm_90 target and make every launch a compile only (``warmup``), then call
    the kernels' own wrappers on CPU tensors of the engine's shapes."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from vllm_loop_kernels import lane_attention, norm_add_norm, skinny_gemm

    class Hopper:  # what Triton asks its driver when it compiles; nothing is launched
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(Hopper())
    built = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        built.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    bf16 = torch.bfloat16
    for rows in (1, 16):
        for n, f in ((2048, 5632), (5280, 17920)):  # Ouro-1.4B, Huginn-0125
            skinny_gemm.swiglu_down(torch.empty(rows, 2 * f, dtype=bf16), torch.empty(n, f, dtype=bf16))
    w = torch.ones(2048, dtype=bf16)
    norm_add_norm.norm_add_norm(torch.empty(4, 2048, dtype=bf16), torch.empty(4, 2048, dtype=bf16), w, 1e-6, w, 1e-6)
    norm_add_norm.add_norm_norm(torch.empty(4, 2048, dtype=bf16), torch.empty(4, 2048, dtype=bf16), w, 1e-6, w, 1e-6)
    for D in (128, 96):  # Ouro-1.4B's head size and Huginn-0125's (not a power of two: a padded tile)
        paged, scratch, rows, bank_ids, depths, q, k, v = lane_attention_case("split-last", "cpu", bf16,
                                                                              heads=(16, 16), D=D)
        bias = (torch.zeros(16 * D, dtype=bf16),) * 2  # Huginn's q / k bias
        for merge, qk_bias in (("one-pass", None), ("two-pass", None), ("one-pass", bias)):
            lane_attention.lane_attention(q, k, v, paged.k, paged.v, paged.page_of, bank_ids, depths, rows.prefix,
                                          rows.slots, rows.block_rows, rows.ancestors, scratch.kv, D**-0.5,
                                          merge=merge, bias=qk_bias)
    from vllm_loop_kernels.coupled_sample import coupled_sample

    rows = 4
    coupled_sample(torch.empty(rows, 49152), torch.ones(rows), torch.zeros(rows, dtype=torch.int64),
                   torch.ones(rows), torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64))
    names = {name for name, _ in built}
    assert names == {"_skinny_gemm_kernel", "_norm_add_norm_kernel", "_add_norm_norm_kernel", "_lane_kernel",
                     "_merge_kernel", "_coupled_sample_kernel"}, names
    for name, kernel in built:
        assert ".target sm_90" in kernel.asm["ptx"], name
    print(f"HOPPER OK: {len(built)} launches compiled for sm_90 ({len(names)} kernels)", flush=True)


@pytest.mark.engine
def test_triton_lane_attention_in_the_engine(ckpt_factory):
    """A CPU engine whose lanes attend with the kernel (interpreted; lane calls padded to the graph
    shapes): 4 staggered greedy requests of up to 12 tokens (one with a shared prefix) equal the
    reference token for token, nothing leaks. Kept small: interpreted, 8 requests of up to 40 tokens
    took ~17 minutes of a CI run on 2 cores, 4 of them ~10."""
    path = ckpt_factory("ouro", options={"agreement": "0.005"})
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, __file__, "engine", path], env=env, capture_output=True, text=True,
                          timeout=1800)  # ~10 minutes on CI's 2 cores; a slower host must not fail it
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ENGINE OK" in proc.stdout, proc.stdout[-3000:]


def _engine_run(path: str) -> None:
    from vllm_loop.reference import load_reference
    from vllm_loop.testing.engines import (greedy_jobs, lane_census, run_jobs, runner_totals, start_llm, stop_llm,
                                           worker_functions)

    jobs = greedy_jobs(n=4)
    for job in jobs:  # interpreted, every token costs: 12 at most (48 in all) still spans several lane steps each
        job.params.max_tokens = min(job.params.max_tokens, 12)
    # step_tokens 0 (drafts = the lane chain): interpreted, fewer recurrent steps a lane step than with the
    # default padding, which has its own engine tests
    spec = {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2, "lane_attention": "triton", "lane_graphs": "on",
            "step_tokens": 0}
    with worker_functions():
        llm = start_llm(path, speculative_config=spec, max_model_len=128, block_size=16,
                        kv_cache_memory_bytes=2**28)
        try:
            got = run_jobs(llm, jobs)
            census = llm.collective_rpc(lane_census)[0]
            totals = runner_totals(llm)
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
    if sys.argv[1:2] == ["hopper"]:
        _compile_for_hopper()
        sys.exit(0)
    if sys.argv[1:2] == ["gemm"]:
        compare_skinny_gemm("cpu", torch.float16)
        compare_skinny_gemm("cpu", torch.float32)
        compare_swiglu_down("cpu", torch.float16)
        compare_swiglu_down("cpu", torch.float32)
        print("GEMM OK", flush=True)
        sys.exit(0)
    if sys.argv[1:2] == ["coupled"]:
        compare_coupled_sample("cpu")
        from vllm_loop_kernels.coupled_sample import coupled_sample

        bad = torch.randn(2, 300)
        bad[:, 7] = float("nan")  # a broken row ends (some token), never loops
        token = coupled_sample(bad, torch.ones(2), torch.tensor([0, 5]), torch.tensor([0.7, 0.9]),
                               torch.tensor([1, 2]), torch.tensor([3, 4]))
        assert ((token >= 0) & (token < 300)).all(), token
        print("COUPLED OK", flush=True)
        try:
            compare_coupled_sample("cpu", broken=True)
        except AssertionError as e:
            print(f"BROKEN FAILS {e}", flush=True)
        sys.exit(0)
    if sys.argv[1:2] == ["norms"]:
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, BF16_NORM_TOL)):
            compare_norm_add_norm("cpu", dtype, tol=tol)
            print(f"NORMS OK norm_add_norm {dtype}", flush=True)
            compare_add_norm_norm("cpu", dtype, tol=tol)
            print(f"NORMS OK add_norm_norm {dtype}", flush=True)
        sys.exit(0)
    from vllm_loop_kernels.lane_attention import lane_attention

    for layout, heads, D, prefix0, split, rope in CASES:
        compare(*kernel_of(lane_attention, split), layout, "cpu", heads=heads, D=D, prefix0=prefix0, rope=rope)
        print(f"OK {layout} heads={heads} D={D} prefix={prefix0} split={split} rope={rope}", flush=True)


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


@pytest.mark.slow
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
