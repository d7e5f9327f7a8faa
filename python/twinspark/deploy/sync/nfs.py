"""nfs sync: the head exports MODEL_DIR read-only to the worker, which mounts it at WORKER_MODEL_DIR (nothing is
copied). Needs the kernel NFS server on the head and the NFS client on the worker; where either is missing
(containers, this project's CI machines) it says so in one sentence instead of failing half-way."""

from __future__ import annotations

import shlex

from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say

EXPORTS = "/etc/exports.d/twinspark.exports"


def export_line(s) -> str:
    who = s.nfs_export_cidr or f"{s.worker_ip}/32"
    return f"{s.model_dir.resolve()} {who}(ro,no_subtree_check,no_root_squash,async)"


def mount_command(s) -> str:
    d = shlex.quote(str(s.worker_dir))
    return (f"mkdir -p {d} && (mountpoint -q {d} || mount -t nfs -o ro,vers=4.2,nconnect=8,rsize=1048576 "
            f"{s.head_ip}:{shlex.quote(str(s.model_dir.resolve()))} {d})")


def _has_fs(host, fs: str) -> bool:
    r = host.run(f"grep -qw {fs} /proc/filesystems", changes=False, check=False)
    return r.returncode == 0


class NfsSync:
    name = "nfs"

    def __init__(self, s, head, worker):
        self.s, self.head, self.worker = s, head, worker

    def needed_bytes(self) -> int:
        return 0

    def problem(self) -> str | None:
        if not _has_fs(self.head, "nfsd"):
            return ("the head has no kernel NFS server (nfsd is not in /proc/filesystems; in a container or "
                    "without the nfsd module it cannot export)")
        if self.head.run("command -v exportfs", changes=False, check=False).returncode:
            return "the head lacks exportfs (install nfs-kernel-server)"
        if not _has_fs(self.worker, "nfs") and not _has_fs(self.worker, "nfs4"):
            return "the worker has no kernel NFS client (nfs is not in /proc/filesystems; load the nfs module)"
        if self.worker.run("command -v mount.nfs", changes=False, check=False).returncode:
            return "the worker lacks mount.nfs (install nfs-common)"
        return None

    def sync(self) -> str:
        line, mount = export_line(self.s), mount_command(self.s)
        if self.head.dry_run:
            say(f"[dry-run] head: write '{line}' to {EXPORTS} && exportfs -ra")
            say(f"[dry-run] worker: {mount}")
            p = self.problem()
            return "nfs: would export and mount" + (f" (but {p})" if p else "")
        p = self.problem()
        if p:
            raise DeployError(f"NFS sync is unavailable: {p}; use --sync rsync or --sync zfs instead.")
        self.head.write(EXPORTS, line + "\n")
        self.head.run("exportfs -ra", what="exportfs")
        self.worker.run(mount, what="mounting the NFS export", timeout=60)
        return f"nfs: the worker mounts {self.s.head_ip}:{self.s.model_dir.resolve()} read-only at {self.s.worker_dir}"
