"""What the invoke tasks call. Contract: every function takes `flags` (KEY -> value, highest precedence) and
`dry_run`; it returns a short summary string or raises DeployError (one sentence). Order of `deploy`: preflight,
download, image + ship (docker runtime), weight sync, worker rank, head rank, /health, watchdog (+ memory guards)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from twinspark.deploy import apikey, config, operate, plugins, preflight, state
from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import make_hosts, say
from twinspark.deploy.vllm_args import rank_env


def _setup(flags: dict, dry_run: bool):
    s, where = config.load(flags)
    head, worker = make_hosts(s, dry_run=dry_run)
    return s, where, head, worker


def show_config(flags: dict) -> list[tuple[str, str, str]]:
    s, where = config.load(flags)
    return config.describe(where, s)


def _sync_plugin(s, head, worker):
    return plugins.load("twinspark.sync", s.sync)(s, head, worker)


def _runtime(s, head, worker):
    return plugins.load("twinspark.runtime", s.runtime)(s, head, worker)


def sync(flags: dict, dry_run: bool = False) -> str:
    s, _, head, worker = _setup(flags, dry_run)
    try:
        return _sync_plugin(s, head, worker).sync()
    finally:
        worker.close()


def ship(flags: dict, dry_run: bool = False) -> str:
    s, _, head, worker = _setup(flags, dry_run)
    from twinspark.deploy import image

    try:
        return image.ensure_and_ship(s, head, worker)
    finally:
        worker.close()


_FABRIC_KEYS = ("HEAD_IFNAME", "WORKER_IFNAME", "HEAD_HCAS", "WORKER_HCAS", "HEAD_GID_INDEX", "WORKER_GID_INDEX")


def apply_fabric(s, where: dict, head, worker):
    """Fill the fabric keys from detection on both nodes (twinspark.deploy.fabric) unless the user set any of them
    or FABRIC_AUTO is off. The configured HEAD_IP/WORKER_IP decide the interface; an address that detection
    refuses (loopback alias, Wi-Fi, Tailscale, docker bridge) stops the deploy with the reason."""
    if not s.fabric_auto or any(where.get(k, "default") != "default" for k in _FABRIC_KEYS):
        return s
    from twinspark.deploy import fabric as fb

    update = {}
    for host, role, ip in ((head, "head", s.head_ip), (worker, "worker", s.worker_ip)):
        f = fb.detect_host(lambda cmd, h=host: h.run(cmd, changes=False, what="fabric snapshot").stdout)
        cand = next((c for c in f.candidates if c.ipv4 == str(ip)), None)
        if cand is None:
            say(f"fabric: {ip} is not on a detected interface of the {role}; NCCL picks its interface itself")
            continue
        if not cand.ok:
            raise DeployError(f"The {role} address {ip} on {cand.ifname} is not a fabric address: {cand.reason}; "
                              f"set {role.upper()}_IP to the fabric port's address (see `invoke fabric --both`).")
        update[f"{role}_ifname"] = cand.ifname
        if cand.transport == "rdma" and cand.hcas:
            update[f"{role}_hcas"] = ",".join(cand.hcas)
            if cand.gid_index is not None:
                update[f"{role}_gid_index"] = cand.gid_index
            say(f"fabric: {role} uses {cand.ifname} ({', '.join(cand.hcas)}, RoCE v2 GID index {cand.gid_index})")
        else:
            say(f"fabric: no RDMA device for {ip} on the {role} ({f.notice or 'socket transport'}); "
                f"NCCL and Gloo use sockets over {cand.ifname}")
    return s.model_copy(update=update)


def deploy(flags: dict, dry_run: bool = False, skip_preflight: bool = False) -> str:
    s, where, head, worker = _setup(flags, dry_run)
    try:
        s = apply_fabric(s, where, head, worker)
        old = state.load(s.state_dir, required=False)
        if old and old.get("status") in ("booting", "running") and not dry_run:
            rt = _runtime_for(old, head, worker, s)
            if any(rt.alive(r, old["ranks"][r]) for r in old.get("ranks", {})):
                raise DeployError("A deployment is already running (see `invoke status`); run `invoke stop` or "
                                  "`invoke restart` first.")
        if s.auto_download:
            from twinspark.deploy import download

            say(download.fetch(s, dry_run=dry_run))
        syncp = None if s.skip_sync else _sync_plugin(s, head, worker)
        if not skip_preflight:
            preflight.run(s, head, worker, syncp)
        if s.runtime == "docker":
            from twinspark.deploy import image

            say(image.ensure_and_ship(s, head, worker))
        if syncp is not None:
            say(syncp.sync())
        return _launch(s, head, worker, dry_run)
    finally:
        worker.close()


def launch(flags: dict, dry_run: bool = False) -> str:
    s, _, head, worker = _setup(flags, dry_run)
    try:
        return _launch(s, head, worker, dry_run)
    finally:
        worker.close()


def _runtime_for(rec: dict, head, worker, s):
    return plugins.load("twinspark.runtime", rec.get("runtime", s.runtime))(s, head, worker)


def _launch(s, head, worker, dry_run: bool) -> str:
    rt = _runtime(s, head, worker)
    key = apikey.api_key(s, dry_run=dry_run)
    secret = {"VLLM_API_KEY": key} if key else {}
    infos = {}
    rec = {"runtime": s.runtime, "status": "booting", "ranks": infos, "started": time.time(),
           "settings": s.model_dump(mode="json"), "watch_pid": 0}
    if hasattr(rt, "preflight_launch"):
        rt.preflight_launch()
    infos["worker"] = rt.start("worker", rank_env(s, "worker"))  # worker first: the head waits for it
    if not dry_run:
        state.save(s.state_dir, rec)
    infos["head"] = rt.start("head", rank_env(s, "head"), secret_env=secret)
    if dry_run:
        return "dry-run: nothing was started"
    state.save(s.state_dir, rec)
    ctx = operate.Ctx(s, rt, infos, key)
    try:
        boot = operate.wait_ready(ctx)
    except DeployError as e:
        state.update(s.state_dir, status="failed", reason=str(e))
        raise
    rec["status"] = "running"
    rec["boot_s"] = round(boot, 1)
    rec["watch_pid"] = _spawn_watch(s)
    rec["memguard"] = _spawn_memguards(s, head, worker, rt, infos) if s.memguard else {}
    state.save(s.state_dir, rec)
    keynote = f"; API key in {apikey.key_path(s.state_dir).resolve()}" if key else ""
    return f"serving {s.served_model_name} at {operate.base_url(s)}/v1 after {boot:.0f} s{keynote}"


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


def status(flags: dict) -> list[tuple[str, str]]:
    s, _, head, worker = _setup(flags, False)
    rec = state.load(s.state_dir)
    rt = _runtime_for(rec, head, worker, s)
    rows = [("deployment", rec.get("status", "?") + (f" ({rec['reason']})" if rec.get("reason") else ""))]
    for rank in ("head", "worker"):
        info = rec["ranks"].get(rank, {})
        alive = rt.alive(rank, info) if info else False
        ident = info.get("container") or f"pid {info.get('pid')}"
        word = {True: "running", False: "down", None: "unknown (host not answering)"}[alive]
        rows.append((f"{rank} rank", f"{word} ({ident})"))
    rows.append(("API /health", "ok" if operate.healthy(s) else "not answering"))
    rows.append(("endpoint", operate.base_url(s) + "/v1"))
    worker.close()
    return rows


def logs(flags: dict, worker_rank: bool = False, lines: int = 50) -> str:
    s, _, head, worker = _setup(flags, False)
    rec = state.load(s.state_dir)
    rt = _runtime_for(rec, head, worker, s)
    rank = "worker" if worker_rank else "head"
    info = rec["ranks"][rank]
    size = rt.log_size(rank, info)
    text = rt.read_log(rank, info, max(0, size - 200 * lines), 200 * lines)
    worker.close()
    return "\n".join(text.splitlines()[-lines:])


def memory_summary(flags: dict) -> str:
    """Both ranks' memory lines (twinspark.memory.memlog, written by the plugin's hooks into the serving logs):
    each rank's MemAvailable low-water mark and the phase that set it."""
    from twinspark.memory import memlog

    s, _, head, worker = _setup(flags, False)
    rec = state.load(s.state_dir)
    rt = _runtime_for(rec, head, worker, s)
    records = []
    for rank in ("head", "worker"):
        info = rec["ranks"].get(rank)
        if info:
            records += memlog.parse(rt.read_log(rank, info, 0, rt.log_size(rank, info)))
    worker.close()
    return memlog.format_summary(memlog.summarize(records))


def stop(flags: dict, dry_run: bool = False) -> str:
    s, _, head, worker = _setup(flags, dry_run)
    rec = state.load(s.state_dir, required=False)
    if not rec:
        return "nothing recorded as running"
    rt = _runtime_for(rec, head, worker, s)
    if rec.get("watch_pid") and not dry_run:
        head.kill_group(rec["watch_pid"], grace_s=2)
    for rank, pid in (rec.get("memguard") or {}).items():
        (head if rank == "head" else worker).kill_group(pid, grace_s=2)
    for rank in ("head", "worker"):
        if rank in rec.get("ranks", {}):
            if dry_run:
                say(f"[dry-run] {rank}: stop {rec['ranks'][rank]}")
            else:
                rt.stop(rank, rec["ranks"][rank])
    if not dry_run:
        state.update(s.state_dir, status="stopped")
    worker.close(force=True)
    return "dry-run: nothing was stopped" if dry_run else "stopped both ranks"


def restart(flags: dict, dry_run: bool = False, skip_sync: bool = False) -> str:
    say(stop(flags, dry_run))
    if skip_sync:
        flags = {**flags, "SKIP_SYNC": True}
    return deploy(flags, dry_run)


def quote_flags(flags: dict) -> str:
    return " ".join(f"{k}={shlex.quote(str(v))}" for k, v in flags.items())
