"""`vllm serve` with LoopSpec: the OpenAI API (completions and chat, streaming and not) and /metrics."""

from __future__ import annotations

import json

import pytest

SPEC = '{"method": "loopspec", "d1": 1, "d2": 2, "lanes": "on"}'


@pytest.fixture(scope="module")
def server(ckpt_factory, tmp_path_factory):
    from vllm_loop.testing.engines import Server

    path = ckpt_factory("ouro", options={"agreement": "0.005"})
    # a 256-token batch budget: longer prompts are prefilled in chunks (the seeded chunked-prefill test)
    srv = Server(path, "--speculative-config", SPEC, "--max-num-batched-tokens", "256",
                 log_path=str(tmp_path_factory.mktemp("serve") / "server.log"), served_name="tiny-ouro")
    srv.path = path
    yield srv
    srv.stop()


def _stream(server, path: str, body: dict) -> list[dict]:
    import requests

    chunks = []
    with requests.post(f"{server.base}{path}", json=body | {"stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line and line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.engine
def test_completions_equal_the_reference_streaming_or_not(server):
    from vllm_loop.reference import load_reference

    prompt = [5, 17, 99, 3, 250]
    body = {"model": "tiny-ouro", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    tokens = data["choices"][0]["token_ids"]
    assert tokens == load_reference(server.path).greedy_generate(prompt, 24)
    assert data["usage"]["completion_tokens"] == 24
    chunks = _stream(server, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == data["choices"][0]["text"]


@pytest.mark.engine
def test_chat_completions_streaming_or_not(server):
    body = {"model": "tiny-ouro", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["usage"]["completion_tokens"] == 16
    chunks = _stream(server, "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == data["choices"][0]["message"]["content"]


@pytest.mark.engine
def test_requests_lanes_cannot_serve_and_sampling_are_served(server):
    ok = server.post("/v1/completions", {"model": "tiny-ouro", "prompt": [4, 5, 6], "max_tokens": 8,
                                          "temperature": 0, "logprobs": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"] is not None
    sampled = server.post("/v1/completions", {"model": "tiny-ouro", "prompt": [4, 5, 6], "max_tokens": 8,
                                               "temperature": 1.0, "top_p": 0.7, "seed": 3, "ignore_eos": True})
    assert sampled.status_code == 200 and sampled.json()["usage"]["completion_tokens"] == 8
    refused = server.post("/v1/completions", {"model": "tiny-ouro", "prompt": [4, 5, 6], "max_tokens": 8,
                                               "min_p": 0.1})
    assert refused.status_code == 400 and "min_p" in refused.text
    assert server.post("/v1/completions", {"model": "tiny-ouro", "prompt": [4], "max_tokens": 2}).status_code == 200


@pytest.mark.engine
def test_metrics_show_loopspec_counters(server):
    import requests

    # 64 tokens: several lane steps of ~16 tokens, back to back (the gap counters)
    server.post("/v1/completions", {"model": "tiny-ouro", "prompt": [9, 8, 7], "max_tokens": 64, "temperature": 0,
                                    "ignore_eos": True})
    text = requests.get(f"{server.base}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith(("vllm_loop:", "vllm:spec_decode")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)

    def get(prefix):
        return sum(v for k, v in values.items() if k.startswith(prefix))

    assert get('vllm_loop:loopspec_commits_total{') > 0
    assert get('vllm_loop:loopspec_commits_total{engine="0",model_name="tiny-ouro",source="first"}') > 0
    assert get("vllm_loop:loopspec_recurrent_steps_total") > 0 and get("vllm_loop:loopspec_lanes_advanced_total") > 0
    assert get("vllm_loop:loopspec_gate_evaluations_total") > 0 and get("vllm_loop:loopspec_lane_steps_total") > 0
    assert get("vllm_loop:loopspec_lane_step_seconds_total") > 0
    assert get("vllm_loop:loopspec_lane_step_gaps_total") > 0 and get("vllm_loop:loopspec_lane_step_gap_seconds_total") > 0
    assert 1.0 <= get("vllm_loop:loopspec_gamma{") <= 4.0 and get("vllm_loop:loopspec_lanes_per_step{") > 1
    # lanes "on": every lanes-mode step at the full lane budget
    assert get('vllm_loop:loopspec_lane_option_steps_total{engine="0",model_name="tiny-ouro",option="full"}') > 0
    # vLLM's own spec-decode counters carry LoopSpec's verifications
    assert get("vllm:spec_decode_num_drafts_total") > 0 and get("vllm:spec_decode_num_accepted_tokens_total") > 0


@pytest.mark.engine
def test_periodic_log_line_and_startup_schedule(server):
    import time

    server.post("/v1/completions", {"model": "tiny-ouro", "prompt": [1, 2], "max_tokens": 16, "temperature": 0,
                                    "ignore_eos": True})
    deadline = time.time() + 30  # vLLM logs its stats every VLLM_LOG_STATS_INTERVAL (10 s)
    while "LoopSpec: gamma" not in server.log_tail(10**6) and time.time() < deadline:
        time.sleep(1)
    log = server.log_tail(10**6)
    line = next(x for x in log.splitlines() if "LoopSpec: gamma" in x)
    assert "commits first" in line and "gate open" in line and "lanes per recurrent step" in line
    assert "LoopSpec on: R=4 d1=1 d2=2 (gated) max_lanes=7" in log  # the schedule, logged at start-up


@pytest.mark.engine
def test_client_disconnect_mid_stream_frees_kv_blocks_and_lanes(server):
    import time

    import requests

    def gauge(name):
        text = requests.get(f"{server.base}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    body = {"model": "tiny-ouro", "prompt": [3, 1, 4, 1, 5], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with requests.post(f"{server.base}/v1/completions", json=body, stream=True, timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(5):  # a few chunks: the request is decoding in lanes
            next(lines)
        assert gauge("vllm:num_requests_running") == 1 and gauge("vllm:kv_cache_usage_perc") > 0
    # the connection is closed: vLLM aborts the request, which gives back its blocks and lanes
    deadline = time.time() + 60
    while (gauge("vllm:num_requests_running") or gauge("vllm:kv_cache_usage_perc")) and time.time() < deadline:
        time.sleep(0.5)
    assert gauge("vllm:num_requests_running") == 0
    assert gauge("vllm:kv_cache_usage_perc") == 0
    # and the server keeps serving
    ok = server.post("/v1/completions", {"model": "tiny-ouro", "prompt": [7], "max_tokens": 4})
    assert ok.status_code == 200


def _greedy_served_exactly(server, prompt=(5, 17, 99, 3, 250), n=12) -> None:
    """A normal request after a hostile one: served, and equal to the reference."""
    from vllm_loop.reference import load_reference

    r = server.post("/v1/completions", {"model": "tiny-ouro", "prompt": list(prompt), "max_tokens": n,
                                        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == load_reference(server.path).greedy_generate(list(prompt), n)


@pytest.mark.engine
def test_prompt_token_id_out_of_vocabulary_is_a_400_and_the_server_stays_up(server):
    import json as _json

    vocab = _json.load(open(f"{server.path}/config.json"))["vocab_size"]
    for bad in ([1, 2, vocab], [vocab + 7], [3, -1]):
        r = server.post("/v1/completions", {"model": "tiny-ouro", "prompt": bad, "max_tokens": 4})
        assert r.status_code == 400, (bad, r.status_code, r.text)
        if min(bad) >= 0:  # vLLM's own schema refuses negative ids before the plugin sees them
            assert "prompt" in r.text and "out of vocabulary" in r.text and f"0 to {vocab - 1}" in r.text, r.text
    # the largest id is fine
    ok = server.post("/v1/completions", {"model": "tiny-ouro", "prompt": [1, vocab - 1], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    _greedy_served_exactly(server)


@pytest.mark.engine
def test_seeded_request_with_a_chunked_prefill_is_served_reproducibly(server):
    import random

    prompt = [random.Random(4).randrange(1, 500) for _ in range(300)]  # > the 256-token batch budget
    body = {"model": "tiny-ouro", "prompt": prompt, "max_tokens": 8, "temperature": 0.8, "seed": 1,
            "ignore_eos": True, "return_token_ids": True}
    first = server.post("/v1/completions", body)
    assert first.status_code == 200, first.text + server.log_tail()
    again = server.post("/v1/completions", body)
    assert again.status_code == 200, again.text
    tokens = first.json()["choices"][0]["token_ids"]
    assert len(tokens) == 8 and again.json()["choices"][0]["token_ids"] == tokens  # the seed's promise
    _greedy_served_exactly(server)


def _metric(server, name: str) -> float:
    import requests

    text = requests.get(f"{server.base}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.engine
def test_live_lanes_gauge_returns_to_zero_after_an_abort_storm(server):
    import threading
    import time

    import requests

    seen_live = []

    def stream_then_drop(i: int) -> None:
        body = {"model": "tiny-ouro", "prompt": [3 + i, 1, 4, 1, 5], "max_tokens": 300, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with requests.post(f"{server.base}/v1/completions", json=body, stream=True, timeout=120) as r:
            lines = r.iter_lines()
            for _ in range(6 + 2 * i):  # every client drops its connection at another point
                next(lines)

    clients = [threading.Thread(target=stream_then_drop, args=(i,)) for i in range(6)]
    for c in clients:
        c.start()
    deadline = time.time() + 60
    while any(c.is_alive() for c in clients) and time.time() < deadline:
        seen_live.append(_metric(server, "vllm_loop:loopspec_lanes_live"))
        time.sleep(0.2)
    for c in clients:
        c.join(timeout=60)
    assert max(seen_live, default=0) > 0, f"the gauge never showed lanes while requests decoded: {seen_live}"
    deadline = time.time() + 60
    while (_metric(server, "vllm:num_requests_running") or _metric(server, "vllm_loop:loopspec_lanes_live")) \
            and time.time() < deadline:
        time.sleep(0.5)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm_loop:loopspec_lanes_live") == 0
    assert _metric(server, "vllm_loop:loopspec_lane_requests_live") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0
    _greedy_served_exactly(server)


@pytest.mark.engine
def test_a_requested_shutdown_exits_zero(server):
    """Last in this module: SIGTERM stops the server with status 0 (only an engine that died while
    serving makes it exit 1: tests/test_serve_failures.py)."""
    assert server.stop() == 0, server.log_tail()
