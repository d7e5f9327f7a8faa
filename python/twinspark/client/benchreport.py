"""Render a bench document (client.bench.run): markdown table, PNG plots, JSON (temp + rename), and the change
against a previous run (--compare PREVIOUS.json). A comparison uses every sample of both runs: medians for the
change, and a change counts only when the two runs' sample ranges do not overlap (a single sample cannot tell a
change from noise, and says so); the header names both runs' commit and recipe."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from twinspark.client.http import ClientError
from twinspark.fileio import atomic_write


def metrics(doc: dict) -> dict[str, list[float]]:
    """Flat {metric name: samples}: the keys compare across runs (a document of one sample per row gives lists
    of one)."""
    out = {}
    for r in doc.get("prefill", []):
        out[f"prefill {r['kind']} {r['target']} tok/s"] = r.get("tok_s_samples") or [r["tok_s"]]
    for r in doc.get("decode", []):
        key = f"decode {r['kind']} x{r['concurrency']}"
        out[f"{key} per-stream tok/s"] = (r.get("per_stream_mean_tok_s_samples")
                                          or [statistics.mean(r["per_stream_tok_s"])])
        out[f"{key} aggregate tok/s"] = r.get("aggregate_tok_s_samples") or [r["aggregate_tok_s"]]
    return {k: [float(x) for x in v] for k, v in out.items()}


def _spread(v: list[float]) -> str:
    m = statistics.median(v)
    return f"{m:.1f}" if len(v) < 2 else f"{m:.1f} ({min(v):.1f}-{max(v):.1f}, n={len(v)})"


def verdict(new: list[float], old: list[float]) -> str:
    if min(len(new), len(old)) < 2:
        return "one sample: cannot tell from noise"
    if max(new) < min(old) or min(new) > max(old):
        return "beyond noise"
    return "within noise"


def _who(doc: dict) -> str:
    m = doc.get("meta", {})
    return f"commit {str(m.get('commit', '?'))[:12]}, recipe {m.get('recipe', '?')}, {m.get('date', '?')}"


def markdown(doc: dict) -> str:
    m = doc["meta"]
    n = doc.get("settings", {}).get("samples", 1)
    lines = [f"# Bench: {m['model']} at {m['url']} ({m['date']})", "",
             f"{_who(doc)}; max_model_len {m.get('max_model_len', '?')}; each row the median of {n} sample(s)", "",
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
    """A markdown table of every metric both runs have: medians (range, samples), change of the medians in
    percent, and whether the change is beyond the samples' noise."""
    new, old = metrics(doc), metrics(previous)
    common = [k for k in new if k in old]
    if not common:
        return "No metric in common with the previous run (different lengths, kinds or concurrency).\n"
    lines = [f"previous: {_who(previous)}; now: {_who(doc)}", "",
             "| metric | previous | now | change | verdict |", "|---|---|---|---|---|"]
    for k in common:
        a, b = statistics.median(old[k]), statistics.median(new[k])
        ch = (b - a) / a * 100 if a else float("nan")
        lines.append(f"| {k} | {_spread(old[k])} | {_spread(new[k])} | {ch:+.1f}% | {verdict(new[k], old[k])} |")
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
