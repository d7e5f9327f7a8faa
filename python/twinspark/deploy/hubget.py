"""Large-file downloads from a hub that resume mid-file across runs, with huggingface_hub's own HTTP client.

Why: huggingface_hub 2.x (`snapshot_download`, `hf_hub_download`) writes each file into a process-unique temp file
and deletes it when the download fails, so a killed or cut-off 5 GB shard starts again from byte 0 on the next
run (its Range retries only help within one process). Here a large file goes into a partial file that survives:
`<local_dir>/.cache/twinspark/<name>.<etag>.incomplete`; the next run sends `Range: bytes=<have>-` through
`huggingface_hub.file_download.http_get` (same headers, token, retries and progress bar as the library) and renames
the finished file into place. The library's local-dir metadata is written afterwards, so `snapshot_download` then
treats the file as current; a file already present is left to `snapshot_download` (its metadata or sha256 check).
A resumed file whose etag is a sha256 (LFS files on the hub) is checked against it.

Contract: `large_files(repo, endpoint, allow, min_size, ignore=None) -> list[(name, size)]`;
`fetch(repo, name, dest, endpoint) -> (bytes fetched now, bytes resumed from)`; raises DeployError on a corrupt
resume; network errors propagate (the caller words them)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from twinspark.deploy.errors import DeployError

SHA256 = re.compile(r"^[0-9a-f]{64}$")


def repo_files(repo: str, endpoint: str | None, allow: list[str] | None,
               ignore: list[str] | None = None) -> dict[str, int]:
    """{path: size} of the repo's files that the patterns select."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    files = [f for f in HfApi(endpoint=endpoint).list_repo_tree(repo, recursive=True) if getattr(f, "size", None)]
    keep = set(filter_repo_objects([f.path for f in files], allow_patterns=allow, ignore_patterns=ignore or None))
    return {f.path: f.size for f in files if f.path in keep}


def large_files(repo: str, endpoint: str | None, allow: list[str] | None, min_size: int,
                ignore: list[str] | None = None) -> list[tuple[str, int]]:
    return sorted((n, size) for n, size in repo_files(repo, endpoint, allow, ignore).items() if size >= min_size)


INCOMPLETE = re.compile(r"^(?P<name>.+)\.[0-9A-Za-z]+\.incomplete$")


def local_bytes(dest: Path, sizes: dict[str, int]) -> int:
    """Bytes of the repo files `sizes` that are in `dest` so far: finished files, and partial ones (hubget's and
    huggingface_hub's `.incomplete` files under dest/.cache), each at most its size."""
    have: dict[str, int] = {}
    for p in Path(dest).rglob("*"):
        if not p.is_file():
            continue
        rel = p.relative_to(dest).as_posix()
        m = INCOMPLETE.match(p.name) if rel.startswith(".cache/") else None
        name = rel if m is None else str(Path(rel).parent / m["name"]).split("/", 2)[-1]
        if name in sizes:
            have[name] = max(have.get(name, 0), min(p.stat().st_size, sizes[name]))
    return sum(have.values())


def partial_dir(dest: Path) -> Path:
    return Path(dest) / ".cache" / "twinspark"


def fetch(repo: str, name: str, dest: Path, endpoint: str | None) -> tuple[int, int]:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    dest = Path(dest)
    target = dest / name
    if target.is_file():  # present: snapshot_download decides whether it is current (metadata, else sha256)
        return 0, 0
    meta = get_hf_file_metadata(hf_hub_url(repo, name, endpoint=endpoint))
    etag = (meta.etag or "").strip('"')
    tag = re.sub(r"[^0-9A-Za-z]", "", etag)[:16] or "noetag"
    part = partial_dir(dest) / f"{name}.{tag}.incomplete"
    part.parent.mkdir(parents=True, exist_ok=True)
    mine = re.compile(re.escape(Path(name).name) + r"\.[0-9A-Za-z]+\.incomplete")
    for stale in part.parent.glob("*.incomplete"):
        if stale != part and mine.fullmatch(stale.name):  # an older revision of this file: cannot be continued
            stale.unlink()
    part.touch()
    with open(part, "r+b") as f:
        have = f.seek(0, os.SEEK_END)
        if meta.size is not None and have > meta.size:
            f.truncate(0)
            have = f.seek(0)
        http_get(meta.location, f, resume_size=have, headers=build_hf_headers(), expected_size=meta.size,
                 displayed_filename=name)
        got = f.tell() - have
    if have and SHA256.match(etag):
        h = hashlib.sha256()
        with open(part, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        if h.hexdigest() != etag:
            part.unlink()
            raise DeployError(f"{name} resumed from byte {have} does not match its sha256 on the hub; the partial "
                              "file was removed, re-run to download it again.")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, target)
    if meta.commit_hash and meta.etag:
        _write_metadata(dest, name, meta.commit_hash, meta.etag)
    return got, have


def _write_metadata(dest: Path, name: str, commit_hash: str, etag: str) -> None:
    """Record the file in huggingface_hub's local-dir metadata, so snapshot_download takes it as current without
    hashing it again. The writer is the library's own but not public API (huggingface_hub._local_folder, present
    since 0.23): if a release moves it, skip — snapshot_download then checks the file by its sha256 (one extra read
    of the file, same result)."""
    try:
        from huggingface_hub._local_folder import write_download_metadata
    except ImportError:
        return
    write_download_metadata(dest, name, commit_hash=commit_hash, etag=etag)
