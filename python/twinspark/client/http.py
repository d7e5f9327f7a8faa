"""One small OpenAI-compatible HTTP client (httpx) shared by smoke and bench: base URL, optional bearer key,
served model id, and every transport or HTTP failure turned into one sentence that says what to do."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

API_KEY_ENV = "TWINSPARK_API_KEY"


class ClientError(RuntimeError):
    """A request failed for a reason the user can fix; str() is one sentence."""


def resolve_api_key(api_key: str | None = None, key_file: str | os.PathLike | None = None) -> str | None:
    """--api-key, else $TWINSPARK_API_KEY, else the first line of key_file (e.g. state/api_key), else None."""
    if api_key:
        return api_key
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    if key_file and Path(key_file).is_file():
        return Path(key_file).read_text().strip() or None
    return None


class Api:
    """``Api("http://head:8888")``; paths are relative to the server root (``/v1/...``, ``/tokenize``)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0):
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        self.root = url[: -len("/v1")] if url.endswith("/v1") else url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.root, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
        self._model = model
        self._info: dict[str, Any] | None = None

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ errors
    def _fail(self, path: str, resp: httpx.Response | None = None, exc: Exception | None = None) -> ClientError:
        if exc is not None:
            return ClientError(f"cannot reach {self.root}{path} ({type(exc).__name__}: {exc}); check the URL and that "
                               "the server is up (`invoke status`)")
        assert resp is not None
        if resp.status_code == 401:
            return ClientError(f"{self.root} refused the request (401 Unauthorized): pass --api-key or set "
                               f"{API_KEY_ENV} to the server's key")
        try:
            detail = resp.json()
            detail = detail.get("error", detail) if isinstance(detail, dict) else detail
            detail = detail.get("message", detail) if isinstance(detail, dict) else detail
        except ValueError:
            detail = resp.text[:300]
        return ClientError(f"{self.root}{path} answered HTTP {resp.status_code}: {detail}")

    def get(self, path: str) -> Any:
        try:
            r = self.http.get(path)
        except httpx.HTTPError as e:
            raise self._fail(path, exc=e) from None
        if r.status_code != 200:
            raise self._fail(path, r)
        return r.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            r = self.http.post(path, json=body)
        except httpx.HTTPError as e:
            raise self._fail(path, exc=e) from None
        if r.status_code != 200:
            raise self._fail(path, r)
        return r.json()

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Server-sent events of a streaming request, one parsed JSON object per data line."""
        try:
            with self.http.stream("POST", path, json=dict(body, stream=True)) as r:
                if r.status_code != 200:
                    r.read()
                    raise self._fail(path, r)
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except httpx.HTTPError as e:
            raise self._fail(path, exc=e) from None

    # -------------------------------------------------------------------------------------------- endpoints
    def model_info(self) -> dict[str, Any]:
        """The served model's entry in /v1/models (id, max_model_len, root): the given id's, else the first."""
        if self._info is None:
            data = self.get("/v1/models").get("data", [])
            if not data:
                raise ClientError(f"{self.root}/v1/models lists no model; is the server still loading?")
            self._info = next((m for m in data if m.get("id") == self._model), data[0])
        return self._info

    @property
    def model(self) -> str:
        """The served model id (the only one, or the one given)."""
        if self._model is None:
            self._model = self.model_info()["id"]
        return self._model

    @property
    def max_model_len(self) -> int | None:
        """The context length the server serves (vLLM lists it in /v1/models; None where a server does not)."""
        v = self.model_info().get("max_model_len")
        return int(v) if isinstance(v, int) and v > 0 else None

    def count_tokens(self, prompt: str | None = None, messages: list | None = None) -> int:
        """Exact prompt length from vLLM's /tokenize (the same tokenizer and special tokens as a request)."""
        body: dict[str, Any] = {"model": self.model}
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=True)
        else:
            body["prompt"] = prompt
        try:
            return int(self.post("/tokenize", body)["count"])
        except ClientError as e:
            if "HTTP 404" in str(e):
                raise ClientError(f"{self.root} has no /tokenize endpoint (not a vLLM server?); exact prompt "
                                  "lengths need it") from None
            raise
