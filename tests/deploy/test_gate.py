"""The head's health gate (twinspark.deploy.gate) as vLLM runs it: an ASGI middleware around an app, fed by the
watchdog's health file. A fake app stands in for vLLM (one that answers at once, one that never finishes); the
requests go through httpx's ASGI transport. Also the boot phases read from vLLM's log lines."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from twinspark.deploy import gate, operate

KEY = "sk-test-0123456789abcdef"


async def fake_vllm(scope, receive, send):
    if scope["path"] == "/slow":
        await asyncio.sleep(60)  # a request stuck behind collectives that cannot finish
    body = json.dumps({"path": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _get(app, path, headers=None, timeout=10.0):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://h") as c:
            return await c.get(path, headers=headers or {}, timeout=timeout)

    return asyncio.run(go())


@pytest.fixture
def health(tmp_path):
    return gate.path_for(tmp_path)


def test_no_health_file_lets_everything_through_and_keeps_the_key(health):
    g = gate.Gate(fake_vllm, path=str(health), api_key=KEY)
    assert _get(g, "/health").status_code == 200
    assert _get(g, "/metrics").status_code == 401  # vLLM's own key check covers /v1 only
    assert _get(g, "/tokenize").status_code == 401
    assert _get(g, "/metrics", {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert _get(gate.Gate(fake_vllm, path="", api_key=""), "/metrics").status_code == 200  # API_KEY=off


def test_closed_gate_answers_503_with_the_sentence_at_once(health):
    reason = "the worker 10.0.0.2 has not answered on port 22 since 12:00:00 (timed out): the link is down"
    gate.write(health, ok=False, status="split", reason=reason, probe="tok")
    g = gate.Gate(fake_vllm, path=str(health), api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/health", "/v1/completions"):
        t0 = time.monotonic()
        r = _get(g, path, auth)
        assert r.status_code == 503 and r.json()["error"]["message"] == reason
        assert time.monotonic() - t0 < 1.0
    # the watchdog's probe passes a closed gate (with the token only)
    assert _get(g, "/v1/models", {**auth, "X-Twinspark-Probe": "tok"}).status_code == 200
    assert _get(g, "/v1/models", {**auth, "X-Twinspark-Probe": "wrong"}).status_code == 503


def test_stale_heartbeat_fails_health_but_serves(health):
    gate.write(health, ok=True, status="running", reason="")
    data = json.loads(health.read_text())
    data["t"] -= gate.STALE_S + 5
    health.write_text(json.dumps(data))
    g = gate.Gate(fake_vllm, path=str(health), api_key="")
    r = _get(g, "/health")
    assert r.status_code == 503 and "the watchdog has not reported for" in r.json()["error"]["message"]
    assert _get(g, "/v1/models").status_code == 200


def test_request_in_flight_ends_when_the_gate_closes(health):
    gate.write(health, ok=True, status="running", reason="")
    g = gate.Gate(fake_vllm, path=str(health), api_key="")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=g), base_url="http://h") as c:
            pending = asyncio.ensure_future(c.get("/slow", timeout=30))
            await asyncio.sleep(0.3)
            gate.write(health, ok=False, status="split", reason="the link is down")
            t0 = time.monotonic()
            r = await pending
            return r, time.monotonic() - t0

    r, waited = asyncio.run(go())
    assert r.status_code == 503 and r.json()["error"]["message"] == "the link is down"
    assert waited < 3 * gate.POLL_S + 1


def test_boot_phase_from_log_lines():
    lines = ("(APIServer pid=1) INFO [api_utils.py] non-default args: {...}\n"
             "(Worker pid=2) INFO [parallel_state.py] world_size=2 rank=0 distributed_init_method=tcp://h:1\n"
             "(Worker_TP0 pid=2) INFO [cpu_model_runner.py] Starting to load model /m...\n")
    assert operate.phase_of(lines) == "loading weights"
    assert operate.phase_of("(Worker_TP0) INFO Loading weights took 0.01 seconds\n", "loading weights") == \
        "weights loaded"
    assert operate.phase_of("WARNING Enforce eager set, disabling torch.compile\n", "weights loaded") == \
        "weights loaded"  # never goes back, and a config warning is no compile phase
    assert operate.phase_of("INFO Starting vLLM server on http://0.0.0.0:8888\n", "engine ready") == \
        "starting the API server"
