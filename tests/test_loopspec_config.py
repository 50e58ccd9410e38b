"""The LoopSpec front door: ``speculative_config={"method": "loopspec", ...}`` on vLLM's own config path.

Every check runs vLLM's ``EngineArgs.create_engine_config`` (what ``LLM(...)`` and ``vllm serve`` do
in the front end, before any engine process starts): good configs become vLLM's ``custom_class``
method with our knobs in ``additional_config``; bad ones fail there with a message naming the key
and the rule.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_loop.loopspec.config import build_schedule, default_depths, flag


def _config(path: str, spec, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=path, speculative_config=spec, dtype="float32", max_model_len=256,
                      **({"enforce_eager": True} | kw))
    return args.create_engine_config()


@pytest.mark.parametrize(
    "family, R, expected",
    [("ouro", 4, (1, 2)), ("raven", 32, (2, 8)), ("raven", 8, (1, 2)), ("raven", 16, (1, 4)), ("raven", 64, (4, 16)),
     ("raven", 3, (1, 2)), ("raven", 2, (1, None)), ("ouro", 2, (1, None))],
)
def test_family_defaults(family, R, expected):
    assert default_depths(family, R) == expected
    schedule, max_lanes = build_schedule({"method": "loopspec"}, family, R)  # always a valid schedule
    assert (schedule.d1, schedule.d2) == expected and 1 <= max_lanes <= 64


def test_flag_is_what_vllm_serve_takes():
    assert flag(2, 8) == """--speculative-config '{"method": "loopspec", "d1": 2, "d2": 8}'"""
    assert flag(1, None, gate=False) == """--speculative-config '{"method": "loopspec", "d1": 1, "gate": false}'"""
    assert flag(1, 5, late=(8, 16)) == """--speculative-config '{"method": "loopspec", "d1": 1, "d2": 5, "late": [8, 16]}'"""


def test_ouro_translates_to_vllm_custom_class(ckpt_factory):
    cfg = _config(ckpt_factory("ouro"), {"method": "loopspec"})
    spec = cfg.speculative_config
    assert spec.method == "custom_class" and spec.model == "vllm_loop.loopspec.runner.LoopSpecRunner"
    assert spec.num_speculative_tokens == 16  # max(ceil(R / d1), step_tokens 16)
    assert cfg.additional_config["loopspec"] == {"R": 4, "d1": 1, "d2": 2, "gate": True, "late": [], "max_lanes": 7,
                                                  "lanes": "auto", "lane_graphs": "auto",
                                                  "lane_attention": "auto", "lane_overlap": "auto", "step_tokens": 16,
                                                  "sampling": "auto",
                                                  "async": "auto"}
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.scheduler_config.scheduler_cls == "vllm_loop.loopspec.scheduler.LoopSpecScheduler"


def test_knobs_read_back_what_translate_wrote(ckpt_factory):
    """``config.knobs`` is the one typed view of ``additional_config["loopspec"]``: every key
    ``translate`` writes comes back as a field, and a key missing from the dict (an older or partial
    config) gets translate's own default, not one of each consumer's."""
    import dataclasses

    from vllm_loop.loopspec.config import STEP_TOKENS, Knobs, knobs

    cfg = _config(ckpt_factory("ouro"), {"method": "loopspec", "d1": 1, "d2": 2, "step_tokens": 0,
                                         "sampling": "cascade", "lanes": "on"})
    k = knobs(cfg)
    raw = cfg.additional_config["loopspec"]
    names = {f.name for f in dataclasses.fields(Knobs)}
    assert set(raw) - {"async"} <= names and "async_scheduling" in names
    assert (k.R, k.d1, k.d2, k.step_tokens, k.sampling, k.lanes) == (4, 1, 2, 0, "cascade", "on")
    assert not k.coupled and k.schedule.readout_depths == (1, 2, 4)
    assert k.async_scheduling == raw["async"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.lanes = "auto"
    partial = Knobs.of({"R": 4})
    assert (partial.step_tokens, partial.lanes, partial.sampling) == (STEP_TOKENS, "auto", "auto")


def test_raven_schedule_follows_the_deployed_loop_count(ckpt_factory):
    path = ckpt_factory("huginn_raven", options={"layout": "llama", "state_init": "seeded"})
    cfg = _config(path, {"method": "loopspec", "d1": 2, "d2": 8, "gate": False},
                  hf_overrides={"mean_recurrence": 32})
    assert cfg.additional_config["loopspec"] == {"R": 32, "d1": 2, "d2": 8, "gate": False, "late": [], "max_lanes": 64,
                                                  "lanes": "auto", "lane_graphs": "auto",
                                                  "lane_attention": "auto", "lane_overlap": "auto", "step_tokens": 16,
                                                  "sampling": "auto",
                                                  "async": "auto"}
    assert cfg.speculative_config.num_speculative_tokens == 16


def test_step_tokens_sets_the_drafts_a_step_schedules(ckpt_factory):
    ouro = ckpt_factory("ouro")  # ceil(R / d1) = 4
    assert _config(ouro, {"method": "loopspec", "step_tokens": 0}).speculative_config.num_speculative_tokens == 4
    assert _config(ouro, {"method": "loopspec", "step_tokens": 32}).speculative_config.num_speculative_tokens == 32
    assert _config(ouro, {"method": "loopspec", "step_tokens": 2}).speculative_config.num_speculative_tokens == 4


def test_lockstep_goes_to_step_tokens_only_while_no_request_waits(ckpt_factory):
    """Once every request of a lane step has committed, the step goes on in lockstep: up to
    max(R, 16) recurrent steps while requests wait to join, up to max(R, 16, step_tokens) while none
    does (as the scheduler saw it)."""
    from types import SimpleNamespace

    from vllm_loop.loopspec.pipeline import RequestPipeline
    from vllm_loop.loopspec.runner import LoopSpecRunner, _Live, _Row
    from vllm_loop.loopspec.scheduler import LoopSpecScheduler

    runner = LoopSpecRunner(_config(ckpt_factory("ouro"), {"method": "loopspec", "step_tokens": 32}))
    pipe = RequestPipeline(runner.schedule)
    pipe.start(token=5, position=3)
    row = _Row(_Live("r", pipe), index=0, cap=33, state=None, tokens=[7])  # committed once, room for 32 more

    def steps_taken(waiting: bool) -> int:
        runner._waiting = waiting
        return next(steps for steps in range(100) if not runner._more_steps([row], steps))

    assert (steps_taken(True), steps_taken(False)) == (16, 32)
    # until every request has committed once, whatever the bound
    assert runner._more_steps([row, _Row(_Live("s", pipe), 1, 33, None)], 99)
    # the default step_tokens (16): the same bound either way, as before it depended on waiting requests
    default = LoopSpecRunner(_config(ckpt_factory("ouro"), {"method": "loopspec"}))
    assert default.lockstep == default.lockstep_joining == 16

    # the scheduler stamps each step with whether requests still wait (waiting, or skipped this step)
    from vllm_loop.loopspec.metrics import EngineCounters
    from vllm_loop.loopspec.policy import LanePolicy

    scheduler = object.__new__(LoopSpecScheduler)
    scheduler._arrivals, scheduler.lane_policy, scheduler.loopspec_totals = 0, LanePolicy("on"), EngineCounters()
    for waiting, skipped, expected in (([], [], False), (["q"], [], True), ([], ["q"], True)):
        scheduler.waiting, scheduler.skipped_waiting = waiting, skipped
        so = SimpleNamespace(total_num_scheduled_tokens=1)
        scheduler._stamp(so, True, 0.0)
        assert so.loopspec_waiting is expected
    # a step without the stamp: requests are assumed to wait (the shorter bound)
    from vllm_loop.loopspec.runner import _requests_waiting

    assert _requests_waiting(SimpleNamespace()) is True


BAD = [
    ({"method": "loopspec", "draft": 2}, "unknown key(s) 'draft'; allowed keys: method, d1, d2, gate, late, max_lanes, "
                                         "lanes, lane_graphs, lane_attention, lane_overlap, step_tokens"),
    ({"method": "loopspec", "d1": 2, "d2": 2}, "d2=2 is invalid: d1 must be < d2"),
    ({"method": "loopspec", "d1": 2, "d2": 3}, "d2=3 is invalid: d2 must be a multiple of d1"),
    ({"method": "loopspec", "d1": 1, "d2": 4}, "d2=4 is invalid: d2 must be < R (R=4)"),
    ({"method": "loopspec", "d1": 4}, "d1=4 is invalid: d1 must be < R"),
    ({"method": "loopspec", "d1": "1"}, "d1='1' is invalid: d1 must be an integer"),
    ({"method": "loopspec", "d1": 1.5}, "d1=1.5 is invalid: d1 must be an integer"),
    ({"method": "loopspec", "d1": 1, "d2": True}, "d2=True is invalid: d2 must be an integer"),
    ({"method": "loopspec", "d2": 2}, "d2 needs d1"),
    ({"method": "loopspec", "gate": "yes"}, "gate='yes' is invalid: gate must be true or false"),
    ({"method": "loopspec", "max_lanes": 0}, "max_lanes=0 is invalid: max_lanes must be >= 1"),
    ({"method": "loopspec", "d1": 1, "d2": 2, "late": 3}, "late=3 is invalid: late must be a list of depths"),
    ({"method": "loopspec", "d1": 1, "d2": 2, "late": [2]},
     "late=[2] is invalid: each late depth must be > d2=2 and < R=4"),
    ({"method": "loopspec", "d1": 1, "d2": 2, "late": [4]},
     "late=[4] is invalid: each late depth must be > d2=2 and < R=4"),
    ({"method": "loopspec", "d1": 1, "d2": 2, "late": ["3"]}, "late='3' is invalid: late must be an integer"),
    ({"method": "loopspec", "lanes": "off"}, "lanes='off' is invalid; allowed values: 'auto', 'on'"),
    ({"method": "loopspec", "lane_graphs": True}, "lane_graphs=True is invalid; allowed values: 'auto', 'on', 'off'"),
    ({"method": "loopspec", "lane_attention": "flash"},
     "lane_attention='flash' is invalid; allowed values: 'auto', 'torch', 'triton'"),
    ({"method": "loopspec", "lane_overlap": "on"}, "lane_overlap='on' is invalid; allowed values: 'auto', 'off'"),
    ({"method": "loopspec", "step_tokens": -1}, "step_tokens=-1 is invalid: allowed 0 (the lane chain alone) to 256"),
    ({"method": "loopspec", "step_tokens": 1000},
     "step_tokens=1000 is invalid: allowed 0 (the lane chain alone) to 256"),
    ({"method": "loopspec", "step_tokens": "16"}, "step_tokens='16' is invalid: step_tokens must be an integer"),
    ({"method": "loopspec", "sampling": "gumbel"},
     "sampling='gumbel' is invalid; allowed values: 'auto', 'coupled', 'cascade'"),
]


@pytest.mark.parametrize("spec, message", BAD, ids=[m.split(" is")[0].split(";")[0][:24] for _, m in BAD])
def test_bad_config_names_the_key_and_the_rule(ckpt_factory, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(ckpt_factory("ouro"), spec)


def test_triton_lane_attention_needs_cuda_at_start_up(ckpt_factory, monkeypatch):
    """Checked when the runner is built (engine start-up), not at the first lane step."""
    from vllm_loop.loopspec.runner import LoopSpecRunner

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = _config(ckpt_factory("ouro"), {"method": "loopspec", "lane_attention": "triton"})
    with pytest.raises(ValueError, match="lane_attention='triton' needs a CUDA device .*allowed on this device: 'torch'"):
        LoopSpecRunner(cfg)


def test_lane_attention_auto_is_the_kernel_on_cuda_only(ckpt_factory):
    from vllm_loop.loopspec.runner import LoopSpecRunner

    runner = LoopSpecRunner(_config(ckpt_factory("ouro"), {"method": "loopspec"}))
    assert runner.attention_mode == "torch" and runner.kernel is None  # this machine has no CUDA


@pytest.mark.parametrize("chosen", [[], ["all"], ["+rms_norm"]])
def test_loopspec_leaves_custom_ops_to_vllm_and_the_user(ckpt_factory, chosen):
    """vLLM's forward in a LoopSpec engine has the custom ops a vanilla engine would get
    (the lane calls take vLLM's CUDA ops themselves, ``lane_graphs.cuda_custom_ops``); what the user
    names in --compilation-config stays as named."""
    path = ckpt_factory("ouro")
    kw = {"compilation_config": {"custom_ops": list(chosen)}}
    loopspec = _config(path, {"method": "loopspec"}, **kw).compilation_config.custom_ops
    assert loopspec == _config(path, None, **kw).compilation_config.custom_ops
    assert set(chosen) <= set(loopspec)


def test_fast_start_compilation_only_where_the_user_chose_nothing():
    """On one CUDA GPU a LoopSpec engine skips torch.compile (vLLM's full graphs kept, for every step); any choice of
    the user's (compile mode, graph mode, -O, --enforce-eager), another device or more GPUs keep vLLM's."""
    from vllm.config import CompilationConfig, CompilationMode
    from vllm.config.compilation import CUDAGraphMode

    from vllm_loop.loopspec.config import fast_start_compilation

    on = dict(enforce_eager=False, optimization_level_set=False, cuda=True, gpus=1)
    assert fast_start_compilation(CompilationConfig(), **on) == {
        "mode": CompilationMode.NONE, "cudagraph_mode": CUDAGraphMode.FULL}
    assert fast_start_compilation(CompilationConfig(custom_ops=["+rms_norm"]), **on) is not None
    assert fast_start_compilation(CompilationConfig(mode=CompilationMode.VLLM_COMPILE), **on) is None
    assert fast_start_compilation(CompilationConfig(cudagraph_mode=CUDAGraphMode.PIECEWISE), **on) is None
    for change in ({"enforce_eager": True}, {"optimization_level_set": True}, {"cuda": False}, {"gpus": 2}):
        assert fast_start_compilation(CompilationConfig(), **(on | change)) is None, change


def test_fast_start_in_the_front_door(ckpt_factory, monkeypatch):
    """The front door writes the fast-start fields into the engine args of a LoopSpec engine on CUDA (as
    if this machine had a GPU), into a copy, not vLLM's default object; on this CPU the engine's
    compilation mode is a vanilla engine's (the CPU path unchanged)."""
    from types import SimpleNamespace as NS

    from vllm.config import CompilationMode
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_loop.vllm_patches import loopspec as vllm_patches

    path = ckpt_factory("ouro")
    args = EngineArgs(model=path)
    before = args.compilation_config
    one_gpu = NS(tensor_parallel_size=1, pipeline_parallel_size=1)
    with monkeypatch.context() as m:
        m.setattr(type(current_platform), "is_cuda", lambda self: True)
        vllm_patches._fast_start(args, one_gpu)
        compiled = EngineArgs(model=path, compilation_config={"mode": 3})
        vllm_patches._fast_start(compiled, one_gpu)
    assert args.compilation_config.mode == CompilationMode.NONE
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.FULL
    assert before.mode is None and before.cudagraph_mode is None
    assert compiled.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert compiled.compilation_config.cudagraph_mode is None
    cpu = dict(enforce_eager=False)
    assert _config(path, {"method": "loopspec"}, **cpu).compilation_config.mode == \
        _config(path, None, **cpu).compilation_config.mode


def test_graph_capture_sizes():
    """Decode-only graphs: a vanilla engine's largest graph unless the user set sizes. Mixed-step
    graphs (FULL): vLLM's 512 unless set, and never one longer than ``max_model_len``."""
    from vllm_loop.loopspec.config import graph_capture_sizes

    decode = dict(mixed=False, max_num_seqs=8, max_model_len=128)
    assert graph_capture_sizes(None, None, **decode) == (None, 16)
    assert graph_capture_sizes(None, None, **(decode | {"max_num_seqs": 1024})) == (None, 512)
    assert graph_capture_sizes([1, 2, 300], None, **decode) == ([1, 2, 300], None)  # the user's, untouched
    assert graph_capture_sizes(None, 64, **decode) == (None, 64)
    mixed = dict(mixed=True, max_num_seqs=8, max_model_len=128)
    assert graph_capture_sizes(None, None, **mixed) == (None, 128)
    assert graph_capture_sizes(None, None, **(mixed | {"max_model_len": 4096})) == (None, 512)
    assert graph_capture_sizes(None, 512, **mixed) == (None, 128)
    assert graph_capture_sizes(None, 64, **mixed) == (None, 64)
    assert graph_capture_sizes([1, 8, 128, 256], None, **mixed) == ([1, 8, 128], None)
    assert graph_capture_sizes([1, 8, 128, 256], 256, **mixed) == ([1, 8, 128], 128)
    assert graph_capture_sizes([256, 512], None, **mixed) == ([128], None)


def test_full_graphs_keep_decode_graphs_apart():
    """Under ``cudagraph_mode`` FULL a LoopSpec engine's dispatcher also holds FULL_DECODE_ONLY's keys and
    sends 1-token decode steps to them; mixed steps keep vLLM's mixed-step graphs; a dispatcher without
    the decode keys (a vanilla engine's) dispatches as vLLM does."""
    from types import SimpleNamespace as NS

    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from vllm_loop.vllm_patches.graphs import add_decode_graph_keys

    def dispatcher():
        cc = CompilationConfig(mode=0, cudagraph_mode="FULL", cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                               max_cudagraph_capture_size=16)
        d = CudagraphDispatcher(NS(compilation_config=cc, num_speculative_tokens=16, lora_config=None,
                                   scheduler_config=NS(max_num_seqs=8)))
        d.uniform_decode_query_len = 1  # a LoopSpec runner's (install_loopspec_decode_graphs)
        d.initialize_cudagraph_keys(CUDAGraphMode.FULL, 1)
        return d

    vanilla, ours = dispatcher(), dispatcher()
    add_decode_graph_keys(ours)
    full = ours.cudagraph_keys[CUDAGraphMode.FULL]
    assert sorted(k.num_tokens for k in full if k.uniform) == [1, 2, 4, 8]  # up to max_num_seqs
    assert sorted(k.num_tokens for k in full if not k.uniform) == [1, 2, 4, 8, 16]
    for d, uniform in ((ours, True), (vanilla, False)):
        mode, desc = d.dispatch(5, uniform_decode=True)
        assert (mode, desc.num_tokens, desc.num_reqs, desc.uniform) == (CUDAGraphMode.FULL, 8, 8, uniform)
        mode, desc = d.dispatch(5, uniform_decode=False)
        assert (mode, desc.num_tokens, desc.uniform) == (CUDAGraphMode.FULL, 8, False)
        assert d.dispatch(17, uniform_decode=False)[0] == CUDAGraphMode.NONE  # past the largest graph
    assert ours.dispatch(5, uniform_decode=True, invalid_modes={CUDAGraphMode.FULL})[0] == CUDAGraphMode.NONE


def test_full_graphs_asked_for_are_kept(ckpt_factory):
    """A LoopSpec engine asked for ``{"mode": 0, "cudagraph_mode": "FULL"}`` keeps it (the user's config
    is not rewritten; it once fell back to decode-only graphs)."""
    from types import SimpleNamespace as NS

    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_loop.vllm_patches import loopspec as vllm_patches

    args = EngineArgs(model=ckpt_factory("ouro"), compilation_config={"mode": 0, "cudagraph_mode": "FULL"})
    vllm_patches._fast_start(args, NS(tensor_parallel_size=1, pipeline_parallel_size=1))
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.FULL


def test_loopspec_needs_a_looped_model(ckpt_factory):
    with pytest.raises(ValueError, match="needs a looped model .* this model is LlamaForCausalLM, which does not loop"):
        _config(ckpt_factory("llama"), {"method": "loopspec"})


def test_loopspec_refuses_early_exit(ckpt_factory):
    with pytest.raises(ValueError, match="verifies every token at full depth R"):
        _config(ckpt_factory("ouro"), {"method": "loopspec"}, hf_overrides={"early_exit_threshold": 0.5})


def test_async_scheduling_flag_becomes_a_knob(ckpt_factory):
    """vLLM refuses async scheduling for custom_class: the front door validates synchronously and keeps
    the user's flag; on this CPU the engine stays synchronous, as vLLM's CPU platform does."""
    path = ckpt_factory("ouro")
    for asked, knob in ((True, "on"), (False, "off"), (None, "auto")):
        cfg = _config(path, {"method": "loopspec"}, async_scheduling=asked)
        assert cfg.additional_config["loopspec"]["async"] == knob
        assert cfg.scheduler_config.async_scheduling is False
        assert cfg.scheduler_config.scheduler_cls == "vllm_loop.loopspec.scheduler.LoopSpecScheduler"


def test_async_scheduling_where_supported(ckpt_factory, monkeypatch):
    """Where async scheduling is possible (a CUDA device, the mp / uni executor, no PP / DP; the check
    is patched out on this CPU) a LoopSpec engine schedules asynchronously with the barrier scheduler:
    by default with the lanes policy "auto", and with lanes "on" only when asked for; never with
    --no-async-scheduling. Where it is not, an explicit --async-scheduling is refused, naming why."""
    from vllm_loop.vllm_patches import loopspec as vllm_patches

    path = ckpt_factory("ouro")
    monkeypatch.setattr(vllm_patches, "async_blocker", lambda cfg: None)
    cases = [({}, None, True), ({"lanes": "on"}, None, False), ({"lanes": "on"}, True, True), ({}, False, False)]
    for extra, asked, on in cases:
        cfg = _config(path, {"method": "loopspec"} | extra, async_scheduling=asked)
        assert cfg.scheduler_config.async_scheduling is on, (extra, asked)
        assert cfg.scheduler_config.scheduler_cls.endswith("LoopSpecAsyncScheduler" if on else "LoopSpecScheduler")
        assert cfg.model_config.disable_cascade_attn or not on
    monkeypatch.setattr(vllm_patches, "async_blocker", lambda cfg: "the RayDistributedExecutor does not support it")
    monkeypatch.setattr("vllm.platforms.current_platform.is_cuda", lambda: True)
    with pytest.raises(ValueError, match="--async-scheduling with speculative_config .loopspec.: the Ray"):
        _config(path, {"method": "loopspec"}, async_scheduling=True)
    assert _config(path, {"method": "loopspec"}).scheduler_config.async_scheduling is False  # auto: quietly sync


@pytest.mark.engine
def test_vllm_serve_refuses_a_bad_loopspec_config(ckpt_factory, tmp_path):
    vllm = str(Path(sys.executable).with_name("vllm"))
    proc = subprocess.run(
        [vllm, "serve", ckpt_factory("ouro"), "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
         "--speculative-config", '{"method": "loopspec", "d1": 1, "d2": 4}'],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "d2=4 is invalid: d2 must be < R (R=4)" in proc.stdout + proc.stderr


def _graph_sizes(loopspec: bool, max_model_len: int = 4096, **compilation) -> tuple[int, int]:
    """vLLM's CUDA graph sizes (largest, how many) for a GPU engine of 128 sequences with 16 drafts a
    request, from ``VllmConfig._set_cudagraph_sizes`` as the plugin leaves it (no GPU here: the sizes
    are computed on a config whose other fields are stand-ins)."""
    from types import SimpleNamespace as NS

    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    from vllm_loop import plugin

    plugin.register()
    cfg = object.__new__(VllmConfig)
    fields = dict(model_config=NS(enforce_eager=False, max_model_len=max_model_len),
                  compilation_config=CompilationConfig(**({"cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE} | compilation)),
                  scheduler_config=NS(max_num_seqs=128, max_num_batched_tokens=16384),
                  parallel_config=NS(tensor_parallel_size=1), speculative_config=NS(num_speculative_tokens=16),
                  diffusion_config=None, additional_config={"loopspec": {"R": 4}} if loopspec else {})
    for name, value in fields.items():
        object.__setattr__(cfg, name, value)
    VllmConfig._set_cudagraph_sizes(cfg)
    return cfg.compilation_config.max_cudagraph_capture_size, len(cfg.compilation_config.cudagraph_capture_sizes)


def test_loopspec_graph_sizes_are_a_vanilla_engines():
    """A LoopSpec engine's plain steps have one token a request: its decode graphs go to 2 x max_num_seqs as a
    vanilla engine's (35 sizes to 256), not to vLLM's draft-model size (51 to 512); with full graphs
    for mixed steps too (FULL, a LoopSpec engine's default on one GPU) prefills run in them: vLLM's
    512, none longer than ``max_model_len``; the user's own sizes win; other speculative engines keep vLLM's."""
    assert _graph_sizes(True) == (256, 35)
    assert _graph_sizes(False) == (512, 51)
    assert _graph_sizes(True, max_cudagraph_capture_size=64) == (64, 11)
    assert _graph_sizes(True, cudagraph_mode="FULL") == (512, 51)
    assert _graph_sizes(True, 128, cudagraph_mode="FULL") == (128, 19)
    assert _graph_sizes(False, 128, cudagraph_mode="FULL") == (512, 51)  # vLLM's, past max_model_len
    assert _graph_sizes(True, cudagraph_capture_sizes=[1, 2, 400]) == (400, 3)
