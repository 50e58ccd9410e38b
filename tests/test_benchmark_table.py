"""benchmarks/loopspec_speed.py's side-by-side table, from synthetic worker results (no engine)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from loopspec_speed import _prompts, decode_rate, nominal_bandwidth, sampling_suffix, side_by_side, split_system  # noqa: E402


def _row(c: int, tok_s: float, t_short: float, t_long: float, tokens: list[list[int]], **extra) -> dict:
    return {"concurrency": c, "tok_s": tok_s, "ms_per_token_per_request": 1000 * c / tok_s, "t_short_s": t_short,
            "t_long_s": t_long, "tokens": tokens} | extra


def test_ratios_against_vanilla_and_in_tree():
    counters = {"lane_steps": 80, "plain_steps": 2, "drains": 0, "recurrent_steps": 1200, "overlap_wasted": 4,
                "overlap_lagged": 2, "lane_step_seconds": 2.0}
    loopspec = {"gamma": 3.6, "shares": {"first": 0.97, "second": 0.01, "late": 0.0, "full": 0.02},
                "lanes_per_step": 3.9, "counters": counters}
    results = {
        "vanilla": {"rows": [_row(1, 150.0, 0.5, 4.0, [[1, 2, 3]])]},
        "in-tree": {"rows": [_row(1, 160.0, 0.5, 3.75, [[1, 2, 4]])]},
        # its short run is slower per token than its long run by more than 1.5x: flagged
        "loopspec": {"rows": [_row(1, 480.0, 0.6, 1.2, [[1, 2, 3]], loopspec=loopspec)]},
    }
    table = {r["system"]: r for r in side_by_side(results, runs=2)}
    ls = table["loopspec"]
    assert (ls["speedup_vs_vanilla"], ls["speedup_vs_in_tree"]) == (3.2, 3.0)
    assert (ls["long_run_speedup"], ls["long_run_speedup_vs_in_tree"]) == (3.333, 3.125)
    assert ls["same_tokens_as_vanilla"] == "1/1 requests" and ls["short_run_outlier"] is True
    assert (ls["gamma"], ls["first"], ls["full"]) == (3.6, 0.97, 0.02)
    assert (ls["recurrent_steps"], ls["lane_steps"], ls["lane_step_s"]) == (600, 40, 1.0)  # per long run
    it = table["in-tree"]
    assert "speedup_vs_in_tree" not in it and it["speedup_vs_vanilla"] == round(160 / 150, 3)
    assert it["same_tokens_as_vanilla"] == "0/1 requests" and "short_run_outlier" not in it
    assert table["vanilla"]["speedup_vs_in_tree"] == round(150 / 160, 3)


def test_without_in_tree_no_in_tree_ratios():
    results = {"vanilla": {"rows": [_row(4, 600.0, 0.5, 4.0, [[1]] * 4)]},
               "loopspec": {"rows": [_row(4, 1800.0, 0.2, 1.5, [[1]] * 4)]}}
    table = side_by_side(results, runs=1)
    assert all("speedup_vs_in_tree" not in r for r in table)
    assert [r["speedup_vs_vanilla"] for r in table] == [1.0, 3.0]


def test_first_token_time_when_measured():
    """The time to the first token (prefill included) is reported in ms where a worker measured it;
    results written before it was measured still make a table."""
    results = {"vanilla": {"rows": [_row(1, 30.0, 2.2, 19.7, [[1]], t_first_s=0.0412)]},
               "loopspec": {"rows": [_row(1, 270.0, 0.4, 2.3, [[1]])]}}
    table = {r["system"]: r for r in side_by_side(results, runs=1)}
    assert table["vanilla"]["first_token_ms"] == 41.2
    assert "first_token_ms" not in table["loopspec"]


def test_system_suffixes():
    """A system's compilation, lane-kernel, plain-only and step-tokens suffixes, in any order: the engine's
    config and environment."""
    assert split_system("loopspec-auto-unfused-torchsample") == ("loopspec-auto", None, {
        "VLLM_LOOP_LANE_SWIGLU": "0", "VLLM_LOOP_COUPLED_KERNEL": "0"}, None)
    assert split_system("loopspec-tuned-nocompile-unfused") == (
        "loopspec-tuned", {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, {"VLLM_LOOP_LANE_SWIGLU": "0"}, None)
    assert split_system("loopspec-tuned-step64-unfused") == ("loopspec-tuned", None, {"VLLM_LOOP_LANE_SWIGLU": "0"}, 64)
    assert split_system("loopspec-auto-step32-nocompile") == split_system("loopspec-auto-nocompile-step32") == (
        "loopspec-auto", {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, {}, 32)
    assert split_system("vanilla-step32") == ("vanilla-step32", None, {}, None)  # not a LoopSpec system
    assert split_system("in-tree") == ("in-tree", None, {}, None)
    # every step plain: the lanes policy's test pattern, in the engine-core process's environment
    assert split_system("loopspec-auto-plainonly") == ("loopspec-auto", None, {"VLLM_LOOP_LANES_PATTERN": "P"}, None)
    assert split_system("loopspec-tuned-fullgraphs") == (
        "loopspec-tuned", {"mode": 0, "cudagraph_mode": "FULL", "max_cudagraph_capture_size": 512}, {}, None)


def test_cascade_suffix_picks_the_sampling_mode():
    assert sampling_suffix("loopspec-auto-cascade") == ("loopspec-auto", "cascade")
    assert sampling_suffix("loopspec-cascade-plainonly") == ("loopspec-plainonly", "cascade")
    assert sampling_suffix("loopspec-auto") == ("loopspec-auto", None)
    assert sampling_suffix("vanilla-cascade") == ("vanilla-cascade", None)  # not a LoopSpec system


def test_profile_floor_bandwidth_follows_the_gpu():
    # the profile's floor used the H200's 4.8 TB/s on an H100 too (seen in an H100 profile)
    assert nominal_bandwidth("NVIDIA H100 80GB HBM3") == (3.35e12, "H100's nominal 3.35 TB/s")
    assert nominal_bandwidth("NVIDIA H200") == (4.8e12, "H200's nominal 4.8 TB/s")
    assert nominal_bandwidth("")[0] == 4.8e12  # a CPU run: the label still names the GPU assumed


def test_ensure_checkpoint_makes_a_missing_one_once(tmp_path, monkeypatch):
    import loopspec_speed

    made = []

    def fake_make(shape, folder, agreement):  # stands in for the factory (seconds to minutes per shape)
        made.append((shape, folder.name, agreement))
        folder.mkdir()
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(loopspec_speed, "make_shape_checkpoint", fake_make)
    folder = tmp_path / "ck" / "tiny-ouro"
    (tmp_path / "ck" / "tiny-ouro.partial").mkdir(parents=True)  # a run cut short left this
    loopspec_speed.ensure_checkpoint("tiny-ouro", folder, "0.001")
    loopspec_speed.ensure_checkpoint("tiny-ouro", folder, "0.001")  # exists now: not made again
    assert made == [("tiny-ouro", "tiny-ouro.partial", "0.001")]
    assert (folder / "config.json").exists() and not folder.with_name("tiny-ouro.partial").exists()


def test_decode_rate_counts_every_prompt_set():
    """c requests x K prompt sets x 512 tokens over the long-minus-short time (medians of the runs)."""
    import statistics

    assert decode_rate(1, 1, statistics.median([0.5, 0.7, 0.6]), statistics.median([4.6, 4.0, 4.2])) == 512 / (4.2 - 0.6)
    assert decode_rate(4, 3, 1.0, 9.0) == 3 * 4 * 512 / 8.0


def test_prompt_sets_are_distinct_and_the_first_is_unchanged():
    one = _prompts(2, 1000)
    assert one == _prompts(2, 1000, first=0)  # --texts 1 decodes the prompts of every earlier run
    sets = [_prompts(2, 1000, first=k * 2) for k in range(3)]
    ids = [tuple(p["prompt_token_ids"]) for s in sets for p in s]
    assert len(set(ids)) == 6 and sets[1][0] == _prompts(3, 1000)[2]


def test_texts_must_be_positive():
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "loopspec_speed.py"
    proc = subprocess.run([sys.executable, str(script), "--texts", "0", "--out", "/tmp/unused.json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--texts 0: allowed: an integer >= 1" in proc.stderr


def test_serve_compare_refuses_a_run_with_failed_requests():
    """A `vllm bench serve` run with failed requests is an error naming the count and the first error,
    never a row (a run once recorded only the requests that completed, without a word)."""
    import pytest
    from serve_compare import FailedRequests, check_complete

    ok = {"completed": 16, "failed": 0, "errors": [""] * 16}
    check_complete(ok, 16, "loopspec")
    bad = {"completed": 10, "failed": 6, "errors": [""] * 10 + ["Bad Request: max_model_len is 512"] * 6}
    with pytest.raises(FailedRequests, match=r"loopspec, c=8: 6 of 16 requests failed \(10 completed\); "
                                             r"first error: Bad Request: max_model_len is 512"):
        check_complete(bad, 16, "loopspec, c=8")
    with pytest.raises(FailedRequests, match="0 of 16 requests failed"):  # silently short, nothing failed
        check_complete({"completed": 15, "failed": 0}, 16, "x")


def test_serve_compare_reads_jit_compilations_from_the_server_log(tmp_path):
    from serve_compare import jit_compiles

    log = tmp_path / "server.log"
    log.write_text("INFO ready\n"
                   "WARNING 12-07 [jit_monitor.py:130] Triton kernel JIT compilation during inference: _lane_kernel. "
                   "This causes a latency spike; consider extending warmup to cover this shape/config.\n"
                   "WARNING 12-07 [jit_monitor.py:130] Triton kernel JIT compilation during inference: "
                   "rejection_greedy_sample_kernel. This causes a latency spike.\n")
    assert jit_compiles(str(log)) == ["_lane_kernel", "rejection_greedy_sample_kernel"]
    assert jit_compiles(str(tmp_path / "missing.log")) == []
