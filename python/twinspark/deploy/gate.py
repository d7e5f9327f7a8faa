"""Health that means serving. The watchdog (twinspark.deploy.watch) writes a health file on the head every round;
the head's vLLM API server loads `Gate` (`--middleware twinspark.deploy.gate.Gate`), which reads it:

- /health answers 503 {"error": {"message": SENTENCE}} while the file says not ok (a rank died, the worker or the
  link does not answer) or is older than STALE_S (nothing watches the deployment);
- every other request is answered 503 at once while the file says not ok, and a request in flight when it turns
  is ended (503, or its stream closed): no client hangs on collectives that cannot finish;
- with VLLM_API_KEY set, every path but /health and /ping needs the bearer key (vLLM's own check covers /v1 only:
  /metrics, /tokenize and /invocations answered anyone);
- a request carrying the watchdog's probe token (X-Twinspark-Probe) passes a closed gate: the watchdog's own
  one-token request that decides whether the engine serves again after a split.

Health file (JSON, path in TWINSPARK_HEALTH_FILE, STATE_DIR/health/health.json): t (unix time), ok, status,
reason, phase {rank: text}, link, probe. Contract: `write(path, **fields)`, `read(path) -> dict | None`,
`path_for(state_dir)`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

ENV = "TWINSPARK_HEALTH_FILE"
PROBE_HEADER = b"x-twinspark-probe"
OPEN_PATHS = ("/health", "/ping")
STALE_S = 20.0
POLL_S = 0.5


def path_for(state_dir) -> Path:
    return Path(state_dir).resolve() / "health" / "health.json"


def write(path: Path, **fields) -> None:
    from twinspark.fileio import atomic_write

    atomic_write(path, json.dumps({"t": time.time(), **fields}), mode=0o600)


def read(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def verdict(data: dict | None, now: float | None = None) -> tuple[bool, bool, str]:
    """(requests may pass, /health is ok, the sentence when not). No file: open (not started by deploy)."""
    if data is None:
        return True, True, ""
    if not data.get("ok", True):
        return False, False, str(data.get("reason") or "the deployment is not serving")
    age = (now or time.time()) - float(data.get("t") or 0)
    if age > STALE_S:
        return True, False, (f"the watchdog has not reported for {age:.0f} s, so nothing watches the worker and the "
                             "link; `invoke status` says more, `invoke restart` starts a watched deployment")
    return True, True, ""


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class Gate:
    """Pure ASGI middleware (vLLM adds it with `app.add_middleware(Gate)`); configured from the environment."""

    def __init__(self, app, path: str | None = None, api_key: str | None = None):
        self.app = app
        p = path if path is not None else os.environ.get(ENV, "")
        self.path = Path(p) if p else None
        key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY", "")
        self.key = _digest(key) if key else None
        self._cache: tuple[float, dict | None] = (-1.0, None)

    def state(self) -> dict | None:
        if self.path is None:
            return None
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return None
        if mtime != self._cache[0]:
            self._cache = (mtime, read(self.path))
        return self._cache[1]

    def _header(self, scope, name: bytes) -> str:
        return next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == name), "")

    def _authorized(self, scope) -> bool:
        scheme, _, token = self._header(scope, b"authorization").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(_digest(token), self.key)

    def _probe(self, scope, data: dict | None) -> bool:
        token = (data or {}).get("probe") or ""
        got = self._header(scope, PROBE_HEADER)
        return bool(token and got) and secrets.compare_digest(_digest(got), _digest(token))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self.key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            return await _answer(send, 401, "Unauthorized: pass the API key as a bearer token")
        data = self.state()
        may_pass, healthy, reason = verdict(data)
        if self._probe(scope, data):
            return await self.app(scope, receive, send)
        if path == "/health" and not healthy:
            return await _answer(send, 503, reason)
        if not may_pass:
            return await _answer(send, 503, reason)
        if self.path is None or path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        await self._guarded(scope, receive, send)

    async def _closed(self) -> str:
        while True:
            await asyncio.sleep(POLL_S)
            may_pass, _, reason = verdict(self.state())
            if not may_pass:
                return reason

    async def _guarded(self, scope, receive, send):
        """Run the request; end it when the gate closes while it runs."""
        started = finished = False

        async def tracked(message):
            nonlocal started, finished
            started = started or message["type"] == "http.response.start"
            finished = message["type"] == "http.response.body" and not message.get("more_body", False)
            await send(message)

        app = asyncio.ensure_future(self.app(scope, receive, tracked))
        closed = asyncio.ensure_future(self._closed())
        try:
            done, _ = await asyncio.wait({app, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (app, closed):
                if not t.done():
                    t.cancel()
        if app in done:
            return app.result()
        try:
            await app
        except BaseException:  # noqa: BLE001 - the request was cancelled on purpose
            pass
        reason = closed.result()
        if finished:
            return
        if not started:
            await _answer(send, 503, reason)
        else:  # a stream: one error event, then the end
            event = json.dumps({"error": {"message": reason, "type": "ServiceUnavailable", "code": 503}})
            await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": False})


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "ServiceUnavailable" if status == 503 else
                                 "Unauthorized", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
