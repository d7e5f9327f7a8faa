"""What the invoke tasks call. Contract: every function takes `flags` (KEY -> value, highest precedence) and
`dry_run`; it returns a short summary string or raises DeployError (one sentence; `progress.Interrupted` on Ctrl-C,
saying what state was left and how to resume). Settings and plugin names are checked before any host is touched.
Steps of `deploy`, each timed and showing its progress (twinspark.deploy.progress): fabric, download, preflight,
image + ship (docker runtime), weight sync, then launch and boot (twinspark.deploy.launching). The commands that act
on what runs (status, logs, stop, restart) take the recorded deployment's settings, flags given now over them. `status` returns rows and an exit code (0 serving, 1 not deployed, stopped or
failed, 2 deployed but not serving now: booting, split, unwatched)."""

from __future__ import annotations

import shlex
import time

from twinspark.deploy import config, gate, launching, operate, plugins, preflight, progress, state
from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import make_hosts, say

NOTHING_CHANGED = "nothing was changed; run the command again"
SYNC_RESUME = {
    "rsync": "the worker's copy is incomplete (it has no sync marker, so nothing serves from it) and resumes where "
             "it stopped: run `invoke deploy` (or `invoke sync`) again",
    "zfs": "the worker did not receive the snapshot (the head's was destroyed); `invoke deploy` (or `invoke sync`) "
           "sends it again from the start",
    "nfs": "the export or the mount may be half made; `invoke deploy` (or `invoke sync`) makes them again",
}
IMAGE_RESUME = ("a built image is kept and a staged copy resumes where it stopped (a streamed one restarts): run "
                "`invoke deploy` (or `invoke ship`) again")
DOWNLOAD_RESUME = "finished files and partial shards are kept: run `invoke deploy` again to resume the download"


def _setup(flags: dict, dry_run: bool):
    s, where = config.load(flags)
    plugins.check_names(s, where)
    head, worker = make_hosts(s, dry_run=dry_run)
    return s, where, head, worker


def _recorded(flags: dict, dry_run: bool = False, required: bool = True):
    """For the commands that act on what runs (status, logs, stop, restart): the recorded deployment's settings,
    flags given now over them (`saved_flags`), its record (None when there is none and not `required`)."""
    s0, _ = config.load(flags)
    rec = state.load(s0.state_dir, required=required)
    s, where, head, worker = _setup({**saved_flags(rec), **flags}, dry_run)
    return s, head, worker, rec


def show_config(flags: dict) -> list[tuple[str, str, str]]:
    s, where = config.load(flags)
    plugins.check_names(s, where)
    return config.describe(where, s)


def _sync_plugin(s, head, worker):
    return plugins.load("twinspark.sync", s.sync)(s, head, worker)


def _runtime(s, head, worker):
    return plugins.load("twinspark.runtime", s.runtime)(s, head, worker)


def sync(flags: dict, dry_run: bool = False) -> str:
    s, _, head, worker = _setup(flags, dry_run)
    try:
        with progress.Steps(quiet=True).step(f"sync ({s.sync})", SYNC_RESUME.get(s.sync, NOTHING_CHANGED)):
            return _sync_plugin(s, head, worker).sync()
    finally:
        worker.close()


def ship(flags: dict, dry_run: bool = False) -> str:
    s, _, head, worker = _setup(flags, dry_run)
    from twinspark.deploy import image

    try:
        with progress.Steps(quiet=True).step("image", IMAGE_RESUME):
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


def _refuse_live(s, head, worker) -> None:
    old = state.load(s.state_dir, required=False)
    if old and old.get("status") in state.LIVE:
        rt = _runtime_for(old, head, worker, s)
        if any(rt.alive(r, old["ranks"][r]) for r in old.get("ranks", {})):
            raise DeployError("A deployment is already running (see `invoke status`); run `invoke stop` or "
                              "`invoke restart` first.")


def deploy(flags: dict, dry_run: bool = False, skip_preflight: bool = False) -> str:
    s, where, head, worker = _setup(flags, dry_run)
    steps = progress.Steps()
    try:
        with steps.step("fabric", NOTHING_CHANGED):
            s = apply_fabric(s, where, head, worker)
            if not dry_run:
                _refuse_live(s, head, worker)
        if s.auto_download:
            from twinspark.deploy import download

            with steps.step("download", DOWNLOAD_RESUME):
                say(download.fetch(s, dry_run=dry_run))
        syncp = None if s.skip_sync else _sync_plugin(s, head, worker)
        if not skip_preflight:
            with steps.step("preflight", NOTHING_CHANGED):
                preflight.run(s, head, worker, syncp)
        if s.runtime == "docker":
            from twinspark.deploy import image

            with steps.step("image", IMAGE_RESUME):
                say(image.ensure_and_ship(s, head, worker))
        if syncp is not None:
            with steps.step(f"sync ({s.sync})", SYNC_RESUME.get(s.sync, NOTHING_CHANGED)):
                say(syncp.sync())
        return launching.launch_ranks(s, head, worker, dry_run, steps)
    finally:
        worker.close()


def launch(flags: dict, dry_run: bool = False) -> str:
    s, _, head, worker = _setup(flags, dry_run)
    try:
        return launching.launch_ranks(s, head, worker, dry_run, progress.Steps())
    finally:
        worker.close()


def _runtime_for(rec: dict, head, worker, s):
    return plugins.load("twinspark.runtime", rec.get("runtime", s.runtime))(s, head, worker)


def _clock(t) -> str:
    return time.strftime("%H:%M:%S", time.localtime(float(t or 0)))


def _deployment_row(rec: dict, health: dict, api: tuple) -> str:
    st, reason = rec.get("status", "?"), rec.get("reason")
    if st == "running":
        line = f"running since {_clock(rec.get('running_since') or rec.get('started'))} (boot {rec.get('boot_s')} s)"
        return line if api[0] == 200 else f"{line}, but /health says: {api[1]}"
    if st == "booting":
        return f"booting since {_clock(rec.get('started'))} ({launching.phase_text(health.get('phase') or {})})"
    return f"{st}: {reason}" if reason else st


def status(flags: dict) -> tuple[list[tuple[str, str]], int]:
    """Rows of `invoke status` and its exit code: 0 serving, 1 nothing deployed / stopped / failed, 2 deployed but
    not serving now (booting, split, unwatched, a rank or the link down)."""
    s, head, worker, rec = _recorded(flags, required=False)
    try:
        if not rec:
            return [("deployment", f"none recorded in {state.path(s.state_dir).parent}; `invoke deploy` starts one")], 1
        rt = _runtime_for(rec, head, worker, s)
        health = gate.read(gate.path_for(s.state_dir)) or {}
        api = operate.health(s)
        rows = [("deployment", _deployment_row(rec, health, api))]
        link = worker.reachable()
        alive = {}
        for rank in ("head", "worker"):
            info = rec["ranks"].get(rank, {})
            alive[rank] = None if rank == "worker" and link else (rt.alive(rank, info) if info else False)
            ident = info.get("container") or f"pid {info.get('pid')}"
            word = {True: "running", False: "down", None: "unknown (host not answering)"}[alive[rank]]
            rows.append((f"{rank} rank", f"{word} ({ident})"))
        rows.append(("link", f"ok ({s.worker_ip}:{s.ssh_port} answers)" if link is None else f"down ({link})"))
        watched = rec.get("status") in state.LIVE and head.alive(rec.get("watch_pid") or 0) is True
        age = time.time() - float(health.get("t") or 0)
        rows.append(("watchdog", f"running (pid {rec.get('watch_pid')}, last report {age:.0f} s ago)" if watched else
                     f"not running{' (' + rec['watch_error'] + ')' if rec.get('watch_error') else ''}"))
        said = api[1] if api[1] != rec.get("reason") else "the reason above"
        rows.append(("API /health", "ok" if api[0] == 200 else f"HTTP {api[0]}: {said}" if api[0] else api[1]))
        rows.append(("endpoint", operate.base_url(s) + "/v1"))
    finally:
        worker.close()
    serving = rec.get("status") == "running" and api[0] == 200 and all(alive.values()) and link is None and watched
    return rows, 0 if serving else 1 if rec.get("status") in ("stopped", "failed") or not any(alive.values()) else 2


def logs(flags: dict, worker_rank: bool = False, lines: int = 50) -> str:
    s, head, worker, rec = _recorded(flags)
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

    s, head, worker, rec = _recorded(flags)
    rt = _runtime_for(rec, head, worker, s)
    records = []
    for rank in ("head", "worker"):
        info = rec["ranks"].get(rank)
        if info:
            start = int(info.get("log_offset", 0))  # this deployment's lines only
            records += memlog.parse(rt.read_log(rank, info, start, max(0, rt.log_size(rank, info) - start)))
    worker.close()
    return memlog.format_summary(memlog.summarize(records))


def stop(flags: dict, dry_run: bool = False) -> str:
    s, head, worker, rec = _recorded(flags, dry_run, required=False)
    if not rec:
        return "nothing recorded as running"
    rt = _runtime_for(rec, head, worker, s)
    if rec.get("watch_pid") and not dry_run:
        head.kill_group(rec["watch_pid"], grace_s=2)
    left = []
    for rank, pid in (rec.get("memguard") or {}).items():
        try:
            (head if rank == "head" else worker).kill_group(pid, grace_s=2)
        except DeployError:
            left.append(f"the {rank}'s memory guard")
    for rank in ("head", "worker"):
        if rank in rec.get("ranks", {}):
            if dry_run:
                say(f"[dry-run] {rank}: stop {rec['ranks'][rank]}")
                continue
            try:
                rt.stop(rank, rec["ranks"][rank])
            except DeployError as e:
                say(f"stop {rank}: {e}")
                left.append(f"the {rank} rank")
    if dry_run:
        return "dry-run: nothing was stopped"
    reason = (f"{' and '.join(left)} could not be stopped ({s.worker_ip} did not answer); run `invoke stop` again "
              "once it answers") if left else None
    state.set_status(s.state_dir, "stopped", reason)
    gate.path_for(s.state_dir).unlink(missing_ok=True)
    worker.close(force=True)
    if left:
        raise DeployError(f"Stopped what answered, but {reason}.")
    return "stopped both ranks"


SKIP_ON_RESTART = ("SKIP_SYNC",)  # one-off choices of a deploy: a restart decides them anew


def saved_flags(rec: dict | None) -> dict:
    """The effective settings a deployment was started with, as flags (the lowest layer of a restart)."""
    saved = (rec or {}).get("settings") or {}
    return {k.upper(): v for k, v in saved.items()  # keys of an older schema are left out
            if v is not None and k in config.Settings.model_fields and k.upper() not in SKIP_ON_RESTART}


def restart(flags: dict, dry_run: bool = False, skip_preflight: bool = False) -> str:
    """Stop, then deploy again with the recorded deployment's settings; flags given now override them. A sync
    method that does not match the worker's storage is refused before anything is stopped."""
    s, head, worker, rec = _recorded(flags, dry_run, required=False)
    merged = {**saved_flags(rec), **flags}
    try:
        if rec:
            say(f"restart: with the settings of the deployment started at {_clock(rec.get('started'))} (RECIPE="
                f"{s.recipe}, RUNTIME={s.runtime}, SYNC={s.sync}{', SKIP_SYNC' if s.skip_sync else ''}); flags given "
                "now override them")
        if not s.skip_sync:
            problem = _sync_plugin(s, head, worker).storage_problem()
            if problem:
                raise DeployError(f"Refusing to restart: {problem}; nothing was stopped.")
    finally:
        worker.close()
    say(stop(merged, dry_run))
    return deploy(merged, dry_run, skip_preflight=skip_preflight)


def quote_flags(flags: dict) -> str:
    return " ".join(f"{k}={shlex.quote(str(v))}" for k, v in flags.items())
