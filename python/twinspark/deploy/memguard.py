"""Memory guard for one node: `python -m twinspark.deploy.memguard (--pid PID | --container NAME) [--min-gib G]`.

Samples MemAvailable every second (from --meminfo, default /proc/meminfo); after two consecutive samples under
the threshold it logs the top memory users (processes by resident memory, and containers when docker answers),
then stops its own serving rank only (the process session of PID, or the container NAME) and exits 3."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import psutil

GIB = 1 << 30


def mem_available(meminfo: str) -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"memguard: no MemAvailable line in {meminfo}")


def top_users(n: int = 8) -> list[str]:
    procs = []
    for p in psutil.process_iter(["pid", "name", "memory_info"]):
        mi = p.info.get("memory_info")
        if mi:
            procs.append((mi.rss, p.info["pid"], p.info["name"]))
    lines = [f"  pid {pid:>7} {rss / GIB:6.2f} GiB {name}" for rss, pid, name in sorted(procs, reverse=True)[:n]]
    r = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}"],
                       capture_output=True, text=True, timeout=20) if _has_docker() else None
    if r is not None and r.returncode == 0:
        lines += [f"  container {x}" for x in r.stdout.splitlines()[:n]]
    return lines


def _has_docker() -> bool:
    from shutil import which

    return which("docker") is not None


def stop_target(pid: int | None, container: str | None) -> None:
    if container:
        subprocess.run(["docker", "stop", "-t", "10", container], capture_output=True, timeout=60)
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(30):  # bounded: 15 s grace, then SIGKILL
        time.sleep(0.5)
        if not _group_alive(pid):
            return
    os.killpg(pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    """Any process of the group still running (zombies waiting for their parent do not count)."""
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--pid", type=int, help="session leader PID of the serving rank (process runtime)")
    g.add_argument("--container", help="serving container name (docker runtime)")
    ap.add_argument("--min-gib", type=float, default=1.5, help="threshold in GiB (default 1.5)")
    ap.add_argument("--meminfo", default="/proc/meminfo", help="file to read MemAvailable from")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    a = ap.parse_args(argv)
    low = 0
    print(f"memguard: watching {'pid ' + str(a.pid) if a.pid else 'container ' + a.container}, "
          f"threshold {a.min_gib} GiB", flush=True)
    while True:
        if a.pid and not psutil.pid_exists(a.pid):
            print("memguard: the rank is gone; exiting", flush=True)
            return 0
        avail = mem_available(a.meminfo)
        low = low + 1 if avail < a.min_gib * GIB else 0
        if low >= 2:
            print(f"memguard: MemAvailable {avail / GIB:.2f} GiB < {a.min_gib} GiB twice; top memory users:", flush=True)
            print("\n".join(top_users()), flush=True)
            stop_target(a.pid, a.container)
            print("memguard: stopped the serving rank", flush=True)
            return 3
        time.sleep(a.interval)


if __name__ == "__main__":
    sys.exit(main())
