"""Render a bench document (client.bench.run): markdown table, PNG plots, JSON (temp + rename), and the change
against a previous run (--compare PREVIOUS.json)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from twinspark.client.http import ClientError
from twinspark.fileio import atomic_write


def metrics(doc: dict) -> dict[str, float]:
    """Flat {metric name: value}: the keys compare across runs."""
    out = {}
    for r in doc.get("prefill", []):
        out[f"prefill {r['kind']} {r['target']} tok/s"] = r["tok_s"]
    for r in doc.get("decode", []):
        out[f"decode {r['kind']} x{r['concurrency']} per-stream tok/s"] = statistics.mean(r["per_stream_tok_s"])
        out[f"decode {r['kind']} x{r['concurrency']} aggregate tok/s"] = r["aggregate_tok_s"]
    return out


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = [f"# Bench: {m['model']} at {m['url']} ({m['date']})", "",
             "| prefill | prompt tokens | TTFT s | tok/s |", "|---|---|---|---|"]
    for r in doc["prefill"]:
        lines.append(f"| {r['kind']} | {r['prompt_tokens']} | {r['ttft_s']:.3f} | {r['tok_s']:.1f} |")
    lines += ["", "| decode | streams | per stream tok/s (min-max) | aggregate tok/s |", "|---|---|---|---|"]
    for r in doc["decode"]:
        p = r["per_stream_tok_s"]
        lines.append(f"| {r['kind']} | {r['concurrency']} | {statistics.mean(p):.1f} ({min(p):.1f}-{max(p):.1f}) | "
                     f"{r['aggregate_tok_s']:.1f} |")
    return "\n".join(lines) + "\n"


def compare(doc: dict, previous: dict) -> str:
    """A markdown table of every metric both runs have: old, new, change in percent."""
    new, old = metrics(doc), metrics(previous)
    common = [k for k in new if k in old]
    if not common:
        return "No metric in common with the previous run (different lengths, kinds or concurrency).\n"
    lines = ["| metric | previous | now | change |", "|---|---|---|---|"]
    for k in common:
        ch = (new[k] - old[k]) / old[k] * 100 if old[k] else float("nan")
        lines.append(f"| {k} | {old[k]:.1f} | {new[k]:.1f} | {ch:+.1f}% |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for kind in sorted({r["kind"] for r in doc["prefill"]}):
        rows = [r for r in doc["prefill"] if r["kind"] == kind]
        a1.plot([r["prompt_tokens"] for r in rows], [r["tok_s"] for r in rows], "o-", label=kind)
    a1.set_xscale("log")
    a1.set_xlabel("prompt tokens")
    a1.set_ylabel("prefill tok/s (prompt / TTFT)")
    for kind in sorted({r["kind"] for r in doc["decode"]}):
        rows = [r for r in doc["decode"] if r["kind"] == kind]
        cs = [r["concurrency"] for r in rows]
        a2.plot(cs, [r["aggregate_tok_s"] for r in rows], "o-", label=f"{kind} aggregate")
        a2.plot(cs, [statistics.mean(r["per_stream_tok_s"]) for r in rows], "s--", label=f"{kind} per stream")
    a2.set_xlabel("concurrent streams")
    a2.set_ylabel("decode tok/s")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"{doc['meta']['model']} ({doc['meta']['date']})", fontsize=9)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=f".{png.name}.", suffix=".png", dir=png.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, png)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)


def save(doc: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    """<stem>.json, <stem>.md and <stem>.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    atomic_write(paths["json"], json.dumps(doc, indent=1) + "\n")
    atomic_write(paths["md"], markdown(doc))
    plot(doc, paths["png"])
    return paths


def load(path: str | os.PathLike) -> dict:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        metrics(doc)
        return doc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ClientError(f"{p} is not a bench result written by `invoke bench` ({e}); pass the .json it wrote") from None
