"""Runtime plugins (entry-point group `twinspark.runtime`): how a rank runs on its host. Contract of a plugin class
`Plugin(settings, head, worker)`:
  start(rank, env, secret_env) -> info dict (JSON-serialisable: pid / container, log path)
  alive(rank, info) -> bool;  stop(rank, info);  log_size(rank, info) -> int
  read_log(rank, info, offset, limit) -> str;  stacks(rank, info) -> str (py-spy dump of the rank's processes)
Ranks are "head" (local, serves the API) and "worker" (over SSH, `--headless --node-rank 1`); the caller starts
the worker first."""

from __future__ import annotations

import shlex


def host_of(rt, rank: str):
    return rt.head if rank == "head" else rt.worker


def remote_log_size(host, path) -> int:
    r = host.run(f"stat -c %s {shlex.quote(str(path))} 2>/dev/null || echo 0", changes=False, check=False, timeout=15)
    try:
        return int((r.stdout or "0").split()[0])
    except (ValueError, IndexError):
        return 0


def remote_read(host, path, offset: int, limit: int) -> str:
    r = host.run(f"tail -c +{offset + 1} {shlex.quote(str(path))} 2>/dev/null | head -c {limit}", changes=False,
                 check=False, timeout=15)
    return r.stdout or ""
