"""rsync sync: a node-local copy on the worker. Skipped when the worker's marker equals the head's fingerprint
(size + mtime of every file); resumable: partial files are kept in --partial-dir and continued on the next run."""

from __future__ import annotations

import re
import shlex
import subprocess

from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say
from twinspark.deploy.sync import MARKER, tree_fingerprint

# rsync exit codes that mean the link or the peer failed rather than the files.
LINK_CODES = {10, 12, 23, 30, 35, 255}


class RsyncSync:
    name = "rsync"

    def __init__(self, s, head, worker):
        self.s, self.head, self.worker = s, head, worker
        self.src = s.model_dir.resolve()
        self.dst = s.worker_dir if s.worker_dir.is_absolute() else s.worker_dir.resolve()

    def needed_bytes(self) -> int:
        return 0 if self._up_to_date() else tree_fingerprint(self.src)[1]

    def _up_to_date(self) -> bool:
        fp, _ = tree_fingerprint(self.src)
        have = self.worker.read(self.dst / MARKER, default="") or ""
        return have.strip() == fp

    def argv(self) -> list[str]:
        return ["rsync", "-a", "--delete", "--partial", "--partial-dir=.rsync-partial", "--timeout=20", "--stats",
                "--exclude", MARKER, "-e", self.worker.ssh_command(),
                f"{self.src}/", f"{self.worker.user}@{self.worker.ip}:{self.dst}/"]

    def sync(self) -> str:
        if not self.src.is_dir():
            raise DeployError(f"MODEL_DIR {self.src} does not exist on the head; download the weights first "
                              "(AUTO_DOWNLOAD=1) or fix MODEL_DIR.")
        fp, total = tree_fingerprint(self.src)
        if self.worker.dry_run:
            say(f"[dry-run] head: {shlex.join(self.argv())}")
            return f"rsync: would copy {self.src} to the worker's {self.dst} ({total} bytes at most)"
        if self._up_to_date():
            return f"rsync: the worker's {self.dst} already matches (marker), nothing copied"
        self.worker.run(f"mkdir -p {shlex.quote(str(self.dst))}", what="creating the weights directory")
        r = subprocess.run(self.argv(), capture_output=True, text=True)
        if r.returncode:
            tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            hint = ("check the link and SSH to the worker, then re-run: the copy resumes where it stopped"
                    if r.returncode in LINK_CODES else "fix that and re-run")
            raise DeployError(f"Copying the weights to the worker failed (rsync exit {r.returncode}: {tail}); {hint}.")
        self.worker.write(self.dst / MARKER, fp + "\n")
        m = re.search(r"Total bytes sent: ([\d,]+)", r.stdout)
        sent = int(m.group(1).replace(",", "")) if m else -1
        return f"rsync: copied {self.src} to the worker's {self.dst} ({sent} bytes sent, {total} bytes in the tree)"
