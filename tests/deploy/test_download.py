"""Download through the real huggingface_hub client against a hub-compatible server on loopback (HF_ENDPOINT):
full repo + only the Engram files of the original repo, a dropped connection then a re-run that fetches only the
missing files, .partNN reassembly with the sha256 manifest, ENGRAM_DIR reuse."""

from __future__ import annotations

import hashlib
import os

import pytest
from hubserver import Hub
from twinspark.deploy import config, download
from twinspark.deploy.errors import DeployError


@pytest.fixture
def repos(tmp_path):
    exl3, orig = tmp_path / "hub/exl3", tmp_path / "hub/orig"
    exl3.mkdir(parents=True)
    orig.mkdir(parents=True)
    (exl3 / "config.json").write_text("{}")
    shard = os.urandom(3 << 20)
    (exl3 / "model-00001-of-00001.safetensors.part00").write_bytes(shard[: 2 << 20])
    (exl3 / "model-00001-of-00001.safetensors.part01").write_bytes(shard[2 << 20:])
    (exl3 / "SHA256SUMS").write_text(f"{hashlib.sha256(shard).hexdigest()}  model-00001-of-00001.safetensors\n")
    for n in ("model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors", "model-00001-of-00048.safetensors"):
        (orig / n).write_bytes(os.urandom(1 << 20))
    (orig / "model.safetensors.index.json").write_text("{}")
    return {"org/exl3": exl3, "org/orig": orig}, shard


def _settings(tmp_path, **kw):
    s, _ = config.load({"MODEL_DIR": str(tmp_path / "model"), "HF_REPO": "org/exl3", "HF_ENGRAM_REPO": "org/orig",
                        "ENGRAM_FILES": "model-00047-of-00048.safetensors model-00048-of-00048.safetensors "
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
        assert "3 Engram file(s) from org/orig" in out
        again = {n for n, _ in hub.ranges[first_run:]}
        # The re-run fetches only what was missing: finished files are kept (huggingface_hub resumes per file).
        assert name in again and not again & {"config.json", "model-00047-of-00048.safetensors",
                                               "model-00001-of-00001.safetensors.part00"}, again
    d = tmp_path / "model"
    assert (d / "model-00001-of-00001.safetensors").read_bytes() == shard
    assert not list(d.glob("*.part*")), "parts must be removed after joining"
    assert not (d / "model-00001-of-00048.safetensors").exists(), "only the Engram files come from the original"
    assert (d / "model-00048-of-00048.safetensors").read_bytes() == (repo_dirs["org/orig"] /
                                                                      "model-00048-of-00048.safetensors").read_bytes()


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
        s = _settings(tmp_path, ENGRAM_DIR=str(repo_dirs["org/orig"]))
        out = download.fetch(s)
        assert "Engram files linked from" in out
        assert not [n for n, _ in hub.ranges if "00048" in n]
