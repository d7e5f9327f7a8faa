"""Launch and boot of a deployment (the last two steps of `invoke deploy`, all of `invoke launch`). Contract:
`launch_ranks(s, head, worker, dry_run, steps) -> str` starts the worker rank, the head rank, then at once the
watchdog (twinspark.deploy.watch) and memory guards, so the deployment is watched whatever becomes of the command;
a failure or Ctrl-C during the start stops what was started. Then it follows the boot through the watchdog's
record and health file (each rank's phase) until the watchdog says running or failed; Ctrl-C there leaves the
deployment booting under the watchdog, and says so."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from twinspark.deploy import apikey, gate, operate, plugins, progress, state
from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say
from twinspark.deploy.vllm_args import rank_env
from twinspark.paths import checkout_commit


def launch_ranks(s, head, worker, dry_run: bool, steps) -> str:
    rt = plugins.load("twinspark.runtime", s.runtime)(s, head, worker)
    key = apikey.api_key(s, dry_run=dry_run)
    if key is None and s.api_host in ("0.0.0.0", "::"):
        say(f"warning: API_KEY=off and API_HOST={s.api_host}: anyone who reaches port {s.api_port} of the head can "
            "use the model; set API_KEY=generate, or API_HOST to an address only you reach")
    rec = {"runtime": s.runtime, "status": "booting", "ranks": {}, "started": time.time(),
           "settings": s.model_dump(mode="json"), "watch_pid": 0, "commit": checkout_commit()}
    if key and s.api_key != "generate":  # your own key lives in the 0600 key file only; generate reuses that file
        rec["settings"]["api_key"] = "generate"
    with steps.step("launch", "the ranks started so far were stopped, nothing runs: run `invoke deploy` again"):
        _start(s, head, worker, rt, rec, {"VLLM_API_KEY": key} if key else {}, dry_run)
    if dry_run:
        return "dry-run: nothing was started"
    watch_log = Path(s.log_dir).resolve() / "watch.log"
    with steps.step("boot", lambda: f"the deployment keeps booting, watched by the watchdog (pid {rec['watch_pid']}, "
                                    f"log {watch_log}): `invoke status` shows how far it got, `invoke stop` stops it"):
        boot = _follow(s, rec, head, rt)
    progress.console().print(steps.table())
    keynote = f"; API key in {apikey.key_path(s.state_dir).resolve()}" if key else ""
    return f"serving {s.served_model_name} at {operate.base_url(s)}/v1 after {boot:.0f} s{keynote}"


def _start(s, head, worker, rt, rec: dict, secret: dict, dry_run: bool) -> None:
    """Worker rank, head rank, watchdog and memory guards; on any failure or Ctrl-C what was started is stopped."""
    infos = rec["ranks"]
    try:
        if hasattr(rt, "preflight_launch"):
            rt.preflight_launch()
        if not dry_run:  # a fresh health file: the gate never reads an earlier deployment's verdict
            gate.write(gate.path_for(s.state_dir), ok=True, status="booting", reason="", started=rec["started"])
        infos["worker"] = rt.start("worker", rank_env(s, "worker"))  # worker first: the head waits for it
        if not dry_run:
            state.save(s.state_dir, rec)
        infos["head"] = rt.start("head", rank_env(s, "head"), secret_env=secret)
        if dry_run:
            return
        rec["watch_pid"] = _spawn_watch(s)
        rec["memguard"] = _spawn_memguards(s, head, worker, rt, infos) if s.memguard else {}
        state.save(s.state_dir, rec)
    except BaseException as e:
        if not dry_run:
            _undo_start(s, head, rt, rec, e)
        raise


def _undo_start(s, head, rt, rec: dict, e: BaseException) -> None:
    if rec.get("watch_pid"):
        head.kill_group(rec["watch_pid"], grace_s=2)
    operate.stop_ranks(operate.Ctx(s, rt, rec["ranks"]))
    rec.update(status="failed" if isinstance(e, DeployError) else "stopped",
               reason=str(e) if isinstance(e, DeployError) else None)
    state.save(s.state_dir, rec)


def phase_text(phase: dict) -> str:
    return "; ".join(f"{rank}: {phase[rank]}" for rank in ("head", "worker") if phase.get(rank)) or "starting"


def _follow(s, rec: dict, head, rt) -> float:
    """Wait for the watchdog to report the boot's end; show each rank's phase meanwhile."""
    health = gate.path_for(s.state_dir)
    with progress.Phase("boot") as shown:
        while True:
            cur = state.load(s.state_dir, required=False) or {}
            if cur.get("started") != rec["started"]:
                raise DeployError("Another deployment replaced this one during its boot; `invoke status` shows it.")
            if cur.get("status") == "running":
                return float(cur.get("boot_s") or 0.0)
            if cur.get("status") not in state.LIVE:
                raise DeployError(cur.get("reason") or f"The deployment was {cur.get('status')} during its boot.")
            if head.alive(rec["watch_pid"]) is False:
                operate.stop_ranks(operate.Ctx(s, rt, rec["ranks"]))
                why = (f"The watchdog (pid {rec['watch_pid']}) exited during the boot (see "
                       f"{Path(s.log_dir).resolve() / 'watch.log'}); both ranks were stopped: deploy again.")
                state.set_status(s.state_dir, "failed", why)
                raise DeployError(why)
            shown.set(phase_text((gate.read(health) or {}).get("phase") or {}))
            time.sleep(1.0)


def _spawn_watch(s) -> int:
    log = Path(s.log_dir).resolve() / "watch.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        p = subprocess.Popen([sys.executable, "-m", "twinspark.deploy.watch", str(Path(s.state_dir).resolve())],
                             stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                             cwd=os.getcwd())
    return p.pid


def _spawn_memguards(s, head, worker, rt, infos) -> dict:
    out = {}
    for rank, host in (("head", head), ("worker", worker)):
        target = rt.guard_target(rank, infos[rank]) if hasattr(rt, "guard_target") else ["--pid", str(infos[rank]["pid"])]
        py = sys.executable if rank == "head" else s.vllm_python
        argv = [py, "-m", "twinspark.deploy.memguard", *target, "--min-gib", str(s.memguard_min_gib)]
        out[rank] = host.spawn(argv, env={}, log=Path(s.log_dir).resolve() / f"memguard-{rank}.log")
    return out
