"""GPU checks (vllm==0.26.0, default torch.compile + CUDA graphs). Run on the H200 with
``pytest tests/test_gpu.py``; CI machines have no GPU, so there these tests are skipped."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_loop.testing.engines import check_ouro_early_exit, start_llm, stop_llm, worker_facts, worker_functions
from vllm_loop.testing.prompts import PARITY_PROMPTS as PROMPTS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run on the H200)")]



@pytest.mark.engine
def test_plugin_smoke_on_gpu(ckpt_factory):
    from vllm import SamplingParams

    with worker_functions():  # collective_rpc(worker_facts) below
        llm = start_llm(ckpt_factory("llama"))
        try:
            outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
            (facts,) = llm.collective_rpc(worker_facts)
            assert facts["registered"] and facts["pid"] != os.getpid()
            assert "RavenForCausalLM" in facts["plugin_archs"]
            print("GPU smoke:", facts, [list(o.outputs[0].token_ids) for o in outs])
        finally:
            stop_llm(llm)


# vLLM's forward compiled (a vanilla engine's default, asked for by name: a LoopSpec engine skips it by
# default, config.fast_start_compilation) or not (eager, full decode graphs, the sandwich seams as this
# plugin's Triton kernels instead of Inductor's fusions; what a LoopSpec engine ran on one GPU before
# it took full graphs for mixed steps too)
COMPILATION = {"compiled": {"compilation_config": {"mode": 3}},
               "nocompile": {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}}
COMPILED = COMPILATION["compiled"]


def _check_compilation(llm, compilation: str) -> None:
    config = llm.llm_engine.vllm_config.compilation_config
    assert config.mode.name == ("VLLM_COMPILE" if compilation == "compiled" else "NONE"), config.mode
    assert config.cudagraph_mode.has_full_cudagraphs(), config.cudagraph_mode


@pytest.mark.engine
@pytest.mark.parametrize("compilation", list(COMPILATION))
def test_ouro_parity_compiled_cuda_graphs(ckpt_factory, compilation):
    """fp32 (Triton attention), vLLM's default compilation (or none) and CUDA graphs: greedy tokens
    equal the reference; logprobs of the chosen tokens within 1e-3."""
    path = ckpt_factory("ouro")
    llm = start_llm(path, **COMPILATION[compilation])
    try:
        _check_compilation(llm, compilation)
        n, worst, _ = _greedy_parity_with_logprobs(llm, path, "ouro")
        print(f"GPU Ouro parity ({compilation}): {n} prompts x 32 tokens identical; max |logprob diff| = {worst:.2e}")
    finally:
        stop_llm(llm)


RAVEN_LAYOUTS = ["huginn", "llama", "olmo2"]


@pytest.mark.engine
@pytest.mark.parametrize("compilation", list(COMPILATION))
@pytest.mark.parametrize("layout", RAVEN_LAYOUTS)
def test_raven_parity_compiled_cuda_graphs(ckpt_factory, layout, compilation):
    """Huginn-0125 and the retrofitted Raven layouts (Llama, OLMo-2) in fp32 (Triton attention)
    under vLLM's default compilation (or none) and full CUDA graphs: prelude, T core steps and coda
    banks; greedy tokens equal the reference, logprobs of the chosen tokens within 1e-3."""
    path = ckpt_factory("huginn_raven", options={"layout": layout, "state_init": "seeded"})
    llm = start_llm(path, **COMPILATION[compilation])
    try:
        _check_compilation(llm, compilation)
        n, worst, depth = _greedy_parity_with_logprobs(llm, path, layout)
        print(f"GPU Raven {layout} parity ({compilation}, T={depth}): {n} prompts x 32 tokens identical; "
              f"max |logprob diff| = {worst:.2e}")
    finally:
        stop_llm(llm)


def _greedy_parity_with_logprobs(llm, path: str, label: str) -> tuple[int, float, int]:
    """32 greedy tokens per parity prompt equal the reference's; the chosen tokens' logprobs are within
    1e-3 of the reference's (float64 log-softmax). Returns (prompts, worst logprob diff, reference depth)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_loop.reference import load_reference

    tok, ref = AutoTokenizer.from_pretrained(path), load_reference(path)
    prompts = [tok(p).input_ids for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1))
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        got = list(out.outputs[0].token_ids)
        assert got == ref.greedy_generate(prompt, 32), f"{label}: prompt {prompt[:6]}..."
        logits = ref.forward_depths(torch.tensor(prompt + got[:-1]))[ref.depth][len(prompt) - 1:]
        want = torch.log_softmax(logits.double(), -1)
        for i, (t, lp) in enumerate(zip(got, out.outputs[0].logprobs)):
            worst = max(worst, abs(lp[t].logprob - want[i, t].item()))
    assert worst < 1e-3, (label, worst)
    return len(prompts), worst, ref.depth


@pytest.mark.engine
def test_ouro_early_exit_compiled_cuda_graphs(ckpt_factory):
    """``early_exit_threshold`` = 0.5 under compilation and CUDA graphs: each depth's state is kept
    (the next loop's fused add + norm updates its input in place on the GPU); greedy == reference."""
    path = ckpt_factory("ouro")
    llm = start_llm(path, hf_overrides={"early_exit_threshold": 0.5})
    try:
        assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs()
        depths = check_ouro_early_exit(llm, path, PROMPTS, max_tokens=32, threshold=0.5)
    finally:
        stop_llm(llm)
    assert len(depths) > 1, depths
    print(f"GPU Ouro early exit (threshold 0.5): 8 prompts x 32 tokens identical; depths used {sorted(depths)}")


LATENT = {"coconut": ("coconut", {}), "codi-llama": ("codi", {"base": "llama"}), "lotus": ("lotus", {})}


@pytest.mark.engine
@pytest.mark.parametrize("name", list(LATENT))
def test_latent_cuda_graphs_match_eager_and_reference(ckpt_factory, name):
    """fp32, mixed budgets in one batch: compiled + CUDA graphs with async scheduling (vLLM's GPU
    default) == eager with synchronous scheduling == the reference."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_loop.latent.spec import LatentSpec
    from vllm_loop.reference.latent_loading import load_latent_reference

    family, options = LATENT[name]
    path = ckpt_factory(family, options=options)
    spec = LatentSpec.from_config(json.loads((Path(path) / "config.json").read_text()))
    tok, ref = AutoTokenizer.from_pretrained(path), load_latent_reference(path)
    prompts = [tok(q).input_ids for q in ("Question: Tom has 3 apples.\n", "x\n", "A train travels 60 miles.\n")]
    budgets = [0, spec.default_budget, spec.default_budget + 2]
    batch = [(p, b) for p in prompts for b in budgets]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, extra_args={"latent_budget": b})
              for _, b in batch]
    runs, prompts_shown = {}, {}
    for mode, eager in (("graphs", False), ("eager", True)):
        llm = start_llm(path, enforce_eager=eager, max_model_len=256, **({"async_scheduling": False} if eager else {}))
        try:
            config = llm.llm_engine.vllm_config
            assert config.scheduler_config.async_scheduling is (not eager)
            if not eager:
                assert config.compilation_config.cudagraph_mode.has_full_cudagraphs()
            outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params)
            runs[mode] = [list(o.outputs[0].token_ids) for o in outs]
            prompts_shown[mode] = [list(o.prompt_token_ids) for o in outs]
        finally:
            stop_llm(llm)
    assert runs["graphs"] == runs["eager"]
    for (p, b), got, shown in zip(batch, runs["graphs"], prompts_shown["graphs"]):
        # the answer only; the latent phase ends the prompt (vllm_loop/latent/spec.py)
        assert got == ref.generate(p, latent_budget=b, max_new_tokens=16, ignore_eos=True)[0]
        assert shown[: len(p)] == p and spec.phase_budget(shown) == b
    print(f"GPU latent {name}: {len(batch)} requests, CUDA graphs + async scheduling == eager + sync == reference")


LOOPSPEC = {  # name -> (family, options, overrides, speculative config)
    "ouro-1:2": ("ouro", {}, {}, {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2}),
    "ouro-agree-1:2": ("ouro", {"agreement": "0.005"}, {}, {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2}),
    # drafts = the lane chain alone, not padded to step_tokens' default 16
    "ouro-agree-1:2-chain": ("ouro", {"agreement": "0.005"}, {},
                             {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2, "step_tokens": 0}),
    # 32 drafts a step: lane steps of up to 32 recurrent steps while no request waits to join
    "ouro-agree-1:2-step32": ("ouro", {"agreement": "0.005"}, {},
                              {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2, "step_tokens": 32}),
    "raven-olmo2-R32-2:8": ("huginn_raven", {"layout": "olmo2", "state_init": "seeded", "agreement": "0.5"},
                            {"mean_recurrence": 32}, {"method": "loopspec", "lanes": "on", "d1": 2, "d2": 8}),
    # the tuner's schedule for the Huginn-0125 shape at agreement 0.001 (a lane every recurrent step), on a
    # tiny checkpoint whose depths disagree often enough that every kind of commit happens
    "huginn-R32-1:5": ("huginn_raven", {"layout": "huginn", "state_init": "seeded", "agreement": "0.5"},
                       {"mean_recurrence": 32}, {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 5}),
    # with greedy late re-proposals (schedule.py): the same checkpoint's many full rejections give them work
    "huginn-R32-1:5-late": ("huginn_raven", {"layout": "huginn", "state_init": "seeded", "agreement": "0.5"},
                            {"mean_recurrence": 32},
                            {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 5, "late": [8, 16]}),
}
# (checkpoint, lane_graphs, lane_attention, lane_overlap)
LANE_GRAPHS = [("ouro-1:2", "auto", "torch", "auto"), ("ouro-agree-1:2", "auto", "torch", "auto"),
               ("ouro-agree-1:2", "off", "torch", "auto"), ("raven-olmo2-R32-2:8", "auto", "torch", "auto"),
               ("raven-olmo2-R32-2:8", "off", "torch", "auto"), ("ouro-agree-1:2", "auto", "triton", "auto"),
               ("raven-olmo2-R32-2:8", "auto", "triton", "auto"), ("ouro-agree-1:2", "auto", "triton", "off"),
               ("ouro-agree-1:2-chain", "auto", "triton", "auto"), ("huginn-R32-1:5", "auto", "triton", "auto"),
               ("huginn-R32-1:5-late", "auto", "triton", "auto")]


def _captured_lane_graphs(worker) -> int:
    graphs = worker.model_runner.drafter.graphs
    return -1 if graphs is None else graphs.captured


@pytest.mark.engine
@pytest.mark.parametrize("name, graphs, attention, overlap", LANE_GRAPHS,
                         ids=[f"{n}-graphs-{g}-{a}-overlap-{o}" for n, g, a, o in LANE_GRAPHS])
def test_loopspec_greedy_identity_compiled(ckpt_factory, name, graphs, attention, overlap):
    """fp32, vLLM's default compilation and CUDA graphs; lane calls replayed from CUDA graphs
    (``lane_graphs`` auto) or eager (off), lane attention in PyTorch or the Triton kernel, recurrent
    steps overlapped with the host's decisions or not: 16
    requests arriving while others decode; LoopSpec == the
    reference token for token (so graphs on == off == vanilla, which equals the reference:
    the parity tests above); nothing leaks."""
    _greedy_identity(ckpt_factory, name, graphs, attention, overlap, compiled=True)


# (checkpoint, lane_graphs)
NOCOMPILE = [(name, "auto") for name in ("huginn-R32-1:5", "ouro-agree-1:2", "ouro-agree-1:2-step32")] + \
    [("huginn-R32-1:5", "off"), ("ouro-agree-1:2", "off")]


@pytest.mark.engine
@pytest.mark.parametrize("name, graphs", NOCOMPILE,
                         ids=[n + ("" if g == "auto" else f"-lane-graphs-{g}") for n, g in NOCOMPILE])
def test_loopspec_greedy_identity_nocompile(ckpt_factory, name, graphs):
    """The same with a LoopSpec engine's default compilation: none (``mode`` NONE, ``cudagraph_mode``
    FULL: no Dynamo / Inductor at start-up; vLLM's forward replayed from its full graphs, prefills and
    lane-verifying steps from mixed-step graphs capped at ``max_model_len``, 1-token decode steps from
    their own): identical to the reference, with lane calls replayed from the lane graphs and (``off``)
    eager; and with 32 drafts a step (``step32``: longer lane steps)."""
    _greedy_identity(ckpt_factory, name, graphs, "triton", "auto", compiled=False)


def _count_graph_dispatches(worker) -> None:
    """Count, from now on, what vLLM's dispatcher picks for each step of its forward."""
    d = worker.model_runner.cudagraph_dispatcher
    dispatch, d.test_counts = d.dispatch, {}

    def counted(*args, **kwargs):
        mode, desc = dispatch(*args, **kwargs)
        key = f"{mode.name}-{'decode' if desc.uniform else 'mixed'}"
        d.test_counts[key] = d.test_counts.get(key, 0) + 1
        return mode, desc

    d.dispatch = counted


def _graph_dispatches(worker) -> dict:
    from vllm.config.compilation import CUDAGraphMode

    d = worker.model_runner.cudagraph_dispatcher
    keys = d.cudagraph_keys[CUDAGraphMode.FULL]
    return {"counts": dict(d.test_counts), "decode_keys": sum(k.uniform for k in keys),
            "mixed_keys": sum(not k.uniform for k in keys), "largest": d.compilation_config.max_cudagraph_capture_size}


def _greedy_identity(ckpt_factory, name, graphs, attention, overlap, compiled: bool):
    from vllm_loop.loopspec.stat_logger import engine_totals
    from vllm_loop.reference import load_reference
    from vllm_loop.testing.engines import greedy_jobs, lane_census, run_jobs

    family, options, overrides, spec = LOOPSPEC[name]
    path = ckpt_factory(family, options=options, **overrides)
    with worker_functions():  # collective_rpc(lane_census) below
        llm = start_llm(path, speculative_config=spec | {"lane_graphs": graphs, "lane_attention": attention,
                                                          "lane_overlap": overlap},
                        max_model_len=128, block_size=16,
                        **(COMPILED if compiled else {}))
        try:
            compilation = llm.llm_engine.vllm_config.compilation_config
            assert compilation.mode.name == ("VLLM_COMPILE" if compiled else "NONE")
            assert compilation.cudagraph_mode.name == ("FULL_AND_PIECEWISE" if compiled else "FULL")
            if not compiled:
                llm.collective_rpc(_count_graph_dispatches)
            got = run_jobs(llm, greedy_jobs())
            graphs_used = None if compiled else llm.collective_rpc(_graph_dispatches)[0]
            census = llm.collective_rpc(lane_census)[0]
            captured = llm.collective_rpc(_captured_lane_graphs)[0]
        finally:
            stop_llm(llm)
    ref = load_reference(path)
    for job in greedy_jobs():
        assert got[job.request_id] == ref.greedy_generate(job.prompt, job.params.max_tokens), job.request_id
    totals = engine_totals()  # of the engine started last: this one
    assert totals.lane_steps > 0 and totals.standard_steps > 0
    assert census["lanes"] == 0 and census["free_slots"] == census["slots"]
    assert (captured > 0) if graphs == "auto" else (captured == -1), captured
    assert (totals.late > 0) if spec.get("late") else (totals.late_verified == 0), totals
    overlapped = totals.overlap_wasted + totals.overlap_lagged
    assert (overlapped > 0) if overlap == "auto" else (overlapped == 0), totals
    lane_graphs = f"{captured} captured" if captured >= 0 else "none"  # -1: the runner holds no lane graphs
    if not compiled:  # capped at max_model_len; prefills ran in graphs
        assert graphs_used["largest"] == 128 and graphs_used["decode_keys"] > 0, graphs_used
        assert graphs_used["counts"].get("FULL-mixed", 0) > 0, graphs_used
    asked = f", vLLM's graphs {graphs_used}" if graphs_used else ""
    print(f"GPU LoopSpec {name}, {'compiled' if compiled else 'no compile'}{asked}, lane graphs {graphs} "
          f"({lane_graphs}), lane attention {attention}, overlap "
          f"{overlap} ({totals.overlap_wasted} rows wasted, {totals.overlap_lagged} lanes lagged): 16 staggered "
          f"requests identical to the reference; {totals.log_line(overrides.get('mean_recurrence', 4))}")


ASYNC_CASES = [  # (checkpoint of LOOPSPEC, lanes pattern: None = lanes "on" with --async-scheduling)
    ("ouro-agree-1:2", None), ("ouro-agree-1:2", "LLLPPPPP"), ("ouro-1:2", "PPPPPPPL"),
    ("raven-olmo2-R32-2:8", None), ("raven-olmo2-R32-2:8", "LLPPP")]


def _async_facts(worker) -> dict:
    runner = worker.model_runner
    return {"runner_async": runner.use_async_scheduling, "census": runner.drafter.lane_census(),
            "captured": -1 if runner.drafter.graphs is None else runner.drafter.graphs.captured}


@pytest.mark.engine
@pytest.mark.parametrize("name, pattern", ASYNC_CASES, ids=[f"{n}-{p or 'lanes-on'}" for n, p in ASYNC_CASES])
def test_loopspec_async_greedy_identity_compiled(ckpt_factory, name, pattern):
    """fp32, compiled, CUDA defaults (lane graphs, Triton lane attention), async scheduling in a
    multiprocess engine: vLLM's async runner for plain steps, lanes-mode steps as barriers with its
    async state reset after them. Lanes on every step, or the policy forced through every transition
    (``VLLM_LOOP_LANES_PATTERN``): 16 staggered requests identical to the reference, plain steps
    pipelined, nothing leaked."""
    from vllm_loop.loopspec.policy import PATTERN_ENV
    from vllm_loop.loopspec.stat_logger import engine_totals
    from vllm_loop.reference import load_reference
    from vllm_loop.testing.engines import greedy_jobs, run_jobs

    family, options, overrides, spec = LOOPSPEC[name]
    spec = spec | ({"lanes": "auto"} if pattern else {})
    path = ckpt_factory(family, options=options, **overrides)
    if pattern:
        os.environ[PATTERN_ENV] = pattern  # read by the engine-core process
    try:
        with worker_functions():
            llm = start_llm(path, speculative_config=spec, max_model_len=128, block_size=16, **COMPILED,
                            **({} if pattern else {"async_scheduling": True}))
            try:
                config = llm.llm_engine.vllm_config.scheduler_config
                assert config.async_scheduling and config.scheduler_cls.endswith("LoopSpecAsyncScheduler")
                got = run_jobs(llm, greedy_jobs())
                facts = llm.collective_rpc(_async_facts)[0]
            finally:
                stop_llm(llm)
    finally:
        os.environ.pop(PATTERN_ENV, None)
    ref = load_reference(path)
    for job in greedy_jobs():
        assert got[job.request_id] == ref.greedy_generate(job.prompt, job.params.max_tokens), job.request_id
    totals = engine_totals()
    census = facts["census"]
    assert facts["runner_async"] and census["lanes"] == 0 and census["free_slots"] == census["slots"], facts
    # a lane step needs two lanes-mode steps in a row: the first starts the lanes (vLLM's path, then
    # the new lanes' pre-layers, a lane graph), the next runs them
    lanes_expected = pattern is None or "LL" in pattern + pattern
    assert (totals.lane_steps > 0) is lanes_expected and facts["captured"] > 0, facts
    assert (totals.pipelined_steps > 0) is (pattern is not None)
    print(f"GPU async LoopSpec {name} {pattern or 'lanes on'}: 16 staggered requests identical to the reference; "
          f"{totals.plain_steps} plain steps ({totals.pipelined_steps} pipelined), {totals.drains} drains; "
          f"{totals.log_line(overrides.get('mean_recurrence', 4))}")


def _mixed_on_v1(path: str, scheduling: str, env: dict, **kwargs) -> list:
    """``generate_mixed`` on an engine started with ``env`` set (read by the engine-core process); the
    engine must schedule as ``scheduling`` says and run vLLM's V1 model runner."""
    from vllm_loop.testing.engines import generate_mixed

    os.environ.update(env)
    try:
        llm = start_llm(path, max_model_len=128, block_size=16, **kwargs)
        try:
            config = llm.llm_engine.vllm_config
            assert config.scheduler_config.async_scheduling is (scheduling == "async")
            assert not config.use_v2_model_runner
            return generate_mixed(llm)
        finally:
            stop_llm(llm)
    finally:
        for name in env:
            os.environ.pop(name, None)


@pytest.mark.engine
@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_loopspec_mixed_rows_compiled(ckpt_factory, scheduling):
    """Forced transitions, async or sync scheduling: requests the lanes cannot serve (logprobs,
    penalties, min_tokens, allowed tokens, seeded sampling with bad words) next to lane requests give
    what vanilla vLLM with the same scheduling gives; under async their -1 placeholders are repaired
    through the barrier steps.

    The vanilla engine runs vLLM's V1 model runner, the one every LoopSpec engine runs (vLLM 0.26's
    V2 runner has no custom speculative methods). Left to its defaults, vanilla Ouro on CUDA takes the
    V2 runner, whose seeded sampling draws other random numbers than V1's per-request
    ``torch.Generator``: its seeded rows differ from any V1 engine's, LoopSpec or not (traced on the
    H200, benchmarks/RESULTS.md)."""
    from vllm_loop.loopspec.policy import PATTERN_ENV
    from vllm_loop.testing.engines import mixed_batch

    flag = {} if scheduling == "async" else {"async_scheduling": False}
    path = ckpt_factory("ouro", options={"agreement": "0.005"})
    want = _mixed_on_v1(path, scheduling, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, **flag)
    got = _mixed_on_v1(path, scheduling, {PATTERN_ENV: "LLPPPLP"},
                       speculative_config={"method": "loopspec", "d1": 1, "d2": 2}, **flag, **COMPILED)
    batch = mixed_batch()
    random_rows = {i for i, (_, sp) in enumerate(batch) if sp.temperature > 0}
    for i, (g, w) in enumerate(zip(got, want)):
        if i not in random_rows:
            assert g == w, (i, batch[i][1])
    print(f"GPU {scheduling} LoopSpec: {len(batch) - len(random_rows)} greedy mixed requests (lanes and vLLM's "
          f"path) identical to vanilla {scheduling}")
    differ = sorted(i for i in random_rows if got[i] != want[i])
    assert not differ, f"seeded random rows {differ} differ from vanilla vLLM on the V1 runner"
    print(f"GPU {scheduling} LoopSpec: {len(random_rows)} seeded random rows on vLLM's path identical to vanilla "
          f"{scheduling} (V1 runner)")


@pytest.mark.engine
def test_loopspec_sampling_distribution(ckpt_factory):
    """fp32, a LoopSpec engine's defaults (no compile, vLLM's full graphs for every step), with the CUDA
    defaults (lane graphs, the Triton lane attention): seeded top-k
    and top-p samples of LoopSpec's first tokens follow the exact distribution of ordinary sampling
    (the reference model's, enumerated), every branch of the cascade ran, nothing leaks. Here the
    readouts' top-k / top-p filter runs on the GPU (``pipeline.readout_values``)."""
    from test_loopspec_engine import ALPHA, N_TOKENS, PROMPT, SAMPLING_CASES, _samples

    from vllm_loop.loopspec.metrics import EngineCounters
    from vllm_loop.loopspec.proposals import SamplingParams as LaneParams
    from vllm_loop.loopspec.stat_logger import engine_totals
    from vllm_loop.reference import load_reference
    from vllm_loop.testing.distribution import chi2_gof, exact_tree
    from vllm_loop.testing.engines import lane_census

    path = ckpt_factory("ouro", options={"agreement": "0.1"})
    spec = {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2}
    counts, steps = {}, {}
    with worker_functions():  # collective_rpc(lane_census) below
        llm = start_llm(path, speculative_config=spec, max_model_len=128, block_size=16, max_num_seqs=64)
        try:
            for name, (params, n) in SAMPLING_CASES.items():
                before = engine_totals() or EngineCounters()
                counts[name] = _samples(llm, params, n)
                steps[name] = engine_totals().minus(before)
            census = llm.collective_rpc(lane_census)[0]
        finally:
            stop_llm(llm)
    ref = load_reference(path)
    for name, (params, n) in SAMPLING_CASES.items():
        exact = exact_tree(ref, PROMPT, LaneParams(**params), N_TOKENS)[0]
        p = chi2_gof(counts[name], exact, n)
        assert p > ALPHA, (name, p)
        assert steps[name].first > 0 and steps[name].second > 0 and steps[name].full > 0, vars(steps[name])
        print(f"GPU LoopSpec sampling {name}: {n} seeded samples, chi-square p = {p:.3f} against the exact "
              f"distribution; {steps[name].log_line(4)}")
    assert census["lanes"] == 0 and census["free_slots"] == census["slots"]


def _record_triton_compiles(worker) -> None:
    """From now on, record every Triton kernel compiled in this worker (Triton's post-compile hook, as
    vLLM's jit monitor uses it; the monitor's own hook is kept)."""
    from triton import knobs

    existing, worker.test_compiles = knobs.runtime.jit_post_compile_hook, []

    def hook(**kwargs):
        worker.test_compiles.append(getattr(kwargs.get("fn"), "name", "?"))
        return existing(**kwargs) if existing is not None else None

    knobs.runtime.jit_post_compile_hook = hook


def _triton_compiles(worker) -> list[str]:
    return list(worker.test_compiles)


def test_loopspec_serves_without_triton_compilation_after_start(ckpt_factory):
    """A LoopSpec engine with the defaults a user gets (bf16, lanes policy auto, lane graphs, the lane
    kernels) compiles every Triton kernel it will launch at start-up (``install_loopspec_warmup``):
    serving batches of 1 to 32 requests, short and long contexts, greedy, sampled and logprobs requests
    (vLLM's path) compiles nothing more, and no lane graph is captured while serving."""
    from vllm import SamplingParams

    from vllm_loop.loopspec.stat_logger import engine_totals

    path = ckpt_factory("ouro", options={"agreement": "0.005"})
    with worker_functions():
        llm = start_llm(path, dtype="bfloat16", speculative_config={"method": "loopspec"}, max_model_len=512,
                        max_num_seqs=32)
        try:
            llm.collective_rpc(_record_triton_compiles)
            kinds = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                     SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
                     SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)]
            waves = 0
            for batch in (1, 2, 5, 16, 32):
                for prompt_len in (4, 60, 300):
                    for params in kinds:
                        prompts = [[(7 * i + 3 * j) % 400 + 1 for j in range(prompt_len)] for i in range(batch)]
                        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                        waves += 1
            compiled = llm.collective_rpc(_triton_compiles)[0]
            captured = llm.collective_rpc(_captured_lane_graphs)[0]
        finally:
            stop_llm(llm)
    totals = engine_totals()
    assert totals.lane_steps > 0 and totals.graph_captures == 0, vars(totals)
    assert compiled == [], f"Triton compiled while serving: {sorted(set(compiled))}"
    print(f"GPU LoopSpec engine: {waves} waves of 1-32 requests (greedy, sampled, logprobs; prompts of 4-300 "
          f"tokens) after start-up: no Triton compilation, {captured} lane graphs all captured at start-up, "
          f"{totals.lane_steps} lane steps, {totals.plain_steps} plain steps")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, D", [((16, 16), 128), ((8, 2), 64), ((4, 4), 96)], ids=["ouro", "gqa", "huginn-d96"])
@pytest.mark.parametrize("prefix0, split, rope", [(37, {}, None), (1000, {}, None), (1000, {"split": 32}, None),
                                                  (300, {}, "neox"), (300, {"split": 32}, "gptj"),
                                                  (1000, {"split": 16, "pieces": 8}, None),
                                                  (1000, {"merge": "two-pass"}, None),
                                                  (300, {"merge": "two-pass"}, "neox"),
                                                  (300, {"bias": True}, "neox")],
                         ids=["short", "long", "long-32", "neox", "gptj-32", "long-8-programs", "long-two-pass",
                              "neox-two-pass", "neox-bias"])
def test_triton_lane_attention_on_gpu(dtype, heads, D, prefix0, split, rope):
    """The compiled kernel against the PyTorch lane attention (the CPU test runs it interpreted): a
    short prefix, and a long one in the default pieces, in 32 (more than one merge step) and over 8
    programs per (lane, head); RoPE applied by the kernel against vLLM's rotary kernel; merged by the
    last program (these few rows' default) and by a second kernel (two-pass, many rows' default); a
    q / k bias added by the kernel before its RoPE (Huginn's)."""
    from test_lane_kernels import compare, kernel_of
    from vllm_loop_kernels.lane_attention import lane_attention

    compare(*kernel_of(lane_attention, split), "split-last", "cuda", dtype=dtype, heads=heads, D=D,
            tol=1e-5 if dtype == torch.float32 else 2e-2, prefix0=prefix0, rope=rope)


@pytest.mark.engine
def test_loopspec_plain_decode_runs_full_cuda_graphs(ckpt_factory):
    """In a LoopSpec engine, decode steps of 1 token per request (requests the lanes do not serve,
    here: logprobs; the lanes policy's plain steps) have full CUDA graphs
    (``vllm_patches.graphs.install_loopspec_decode_graphs``), and their tokens equal the reference (fp32)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.config import CUDAGraphMode

    from vllm_loop.reference import load_reference

    path = ckpt_factory("ouro")

    def full_decode_keys(worker):
        runner = worker.model_runner
        keys = runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
        return runner.uniform_decode_query_len, sorted(k.num_tokens for k in keys if k.uniform)

    with worker_functions():
        llm = start_llm(path, speculative_config={"method": "loopspec", "lanes": "on"}, max_model_len=128,
                        block_size=16)
        try:
            query_len, sizes = llm.collective_rpc(full_decode_keys)[0]
            tok, ref = AutoTokenizer.from_pretrained(path), load_reference(path)
            prompts = [tok(p).input_ids for p in PROMPTS[:4]]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1))
        finally:
            stop_llm(llm)
    assert query_len == 1 and 1 in sizes and 2 in sizes, (query_len, sizes)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == ref.greedy_generate(prompt, 24)
    print(f"GPU LoopSpec engine: 1-token decode has full graphs for {sizes[:8]}... tokens; 4 logprobs requests "
          f"identical to the reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_norm_add_norm_on_gpu(dtype):
    """The compiled seam kernels against vLLM's native norms at Ouro-1.4B's and Huginn-0125's widths
    (the CPU test runs them interpreted)."""
    from test_lane_kernels import BF16_NORM_TOL, compare_add_norm_norm, compare_norm_add_norm

    tol = 1e-5 if dtype == torch.float32 else BF16_NORM_TOL
    compare_norm_add_norm("cuda", dtype, H=2048, tol=tol)
    compare_add_norm_norm("cuda", dtype, H=5280, tol=tol)


def test_coupled_sampler_on_gpu():
    """The one-kernel coupled sampler compiled, at Ouro-1.4B's and Huginn-0125's vocabularies: the
    PyTorch path's token on every row (``test_lane_kernels.compare_coupled_sample``), and its time
    against the PyTorch path's on the GPU at 4 and 64 rows (printed)."""
    import time

    from test_lane_kernels import compare_coupled_sample

    from vllm_loop.loopspec import noise
    from vllm_loop_kernels.coupled_sample import coupled_sample

    for vocab in (49152, 65536):
        compare_coupled_sample("cuda", vocab=vocab, rows=256)
    for rows in (4, 64):
        logits = torch.randn(rows, 49152, device="cuda") * 3
        args = (torch.ones(rows, device="cuda"), torch.zeros(rows, dtype=torch.int64, device="cuda"),
                torch.full((rows,), 0.7, device="cuda"), torch.arange(rows, device="cuda"),
                torch.arange(rows, device="cuda") + 50)
        for name, fn in (("kernel", coupled_sample), ("torch", noise.coupled_sample)):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(noise.KERNEL_ENV, "0")
                for _ in range(3):
                    fn(logits, *args)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(50):
                    fn(logits, *args)
                torch.cuda.synchronize()
            print(f"coupled sample {name} rows={rows} top-p 0.7: {(time.perf_counter() - t) / 50 * 1e6:.1f} us")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_triton_skinny_gemm_on_gpu(dtype):
    """Every configuration of the few-rows GEMM against an fp64 product, at small
    shapes and at Ouro-1.4B's four (the CPU test runs it interpreted); fp32 without TF32."""
    from test_lane_kernels import compare_skinny_gemm

    compare_skinny_gemm("cuda", dtype, shapes=((1, 40, 72), (5, 24, 300), (16, 33, 64), (8, 6144, 2048),
                                               (8, 2048, 2048), (8, 11264, 2048), (4, 2048, 5632)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_triton_swiglu_down_on_gpu(dtype):
    """SiLU-and-mul fused into the down projection, against vLLM's rounding and an fp64 product, at
    small shapes and at the down projections of Ouro-1.4B (2,048 x 5,632) and Huginn-0125 (5,280 x
    17,920) at the lane calls' 1-16 rows, in both configurations (the CPU test runs it interpreted)."""
    from test_lane_kernels import compare_swiglu_down

    compare_swiglu_down("cuda", dtype, shapes=((1, 40, 72), (4, 24, 300), (16, 33, 200), (1, 2048, 5632),
                                               (4, 2048, 5632), (16, 2048, 5632), (4, 5280, 17920)))
