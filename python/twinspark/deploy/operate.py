"""Boot supervision (run by the watchdog, twinspark.deploy.watch). Contract: `boot_round(ctx, t0)` is one round:
the boot time when /health answers 200, None while booting; DeployError (after stopping both ranks) when a rank
exits, when a rank writes no new log line for SILENCE_S seconds (py-spy stacks of both ranks are saved into LOG_DIR
first), or at HEALTH_TIMEOUT_S. Each round reads the ranks' new log lines, and `ctx.phase[rank]` says which boot
phase the newest of them shows (`phase_of`)."""

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
# Boot phases in the order vLLM goes through them (CUDA and CPU builds; the plugin's memory lines too): a rank's
# phase is the furthest one its log has shown.
PHASES = (
    (re.compile(r"non-default args|Resolved architecture|Launching vLLM .*headless"), "reading the model config"),
    (re.compile(r"Initializing a V1 LLM engine|DP group leader|OpenMP thread binding"), "starting the engine"),
    (re.compile(r"distributed_init_method|init_process_group|TCPStore|Waiting for .* to connect"),
     "joining the other rank (torch.distributed)"),
    (re.compile(r"Starting to load model|Loading safetensors|Loading weights(?! took)|Loading model"),
     "loading weights"),
    (re.compile(r"Loading weights took|Model loading took|\"phase\": \"weights_loaded\""), "weights loaded"),
    (re.compile(r"KV cache|Memory profiling|\"phase\": \"profiled\""), "profiling memory, allocating the KV cache"),
    (re.compile(r"Compiling a graph|torch\.compile takes|Dynamo bytecode transform|Capturing CUDA graph"),
     "compiling, capturing CUDA graphs"),
    (re.compile(r"init engine .* took|Graph capturing finished|\"phase\": \"graphs_captured\""),
     "engine ready"),
    (re.compile(r"Starting vLLM server|Available routes|Application startup complete"), "starting the API server"),
)


@dataclass
class Ctx:
    s: object
    rt: object
    infos: dict
    api_key: str | None = None
    offsets: dict = field(default_factory=dict)
    last_line: dict = field(default_factory=dict)
    phase: dict = field(default_factory=dict)

    def __post_init__(self):
        # a rank's log may hold earlier deployments' lines (process runtime: appended): read from where this one began
        for rank, info in self.infos.items():
            self.offsets.setdefault(rank, int(info.get("log_offset", 0)))


def phase_of(text: str, current: str = "") -> str:
    """The furthest boot phase that `text` (new log lines) shows, never going back behind `current`."""
    labels = [label for _, label in PHASES]
    best = labels.index(current) if current in labels else -1
    for line in text.splitlines():
        for i, (rx, _) in enumerate(PHASES):
            if i > best and rx.search(line):
                best = i
    return labels[best] if best >= 0 else current


def base_url(s) -> str:
    host = s.head_ip if s.api_host in ("0.0.0.0", "::") else s.api_host
    return f"http://{host}:{s.api_port}"


def health(s, timeout: float = 2.0) -> tuple[int | None, str]:
    """(HTTP status of the head's /health or None when it does not answer, the gate's sentence on a 503)."""
    try:
        r = httpx.get(base_url(s) + "/health", timeout=timeout)
    except httpx.HTTPError as e:
        return None, f"not answering ({type(e).__name__})"
    try:
        message = r.json()["error"]["message"] if r.status_code != 200 else ""
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    return r.status_code, message


def healthy(s, timeout: float = 2.0) -> bool:
    return health(s, timeout)[0] == 200


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
        ctx.phase[rank] = phase_of(new, ctx.phase.get(rank, ""))
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


def boot_round(ctx: Ctx, t0: float) -> float | None:
    """One round of the boot wait that began at monotonic time t0."""
    now = time.monotonic()
    if healthy(ctx.s):
        return now - t0
    check_once(ctx, now)
    if now - t0 > ctx.s.health_timeout_s:
        files = collect_stacks(ctx)
        stop_ranks(ctx)
        raise DeployError(f"/health did not answer within HEALTH_TIMEOUT_S={ctx.s.health_timeout_s} s; stacks are in "
                          f"{', '.join(map(str, files))}; the boot was stopped: raise the timeout or read the logs.")
    return None
