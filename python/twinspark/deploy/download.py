"""Weights download with huggingface_hub. Contract: `fetch(s)` -> summary line; raises DeployError.

HF_REPO (the EXL3 pack) goes into MODEL_DIR in full; from HF_ENGRAM_REPO only ENGRAM_FILES (Engram shards and
their index; names or globs) into ENGRAM_DIR, never into MODEL_DIR (the original's index would replace the pack's),
unless ENGRAM_DIR already holds them.
Resumable: files of RESUME_MIN bytes or more (the shards) are fetched first by `hubget`, whose partial file survives
an interrupted run and is continued with an HTTP Range request (huggingface_hub 2.x itself drops a partial file, so
a cut-off shard would start again from byte 0); then `snapshot_download` fetches the rest and skips what is
current. Afterwards files split as NAME.part00, NAME.part01, ... are joined into NAME (temp name, then rename) and
checked against SHA256SUMS ("<hex>  <name>" lines) when the repo has one; a later run does not fetch the parts of a
NAME that is already there. HF_ENDPOINT selects the hub (tests use a
loopback server)."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from twinspark.deploy import hubget
from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say
from twinspark.deploy.progress import Transfer

MANIFEST = "SHA256SUMS"
PART = re.compile(r"^(?P<name>.+)\.part(?P<idx>\d{2,})$")
RESUME_MIN = 16 << 20  # files this large resume mid-file (hubget); smaller ones are fetched again whole
WORKERS = 4


@contextmanager
def quiet_hub_bars():
    """huggingface_hub's own tqdm bars off while our bar (all files, one total) shows the download."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was:
            enable_progress_bars()


def _snapshot(repo: str, dest: Path, allow: list[str] | None = None) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    endpoint = os.environ.get("HF_ENDPOINT") or None
    # NAME.partNN of a NAME already joined (written only after its sha256 check) are not fetched again.
    ignore = [f"{p.name}.part*" for p in dest.iterdir() if p.is_file() and not p.name.startswith(".")] \
        if dest.is_dir() else []
    try:
        sizes = hubget.repo_files(repo, endpoint, allow, ignore)
        big = sorted(n for n, size in sizes.items() if size >= RESUME_MIN)
        with quiet_hub_bars(), Transfer(f"download {repo}", sum(sizes.values())) as bar:
            bar.watch(lambda: hubget.local_bytes(dest, sizes), every=1.0)
            with ThreadPoolExecutor(WORKERS) as pool:
                for name, (got, had) in zip(big, pool.map(lambda n: hubget.fetch(repo, n, dest, endpoint), big)):
                    if had:
                        say(f"download: {name} resumed at byte {had} ({got} bytes fetched now)")
            snapshot_download(repo_id=repo, local_dir=dest, allow_patterns=allow, ignore_patterns=ignore or None,
                              endpoint=endpoint, max_workers=WORKERS)
            bar.update(hubget.local_bytes(dest, sizes))
    except DeployError:
        raise
    except HfHubHTTPError as e:
        raise DeployError(f"Downloading {repo} failed ({str(e).splitlines()[0]}); check the repo name and HF_TOKEN, "
                          "then re-run (finished files and partial shards are kept).") from None
    except Exception as e:  # network drops surface as several httpx/OS error types
        raise DeployError(f"Downloading {repo} was interrupted ({type(e).__name__}: {str(e)[:120]}); re-run to "
                          "resume where it stopped.") from None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(d: Path) -> dict[str, str]:
    p = d / MANIFEST
    if not p.is_file():
        return {}
    out = {}
    for line in p.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            out[name.lstrip("*")] = digest.lower()
    return out


def reassemble(d: Path) -> list[str]:
    """Join NAME.partNN files into NAME (in index order), verify against SHA256SUMS, delete the parts."""
    groups: dict[str, list[tuple[int, Path]]] = {}
    for p in d.iterdir():
        m = PART.match(p.name)
        if m and p.is_file():
            groups.setdefault(m["name"], []).append((int(m["idx"]), p))
    sums = manifest(d)
    done = []
    for name, parts in sorted(groups.items()):
        parts.sort()
        idx = [i for i, _ in parts]
        if idx != list(range(len(idx))):
            raise DeployError(f"{name} is split into parts {idx} with gaps; re-run the download to fetch the rest.")
        tmp = d / f".{name}.joining"
        with open(tmp, "wb") as out:
            for _, p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        want = sums.get(name)
        if want and sha256(tmp) != want:
            tmp.unlink()
            raise DeployError(f"{name} joined from {len(parts)} parts does not match its sha256 in {MANIFEST}; "
                              "delete the parts and download again.")
        os.replace(tmp, d / name)
        for _, p in parts:
            p.unlink()
        done.append(name)
    return done


def _present(d: Path, patterns: list[str]) -> bool:
    """Every name or glob in `patterns` matches a file in folder `d`."""
    names = [p.name for p in d.iterdir() if p.is_file()] if d.is_dir() else []
    return all(fnmatch.filter(names, pat) for pat in patterns)


def fetch(s, dry_run: bool = False) -> str:
    """HF_REPO in full into MODEL_DIR; ENGRAM_FILES of HF_ENGRAM_REPO into ENGRAM_DIR (its own folder: the
    original's model.safetensors.index.json never lands beside the EXL3 pack's), unless ENGRAM_DIR holds them."""
    dest, edest = Path(s.model_dir), Path(s.engram_folder)
    names = s.engram_files.split()
    if dry_run:
        return (f"download: would fetch {s.hf_repo or '(no HF_REPO)'} into {dest} and {len(names)} Engram file(s) "
                f"into {edest}")
    dest.mkdir(parents=True, exist_ok=True)
    did = []
    if s.hf_repo:
        _snapshot(s.hf_repo, dest)
        did.append(f"{s.hf_repo} in {dest}")
    if s.hf_engram_repo and names:
        if _present(edest, names):
            did.append(f"Engram files already in {edest}")
        else:
            edest.mkdir(parents=True, exist_ok=True)
            _snapshot(s.hf_engram_repo, edest, allow=names)
            did.append(f"{len(names)} Engram file(s) from {s.hf_engram_repo} in {edest}")
    joined = reassemble(dest) + (reassemble(edest) if edest.is_dir() else [])
    if joined:
        say(f"download: joined and verified {', '.join(joined)}")
    return f"download: {'; '.join(did) or 'nothing to fetch'}"
