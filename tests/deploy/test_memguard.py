"""Memory guard: stops its own serving process (a real process session) after two low MemAvailable samples and
logs the top memory users, leaving other processes alone."""

from __future__ import annotations

import subprocess
import sys
import time


def _meminfo(path, kib):
    path.write_text(f"MemTotal: 100000000 kB\nMemAvailable: {kib} kB\n")


def _guard(pid, meminfo):
    return subprocess.Popen([sys.executable, "-m", "twinspark.deploy.memguard", "--pid", str(pid), "--min-gib", "1.5",
                             "--meminfo", str(meminfo), "--interval", "0.2"], stdout=subprocess.PIPE, text=True)


def test_memguard_stops_own_rank_after_two_low_samples(tmp_path):
    meminfo = tmp_path / "meminfo"
    _meminfo(meminfo, 8 << 20)  # 8 GiB: fine
    rank = subprocess.Popen(["sleep", "300"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    guard = _guard(rank.pid, meminfo)
    try:
        time.sleep(1.0)
        assert rank.poll() is None
        _meminfo(meminfo, 1 << 20)  # 1 GiB < 1.5 GiB
        out, _ = guard.communicate(timeout=20)
        assert guard.returncode == 3
        assert rank.wait(timeout=20) is not None
        assert bystander.poll() is None, "the guard must stop only its own rank"
        assert "top memory users" in out and "GiB" in out.split("top memory users:")[1]
        assert "stopped the serving rank" in out
    finally:
        for p in (rank, bystander, guard):
            if p.poll() is None:
                p.kill()
                p.wait()
