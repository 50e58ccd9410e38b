"""`latent_budget` over the OpenAI API (`vllm serve`): it changes the latent steps, bad values get a
400 naming the field and its range, and the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_loop.testing.engines import Server


@pytest.fixture(scope="module")
def coconut_server(ckpt_factory, tmp_path_factory):
    path = ckpt_factory("coconut")
    srv = Server(path, log_path=str(tmp_path_factory.mktemp("latent-serve") / "server.log"), served_name="coconut")
    srv.spec = json.loads((Path(path) / "config.json").read_text())["latent_spec"]
    yield srv
    srv.stop()


def _complete(server, **extra):
    body = {"model": "coconut", "prompt": "Question: Tom has 3 apples and buys 5 more.\n", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}
    return server.post("/v1/completions", body)


@pytest.mark.engine
def test_latent_budget_in_extra_body_changes_latent_steps(coconut_server):
    spec = coconut_server.spec
    seen = {}
    for budget in (2, 5):
        r = _complete(coconut_server, vllm_xargs={"latent_budget": budget})
        assert r.status_code == 200, r.text
        data = r.json()
        ids = data["choices"][0]["token_ids"]
        # The forced latent phase leads the output: start, one placeholder per thought, end.
        assert ids[: 2 + budget] == spec["start_token_ids"] + [spec["latent_token_id"]] * budget + spec["end_token_ids"]
        assert data["usage"]["completion_tokens"] == 6 + 2 + budget  # max_tokens still bounds the answer
        seen[budget] = ids
    assert seen[2] != seen[5]
    default = _complete(coconut_server).json()["choices"][0]["token_ids"]
    assert default.count(spec["latent_token_id"]) == spec["default_budget"]


@pytest.mark.engine
@pytest.mark.parametrize("bad", [-1, 2.5, "three", 65])
def test_bad_latent_budget_is_a_400_and_server_keeps_serving(coconut_server, bad):
    r = _complete(coconut_server, vllm_xargs={"latent_budget": bad})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "latent_budget" in message and "[0, 64]" in message
    ok = _complete(coconut_server, vllm_xargs={"latent_budget": 1})
    assert ok.status_code == 200, ok.text
