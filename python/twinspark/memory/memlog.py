"""Memory lines: every rank writes one line per phase (weights loaded, profiling, KV allocated, graphs captured,
each prefill chunk over a threshold, each allocator release) to stderr — which lands in the serving log the
deploy suite already collects — and, when TWINSPARK_MEMLOG_DIR is set, to `memory-rank<R>.jsonl` there.

A line is `TWINSPARK_MEM {json}`; `summarize()` reads them back from any log text (both ranks' logs)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from twinspark.memory.meminfo import GIB, sample

PREFIX = "TWINSPARK_MEM "
PHASES = ("weights_loaded", "profiled", "kv_allocated", "graphs_captured", "prefill_chunk", "release",
          "page_cache_dropped")


def write(phase: str, rank: int, **extra) -> dict:
    """Sample memory now and write one line for `phase`; returns the record."""
    rec = {"phase": phase, "rank": rank, **sample().as_dict(), **extra}
    line = PREFIX + json.dumps(rec, sort_keys=True)
    print(line, file=sys.stderr, flush=True)
    folder = os.environ.get("TWINSPARK_MEMLOG_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / f"memory-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    return rec


def parse(text: str) -> list[dict]:
    """Every memory record in a log text (other lines ignored)."""
    out = []
    for line in text.splitlines():
        i = line.find(PREFIX)
        if i >= 0:
            try:
                out.append(json.loads(line[i + len(PREFIX):]))
            except ValueError:
                continue
    return out


@dataclass(frozen=True)
class RankSummary:
    rank: int
    lines: int
    low_water: int  # lowest MemAvailable seen, bytes
    low_phase: str  # the phase whose line saw it
    phases: tuple[str, ...]
    releases: int
    page_cache: tuple[int, int, str] | None = None  # Cached before, after, note of the page-cache drop


def summarize(records: list[dict]) -> list[RankSummary]:
    by_rank: dict[int, list[dict]] = {}
    for r in records:
        by_rank.setdefault(int(r["rank"]), []).append(r)
    out = []
    for rank, recs in sorted(by_rank.items()):
        low = min(recs, key=lambda r: r["mem_available"])
        seen = tuple(dict.fromkeys(r["phase"] for r in recs))
        drop = next((r for r in recs if r["phase"] == "page_cache_dropped"), None)
        pc = (drop["cached_before"], drop["cached_after"], drop.get("note", "")) if drop else None
        out.append(RankSummary(rank, len(recs), low["mem_available"], low["phase"], seen,
                               sum(1 for r in recs if r["phase"] == "release"), pc))
    return out


def format_summary(summaries: list[RankSummary]) -> str:
    if not summaries:
        return "no memory lines found (is the twinspark plugin loaded in the serving processes?)"
    rows = [f"rank {s.rank}: low-water MemAvailable {s.low_water / GIB:.2f} GiB at '{s.low_phase}'; "
            f"{s.lines} lines, {s.releases} allocator releases; phases: {', '.join(s.phases)}"
            + (f"; page cache {s.page_cache[0] / GIB:.3f} -> {s.page_cache[1] / GIB:.3f} GiB ({s.page_cache[2]})"
               if s.page_cache else "") for s in summaries]
    return "\n".join(rows)
