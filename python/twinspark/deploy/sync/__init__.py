"""Weight sync plugins (entry-point group `twinspark.sync`). Contract of a plugin class:
`Plugin(settings, head, worker).sync() -> str` (one line saying what was done), `.needed_bytes() -> int` (free
space the worker needs, for preflight), `.storage_problem() -> str | None` (the sentence when WORKER_MODEL_DIR holds
what another sync method made: rsync into a received ZFS dataset would break its next incremental send) and
optionally `.room() -> (free, have, mount)` where the free space is not that of WORKER_MODEL_DIR's file system.
Head and worker are `twinspark.deploy.hosts.Host`s; a dry-run host prints the commands that change it."""

from __future__ import annotations

import hashlib
import os
import shlex
from pathlib import Path


def tree_fingerprint(root: Path) -> tuple[str, int]:
    """sha256 over (relative path, size, mtime_ns) of every file: the rsync skip marker; also the byte total."""
    h, total = hashlib.sha256(), 0
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".rsync-partial"))
        for f in sorted(files):
            if f == MARKER:
                continue
            p = Path(dirpath) / f
            st = p.stat()
            total += st.st_size
            h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest(), total


MARKER = ".twinspark-sync"


def worker_storage(worker, path: Path) -> tuple[str, str]:
    """What holds `path` on the worker, in one SSH command: ("zfs", dataset) for a dataset's mount point, ("nfs",
    source) for an NFS mount, ("rsync", "") for a folder with an rsync copy's marker, ("", "") for anything else."""
    q = shlex.quote(str(path))
    r = worker.run(f"zfs list -H -o name,mountpoint -t filesystem 2>/dev/null | awk -F'\\t' -v d={q} "
                   f"'$2 == d {{print \"zfs \" $1}}'; findmnt -n -o FSTYPE,SOURCE -M {q} 2>/dev/null | "
                   f"awk '$1 ~ /^nfs/ {{print \"nfs \" $2}}'; test -e {q}/{MARKER} && echo rsync; true",
                   changes=False, check=False)
    first = (r.stdout.split("\n", 1)[0].split(None, 1) + ["", ""])[:2] if r.stdout.strip() else ["", ""]
    return first[0], first[1].strip()


_MADE_BY = {"zfs": "the ZFS dataset {detail}, received by `--sync zfs`",
            "nfs": "an NFS mount of {detail}, made by `--sync nfs`",
            "rsync": f"an rsync copy (it holds the {MARKER} marker), made by `--sync rsync`"}
_HARM = {"rsync": "rsync would write into it", "zfs": "zfs would mount the received dataset over it",
         "nfs": "the NFS mount would hide it"}


def storage_problem(worker, path: Path, method: str, dataset: str = "") -> str | None:
    """The sentence when `path` on the worker holds what another sync method made (None when it matches or is
    free): a deploy or restart must keep the method that made the worker's copy."""
    kind, detail = worker_storage(worker, path)
    if not kind or kind == method and (kind != "zfs" or detail == dataset):
        return None
    made = _MADE_BY[kind].format(detail=detail)
    if kind == method:  # zfs, another dataset
        return (f"the worker's {path} is {made}, not WORKER_ZFS_DATASET={dataset}; set WORKER_ZFS_DATASET={detail} "
                "or another WORKER_MODEL_DIR")
    return (f"the worker's {path} is {made}, and SYNC={method} does not match it: {_HARM[method]}; use --sync "
            f"{kind} (`invoke restart` reuses the deployment's) or set WORKER_MODEL_DIR to another folder")
