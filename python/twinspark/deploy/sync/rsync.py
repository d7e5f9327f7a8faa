"""rsync sync: a node-local copy on the worker. Skipped when the worker's marker equals the head's fingerprint
(size + mtime of every file); resumable: partial files are kept in --partial-dir and continued on the next run.

Cost model: every SSH session runs the worker user's login shell (its ~/.bashrc: often 0.1-0.3 s), so a sync
opens exactly two: one reads the marker; the other is rsync itself, whose remote side (--rsync-path) creates the
directory, receives, and only when the receiver succeeded writes the marker (temp name, then rename). A separate
mkdir and marker write cost ~15% of a 200 MiB copy (bench/bench_deploy_ship.py); a failed copy opens one more to
tell a full disk from other failures.

`run(argv, what, total)` runs any rsync with a progress bar (`--info=progress2`, twinspark.deploy.progress); the
image ship uses it too."""

from __future__ import annotations

import re
import shlex
import subprocess
import threading

from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say
from twinspark.deploy.preflight import disk_full
from twinspark.deploy.progress import Transfer
from twinspark.deploy.sync import MARKER, storage_problem, tree_fingerprint

# rsync exit codes that mean the link or the peer failed rather than the files.
LINK_CODES = {10, 12, 23, 30, 35, 255}
TIMEOUT_CODES = {30, 35, 255}  # the worker did not answer: asking it about its disk would wait for nothing
PROGRESS = re.compile(r"^\s*([\d,]+)\s+\d+%")


def run(argv: list[str], what: str, total: int | None) -> subprocess.CompletedProcess:
    """rsync argv (with --stats) plus --info=progress2, its bytes shown as they go; stdout keeps the stats."""
    argv = [argv[0], "--info=progress2", *argv[1:]]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    reader.start()
    out, pending = [], b""
    try:
        with Transfer(what, total) as bar:
            for chunk in iter(lambda: p.stdout.read1(1 << 16), b""):
                out.append(chunk)
                *parts, pending = re.split(rb"[\r\n]", pending + chunk)
                for part in reversed(parts):
                    m = PROGRESS.match(part.decode(errors="replace"))
                    if m:
                        bar.update(int(m.group(1).replace(",", "")))
                        break
            p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=10)
    return subprocess.CompletedProcess(argv, p.returncode, b"".join(out).decode(errors="replace"),
                                       b"".join(err).decode(errors="replace"))


class RsyncSync:
    name = "rsync"

    def __init__(self, s, head, worker):
        self.s, self.head, self.worker = s, head, worker
        self.src = s.model_dir.resolve()
        self.dst = s.worker_dir if s.worker_dir.is_absolute() else s.worker_dir.resolve()

    def needed_bytes(self) -> int:
        fp, total = tree_fingerprint(self.src)
        return 0 if self._up_to_date(fp) else total

    def storage_problem(self) -> str | None:
        return storage_problem(self.worker, self.dst, "rsync")

    def _up_to_date(self, fp: str) -> bool:
        have = self.worker.read(self.dst / MARKER, default="") or ""
        return have.strip() == fp

    def remote_command(self, fp: str) -> str:
        """The worker side of the copy (rsync appends its server arguments as "$@"). Nothing may write to stdout
        after rsync: that is the protocol stream."""
        d = shlex.quote(str(self.dst))
        m, tmp = f"{d}/{MARKER}", f"{d}/{MARKER}.tmp"
        say_ = shlex.quote(f"twinspark: could not write the sync marker {self.dst}/{MARKER} on the worker")
        script = (f'mkdir -p {d} && rsync "$@" || exit $?; '
                  f'{{ printf "%s\\n" {fp} > {tmp} && mv -f {tmp} {m}; }} 2>/dev/null || {{ echo {say_} >&2; exit 1; }}')
        return f"sh -c {shlex.quote(script)} rsync"

    def argv(self, fp: str) -> list[str]:
        return ["rsync", "-a", "--delete", "--partial", "--partial-dir=.rsync-partial", "--timeout=20", "--stats",
                "--exclude", MARKER, "--exclude", f"{MARKER}.tmp", "--rsync-path", self.remote_command(fp),
                "-e", self.worker.ssh_command(), f"{self.src}/", f"{self.worker.user}@{self.worker.ip}:{self.dst}/"]

    def sync(self) -> str:
        if not self.src.is_dir():
            raise DeployError(f"MODEL_DIR {self.src} does not exist on the head; download the weights first "
                              "(AUTO_DOWNLOAD=1) or fix MODEL_DIR.")
        fp, total = tree_fingerprint(self.src)
        if self.worker.dry_run:
            say(f"[dry-run] head: {shlex.join(self.argv(fp))}")
            return f"rsync: would copy {self.src} to the worker's {self.dst} ({total} bytes at most)"
        if self._up_to_date(fp):
            return f"rsync: the worker's {self.dst} already matches (marker), nothing copied"
        r = run(self.argv(fp), f"rsync to {self.worker.ip}", total)
        if r.returncode:
            full = None if r.returncode in TIMEOUT_CODES else disk_full(self.worker, self.dst, total, r.stderr)
            if full:
                raise DeployError(f"{full}; free space there (or set WORKER_MODEL_DIR to a larger disk), then re-run: "
                                  "the copy resumes where it stopped.")
            lines = r.stderr.strip().splitlines()
            ours = [x.removeprefix("twinspark: ") for x in lines if x.startswith("twinspark: ")]
            tail = (ours or lines or [f"exit {r.returncode}"])[-1]
            hint = ("check the link and SSH to the worker, then re-run: the copy resumes where it stopped"
                    if r.returncode in LINK_CODES else "fix that and re-run")
            raise DeployError(f"Copying the weights to the worker failed (rsync exit {r.returncode}: {tail}); {hint}.")
        m = re.search(r"Total bytes sent: ([\d,]+)", r.stdout)
        sent = int(m.group(1).replace(",", "")) if m else -1
        return f"rsync: copied {self.src} to the worker's {self.dst} ({sent} bytes sent, {total} bytes in the tree)"
