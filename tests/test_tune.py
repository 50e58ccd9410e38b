"""The depth tuner: Theorem 2's closed form, the power-law envelope fit, the schedule ranking, the
TV measurement, and ``python -m vllm_loop.tune`` end to end on tiny checkpoints."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.optimize import minimize

from vllm_loop.loopspec.proposals import SamplingParams
from vllm_loop.loopspec.schedule import LoopSpecSchedule
from vllm_loop.testing.toy_looped import ToyLoopedLM
from vllm_loop.loopspec.tune import (
    cost_bound,
    fit_power_envelope,
    measure_depth_profile,
    optimal_depths,
    rank_schedules,
    recommend,
    theorem2_min_depth,
    tune_profile,
    valid_schedules,
)
from vllm_loop.tune import main as tune_main




# -- Theorem 2 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "beta, alpha, R, expected",
    [(0.175, 1.03, 32, (1.26, 8.85)), (0.207, 1.08, 32, (1.41, 9.17))],  # paper Section 5 and Appendix F
)
def test_paper_numbers(beta, alpha, R, expected):
    d1, d2 = optimal_depths(beta, alpha, R)
    assert (round(d1, 2), round(d2, 2)) == expected
    assert theorem2_min_depth(beta, alpha) < R


@pytest.mark.parametrize("beta, alpha, R", [(0.175, 1.03, 32), (0.207, 1.08, 32), (0.3, 0.8, 64), (0.1, 1.5, 48), (0.5, 1.2, 16)])
def test_closed_form_is_the_minimiser(beta, alpha, R):
    d1, d2 = optimal_depths(beta, alpha, R)
    # stationary conditions of f(d1, d2) = d1 + beta d1^-a d2 + 2 beta d2^-a R (Appendix G.2)
    assert 1 - alpha * beta * d1 ** (-alpha - 1) * d2 == pytest.approx(0, abs=1e-9)
    assert beta * d1**-alpha - 2 * alpha * beta * R * d2 ** (-alpha - 1) == pytest.approx(0, abs=1e-9)
    res = minimize(lambda x: cost_bound(x[0], x[1], beta, alpha, R), x0=[2.0, 10.0], method="Nelder-Mead",
                   options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 5000})
    assert res.x == pytest.approx([d1, d2], rel=1e-4)


def test_validity_condition_matches_the_solution():
    for beta in (0.01, 0.1, 0.5, 2.0):
        for alpha in (0.3, 0.7, 1.0, 1.5, 3.0):
            for R in (2, 4, 8, 16, 32, 64, 256):
                d1, d2 = optimal_depths(beta, alpha, R)
                assert (1 <= d1 < d2 < R) == (R > theorem2_min_depth(beta, alpha)), (beta, alpha, R)


# -- envelope fit ----------------------------------------------------------------------------------------------
def _max_ratio(beta, alpha, rs, tv):
    return max(beta * r**-alpha / v for r, v in zip(rs, tv))


def test_envelope_recovers_a_power_law():
    rs = list(range(1, 32))
    env = fit_power_envelope(rs, [0.175 * r**-1.03 for r in rs])
    assert env.beta == pytest.approx(0.175) and env.alpha == pytest.approx(1.03) and env.max_ratio == pytest.approx(1.0)


def test_envelope_is_the_tightest_upper_bound():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        rs = sorted(set(torch.randint(1, 32, (10,), generator=g).tolist()))
        tv = [0.2 * r ** -(0.5 + trial / 20) * math.exp(0.5 * float(torch.randn((), generator=g))) for r in rs]
        env = fit_power_envelope(rs, tv)
        assert all(env(r) >= v * (1 - 1e-9) for r, v in zip(rs, tv))  # an upper envelope
        assert env.max_ratio == pytest.approx(_max_ratio(env.beta, env.alpha, rs, tv))
        # no alpha on a fine grid (with its tightest beta) gives a smaller maximum ratio
        for a in torch.linspace(0.001, 5, 2000).tolist():
            b = max(v * r**a for r, v in zip(rs, tv))
            assert _max_ratio(b, a, rs, tv) >= env.max_ratio * (1 - 1e-9)


def test_envelope_skips_zero_tv_and_needs_two_points():
    env = fit_power_envelope([1, 2, 3, 4], [0.2, 0.1, 0.0, 0.05])
    assert env.depths == (1, 2, 4)
    with pytest.raises(ValueError, match="two or more depths"):
        fit_power_envelope([1, 2], [0.3, 0.0])


# -- integer schedules -----------------------------------------------------------------------------------------
def test_rank_schedules():
    rows = rank_schedules(0.175, 1.03, 32)
    assert {(d1, d2) for _, d1, d2 in rows} == set(valid_schedules(32))
    for _, d1, d2 in rows:
        LoopSpecSchedule(32, d1, d2)  # all valid
    brute = min((cost_bound(d1, d2, 0.175, 1.03, 32), d1, d2) for d1, d2 in valid_schedules(32))
    assert rows[0] == brute
    assert [f for f, *_ in rows] == sorted(f for f, *_ in rows)
    assert set(valid_schedules(4)) == {(1, None), (1, 2), (1, 3), (2, None), (3, None)}
    # d1 need not divide R: such schedules are ranked like the others and can be the best
    assert {(3, None), (3, 6)} <= set(valid_schedules(8)) and (3, 9) not in valid_schedules(8)
    assert rank_schedules(0.5, 1.0, 32)[0][1:] == (3, 15)
    assert recommend(1.0, 1.5, 32).best_two_proposals == (3, 12)
    res = recommend(0.175, 1.03, 32)
    assert res.best == (1, 8) and res.theorem2_valid  # next to the continuous optimum (1.26, 8.85)
    assert res.to_dict()["best_two_proposals"] == {"d1": 1, "d2": 8}


# -- measurement ---------------------------------------------------------------------------------------------------
def test_measure_depth_profile_on_a_toy_model():
    model = ToyLoopedLM(depth=8, decay=0.5, prelude=True, coda=True, seed=1)
    prompts = [[1, 2, 3], [4, 5], [6]]
    prof = measure_depth_profile(model, prompts, SamplingParams(1.0), max_new_tokens=6)
    assert prof.positions == 3 * 6 and prof.depths == list(range(1, 9))
    assert prof.tv[-1] == 0.0 and prof.agreement[-1] == 1.0
    assert prof.tv[0] > prof.tv[3] > prof.tv[6] > 0  # converging depths
    res = tune_profile(prof)
    assert res.envelope.max_ratio >= 1 and all(res.envelope(r) >= prof.tv[r - 1] * (1 - 1e-9) for r in range(1, 8))
    prompt_prof = measure_depth_profile(model, prompts, SamplingParams(1.0, top_p=0.7), positions="prompt")
    assert prompt_prof.positions == 2 + 1 + 0


# -- the command line --------------------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def add(a, b):", "Numbers: 0 1 2 3", "A looped model reads"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def test_cli_on_tiny_ouro(ckpt_factory, prompt_file, tmp_path, capsys):
    ckpt = ckpt_factory("ouro", options={"agreement": "0.05"})
    png, js = tmp_path / "fit.png", tmp_path / "fit.json"
    args = [ckpt, "--prompts", str(prompt_file), "--max-new-tokens", "8", "--plot", str(png), "--json", str(js)]
    assert tune_main(args) == 0
    out = capsys.readouterr().out
    assert "Theorem 2 optimum (R=4)" in out and "recommended LoopSpec schedule: vllm serve MODEL" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    # the printed flag is what vLLM's front end accepts for this checkpoint
    flag_json = out.split("--speculative-config '")[1].split("'")[0]
    assert json.loads(flag_json) == {"method": "loopspec", "d1": data["best"]["d1"]} | (
        {} if data["best"]["d2"] is None else {"d2": data["best"]["d2"]})
    assert data["R"] == 4 and data["profile"]["positions"] == 4 * 8
    assert data["beta"] > 0 and data["alpha"] > 0 and data["envelope_max_ratio"] >= 1
    assert (data["best"]["d1"], data["best"]["d2"]) in valid_schedules(4)
    # benchmarks/loopspec_speed.py --tuned reads this JSON for its loopspec-tuned system
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from loopspec_speed import tuned_depths

    assert {"method": "loopspec"} | tuned_depths(str(js)) == json.loads(flag_json)


def test_cli_module_on_tiny_raven(ckpt_factory, tmp_path):
    ckpt = ckpt_factory("huginn_raven", options={"layout": "llama", "state_init": "seeded", "agreement": "0.5"})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]) + json.dumps({"token_ids": [5, 6, 7]}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_loop.tune", ckpt, "--prompts", str(prompts), "--depth", "16",
         "--max-new-tokens", "4", "--temperature", "1.0", "--top-p", "0.7"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Theorem 2 optimum (R=16)" in proc.stdout and "power-law envelope" in proc.stdout
    assert proc.stdout.count("\n") > 16  # one line per depth


def test_cli_errors(tmp_path, capsys, ckpt_factory):
    assert tune_main([str(tmp_path), "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "--prompts" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert tune_main([ckpt_factory("ouro"), "--prompts", str(empty)]) == 2
    assert "no prompts" in capsys.readouterr().err
