"""Boot supervision and the operate commands. Contract: `wait_ready(ctx)` returns when /health answers 200 and
raises DeployError (after stopping both ranks) when a rank exits, when a rank writes no new log line for
SILENCE_S seconds (py-spy stacks of both ranks are saved into LOG_DIR first), or at HEALTH_TIMEOUT_S."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say

# Lines a healthy idle server prints on its own: they do not count as progress.
PERIODIC = re.compile(r"GET /health|GET /metrics|Avg prompt throughput|Avg generation throughput|"
                      r"KV cache usage|Waiting for .* to connect|Waiting for init message")
POLL_S = 2.0


@dataclass
class Ctx:
    s: object
    rt: object
    infos: dict
    api_key: str | None = None
    offsets: dict = field(default_factory=dict)
    last_line: dict = field(default_factory=dict)


def base_url(s) -> str:
    host = s.head_ip if s.api_host in ("0.0.0.0", "::") else s.api_host
    return f"http://{host}:{s.api_port}"


def healthy(s, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(base_url(s) + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(ctx: Ctx, rank: str, n: int = 5) -> str:
    try:
        text = ctx.rt.read_log(rank, ctx.infos[rank], max(0, ctx.rt.log_size(rank, ctx.infos[rank]) - 4000))
    except DeployError:
        return ""
    lines = [x for x in text.splitlines() if x.strip()][-n:]
    return " | ".join(x[-160:] for x in lines)


def stop_ranks(ctx: Ctx) -> None:
    for rank in ("head", "worker"):
        if rank in ctx.infos:
            try:
                ctx.rt.stop(rank, ctx.infos[rank])
            except DeployError as e:
                say(f"stop {rank}: {e}")


def collect_stacks(ctx: Ctx) -> list[Path]:
    out = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = Path(ctx.s.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank in ("head", "worker"):
        p = log_dir / f"stacks-{rank}-{stamp}.txt"
        try:
            text = ctx.rt.stacks(rank, ctx.infos[rank])
        except DeployError as e:
            text = f"could not collect stacks: {e}"
        p.write_text(text)
        out.append(p)
    return out


def _progress(ctx: Ctx, rank: str, now: float) -> None:
    info = ctx.infos[rank]
    size = ctx.rt.log_size(rank, info)
    off = ctx.offsets.get(rank, 0)
    ctx.last_line.setdefault(rank, now)
    if size > off:
        new = ctx.rt.read_log(rank, info, off, size - off)
        ctx.offsets[rank] = size
        if any(line.strip() and not PERIODIC.search(line) for line in new.splitlines()):
            ctx.last_line[rank] = now


def check_once(ctx: Ctx, now: float) -> None:
    """One supervision step; raises DeployError (both ranks stopped) on a dead or silent rank."""
    for rank in ("worker", "head"):
        if ctx.rt.alive(rank, ctx.infos[rank]) is False:  # None (host not answering) is not proof of death
            tail = _tail(ctx, rank)
            stop_ranks(ctx)
            raise DeployError(f"The {rank} rank exited during boot (last log lines: {tail or 'none'}); read "
                              f"`invoke logs{' --worker' if rank == 'worker' else ''}`, fix the cause and deploy again.")
    for rank in ("worker", "head"):
        _progress(ctx, rank, now)
        quiet = now - ctx.last_line[rank]
        if quiet > ctx.s.silence_s:
            files = collect_stacks(ctx)
            stop_ranks(ctx)
            raise DeployError(f"The {rank} rank wrote no new log line for {quiet:.0f} s (SILENCE_S={ctx.s.silence_s}); "
                              f"Python stacks of both ranks are in {', '.join(map(str, files))}; the boot was stopped.")


def wait_ready(ctx: Ctx) -> float:
    t0 = time.monotonic()
    deadline = t0 + ctx.s.health_timeout_s
    while time.monotonic() < deadline:
        if healthy(ctx.s):
            return time.monotonic() - t0
        check_once(ctx, time.monotonic())
        time.sleep(POLL_S)
    files = collect_stacks(ctx)
    stop_ranks(ctx)
    raise DeployError(f"/health did not answer within HEALTH_TIMEOUT_S={ctx.s.health_timeout_s} s; stacks are in "
                      f"{', '.join(map(str, files))}; raise the timeout or read the logs.")
