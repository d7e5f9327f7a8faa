"""Watchdog of one deployment: `python -m twinspark.deploy.watch STATE_DIR`, started detached by launch as soon as
both ranks run, so it watches whatever becomes of the command that started it (Ctrl-C, a closed terminal).

Boot: `operate.boot_round` every POLL_S (a rank that exits or stays silent, or HEALTH_TIMEOUT_S, stops both ranks:
status failed); each rank's boot phase goes into the health file; /health 200: status running.
Serving, every WATCH_S: the worker's SSH port is probed over the link (TCP connect, LINK_TIMEOUT_S) and every
RANKS_EVERY_S both ranks are asked whether they live (in a thread: a hung SSH never delays the probe). A dead rank:
the other is stopped, status failed. No answer from the worker for SPLIT_S: status split, and the head's gate
(twinspark.deploy.gate) answers every request with the sentence at once. When the worker answers again: a rank that
died meanwhile fails the deployment; else one one-token request through the gate decides: answered, running
again; not within PROBE_S, both ranks are stopped, failed. Every round rewrites the health file (the gate's
heartbeat); a split is reported within SPLIT_S + 2 * WATCH_S (10 s)."""

from __future__ import annotations

import os
import secrets
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from twinspark.deploy import apikey, gate, operate, plugins, state
from twinspark.deploy.config import Settings
from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import make_hosts

WATCH_S = 2.0
LINK_TIMEOUT_S = 2.0
SPLIT_S = 6.0
RANKS_EVERY_S = 4.0
PROBE_S = 60.0


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} watch: {msg}", flush=True)


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


class Watch:
    def __init__(self, state_dir: str):
        self.dir = Path(state_dir)
        self.rec = state.load(self.dir)
        self.s = Settings.model_validate(self.rec["settings"])
        self.head, self.worker = make_hosts(self.s)
        self.rt = plugins.load("twinspark.runtime", self.rec["runtime"])(self.s, self.head, self.worker)
        self.ctx = operate.Ctx(self.s, self.rt, self.rec["ranks"])
        self.health = gate.path_for(self.s.state_dir)
        self.probe = secrets.token_urlsafe(24)
        self.status, self.reason, self.link = "booting", "", "not probed yet"
        self.down_since: float | None = None
        self.pool = ThreadPoolExecutor(1)
        self.pending = None
        self.last_ranks = 0.0

    # ------------------------------------------------------------------ bookkeeping
    def mine(self) -> bool:
        """Still the recorded deployment, not stopped or replaced by a newer one."""
        cur = state.load(self.dir, required=False)
        return bool(cur) and cur.get("started") == self.rec["started"] and cur.get("status") in state.LIVE

    def publish(self) -> None:
        gate.write(self.health, ok=self.status in ("booting", "running"), status=self.status, reason=self.reason,
                   phase=self.ctx.phase, link=self.link, probe=self.probe, started=self.rec["started"],
                   pid=os.getpid())

    def set(self, status: str, reason: str | None = None, **kw) -> None:
        self.status, self.reason = status, reason or ""
        state.set_status(self.dir, status, reason, **kw)
        self.publish()
        log(f"{status}" + (f": {reason}" if reason else ""))

    def fail(self, reason: str) -> int:
        self.set("failed", reason)
        return 1

    def stop(self, rank: str) -> None:
        try:
            self.rt.stop(rank, self.rec["ranks"][rank])
        except DeployError as e:
            log(f"could not stop the {rank} rank: {e}")

    # ------------------------------------------------------------------ boot
    def boot(self) -> int | None:
        t0 = time.monotonic() - max(0.0, time.time() - self.rec["started"])
        while self.mine():
            try:
                took = operate.boot_round(self.ctx, t0)
            except DeployError as e:  # both ranks were stopped
                return self.fail(str(e))
            if took is not None:
                self.set("running", boot_s=round(took, 1), running_since=time.time())
                return None
            self.publish()
            time.sleep(operate.POLL_S)
        return 0

    # ------------------------------------------------------------------ serving
    def ranks_alive(self) -> dict:
        return {rank: self.rt.alive(rank, self.rec["ranks"][rank]) for rank in ("worker", "head")}

    def dead_rank(self, alive: dict) -> int | None:
        for rank, other in (("worker", "head"), ("head", "worker")):
            if alive.get(rank) is False:
                self.stop(other)
                return self.fail(f"the {rank} rank died at {clock(time.time())}; the {other} rank was stopped "
                                 f"(`invoke logs{' --worker' if rank == 'worker' else ''}` shows why; "
                                 "`invoke restart` starts it again)")
        return None

    def split(self, problem: str) -> None:
        self.set("split", f"the worker {self.s.worker_ip} has not answered on port {self.s.ssh_port} since "
                          f"{clock(time.time() - (time.monotonic() - self.down_since))} ({problem}): the link or "
                          "the worker is down, so requests get HTTP 503 until it answers again (`invoke status` "
                          "follows it; `invoke stop` ends the deployment)")

    def probe_request(self) -> str | None:
        """None when a one-token request through the closed gate is answered, else why not."""
        key = apikey.api_key(self.s) if self.s.api_key != "off" else None
        headers = {"X-Twinspark-Probe": self.probe, **({"Authorization": f"Bearer {key}"} if key else {})}
        body = {"model": self.s.served_model_name, "prompt": "ping", "max_tokens": 1}
        try:
            r = httpx.post(operate.base_url(self.s) + "/v1/completions", json=body, headers=headers, timeout=PROBE_S)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}"
        return None if r.status_code == 200 else f"HTTP {r.status_code}"

    def recover(self) -> int | None:
        alive = self.ranks_alive()
        if None in alive.values():
            return None  # the port answers but SSH does not yet: next round
        dead = self.dead_rank(alive)
        if dead is not None:
            return dead
        why = self.probe_request()
        if why is not None:
            operate.stop_ranks(self.ctx)
            return self.fail(f"after the split the engine did not answer a one-token request within {PROBE_S:.0f} s "
                             f"({why}); both ranks were stopped (`invoke restart` starts them again)")
        log("the worker answers again and the engine served a one-token request")
        self.set("running")
        return None

    def round(self) -> int | None:
        now = time.monotonic()
        problem = self.worker.reachable(LINK_TIMEOUT_S)
        if problem is not None:
            self.link = f"down ({problem})"
            self.down_since = self.down_since or now
            if self.status != "split" and time.monotonic() - self.down_since >= SPLIT_S:
                self.split(problem)
            return None
        self.link, self.down_since = "ok", None
        if self.status == "split":
            return self.recover()
        if self.pending is not None and self.pending.done():
            alive, self.pending = self.pending.result(), None
            dead = self.dead_rank(alive)
            if dead is not None:
                return dead
        if self.pending is None and now - self.last_ranks >= RANKS_EVERY_S:
            self.last_ranks = now
            self.pending = self.pool.submit(self.ranks_alive)
        return None

    def serve(self) -> int:
        while self.mine():
            t0 = time.monotonic()
            code = self.round()
            if code is not None:
                return code
            self.publish()
            time.sleep(max(0.0, t0 + WATCH_S - time.monotonic()))
        return 0


def main(state_dir: str) -> int:
    w = Watch(state_dir)
    log(f"watching the deployment started at {clock(w.rec['started'])} (pid {os.getpid()})")
    try:
        code = w.boot()
        return code if code is not None else w.serve()
    except Exception as e:  # noqa: BLE001 - an unwatched deployment must say so: record why the watchdog ended
        traceback.print_exc()  # the heartbeat stops: the gate's /health says nothing watches (requests still pass)
        state.update(w.dir, watch_error=f"{type(e).__name__}: {e}")
        return 2
    finally:
        w.pool.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
