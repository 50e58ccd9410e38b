"""LoopSpec inside the real vLLM engine (CPU), against LoopSpec off and the reference.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the tests read the scheduler's
free KV blocks, the runner's lane census, and plug a broken verifier into the engine's own path.

* greedy: 16 requests of different prompt and output lengths, arriving while others decode, some
  sharing a prompt prefix; LoopSpec on == LoopSpec off == the reference, token for token, for tiny
  Ouro (R=4: 1 and 1:2) and tiny Raven (R=8: 2:4; R=32: 2:8 and 4:8), random and agreement-controlled,
  with prefix caching, with it off, and with chunked prefill forced;
* sampling (temperature 1 with top-k 3, and with top-p 0.7): the distribution of whole sequences
  matches LoopSpec-off sampling and the exact distribution; a broken verifier fails the same tests;
* aborts and a KV cache small enough to preempt: the others' outputs are unchanged, every KV block
  and lane slot comes back;
* requests the lanes cannot serve (logprobs, penalties, min_tokens, ...) decode on vLLM's path in
  the same engine, next to lane requests, with the outputs vanilla vLLM gives.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from vllm_loop.testing.engines import (
    MIXED_PROMPTS,
    free_kv_blocks,
    generate_mixed,
    greedy_jobs,
    lane_census,
    mixed_batch,
    run_jobs,
    runner_totals,
    start_llm,
    stop_llm,
    worker_functions,
)

ALPHA = 1e-3
KV_BYTES = 2**28


@pytest.fixture(scope="module", autouse=True)
def _in_process_engines():
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with worker_functions():  # collective_rpc with our functions (lane census, counters)
        yield
    if saved is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def _engine(path, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", KV_BYTES)
    kw.setdefault("disable_log_stats", False)
    if spec is not None:
        kw["speculative_config"] = spec
    return start_llm(path, **kw)


def _metric(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


# -- greedy: LoopSpec on == LoopSpec off == the reference -------------------------------------------------------
CHECKPOINTS = {  # name -> (family, options, config overrides)
    "ouro": ("ouro", {}, {}),
    "ouro-agree": ("ouro", {"agreement": "0.005"}, {}),
    "raven-llama-R8": ("huginn_raven", {"layout": "llama", "state_init": "seeded"}, {"mean_recurrence": 8}),
    "raven-olmo2-R32": ("huginn_raven", {"layout": "olmo2", "state_init": "seeded", "agreement": "0.5"},
                        {"mean_recurrence": 32}),
    "huginn-R32": ("huginn_raven", {"layout": "huginn", "state_init": "seeded"}, {"mean_recurrence": 32}),
}
# (checkpoint, speculative config, engine options)
GREEDY_CASES = {
    "ouro-1": ("ouro", {"method": "loopspec", "lanes": "on", "d1": 1}, {}),
    "ouro-1:2": ("ouro", {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2}, {}),
    "ouro-agree-1:2": ("ouro-agree", {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2}, {}),
    # each recurrent step decided before the next is enqueued (the overlap's way round, and sampling's)
    "ouro-agree-1:2-no-overlap": ("ouro-agree", {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2,
                                                 "lane_overlap": "off"}, {}),
    # drafts = the lane chain alone (step_tokens 0; by default padded to 16)
    "ouro-agree-1:2-chain": ("ouro-agree", {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2,
                                            "step_tokens": 0}, {}),
    # 32 drafts a step: while no request waits to join, a lane step goes on to 32 recurrent steps (16 else)
    "ouro-agree-1:2-step32": ("ouro-agree", {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2,
                                             "step_tokens": 32}, {}),
    "ouro-1:2-chunked": ("ouro", {"method": "loopspec", "lanes": "on"}, {"max_num_batched_tokens": 16}),
    "raven-R8-2:4": ("raven-llama-R8", {"method": "loopspec", "lanes": "on", "d1": 2, "d2": 4}, {}),
    "raven-R8-2:4-no-prefix-cache": ("raven-llama-R8", {"method": "loopspec", "lanes": "on", "d1": 2, "d2": 4},
                                     {"enable_prefix_caching": False}),
    "raven-R32-2:8": ("raven-olmo2-R32", {"method": "loopspec", "lanes": "on", "d1": 2, "d2": 8}, {}),
    "raven-R32-4:8-chunked": ("raven-olmo2-R32", {"method": "loopspec", "lanes": "on", "d1": 4, "d2": 8},
                              {"max_num_batched_tokens": 16}),
    "huginn-R32-2:8": ("huginn-R32", {"method": "loopspec", "lanes": "on", "d1": 2, "d2": 8}, {}),
    # a lane every recurrent step: prelude, core and coda rows in every lane call (the tuner's pick for
    # the Huginn-0125 shape at agreement 0.001, benchmarks/results/huginn-0125-tune.txt)
    "huginn-R32-1:5": ("huginn-R32", {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 5}, {}),
    # greedy late re-proposals at depths 8 and 16 (schedule.py): their siblings, verified and committed
    "huginn-R32-1:5-late": ("huginn-R32", {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 5, "late": [8, 16]}, {}),
    # lane calls padded to the CUDA-graph shapes (on the CPU run eagerly; captured on the GPU: test_gpu.py)
    "ouro-agree-1:2-padded": ("ouro-agree", {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2,
                                             "lane_graphs": "on"}, {}),
    "raven-R8-2:4-padded": ("raven-llama-R8", {"method": "loopspec", "lanes": "on", "d1": 2, "d2": 4,
                                               "lane_graphs": "on"}, {}),
}
ENGINE = dict(block_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def greedy_reference(ckpt_factory):
    """Per checkpoint: its path, and LoopSpec-off outputs of the jobs (one vanilla engine each)."""
    cache = {}

    def get(name):
        if name not in cache:
            family, options, overrides = CHECKPOINTS[name]
            path = ckpt_factory(family, options=options, **overrides)
            llm = _engine(path, **ENGINE)
            try:
                cache[name] = (path, run_jobs(llm, greedy_jobs()))
            finally:
                stop_llm(llm)
        return cache[name]

    return get


@pytest.mark.engine
@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_loopspec_equals_vanilla_under_continuous_batching(case, greedy_reference):
    from vllm_loop.reference import load_reference

    name, spec, options = GREEDY_CASES[case]
    path, vanilla = greedy_reference(name)
    llm = _engine(path, spec, **ENGINE, **options)
    try:
        free_before = free_kv_blocks(llm)
        got = run_jobs(llm, greedy_jobs())
        totals = runner_totals(llm)
        if spec.get("step_tokens", 16) > 16:
            got["lone"], lone_steps, lone_gaps = _lone_request(llm)
        hits = _metric(llm, "vllm:prefix_cache_hits")
        assert free_kv_blocks(llm) == free_before
        census = llm.collective_rpc(lane_census)[0]
        # vllm_patches.graphs.install_loopspec_decode_graphs: 1-token decode steps count as uniform
        assert llm.collective_rpc(lambda w: w.model_runner.uniform_decode_query_len)[0] == 1
        # lane_attention "auto" without CUDA: the PyTorch lane attention (the kernel is CUDA's default)
        assert llm.collective_rpc(lambda w: w.model_runner.drafter.attention_mode)[0] == spec.get(
            "lane_attention", "torch")
        # Raven: every depth maps to a coda bank set, the padding rows' depth 0 too (the Triton lane kernel
        # looks bank_ids[depth] up unchecked; -1 read out of bounds on the H200)
        coda = llm.collective_rpc(lambda w: getattr(getattr(w.model_runner.model, "transformer", None), "coda_index",
                                                    None))[0]
        assert (coda is None) == (CHECKPOINTS[name][0] == "ouro") and (coda is None or int(coda.min()) >= 0), coda
    finally:
        stop_llm(llm)
    ref = load_reference(path)
    for job in greedy_jobs():
        assert got[job.request_id] == vanilla[job.request_id], f"{case}: {job.request_id} LoopSpec on != off"
        want = ref.greedy_generate(job.prompt, job.params.max_tokens)
        assert got[job.request_id] == want, f"{case}: {job.request_id} != reference"
    if "lone" in got:  # alone, nothing waits: lane steps of more than 16 recurrent steps
        assert got["lone"] == ref.greedy_generate(LONE_PROMPT, LONE_TOKENS)
        assert lone_steps > 16, lone_steps
        # after its prefill (vLLM's step) every engine step was a lane step: one gap between each two
        lane_steps, gaps, gap_seconds = lone_gaps
        assert lane_steps > 1 and gaps == lane_steps - 1 and gap_seconds > 0, lone_gaps
    # the lanes did the decoding, and requests joined while others were decoding
    assert totals["lane_steps"] > 0 and totals["first"] + totals["second"] + totals["late"] + totals["full"] > 100
    assert totals["standard_steps"] > 0, "no prefill joined running lane requests"
    # a request's first lane step after its prefill finds its lanes fresh (a warm-up row for the policy)
    assert totals["warmup_rows"] > 0
    assert census["lanes"] == 0 and census["free_slots"] == census["slots"]
    # overlap (greedy: on unless "off"): the restarts of these checkpoints' rejections start a step late
    if spec.get("lane_overlap") == "off":
        assert totals["overlap_lagged"] == totals["overlap_wasted"] == 0
    else:
        assert totals["overlap_lagged"] > 0 and totals["overlap_wasted"] > 0, totals
    if spec.get("d2") and "agree" not in case:
        assert totals["second_verified"] > 0
    assert (totals["late"] > 0) if spec.get("late") else (totals["late_verified"] == 0), totals
    if options.get("enable_prefix_caching", True):
        assert hits > 0, "the shared prefixes must hit the prefix cache"


LONE_PROMPT, LONE_TOKENS = [11, 12, 13, 14, 15, 16, 17, 18], 100


def _lone_request(llm) -> tuple[list[int], float, tuple[int, int, float]]:
    """One request alone in the engine: its greedy tokens, its recurrent steps per lane step, and its
    (lane steps, gaps between consecutive lane steps, seconds in those gaps)."""
    from vllm import SamplingParams

    before = runner_totals(llm)
    out = llm.generate([{"prompt_token_ids": LONE_PROMPT}], SamplingParams(max_tokens=LONE_TOKENS, temperature=0.0,
                                                                           ignore_eos=True), use_tqdm=False)
    after = runner_totals(llm)
    d = {k: after[k] - before[k] for k in ("recurrent_steps", "lane_steps", "lane_step_gaps", "lane_step_gap_seconds")}
    gaps = (d["lane_steps"], d["lane_step_gaps"], d["lane_step_gap_seconds"])
    return list(out[0].outputs[0].token_ids), d["recurrent_steps"] / d["lane_steps"], gaps


# -- lanes "auto": the policy switches whole engine steps between lanes and plain decoding -------------------------
@pytest.mark.engine
@pytest.mark.parametrize("slow", ["lanes", "plain"])
def test_auto_lanes_stay_exact_and_pick_the_faster_mode(slow, greedy_reference, monkeypatch):
    """``lanes: auto`` (the default): per batch-size bucket the scheduler tries lanes and plain decoding,
    then runs the faster. One mode is made slow here (30 ms more per recurrent step of the lanes, or
    60 ms more per plain step; a lane step commits several tokens, so a delay per engine step would
    be amortised): the policy must run the
    other for almost every step, and the switching (lanes dropped, restarted after a plain step) must
    keep every token equal to vanilla's and give back every KV block and lane."""
    import functools
    import time

    from vllm_loop.loopspec import policy, runner

    monkeypatch.setattr(policy.LanePolicy, "__init__",
                        functools.partialmethod(policy.LanePolicy.__init__, trial=2, recheck=10**6))
    if slow == "lanes":
        original = runner.LoopSpecRunner._recurrent_step

        def slowed(self, *args):
            time.sleep(0.03)
            return original(self, *args)

        monkeypatch.setattr(runner.LoopSpecRunner, "_recurrent_step", slowed)
    else:
        original = runner.LoopSpecRunner.after_standard_step

        def slowed(self, run, so, output):
            if not runner._lanes_on(so):
                time.sleep(0.06)
            return original(self, run, so, output)

        monkeypatch.setattr(runner.LoopSpecRunner, "after_standard_step", slowed)
    path, vanilla = greedy_reference("ouro-agree")
    llm = _engine(path, {"method": "loopspec", "d1": 1, "d2": 2}, **ENGINE)
    try:
        free_before = free_kv_blocks(llm)
        got = run_jobs(llm, greedy_jobs())
        totals = runner_totals(llm)
        assert free_kv_blocks(llm) == free_before
        census = llm.collective_rpc(lane_census)[0]
    finally:
        stop_llm(llm)
    assert got == vanilla
    assert census["lanes"] == 0 and census["free_slots"] == census["slots"]
    lane, plain = totals["lane_steps"], totals["plain_steps"]
    print(f"slow {slow}: {lane} lane steps, {plain} plain steps")
    assert lane > 0 and plain > 0, totals  # both were tried
    # five buckets (1, 2, 4, 8, 16 requests) x 2 trial steps of the slow mode, plus switches
    if slow == "lanes":
        assert lane <= 12 and plain > 3 * lane, totals
    else:
        assert plain <= 20 and lane > plain, totals


# -- sampling: the distribution through the engine --------------------------------------------------------------
PROMPT = [3, 14, 15]
N_TOKENS = 3
SAMPLING_CASES = {  # name -> (lane sampling params as dict, samples)
    "top-k": (dict(temperature=1.0, top_k=3), 1280),
    "top-p": (dict(temperature=1.0, top_p=0.7), 1280),
}


@pytest.fixture(scope="module")
def sampling_baseline(ckpt_factory):
    """The checkpoint, the exact distributions, and vanilla vLLM's own samples."""
    from vllm_loop.loopspec.proposals import SamplingParams as LaneParams
    from vllm_loop.reference import load_reference
    from vllm_loop.testing.distribution import exact_tree

    path = ckpt_factory("ouro", options={"agreement": "0.1"})
    ref = load_reference(path)
    exact = {name: exact_tree(ref, PROMPT, LaneParams(**p), N_TOKENS)[0] for name, (p, _) in SAMPLING_CASES.items()}
    for name, dist in exact.items():
        assert 5 <= len(dist) <= 200, f"{name}: {len(dist)} sequences: the test needs a small support"
    vanilla = _engine(path, max_num_seqs=64)
    try:
        ordinary = {name: _samples(vanilla, p, n, seed0=10**6) for name, (p, n) in SAMPLING_CASES.items()}
    finally:
        stop_llm(vanilla)
    return {"path": path, "ref": ref, "exact": exact, "ordinary": ordinary}


@pytest.fixture(scope="module", params=["coupled", "cascade"])
def sampling_setup(request, sampling_baseline):
    """A LoopSpec engine (lanes on) of each sampling mode (``sampling``: coupled noise, the cascade)."""
    llm = _engine(sampling_baseline["path"], {"method": "loopspec", "lanes": "on", "d1": 1, "d2": 2,
                                              "sampling": request.param}, max_num_seqs=64)
    yield sampling_baseline | {"llm": llm, "mode": request.param}
    stop_llm(llm)


def _samples(llm, params: dict, n: int, seed0: int = 0) -> Counter:
    """``n`` seeded samples of the first tokens, in waves of 64 (a wave's decode steps are lane steps)."""
    from vllm import SamplingParams

    counts = Counter()
    for w in range(0, n, 64):
        sps = [SamplingParams(max_tokens=N_TOKENS, seed=seed0 + i, ignore_eos=True, **params) for i in range(w, w + 64)]
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(sps), sps, use_tqdm=False)
        counts.update(tuple(o.outputs[0].token_ids) for o in outs)
    return counts


@pytest.mark.engine
@pytest.mark.parametrize("name", list(SAMPLING_CASES))
def test_sampling_distribution_matches_vanilla(sampling_setup, name):
    from vllm_loop.testing.distribution import chi2_gof, chi2_two_sample

    llm, exact, ordinary = sampling_setup["llm"], sampling_setup["exact"][name], sampling_setup["ordinary"][name]
    params, n = SAMPLING_CASES[name]
    before = runner_totals(llm)
    counts = _samples(llm, params, n)
    after = runner_totals(llm)
    assert chi2_gof(ordinary, exact, n) > ALPHA  # vLLM's own sampling, the baseline
    assert chi2_gof(counts, exact, n) > ALPHA
    assert chi2_two_sample(counts, ordinary) > ALPHA
    for source in ("first", "second", "full"):  # every branch of the cascade ran in the engine
        assert after[source] > before[source], source


@pytest.mark.engine
def test_broken_verifier_fails_the_same_test(sampling_setup, monkeypatch):
    """Mutation: accepting the first proposal without the test (the cascade's ratio test; coupled: the
    comparison with the target's noisy argmax) samples tokens 2..3 from p_d1."""
    import vllm_loop.loopspec.pipeline as pipeline_mod
    from vllm_loop.loopspec.verify import CommitSource, Verdict
    from vllm_loop.testing.distribution import chi2_gof, chi2_two_sample

    if sampling_setup["mode"] == "cascade":
        def accept_always(p, first, second=None, rng=None):
            return Verdict(first.token, CommitSource.FIRST)

        monkeypatch.setattr(pipeline_mod, "cascade_verify", accept_always)
    else:
        def accept_always(target, first, second=None, late=()):
            return Verdict(first, CommitSource.FIRST)

        monkeypatch.setattr(pipeline_mod, "cascade_verify_greedy", accept_always)
    params, n = SAMPLING_CASES["top-k"]
    counts = _samples(sampling_setup["llm"], params, n, seed0=5000)
    assert chi2_two_sample(counts, sampling_setup["ordinary"]["top-k"]) < ALPHA
    exact = sampling_setup["exact"]["top-k"]
    assert set(counts) - set(exact) or chi2_gof(counts, exact, n) < ALPHA


COUPLED_KINDS = [dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.7), dict(temperature=0.7, top_p=0.95),
                 dict(temperature=1.3), dict(temperature=0.0)]


def _coupled_reference(ref, prompt: list[int], params: dict, seed: int, n: int) -> list[int]:
    """The reference's decoding of ``prompt`` with the coupled sampler of ``seed`` (float32, as the engine)."""
    import torch

    from vllm_loop.loopspec.executor import GenerationRequest, coupled_generate
    from vllm_loop.loopspec.proposals import SamplingParams as LaneParams

    return coupled_generate(ref, GenerationRequest(prompt, n, sampling=LaneParams(**params)), seed, dtype=torch.float32)


def _coupled_batch(llm, prompts, params, seeds, n: int = 16) -> list[list[int]]:
    from vllm import SamplingParams

    sps = [SamplingParams(max_tokens=n, seed=s, ignore_eos=True, **p) for p, s in zip(params, seeds)]
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sps,
                                                                 use_tqdm=False)]


@pytest.mark.engine
@pytest.mark.parametrize("sampling_setup", ["coupled"], indirect=True)
def test_coupled_sampling_equals_coupled_decoding_of_the_reference(sampling_setup):
    """Coupled mode (lanes on), seeded requests of mixed temperatures and filters in one batch, greedy
    ones beside them: every token -- the prefill's (vLLM's sampler), the lanes' -- equals the
    reference decoding with the same noise (``executor.coupled_generate``), token for token; the same
    seed gives the same text twice."""
    llm, ref = sampling_setup["llm"], sampling_setup["ref"]
    prompts = [[3 + i, 14, 15, 9 + 2 * i] for i in range(10)]
    params = [COUPLED_KINDS[i % len(COUPLED_KINDS)] for i in range(len(prompts))]
    seeds = [70 + i for i in range(len(prompts))]
    before = runner_totals(llm)
    outs = _coupled_batch(llm, prompts, params, seeds)
    assert runner_totals(llm)["lane_steps"] > before["lane_steps"]
    assert _coupled_batch(llm, prompts, params, seeds) == outs
    for prompt, p, seed, got in zip(prompts, params, seeds, outs):
        assert got == _coupled_reference(ref, prompt, p, seed, 16), (seed, p)


@pytest.mark.engine
def test_seeded_text_does_not_depend_on_load_or_the_lanes_policy(sampling_baseline, monkeypatch):
    """A seeded request gives the same text alone and while 24 other requests decode, whatever the
    lanes policy chooses step by step (here a fixed pattern of lane and plain steps, so both paths
    serve it, and requests joining mid-way add steps of vLLM's forward that verify lane chains):
    every text equals the reference's coupled decoding of its seed."""
    from vllm_loop.loopspec.policy import PATTERN_ENV
    from vllm_loop.testing.engines import Job, run_jobs

    from vllm import SamplingParams

    monkeypatch.setenv(PATTERN_ENV, "LLPLP")  # read by the scheduler at engine start (in this process)
    ref = sampling_baseline["ref"]
    llm = _engine(sampling_baseline["path"], {"method": "loopspec", "lanes": "auto", "d1": 1, "d2": 2},
                  max_num_seqs=32)
    probe = ([5, 17, 99, 3], dict(temperature=0.8, top_p=0.9), 7)
    others = [([11 + i, 4, 9 + i], COUPLED_KINDS[i % len(COUPLED_KINDS)], 200 + i) for i in range(24)]
    try:
        alone = _coupled_batch(llm, [probe[0]], [probe[1]], [probe[2]], 20)[0]
        jobs = [Job(f"o{i}", p, SamplingParams(max_tokens=20, seed=s, ignore_eos=True, **k), at=i % 6)
                for i, (p, k, s) in enumerate(others)]
        jobs.append(Job("probe", probe[0], SamplingParams(max_tokens=20, seed=probe[2], ignore_eos=True, **probe[1]),
                        at=3))
        loaded = run_jobs(llm, jobs)
        totals = runner_totals(llm)
    finally:
        stop_llm(llm)
    assert totals["lane_steps"] > 0 and totals["plain_steps"] > 0 and totals["standard_steps"] > 0, totals
    want = _coupled_reference(ref, probe[0], probe[1], probe[2], 20)
    assert alone == want and loaded["probe"] == want
    for i, (prompt, kind, seed) in enumerate(others):
        assert loaded[f"o{i}"] == _coupled_reference(ref, prompt, kind, seed, 20), (i, kind)


def _cpu_attention_isas(worker) -> list[str]:
    """The ISA of every attention layer's implementation and metadata builder (vLLM's CPU backend)."""
    runner = worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context.values()
    builders = [b for groups in runner.attn_groups for g in groups for b in g.metadata_builders]
    return sorted({layer.impl.isa for layer in layers if hasattr(getattr(layer, "impl", None), "isa")} |
                  {b.isa for b in builders if hasattr(b, "isa")})


@pytest.mark.engine
def test_loopspec_reads_the_cpu_kv_layout_of_bf16_engines(ckpt_factory):
    """bf16 with a block size that is a multiple of 32: on a CPU with AMX tiles vLLM's CPU attention
    stores K in AMX tiles, which the lanes cannot read in place (the first decode step failed); a
    LoopSpec engine gets vLLM's "vec" layout instead (``vllm_patches.loopspec.install_cpu_loopspec_kv_layout``)
    and decodes with its lanes, every request to its length, nothing left behind. (Its bf16 tokens
    are not compared: vanilla's AMX kernels round differently.)"""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    path = ckpt_factory("huginn_raven", options={"layout": "llama", "state_init": "seeded", "agreement": "0.5"},
                        mean_recurrence=8)
    llm = _engine(path, {"method": "loopspec", "lanes": "on", "d1": 2, "d2": 4}, dtype="bfloat16", block_size=32,
                  max_model_len=128)
    jobs = greedy_jobs(n=8)
    try:
        free_before = free_kv_blocks(llm)
        got = run_jobs(llm, jobs)
        isas = llm.collective_rpc(_cpu_attention_isas)[0]
        totals = runner_totals(llm)
        census = llm.collective_rpc(lane_census)[0]
        assert free_kv_blocks(llm) == free_before
    finally:
        stop_llm(llm)
    vllms = _get_attn_isa(torch.bfloat16, 32, 32)  # what vLLM picks on this CPU ("amx" where it has AMX)
    print(f"vLLM's CPU attention ISA here: {vllms}; the LoopSpec engine's: {isas}")
    assert isas == (["vec"] if vllms == "amx" else [vllms])
    assert all(len(got[j.request_id]) == j.params.max_tokens for j in jobs)
    assert totals["lane_steps"] > 0 and totals["first"] + totals["second"] + totals["full"] > 50, totals
    assert census["lanes"] == 0 and census["free_slots"] == census["slots"]


# -- aborts, preemption, leaks ----------------------------------------------------------------------------------
@pytest.mark.engine
def test_aborts_and_preemption_leave_nothing_behind(ckpt_factory):
    from vllm_loop.reference import load_reference

    path = ckpt_factory("huginn_raven", options={"layout": "llama", "state_init": "seeded"}, mean_recurrence=8)
    llm = _engine(path, {"method": "loopspec", "lanes": "on", "d1": 2, "d2": 4}, block_size=16, max_model_len=128,
                  num_gpu_blocks_override=12)
    jobs = greedy_jobs(seed=3, aborts=4)
    try:
        free_before = free_kv_blocks(llm)
        preempted_before = _metric(llm, "vllm:num_preemptions")
        got = run_jobs(llm, jobs)
        assert _metric(llm, "vllm:num_preemptions") > preempted_before, "the small KV cache must force preemption"
        assert free_kv_blocks(llm) == free_before
        census = llm.collective_rpc(lane_census)[0]
        assert census["lanes"] == 0 and census["free_slots"] == census["slots"]
    finally:
        stop_llm(llm)
    ref = load_reference(path)
    aborted = [j for j in jobs if j.abort_at is not None]
    assert any(len(got[j.request_id]) < j.params.max_tokens for j in aborted), "no abort hit a running request"
    for job in jobs:
        want = ref.greedy_generate(job.prompt, job.params.max_tokens)
        if job.abort_at is None:
            assert got[job.request_id] == want, job.request_id
        else:
            assert got[job.request_id] == want[: len(got[job.request_id])], job.request_id


@pytest.mark.engine
def test_every_lane_budget_is_lossless_and_switching_leaks_nothing(ckpt_factory, monkeypatch):
    """The lanes policy's lane budgets (``policy.lane_options``: full, first proposals only, a small cap),
    switched from one step to the next by a fixed pattern, with plain steps between: greedy requests
    arriving and aborted mid-way equal the reference, every budget ran, and every lane slot and KV
    block comes back."""
    from vllm_loop.loopspec.policy import PATTERN_ENV
    from vllm_loop.reference import load_reference

    monkeypatch.setenv(PATTERN_ENV, "0120P21")
    path = ckpt_factory("huginn_raven", options={"layout": "llama", "state_init": "seeded", "agreement": "0.5"},
                        mean_recurrence=8)
    llm = _engine(path, {"method": "loopspec", "lanes": "auto", "d1": 2, "d2": 4}, block_size=16, max_model_len=128)
    jobs = greedy_jobs(seed=5, aborts=3)
    try:
        free_before = free_kv_blocks(llm)
        got = run_jobs(llm, jobs)
        census = llm.collective_rpc(lane_census)[0]
        totals = runner_totals(llm)
        free_after = free_kv_blocks(llm)
    finally:
        stop_llm(llm)
    from vllm_loop.loopspec.stat_logger import engine_totals

    steps = engine_totals().option_steps
    assert set(steps) == {"full", "first", "cap2"} and min(steps.values()) > 0, steps
    assert totals["lane_steps"] > 0 and totals["plain_steps"] > 0
    assert census["lanes"] == 0 and census["free_slots"] == census["slots"] and free_after == free_before
    ref = load_reference(path)
    for job in jobs:
        want = ref.greedy_generate(job.prompt, job.params.max_tokens)
        assert got[job.request_id] == (want if job.abort_at is None else want[: len(got[job.request_id])]), job.request_id


# -- requests the lanes do not serve ---------------------------------------------------------------------------
def _warm_rejection_sampler_here(worker) -> int:
    """Run the warm-up's rejection-sampler calls in this (CPU) worker; -> how many calls returned tokens."""
    from vllm_loop.vllm_patches.warmup import _warm_rejection_sampler

    sampler, calls = worker.model_runner.rejection_sampler, []
    forward = sampler.forward
    sampler.forward = lambda *a, **k: calls.append(forward(*a, **k).sampled_token_ids.shape[0]) or None
    try:
        _warm_rejection_sampler(worker.model_runner, 16, cuda_only=False)
    finally:
        del sampler.forward
    return len(calls)


@pytest.mark.engine
def test_requests_lanes_cannot_serve_decode_on_vllms_path(ckpt_factory):
    from vllm import SamplingParams

    path = ckpt_factory("ouro", options={"agreement": "0.005"})
    prompts, plain = MIXED_PROMPTS, mixed_batch()[-1][1]
    vanilla = _engine(path)
    try:
        want = generate_mixed(vanilla)
    finally:
        stop_llm(vanilla)
    llm = _engine(path, {"method": "loopspec", "lanes": "on"})
    try:
        got = generate_mixed(llm)
        # vLLM itself refuses these with any speculative decoding, before the engine sees them
        for bad in (dict(min_p=0.1), dict(logit_bias={7: 5.0})):
            with pytest.raises(ValueError, match="min_p and logit_bias"):
                llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, **bad), use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
        totals = runner_totals(llm)
        # the start-up warm-up's rejection-sampler calls (CUDA only at start-up) are calls vLLM's own rejection
        # sampler takes: every kind runs here on its CPU kernels, and the engine serves on afterwards
        assert llm.collective_rpc(_warm_rejection_sampler_here)[0] == 36
        after = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    finally:
        stop_llm(llm)
    assert got == want
    assert [(list(o.outputs[0].token_ids), False) for o in again] == want[-len(prompts):]
    assert [(list(o.outputs[0].token_ids), False) for o in after] == want[-len(prompts):]
    assert totals["lane_steps"] > 0
