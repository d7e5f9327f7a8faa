"""Download through the real huggingface_hub client against a hub-compatible server on loopback (HF_ENDPOINT):
full repo + only the Engram files of the original repo (into ENGRAM_DIR, leaving the pack's index intact), a
dropped connection then a re-run that fetches only the missing files, a download killed part way through a large
shard then a re-run that fetches only the rest of it (server-side byte count), a corrupt partial refused, .partNN
reassembly with the sha256 manifest, an ENGRAM_DIR that already holds the files."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hubserver import Hub
from huggingface_hub import constants
from twinspark.deploy import config, download
from twinspark.deploy.errors import DeployError


@pytest.fixture
def repos(tmp_path):
    exl3, orig = tmp_path / "hub/exl3", tmp_path / "hub/orig"
    exl3.mkdir(parents=True)
    orig.mkdir(parents=True)
    (exl3 / "config.json").write_text("{}")
    (exl3 / "model.safetensors.index.json").write_text('{"weight_map": {"head.trellis": "pack"}}')
    shard = os.urandom(3 << 20)
    (exl3 / "model-00001-of-00001.safetensors.part00").write_bytes(shard[: 2 << 20])
    (exl3 / "model-00001-of-00001.safetensors.part01").write_bytes(shard[2 << 20:])
    (exl3 / "SHA256SUMS").write_text(f"{hashlib.sha256(shard).hexdigest()}  model-00001-of-00001.safetensors\n")
    for n in ("model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors", "model-00001-of-00048.safetensors"):
        (orig / n).write_bytes(os.urandom(1 << 20))
    (orig / "model.safetensors.index.json").write_text('{"weight_map": {"layers.1.engram.embed.weight": "orig"}}')
    return {"org/exl3": exl3, "org/orig": orig}, shard


def _settings(tmp_path, **kw):
    s, _ = config.load({"MODEL_DIR": str(tmp_path / "model"), "HF_REPO": "org/exl3", "HF_ENGRAM_REPO": "org/orig",
                        "ENGRAM_FILES": "model-00047-of-*.safetensors model-00048-of-*.safetensors "
                                        "model.safetensors.index.json", **kw}, env_file=None)
    return s


def test_download_resume_reassembly_and_engram_subset(tmp_path, monkeypatch, repos):
    repo_dirs, shard = repos
    with Hub(repo_dirs) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        name = "model-00048-of-00048.safetensors"
        hub.cut[name] = 20_000  # every GET of this file drops after 20 kB: the client's own retries give up
        s = _settings(tmp_path)
        with pytest.raises(DeployError, match="re-run to resume"):
            download.fetch(s)
        first_run = len(hub.ranges)
        del hub.cut[name]  # the link is back
        out = download.fetch(s)
        assert "3 Engram file(s) from org/orig" in out and str(tmp_path / "model-engram") in out
        again = {n for n, _ in hub.ranges[first_run:]}
        # The re-run fetches only what was missing: finished files are kept (huggingface_hub resumes per file).
        assert name in again and not again & {"config.json", "model-00047-of-00048.safetensors",
                                               "model-00001-of-00001.safetensors.part00"}, again
        second_run = len(hub.ranges)
        download.fetch(s)  # a later deploy: the joined shard stays, its parts are not fetched again
        third = {n for n, _ in hub.ranges[second_run:]}
        assert not {n for n in third if ".part" in n}, third
    d, e = tmp_path / "model", tmp_path / "model-engram"  # MODEL_DIR and the default ENGRAM_DIR
    assert (d / "model-00001-of-00001.safetensors").read_bytes() == shard
    assert not list(d.glob("*.part*")), "parts must be removed after joining"
    assert not (e / "model-00001-of-00048.safetensors").exists(), "only the Engram files come from the original"
    assert (e / "model-00048-of-00048.safetensors").read_bytes() == (repo_dirs["org/orig"] /
                                                                      "model-00048-of-00048.safetensors").read_bytes()
    # the EXL3 pack's index is the pack's; the original's lives beside its own shards
    for folder, repo in ((d, "org/exl3"), (e, "org/orig")):
        assert (folder / "model.safetensors.index.json").read_text() == (
            repo_dirs[repo] / "model.safetensors.index.json").read_text()
    assert not list(d.glob("model-0004[78]-*")), "no Engram shard in MODEL_DIR"


def test_manifest_mismatch_is_refused(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "a.bin.part00").write_bytes(b"abc")
    (d / "a.bin.part01").write_bytes(b"def")
    (d / "SHA256SUMS").write_text(f"{hashlib.sha256(b'abcdeX').hexdigest()}  a.bin\n")
    with pytest.raises(DeployError, match="does not match its sha256"):
        download.reassemble(d)
    assert not (d / "a.bin").exists() and (d / "a.bin.part00").exists()
    (d / "SHA256SUMS").write_text(f"{hashlib.sha256(b'abcdef').hexdigest()}  a.bin\n")
    assert download.reassemble(d) == ["a.bin"] and (d / "a.bin").read_bytes() == b"abcdef"


def test_engram_dir_is_reused_without_download(tmp_path, monkeypatch, repos):
    repo_dirs, _ = repos
    with Hub(repo_dirs) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        s = _settings(tmp_path, ENGRAM_DIR=str(repo_dirs["org/orig"]))  # a full copy of the original already here
        out = download.fetch(s)
        assert f"Engram files already in {repo_dirs['org/orig']}" in out
        assert not [n for n, _ in hub.ranges if "00048" in n]
    assert not list((tmp_path / "model").glob("model-0004[78]-*"))


def test_killed_download_resumes_mid_file(tmp_path, monkeypatch):
    big = tmp_path / "hub/big"
    big.mkdir(parents=True)
    (big / "config.json").write_text("{}")
    # huggingface_hub writes what it received in DOWNLOAD_CHUNK_SIZE pieces (10 MiB): kill after the first one.
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    name, size = "model-00001-of-00001.safetensors.part00", 2 * chunk + (4 << 20)
    shard = os.urandom(size + (2 << 20))
    assert size >= download.RESUME_MIN, "the shard must take the resumable path"
    (big / name).write_bytes(shard[:size])
    (big / "model-00001-of-00001.safetensors.part01").write_bytes(shard[size:])
    (big / "SHA256SUMS").write_text(f"{hashlib.sha256(shard).hexdigest()}  model-00001-of-00001.safetensors\n")
    dest = tmp_path / "model"
    flags = {"MODEL_DIR": str(dest), "HF_REPO": "org/big", "HF_ENGRAM_REPO": "", "ENGRAM_FILES": ""}
    with Hub({"org/big": big}) as hub:
        hub.rate[name] = 4 << 20  # ~6 s for the shard: the kill lands part way through
        code = ("import sys, json; from twinspark.deploy import config, download; "
                "s, _ = config.load(json.loads(sys.argv[1]), env_file=None); print(download.fetch(s))")
        env = {**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": os.pathsep.join(sys.path)}
        p = subprocess.Popen([sys.executable, "-c", code, json.dumps(flags)], env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            end = time.monotonic() + 60
            while hub.sent.get(name, 0) < chunk + (3 << 20) and time.monotonic() < end and p.poll() is None:
                time.sleep(0.05)
            assert p.poll() is None, f"the download ended before the kill: {p.stdout.read().decode()[-2000:]}"
            os.kill(p.pid, signal.SIGKILL)  # as a crash or a power cut would: no cleanup code runs
        finally:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        partial = list((dest / ".cache" / "twinspark").glob(f"{name}.*.incomplete"))
        assert len(partial) == 1, "the partial shard must survive the killed run"
        kept = partial[0].stat().st_size
        assert 0 < kept < size, kept
        del hub.rate[name]
        before = hub.sent[name]
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        s, _ = config.load(flags, env_file=None)
        download.fetch(s)
        resent = hub.sent[name] - before
        # Only the rest of the shard went over the wire again (the client asked for it with a Range request).
        assert size - kept <= resent <= (size - kept) * 1.1, (kept, resent)
        assert (name, kept) in hub.ranges, hub.ranges[-5:]
    # reassemble() checked the joined shard against SHA256SUMS (a mismatch raises); compare the bytes too.
    assert (dest / "model-00001-of-00001.safetensors").read_bytes() == shard
    assert not list(dest.glob("*.part*")) and not list((dest / ".cache" / "twinspark").rglob("*.incomplete"))


def test_corrupt_partial_is_refused_then_downloaded_again(tmp_path, monkeypatch):
    big = tmp_path / "hub/big"
    big.mkdir(parents=True)
    data = os.urandom(download.RESUME_MIN + (1 << 20))
    (big / "w.safetensors").write_bytes(data)
    dest = tmp_path / "model"
    cache = dest / ".cache" / "twinspark"
    cache.mkdir(parents=True)
    tag = hashlib.sha256(data).hexdigest()[:16]
    (cache / f"w.safetensors.{tag}.incomplete").write_bytes(os.urandom(1 << 20))  # not the file's first bytes
    (cache / "w.safetensors.0123abcd.incomplete").write_bytes(b"x")  # a partial of an older revision
    with Hub({"org/big": big}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        s, _ = config.load({"MODEL_DIR": str(dest), "HF_REPO": "org/big"}, env_file=None)
        with pytest.raises(DeployError, match="does not match its sha256 on the hub; the partial file was removed"):
            download.fetch(s)
        assert not list(cache.glob("*.incomplete")), "both the corrupt and the stale partial must be gone"
        download.fetch(s)
    assert (dest / "w.safetensors").read_bytes() == data


def test_resumable_path_without_the_private_metadata_writer(tmp_path, monkeypatch):
    """hubget records finished files with huggingface_hub's non-public metadata writer; without it (a release that
    moved it) the download still completes and snapshot_download accepts the file by its sha256."""
    big = tmp_path / "hub/big"
    big.mkdir(parents=True)
    data = os.urandom(download.RESUME_MIN + (1 << 20))
    (big / "w.safetensors").write_bytes(data)
    monkeypatch.setitem(sys.modules, "huggingface_hub._local_folder", None)  # import of it raises ImportError
    with Hub({"org/big": big}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        s, _ = config.load({"MODEL_DIR": str(tmp_path / "model"), "HF_REPO": "org/big"}, env_file=None)
        download.fetch(s)
        sent = hub.sent["w.safetensors"]
        download.fetch(s)  # present: not fetched again
        assert hub.sent["w.safetensors"] == sent
    assert (tmp_path / "model" / "w.safetensors").read_bytes() == data
