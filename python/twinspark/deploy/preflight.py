"""Preflight: read-only checks on both nodes before anything changes. Contract: `run(s, head, worker, sync)` prints
one line per check and raises DeployError with the first failure's sentence; notices never fail.

Checks: tools, head address is local, key SSH, docker on both nodes (docker runtime), ports free on the head,
RoCE GID entry at the configured index (sysfs under SYSFS_ROOT), MemAvailable >= per-rank weights + margin,
free disk for the chosen sync, the worker's storage matches the sync (a zfs dataset is not rsynced into), weights
complete. Sizes are shown in IEC units (progress.fmt_bytes), so a small lab disk reads "1.0 MiB", not "0.0 GiB".

`disk_full(host, path, total, stderr)` tells a copy that failed for want of space from other failures."""

from __future__ import annotations

import ipaddress
import json
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil

from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say
from twinspark.deploy.progress import fmt_bytes

GIB = 1 << 30


@dataclass
class Check:
    name: str
    ok: bool
    message: str
    notice: bool = False


def tools_needed(s) -> list[str]:
    t = ["ssh", "rsync"] if s.sync == "rsync" else ["ssh"]
    if s.runtime == "docker":
        t.append("docker")
    if s.sync == "zfs":
        t.append("zfs")
    return t


def check_tools(s, head, worker) -> list[Check]:
    out = []
    for host in (head, worker):
        need = [t for t in tools_needed(s) if not (host.remote and t == "ssh")]
        if s.runtime == "process":
            need.append(s.vllm_python.split()[0])
        r = host.run(" ; ".join(f"command -v {shlex.quote(t)} >/dev/null || echo {shlex.quote(t)}" for t in need),
                     changes=False, check=False)
        missing = r.stdout.split()
        out.append(Check(f"tools on {host.name}", not missing,
                         f"missing on the {host.name}: {', '.join(missing)}; install them (scripts/host-deps.sh)"
                         if missing else f"{', '.join(need)} present"))
    return out


def check_head_ip(s) -> Check:
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    ok = s.head_ip in local
    return Check("head address is local", ok, f"{s.head_ip} is local" if ok else
                 f"HEAD_IP={s.head_ip} is not an address of this machine ({', '.join(sorted(local))}); run deploy on "
                 "the head or fix HEAD_IP")


def check_ssh(worker) -> Check:
    r = worker.run("true", changes=False, check=False, timeout=30)
    ok = r.returncode == 0
    return Check("key SSH to worker", ok, "ok" if ok else worker.failure("ssh", r).rstrip("."))


def check_docker(host) -> Check:
    r = host.run("docker info --format '{{.ServerVersion}}'", changes=False, check=False, timeout=30)
    ok = r.returncode == 0
    return Check(f"docker on {host.name}", ok, f"engine {r.stdout.strip()}" if ok else
                 f"Docker does not answer on the {host.name} ({(r.stderr.strip().splitlines() or ['?'])[-1]}); "
                 "start dockerd or use RUNTIME=process")


def check_ports(s) -> Check:
    busy = []
    for port in (s.api_port, s.master_port):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((s.head_ip, port))
            except OSError:
                busy.append(port)
    return Check("ports free on head", not busy, "ok" if not busy else
                 f"port(s) {', '.join(map(str, busy))} on {s.head_ip} are in use; stop what uses them "
                 "(`invoke stop`) or change API_PORT/MASTER_PORT")


# --- RoCE GIDs -----------------------------------------------------------------------------------------------
GID_SCRIPT = r"""
for port in {root}/class/infiniband/*/ports/*; do
  [ -d "$port/gids" ] || continue
  dev=$(basename $(dirname $(dirname $port))); p=$(basename $port)
  for g in $port/gids/*; do
    i=$(basename $g); gid=$(cat $g 2>/dev/null); t=$(cat $port/gid_attrs/types/$i 2>/dev/null | tr ' ' _)
    nd=$(cat $port/gid_attrs/ndevs/$i 2>/dev/null)
    echo "$dev $p $i $gid ${{t:-?}} ${{nd:--}}"
  done
done
"""


def gid_table(host, root: Path) -> list[tuple[str, str, int, str, str, str]]:
    r = host.run(GID_SCRIPT.format(root=shlex.quote(str(root))), changes=False, check=False)
    rows = []
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) == 6 and f[2].isdigit():
            rows.append((f[0], f[1], int(f[2]), f[3], f[4].replace("_", " "), f[5]))
    return rows


def _v4_of(gid: str) -> str | None:
    try:
        a = ipaddress.IPv6Address(gid)
    except ValueError:
        return None
    return str(a.ipv4_mapped) if a.ipv4_mapped else None


def check_gid(host, root: Path, ip: str, index: int) -> Check:
    rows = gid_table(host, root)
    name = f"RoCE GID on {host.name}"
    if not rows:
        return Check(name, True, f"no RDMA devices under {root}/class/infiniband: NCCL will use sockets", notice=True)
    at = [r for r in rows if r[2] == index]
    good = [r for r in at if r[3].strip("0:") and "v2" in r[4].lower()]
    if good:
        return Check(name, True, f"index {index} is RoCE v2 on {', '.join(f'{r[0]}/{r[1]}' for r in good)}")
    want = [r for r in rows if "v2" in r[4].lower() and _v4_of(r[3]) == ip]
    table = "; ".join(f"{d}/{p}[{i}]={g} {t} {nd}" for d, p, i, g, t, nd in rows if g.strip("0:"))
    hint = (f"use GID index {want[0][2]} (RoCE v2 for {ip} on {want[0][0]})" if want
            else f"no RoCE v2 entry carries {ip}: check the address on the RDMA port")
    return Check(name, False, f"GID index {index} on the {host.name} is empty or not RoCE v2 (boot would fail with "
                 f"ibv_modify_qp errno 61); {hint}; table: {table or 'all entries zero'}")


# --- memory, disk, weights -------------------------------------------------------------------------------------
def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def mem_available(host) -> int:
    text = host.read("/proc/meminfo", default="") or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def check_memory(s, host, per_rank: int) -> Check:
    have = mem_available(host)
    need = per_rank + int(s.boot_margin_gib * GIB)
    ok = have >= need
    return Check(f"memory on {host.name}", ok,
                 f"MemAvailable {fmt_bytes(have)} >= {fmt_bytes(need)}" if ok else
                 f"MemAvailable on the {host.name} is {fmt_bytes(have)} but a rank needs {fmt_bytes(per_rank)} "
                 f"of weights + BOOT_MARGIN_GIB={s.boot_margin_gib}; stop what uses the memory")


def space(host, path: Path) -> tuple[int, int, str] | None:
    """(free bytes on the file system holding `path`, bytes already under `path`, that file system's mount point);
    `path` may not exist yet (its nearest existing parent is asked). None when the host does not answer."""
    q = shlex.quote(str(path))
    try:
        r = host.run(f"p={q}; while [ ! -e \"$p\" ]; do p=$(dirname \"$p\"); done; df -PB1 \"$p\" | tail -1; "
                     f"du -sb {q} 2>/dev/null | cut -f1", changes=False, check=False, timeout=20)
    except DeployError:
        return None
    lines = r.stdout.splitlines()
    try:
        fields = lines[0].split()
        free, mount = int(fields[3]), fields[5]
    except (IndexError, ValueError):
        return None
    have = int(lines[1]) if len(lines) > 1 and lines[1].strip().isdigit() else 0
    return free, have, mount


def free_bytes(host, path: Path) -> int:
    return (space(host, path) or (0, 0, ""))[0]


NO_SPACE = ("No space left on device", "Disk quota exceeded", "out of space")


def disk_full(host, path: Path, total: int, stderr: str = "") -> str | None:
    """The sentence for a copy of `total` bytes into `path` that failed because the disk is full (the error says
    so, or what is left to copy exceeds the free space), else None (also when the host cannot be asked)."""
    if host.remote and host.reachable() is not None:  # a link failure, not a disk: do not wait for SSH to say so
        return None
    room = space(host, path)
    if room is None:
        return None
    free, have, mount = room
    more = max(0, total - have)
    if not any(x in stderr for x in NO_SPACE) and more <= free:
        return None
    return (f"The {host.name}'s disk is full: {fmt_bytes(free)} free at {path} (file system on {mount}) but the "
            f"copy needs {fmt_bytes(more)} more of {fmt_bytes(total)}")


def check_disk(s, worker, needed: int, sync_plugin=None) -> Check:
    if needed <= 0:
        return Check("disk on worker", True, "nothing to copy")
    where = getattr(sync_plugin, "room", None)
    free, have, _ = (where() if where else space(worker, s.worker_dir)) or (0, 0, "")
    more = max(0, needed - have)
    ok = free >= more
    return Check("disk on worker", ok, f"{fmt_bytes(free)} free >= {fmt_bytes(more)} to copy" if ok else
                 f"the worker has {fmt_bytes(free)} free at {s.worker_dir} but the sync needs {fmt_bytes(more)} more "
                 f"(of {fmt_bytes(needed)}); free space on the worker or choose another WORKER_MODEL_DIR or SYNC")


def check_storage(sync_plugin) -> Check:
    problem = sync_plugin.storage_problem() if hasattr(sync_plugin, "storage_problem") else None
    return Check("storage on worker", problem is None, "matches the sync" if problem is None else problem)


def weights_problem(model_dir: Path) -> str | None:
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        return f"{d} has no config.json"
    parts = sorted(p.name for p in d.glob("*.part[0-9]*"))
    if parts:
        return f"{d} still holds split parts ({parts[0]} ...) that were not reassembled"
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        shards = set(json.loads(idx.read_text()).get("weight_map", {}).values())
        missing = sorted(x for x in shards if not (d / x).is_file())
        if missing:
            return f"{d} lacks {len(missing)} shard(s) listed in the index, e.g. {missing[0]}"
    elif not list(d.glob("*.safetensors")):
        return f"{d} has no .safetensors files"
    return None


def check_weights(s) -> Check:
    problem = weights_problem(s.model_dir)
    return Check("weights complete", problem is None, "ok" if problem is None else
                 f"{problem}; run the download (AUTO_DOWNLOAD=1) or fix MODEL_DIR")


def run(s, head, worker, sync_plugin=None, quiet: bool = False) -> list[Check]:
    checks = check_tools(s, head, worker) + [check_head_ip(s), check_ssh(worker)]
    if checks[-1].ok:
        if s.runtime == "docker":
            checks += [check_docker(head), check_docker(worker)]
        checks.append(check_ports(s))
        checks.append(check_gid(head, s.sysfs_root, s.head_ip, s.head_gid_index))
        checks.append(check_gid(worker, s.sysfs_root, s.worker_ip, s.worker_gid_index))
        checks.append(check_weights(s))
        if checks[-1].ok:
            per_rank = weight_bytes(s.model_dir) // s.tensor_parallel
            checks += [check_memory(s, head, per_rank), check_memory(s, worker, per_rank)]
            if sync_plugin is not None and not s.skip_sync:
                checks.append(check_storage(sync_plugin))
                checks.append(check_disk(s, worker, sync_plugin.needed_bytes(), sync_plugin))
    if not quiet:
        for c in checks:
            say(f"preflight {'NOTE' if c.notice else 'ok  ' if c.ok else 'FAIL'} {c.name}: {c.message}")
    bad = [c for c in checks if not c.ok]
    if bad:
        raise DeployError(f"Preflight failed: {bad[0].message}.")
    return checks
