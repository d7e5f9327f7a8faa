"""Serving image: build/pull on the head with the docker SDK, identity by layer list, ship to the worker.

Contract: `ensure_and_ship(s, head, worker)` -> summary line. The recipe stamp (sha256 of docker/Dockerfile and
every file copied into the build) is stored as the label STAMP_LABEL; an image whose label matches is reused.
Images are compared across hosts by the sha256 of their RootFS layer list (image ids and RepoDigests change on
save/load). Ship modes: staged (docker save to a tar in STATE_DIR, resumable rsync, docker load, clean up),
stream (docker save | ssh docker load: no temp space, restarts from zero), auto (staged when the worker has
the space, else stream). The head talks to its engine via DOCKER_HOST (SDK); the worker through `docker` over SSH.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from twinspark.deploy.config import REPO_ROOT
from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say
from twinspark.deploy.preflight import disk_full, free_bytes
from twinspark.deploy.progress import Transfer
from twinspark.deploy.sync.rsync import TIMEOUT_CODES
from twinspark.deploy.sync.rsync import run as rsync_run

STAMP_LABEL = "org.twinspark.recipe-stamp"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
SAVE_CHUNK = 8 << 20  # docker save read size: bigger chunks cost less Python per byte on the stream path


def client():
    import docker

    try:
        c = docker.from_env(timeout=600)
        c.ping()
        return c
    except Exception as e:  # docker raises several types for "no engine"
        raise DeployError(f"Docker does not answer on the head ({type(e).__name__}); start dockerd or set "
                          "DOCKER_HOST, or use RUNTIME=process.") from None


def context_files(s) -> dict[str, Path]:
    """Build-context path -> source file: the Dockerfile and the twinspark wheel(s) from WHEEL_DIR."""
    files = {"Dockerfile": DOCKERFILE}
    wheel_dir = Path(s.wheel_dir)
    for w in sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []:
        files[f"whl/{w.name}"] = w
    return files


def stamp(files: dict[str, Path], base: str) -> str:
    h = hashlib.sha256(f"base={base}\n".encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0")
        with open(files[name], "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def layer_key(layers: list[str]) -> str:
    return hashlib.sha256("\n".join(layers).encode()).hexdigest()


def ensure_image(s, dry_run: bool = False):
    files = context_files(s)
    want = stamp(files, s.vllm_base_image)
    c = client()
    import docker.errors

    try:
        img = c.images.get(s.image)
    except docker.errors.ImageNotFound:
        img = None
    have = (img.labels or {}).get(STAMP_LABEL) if img else None
    if img is not None and have == want and not s.build:
        return img, f"image {s.image} matches the checkout (stamp {want[:12]})"
    if s.pull and not s.skip_pull and not s.build:
        if dry_run:
            say(f"[dry-run] head: docker pull {s.image}")
        else:
            try:
                img = c.images.pull(s.image)
            except docker.errors.APIError as e:
                raise DeployError(f"Pulling {s.image} failed ({e.explanation}); set SKIP_PULL=1 to build instead.") from None
            if (img.labels or {}).get(STAMP_LABEL) == want:
                return img, f"pulled {s.image} (stamp matches)"
    if s.skip_build:
        if img is None:
            raise DeployError(f"Image {s.image} is not on the head and SKIP_BUILD is set; unset SKIP_BUILD or load it.")
        return img, f"image {s.image} reused without a stamp check (SKIP_BUILD)"
    if dry_run:
        say(f"[dry-run] head: docker build -f docker/Dockerfile --build-arg VLLM_BASE={s.vllm_base_image} "
            f"--label {STAMP_LABEL}={want} -t {s.image}")
        return img, f"would build {s.image}"
    with tempfile.TemporaryDirectory(prefix="twinspark-build-") as tmp:
        for name, src in files.items():
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, Path(tmp) / name)
        (Path(tmp) / "whl").mkdir(exist_ok=True)
        try:
            img, _ = c.images.build(path=tmp, tag=s.image, buildargs={"VLLM_BASE": s.vllm_base_image},
                                    labels={STAMP_LABEL: want}, pull=False, rm=True, forcerm=True)
        except docker.errors.BuildError as e:
            last = next((x.get("stream", x.get("error", "")) for x in reversed(list(e.build_log)) if x), "")
            raise DeployError(f"Building {s.image} failed ({str(last).strip() or e.msg}); fix the base image "
                              "(VLLM_BASE_IMAGE) or the Dockerfile.") from None
    return img, f"built {s.image} (stamp {want[:12]})"


def worker_layers(worker, image: str) -> list[str] | None:
    r = worker.run(f"docker image inspect -f '{{{{json .RootFS.Layers}}}}' {shlex.quote(image)}", changes=False,
                   check=False, timeout=60)
    if r.returncode:
        if "No such" in r.stderr or "no such" in r.stderr:
            return None
        raise DeployError(worker.failure("docker image inspect", r))
    return json.loads(r.stdout)


def ship(s, head, worker, img) -> str:
    key = layer_key(img.attrs["RootFS"]["Layers"])
    if s.skip_ship:
        return "ship skipped (SKIP_SHIP)"
    wl = worker_layers(worker, s.image)
    if wl is not None and layer_key(wl) == key:
        return f"the worker already has {s.image} with the same layers; not shipped"
    mode = s.ship_mode
    size = int(img.attrs.get("Size", 0))
    if mode == "auto":
        free = free_bytes(worker, Path(s.worker_state_dir or s.state_dir).resolve())
        mode = "staged" if free >= size * 1.2 + (1 << 30) else "stream"
        say(f"ship auto: worker has {free >> 20} MiB free for a {size >> 20} MiB image -> {mode}")
    if head.dry_run:
        say(f"[dry-run] head: ship {s.image} to the worker ({mode})")
        return f"would ship {s.image} ({mode})"
    msg = _staged(s, head, worker, img, key) if mode == "staged" else _stream(s, worker, img)
    wl = worker_layers(worker, s.image)
    if wl is None or layer_key(wl) != key:
        raise DeployError(f"After shipping, the worker's {s.image} still differs from the head's; re-run `invoke ship`.")
    return msg


def _stream(s, worker, img) -> str:
    p = worker.popen("docker load", stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sent = 0
    try:
        with Transfer(f"image stream to {worker.ip}", int(img.attrs.get("Size", 0))) as bar:
            for chunk in img.save(chunk_size=SAVE_CHUNK, named=True):
                p.stdin.write(chunk)
                sent += len(chunk)
                bar.update(sent)
        p.stdin.close()
    except BrokenPipeError:
        pass
    err = p.stderr.read()
    p.wait(timeout=600)
    if p.returncode:
        raise DeployError(f"Streaming the image to the worker failed ({err.decode(errors='replace').strip()[-200:]}); "
                          "check SSH and docker on the worker, then re-run (stream restarts from zero).")
    return f"streamed {s.image} to the worker ({sent} bytes)"


def _staged(s, head, worker, img, key: str) -> str:
    local_dir = Path(s.state_dir).resolve() / "images"
    local_dir.mkdir(parents=True, exist_ok=True)
    tar = local_dir / f"{key[:24]}.tar"
    if not tar.is_file():  # a complete tar from an interrupted ship is reused; a half-written .tmp is not
        tmp = tar.with_suffix(".tmp")
        with open(tmp, "wb") as f, Transfer("image save", int(img.attrs.get("Size", 0))) as bar:
            for chunk in img.save(chunk_size=SAVE_CHUNK, named=True):
                f.write(chunk)
                bar.update(f.tell())
        tmp.replace(tar)
    remote_dir = Path(s.worker_state_dir or s.state_dir).resolve() / "images"
    worker.run(f"mkdir -p {shlex.quote(str(remote_dir))}", what="creating the staging dir")
    argv = ["rsync", "--partial", "--partial-dir=.rsync-partial", "--timeout=20", "--stats", "-e",
            worker.ssh_command(), str(tar), f"{worker.user}@{worker.ip}:{remote_dir}/"]
    r = rsync_run(argv, f"image to {worker.ip}", tar.stat().st_size)
    if r.returncode:
        full = None if r.returncode in TIMEOUT_CODES else disk_full(worker, remote_dir, tar.stat().st_size, r.stderr)
        if full:
            raise DeployError(f"{full}; free space there (or set WORKER_STATE_DIR, or SHIP_MODE=stream), then re-run: "
                              "the copy resumes where it stopped.")
        tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise DeployError(f"Copying the image to the worker failed (rsync exit {r.returncode}: {tail}); check the "
                          "link and SSH, then re-run: the copy resumes where it stopped.")
    m = re.search(r"Total bytes sent: ([\d,]+)", r.stdout)
    sent = int(m.group(1).replace(",", "")) if m else -1
    total = tar.stat().st_size
    say(f"image: docker load on the worker ({tar.stat().st_size} bytes)")
    worker.run(f"docker load -i {shlex.quote(str(remote_dir / tar.name))}", what="docker load", timeout=900)
    worker.run(f"rm -f {shlex.quote(str(remote_dir / tar.name))}", check=False)
    tar.unlink(missing_ok=True)
    return f"shipped {s.image} staged ({sent} bytes sent, {total} bytes tar)"


def ensure_and_ship(s, head, worker) -> str:
    img, msg = ensure_image(s, dry_run=head.dry_run)
    say(msg)
    if img is None:
        return "no image yet (dry-run)"
    return ship(s, head, worker, img)
