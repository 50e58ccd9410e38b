"""`vllm serve` with a tiny Ouro answers the OpenAI API; bad deployments fail at start-up, clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

VLLM = str(Path(sys.executable).with_name("vllm"))


@pytest.fixture(scope="module")
def server(ckpt_factory, tmp_path_factory):
    from vllm_loop.testing.engines import Server

    srv = Server(ckpt_factory("ouro"), log_path=str(tmp_path_factory.mktemp("serve") / "server.log"),
                 served_name="tiny-ouro")
    yield srv
    srv.stop()


@pytest.mark.engine
def test_openai_completions_over_http(server):
    import requests

    body = {"model": "tiny-ouro", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["usage"]["completion_tokens"] == 8
    assert data["choices"][0]["finish_reason"] == "length"
    # Same request again: greedy decoding is deterministic through the server too.
    again = server.post("/v1/completions", body).json()
    assert again["choices"][0]["text"] == data["choices"][0]["text"]
    metrics = requests.get(f"{server.base}/metrics", timeout=10).text
    assert "vllm:generation_tokens_total" in metrics


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True])
def test_bad_loop_count_fails_at_startup_naming_the_field(ckpt_factory, bad):
    from vllm import LLM

    with pytest.raises(ValueError, match="total_ut_steps"):
        LLM(ckpt_factory("ouro"), hf_overrides={"total_ut_steps": bad})


def test_bad_raven_options_fail_at_startup(ckpt_factory):
    from vllm import LLM

    path = ckpt_factory("huginn_raven", options={"layout": "huginn", "state_init": "seeded"})
    with pytest.raises(ValueError, match="mean_recurrence"):
        LLM(path, hf_overrides={"mean_recurrence": 0})
    with pytest.raises(ValueError, match="state_init"):
        LLM(path, hf_overrides={"state_init": "gaussian"})
    with pytest.raises(ValueError, match="readout_depths"):
        LLM(path, hf_overrides={"readout_depths": [0, 99]})


def test_config_missing_required_key_fails_at_startup(ckpt_factory, tmp_path):
    import shutil

    from vllm import LLM

    src = Path(ckpt_factory("ouro"))
    dst = tmp_path / "ouro-missing-key"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["total_ut_steps"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing required key.*total_ut_steps"):
        LLM(str(dst))


@pytest.mark.engine
def test_vllm_serve_cli_reports_bad_loop_count(ckpt_factory):
    proc = subprocess.run(
        [VLLM, "serve", ckpt_factory("ouro"), "--hf-overrides", json.dumps({"total_ut_steps": -1})],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "total_ut_steps=-1 is invalid" in proc.stderr + proc.stdout
