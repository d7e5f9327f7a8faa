"""zfs sync: per-node datasets; a new snapshot of ZFS_DATASET on the head is sent to WORKER_ZFS_DATASET on the
worker, incrementally from the newest snapshot both sides share, else in full. Without a pool/dataset on the head
it says so and falls back to rsync. (zfs-fuse has no resumable send `-s`/`-t`: an interrupted send restarts; its
snapshot is destroyed, so the next run sends from the same common snapshot.) The stream's bytes are shown as `zfs
send` writes them (its write counter in /proc, no copy through Python), against the dataset's referenced bytes for
a full send; a pool that runs out of space is named as such."""

from __future__ import annotations

import shlex
import subprocess
import time

import psutil

from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say
from twinspark.deploy.preflight import NO_SPACE
from twinspark.deploy.progress import Transfer, fmt_bytes
from twinspark.deploy.sync import storage_problem
from twinspark.deploy.sync.rsync import RsyncSync

PREFIX = "twinspark-"
KEEP = 2
MOUNT_WAIT_S = 30.0  # how long the worker's dataset may take to show up mounted at MODEL_DIR after the receive


def _written(pid: int) -> int | None:
    """Bytes the process `pid` and its children wrote so far (what `zfs send` put into the pipe)."""
    try:
        p = psutil.Process(pid)
        return sum(x.io_counters().write_chars for x in [p, *p.children(recursive=True)])
    except (psutil.Error, AttributeError):
        return None


def _int(host, cmd: str) -> int:
    out = host.run(cmd, changes=False, check=False).stdout.strip()
    return int(out) if out.isdigit() else 0


def _snaps(host, ds: str) -> list[str]:
    r = host.run(f"zfs list -H -t snapshot -o name -s creation -d 1 {shlex.quote(ds)}", changes=False, check=False)
    return [x.split("@", 1)[1] for x in r.stdout.split() if "@" in x and x.split("@", 1)[1].startswith(PREFIX)]


class ZfsSync:
    name = "zfs"

    def __init__(self, s, head, worker):
        self.s, self.head, self.worker = s, head, worker
        self.ds = s.zfs_dataset
        self.wds = s.worker_zfs_dataset or s.zfs_dataset

    def _head_ok(self) -> str | None:
        if not self.ds:
            return "ZFS_DATASET is not set"
        r = self.head.run(f"zfs list -H -o name {shlex.quote(self.ds)}", changes=False, check=False)
        if r.returncode:
            return f"no dataset {self.ds} on the head ({(r.stderr.strip().splitlines() or ['zfs missing'])[-1]})"
        return None

    def needed_bytes(self) -> int:
        if self._head_ok():
            return RsyncSync(self.s, self.head, self.worker).needed_bytes()
        if set(_snaps(self.head, self.ds)) & set(_snaps(self.worker, self.wds)):
            return 0
        return _int(self.head, f"zfs get -Hp -o value referenced {shlex.quote(self.ds)}")

    def _pool(self) -> str:
        return self.wds.split("/")[0]

    def room(self) -> tuple[int, int, str]:
        """Free bytes of the worker's pool (what a receive fills), nothing received yet, the pool's name."""
        if self._head_ok():
            from twinspark.deploy.preflight import space

            return space(self.worker, self.s.worker_dir) or (0, 0, "")
        return _int(self.worker, f"zfs get -Hp -o value available {shlex.quote(self._pool())}"), 0, self._pool()

    def storage_problem(self) -> str | None:
        if self._head_ok():
            return RsyncSync(self.s, self.head, self.worker).storage_problem()
        return storage_problem(self.worker, self.s.worker_dir, "zfs", self.wds)

    def sync(self) -> str:
        problem = self._head_ok()
        if problem:
            say(f"zfs: {problem}; falling back to rsync (create a pool and dataset for MODEL_DIR to use zfs).")
            return RsyncSync(self.s, self.head, self.worker).sync()
        pool = self.wds.split("/")[0]
        if self.worker.run(f"zpool list -H -o name {shlex.quote(pool)}", changes=False, check=False).returncode:
            raise DeployError(f"The worker has no ZFS pool '{pool}' for WORKER_ZFS_DATASET={self.wds}; create it "
                              "or choose --sync rsync.")
        head_snaps, worker_snaps = _snaps(self.head, self.ds), set(_snaps(self.worker, self.wds))
        common = next((x for x in reversed(head_snaps) if x in worker_snaps), None)
        if common is None and self.worker.run(f"zfs list -H {shlex.quote(self.wds)}", changes=False,
                                              check=False).returncode == 0:
            raise DeployError(f"The worker's {self.wds} exists but shares no snapshot with the head's {self.ds}; "
                              f"destroy it on the worker (zfs destroy -r {self.wds}) to receive a full copy.")
        snap = f"{PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
        if snap in head_snaps:
            time.sleep(1.1)
            snap = f"{PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
        send = f"zfs send {'-i @' + common + ' ' if common else ''}{shlex.quote(self.ds)}@{snap}"
        recv = f"zfs recv -F {shlex.quote(self.wds)}"
        mode = f"incremental from @{common}" if common else "full"
        if self.head.dry_run:
            say(f"[dry-run] head: zfs snapshot {self.ds}@{snap}")
            say(f"[dry-run] head: {send} | ssh worker {recv}")
            return f"zfs: would send {self.ds}@{snap} ({mode})"
        self.head.run(f"zfs snapshot {shlex.quote(self.ds)}@{snap}", what="zfs snapshot")
        try:
            err = self._send(send, recv, None if common else
                             _int(self.head, f"zfs get -Hp -o value referenced {shlex.quote(self.ds)}@{snap}"))
        except BaseException:  # Ctrl-C too: the next run sends again from the common snapshot
            self.head.run(f"zfs destroy {shlex.quote(self.ds)}@{snap}", check=False)
            raise
        if err is not None:
            self.head.run(f"zfs destroy {shlex.quote(self.ds)}@{snap}", check=False)
            if any(x in err for x in NO_SPACE):
                free = _int(self.worker, f"zfs get -Hp -o value available {shlex.quote(self._pool())}")
                raise DeployError(f"The worker's pool {self._pool()} is full ({fmt_bytes(free)} available) for the "
                                  f"{mode} send of {self.ds}; free space in the pool, then re-run (the send restarts).")
            raise DeployError(f"zfs send/recv to the worker failed ({err}); check the link and the worker's pool, "
                              "then re-run (the send restarts).")
        mp = str(self.s.worker_dir)
        r = self.worker.run(f"zfs set mountpoint={shlex.quote(mp)} {shlex.quote(self.wds)}", check=False)
        if r.returncode:
            raise DeployError(f"The worker's {self.wds} was received but cannot be mounted at {mp} "
                              f"({(r.stderr.strip().splitlines() or ['zfs set failed'])[-1]}); choose an absolute "
                              "WORKER_MODEL_DIR that zfs may mount there and deploy again.")
        self._wait_mounted(mp)
        self._prune()
        return f"zfs: sent {self.ds}@{snap} to the worker's {self.wds} ({mode})"

    def _wait_mounted(self, mp: str) -> None:
        """Return once the worker's dataset is mounted at mp. zfs-fuse (re)mounts in its daemon after `zfs recv` and
        `zfs set mountpoint` have returned, and once left a received dataset unmounted: the worker rank started next
        found an empty MODEL_DIR and exited. `mounted` is read from the mount table (libzfs), as the rank will see it;
        a dataset zfs calls unmounted is mounted again."""
        q = shlex.quote
        end = time.monotonic() + MOUNT_WAIT_S
        while True:
            r = self.worker.run(f"zfs get -H -o value mounted,mountpoint {q(self.wds)}", changes=False, check=False)
            state = ([x.strip() for x in r.stdout.splitlines()] + ["", ""])[:2]  # one value per line
            if state == ["yes", mp]:
                return
            if time.monotonic() > end:
                break
            if state[0] == "no" and state[1] == mp:
                self.worker.run(f"zfs mount {q(self.wds)}", check=False)
            time.sleep(0.25)
        raise DeployError(f"The worker's {self.wds} is not mounted at {mp} {MOUNT_WAIT_S:.0f} s after the receive "
                          f"(mounted={state[0] or '?'}, mountpoint={state[1] or '?'}); mount it there (zfs set "
                          f"mountpoint={mp} {self.wds}; zfs mount {self.wds}) and deploy again.")

    def _send(self, send: str, recv: str, total: int | None) -> str | None:
        """zfs send | ssh worker zfs recv with a progress bar; None on success, else the last error line."""
        p1 = self.head.popen(send, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p2 = self.worker.popen(recv, stdin=p1.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p1.stdout.close()
        try:
            with Transfer(f"zfs send to {self.worker.ip}", total) as bar:
                bar.watch(lambda: _written(p1.pid))
                _, err2 = p2.communicate()
                err1 = p1.stderr.read()
                bar.update(_written(p1.pid) or bar.done)  # before the wait reaps it: a zombie's counter still reads
                p1.wait()
        finally:
            for p in (p1, p2):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if not (p1.returncode or p2.returncode):
            return None
        detail = (err2 or err1).decode(errors="replace").strip().splitlines()
        return detail[-1] if detail else f"exit codes {p1.returncode}/{p2.returncode}"

    def _prune(self) -> None:
        for host, ds in ((self.head, self.ds), (self.worker, self.wds)):
            for old in _snaps(host, ds)[:-KEEP]:
                host.run(f"zfs destroy {shlex.quote(ds)}@{old}", check=False)
