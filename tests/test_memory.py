"""Unified-memory guards: the release policy counts exactly, memory lines round-trip, the vLLM version check
refuses other versions, and the page-cache drop really lowers Cached."""

from __future__ import annotations

import os

import pytest
from twinspark.memory import hooks, memlog
from twinspark.memory.meminfo import GIB, read_meminfo
from twinspark.memory.pagecache import drop_files
from twinspark.memory.policy import ReleasePolicy


def test_policy_counts_releases_exactly():
    p = ReleasePolicy(chunk_log_tokens=256, release_tokens=512, release_below=10 * GIB, long_prefill_tokens=2048)
    plenty, short = 50 * GIB, 5 * GIB
    # a 4-chunk prefill with plenty of memory: chunks logged, no release until the prefill ends
    steps = [(1024, plenty), (1024, plenty), (1024, plenty), (300, plenty), (1, plenty), (1, plenty)]
    actions = [p.step(t, m) for t, m in steps]
    assert actions == [["log_chunk"], ["log_chunk"], ["log_chunk"], ["log_chunk", "release_end_of_prefill"], [], []]
    # memory short: every big chunk releases; a prefill shorter than long_prefill_tokens gets no end release
    steps = [(1024, short), (600, short), (100, short)]
    actions = [p.step(t, m) for t, m in steps]
    assert actions == [["log_chunk", "release_between_chunks"], ["log_chunk", "release_between_chunks"], []]


def test_policy_from_env():
    env = {"TWINSPARK_RELEASE_TOKENS": "64", "TWINSPARK_RELEASE_BELOW_GIB": "1.5",
           "TWINSPARK_LONG_PREFILL_TOKENS": "128", "TWINSPARK_CHUNK_LOG_TOKENS": "32"}
    p = ReleasePolicy.from_env(env)
    assert (p.release_tokens, p.release_below, p.long_prefill_tokens, p.chunk_log_tokens) == (64, int(1.5 * GIB),
                                                                                             128, 32)


def test_memlog_lines_round_trip(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TWINSPARK_MEMLOG_DIR", str(tmp_path))
    for rank in (0, 1):
        for phase in ("weights_loaded", "profiled", "kv_allocated", "graphs_captured"):
            memlog.write(phase, rank)
        memlog.write("release", rank, tokens=600, reason="release_between_chunks", freed=0)
    err = capsys.readouterr().err
    records = memlog.parse("unrelated line\n" + err)
    assert len(records) == 10
    summary = memlog.summarize(records)
    assert [s.rank for s in summary] == [0, 1]
    assert all(s.releases == 1 and s.phases[:4] == ("weights_loaded", "profiled", "kv_allocated",
                                                    "graphs_captured") for s in summary)
    assert summary[0].low_water > 0
    assert (tmp_path / "memory-rank1.jsonl").read_text().count("\n") == 5
    assert "low-water MemAvailable" in memlog.format_summary(summary)


def test_version_mismatch_is_refused_clearly():
    hooks.check_version("0.32.0")
    hooks.check_version("0.32.0+cpu")
    with pytest.raises(hooks.VllmVersionError, match=r"written for vLLM 0\.32\.0 but this is vLLM 0\.33\.1; "
                                                      r"install vLLM 0\.32\.0 or start with TWINSPARK_MEMORY_HOOKS=0"):
        hooks.check_version("0.33.1")


def test_page_cache_drop_lowers_cached(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    size = 256 * 1024 * 1024
    with open(folder / "model.safetensors", "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())  # clean pages: DONTNEED can drop them
    with open(folder / "model.safetensors", "rb") as f:
        while f.read(1 << 24):
            pass
    before = read_meminfo()["Cached"]
    assert drop_files(folder) == 1
    after = read_meminfo()["Cached"]
    assert before - after > size // 2, f"Cached went from {before} to {after}"


@pytest.mark.vllm
def test_vllm_start_up_fails_on_another_version(tmp_path):
    """The real plugin-loading path of a vLLM process (load_general_plugins -> register) refuses another
    version: start-up fails with the sentence, not later with wrong memory behaviour."""
    import subprocess
    import sys

    pytest.importorskip("vllm")
    code = ("import vllm; vllm.__version__ = '0.99.0'\n"
            "from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TWINSPARK_ALLOW_UNTESTED_VLLM": "1", "VLLM_PLUGINS": "twinspark"})
    assert r.returncode != 0
    assert "written for vLLM 0.32.0 but this is vLLM 0.99.0" in r.stderr, r.stderr[-2000:]


def test_hooks_pin_matches_plugin_pin():
    from twinspark.vllm_plugin import TESTED_VLLM

    assert TESTED_VLLM in hooks.WRITTEN_FOR_VLLM
