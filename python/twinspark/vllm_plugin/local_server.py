"""Serve a model with vLLM (plus this plugin, loaded through its entry point) on 127.0.0.1, for tests and the demo.

``LocalServer(model_dir, ...).start()`` launches ``python -m vllm.entrypoints.openai.api_server`` in its own
process group on a free port, waits for ``/health`` (failing early when the process dies, with the log's tail)
and ``stop()`` ends that process group by its id (SIGTERM, then SIGKILL after a grace period). It is a context
manager: the server stops also when the body fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from twinspark.ports import free_port


class ServerError(RuntimeError):
    """The server did not come up; the message says why and ends with the log's last lines."""


class LocalServer:
    def __init__(self, model_dir: str | os.PathLike, *, tp: int = 1, dtype: str = "float32",
                 served_name: str = "tiny", api_key: str | None = None, max_model_len: int = 256,
                 enforce_eager: bool = True, extra_args: list[str] | None = None, log_path: str | None = None,
                 python: str = sys.executable, startup_timeout: float = 240.0,
                 extra_env: dict[str, str] | None = None):
        self.model_dir, self.tp, self.dtype, self.served_name = str(model_dir), tp, dtype, served_name
        self.api_key, self.max_model_len, self.enforce_eager = api_key, max_model_len, enforce_eager
        self.extra_args, self.python, self.startup_timeout = list(extra_args or []), python, startup_timeout
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.extra_env = dict(extra_env or {})

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--tensor-parallel-size", str(self.tp), "--max-num-seqs", "8", "--disable-log-stats",
               # the start-up profile/warm-up runs a batch of this many tokens: keep it small on a CPU
               "--max-num-batched-tokens", str(max(self.max_model_len, 256))]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.api_key:
            cmd.append(f"--api-key={self.api_key}")  # one token: a key that starts with '-' is no option
        return cmd + self.extra_args

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        if self.tp > 1:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                 for i in range(self.tp)))
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.update(self.extra_env)
        return env

    def start(self) -> LocalServer:
        import httpx

        self.port = free_port()
        log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                     start_new_session=True)
        log.close()
        deadline = t0 + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                cause = self.root_cause()
                raise ServerError(f"vLLM exited with code {self.proc.returncode} before it was ready"
                                  f"{': ' + cause if cause else ''} (log {self.log_path}); last lines:\n"
                                  f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                self.stop()
                raise ServerError(f"vLLM was not ready after {self.startup_timeout:.0f} s (log {self.log_path}):\n"
                                  f"{self.log_tail()}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0
        return self

    def root_cause(self) -> str | None:
        """The first raised exception of the log (a plugin error is preferred): vLLM's own last line only says
        'Engine core initialization failed. See root cause above'. Log lines at WARNING or INFO level are not
        errors, even when they quote one (vLLM's ulimit warning names `OSError: [Errno 24] ...`); a line counts
        when, after vLLM's "(Process pid=N)" prefix, it starts with the exception's name or is logged as ERROR."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return None
        errors = []
        for ln in lines:
            text = re.sub(r"^\(\w+ pid=\d+\)\s*", "", ln.strip())
            raised = re.match(r"([\w.]+(Error|Exception)|ERROR\b.*?\w(Error|Exception)): ", text)
            if raised and "See root cause above" not in text:
                errors.append(text)
        ours = [ln for ln in errors if "Exl3FormatError" in ln or "twinspark" in ln]
        return (ours or errors or [None])[0]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 20.0) -> None:
        """End the server's process group by its id (the API server, engine core and workers)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the server's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        try:  # workers that outlived the API server in the same group
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
