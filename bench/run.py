"""Run the kernel benchmarks and write one report (what `nox -s bench -- [NAMES]` runs).

    python bench/run.py                 # every bench/bench_*.py
    python bench/run.py exl3 moe        # bench_exl3*.py and bench_moe*.py
    python bench/run.py --list          # what would run (no GPU needed)
    python bench/run.py --report-only   # rebuild report.md/.png from the JSON already in bench/results

Each benchmark runs in its own process with $TWINSPARK_BENCH_OUT set and writes `<op>.json` through
benchkit.write_results. The report (report.md + report.png in the output folder) puts every record
next to the device-to-device copy ceiling measured in this run and the upstream H200 anchors
(bench/anchors_h200.json). Without a CUDA GPU it says so and exits with status 2 (except --list/--report-only).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))  # a source checkout works without installing

import benchkit as bk  # noqa: E402
from twinspark.fileio import atomic_write  # noqa: E402


def discover(bench_dir: Path, names: list[str]) -> list[Path]:
    """bench_*.py in bench_dir whose name (without bench_) starts with one of ``names`` or matches it as a glob."""
    files = sorted(bench_dir.glob("bench_*.py"))
    if not names:
        return files
    out = []
    for f in files:
        op = f.stem.removeprefix("bench_")
        if any(op.startswith(n.removeprefix("bench_")) or fnmatch.fnmatch(op, n) for n in names):
            out.append(f)
    return out


def run_one(path: Path, out_dir: Path, timeout: float) -> tuple[bool, float, str]:
    env = dict(os.environ, TWINSPARK_BENCH_OUT=str(out_dir), PYTHONUNBUFFERED="1")
    # bench/ for benchkit (also for a benchmark outside it, --bench-dir), python/ for a checkout without installing
    dirs = [str(HERE), str(HERE.parent / "python"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, dirs))
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, str(path)], env=env, timeout=timeout, cwd=HERE.parent)
        ok, why = p.returncode == 0, f"exit status {p.returncode}"
    except subprocess.TimeoutExpired:
        ok, why = False, f"timed out after {timeout:.0f} s"
    return ok, time.monotonic() - t0, why


# ------------------------------------------------------------------------------------------------------ report
def _fmt(v, spec=".1f", none="-"):
    return none if v is None else format(v, spec)


def _shape(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def build_report(results: list[dict], out_dir: Path, copy_gbps: float | None, anchors: bk.Anchors | None,
                 failed: list[str]) -> tuple[Path, Path | None]:
    """report.md (+ report.png when any record has a GB/s or an anchor) from loaded results files."""
    lines = ["# Kernel benchmarks", ""]
    machines = {r["machine"].get("gpu") or "no GPU" for r in results}
    first = results[0]["machine"] if results else bk.machine_info()
    lines.append(f"Machine: {', '.join(sorted(machines)) or first.get('gpu')}; torch {first.get('torch')}, "
                 f"CUDA {first.get('cuda')}; {first.get('date')}.")
    if copy_gbps:
        lines.append(f"Copy ceiling measured in this run: {copy_gbps:.0f} GB/s (device-to-device, read + write).")
    if anchors:
        lines.append(f"Anchors: upstream {anchors.meta.get('upstream', '?')} on {anchors.meta.get('device', '?')} "
                     f"(copy ceiling {anchors.ceilings.copy_gbps:.0f} GB/s there); `vs upstream` > 1 means faster.")
    if failed:
        lines += ["", "**Failed or unreadable:** " + ", ".join(failed)]
    bars = []  # (label, fraction of the copy ceiling, speed-up vs anchor)
    for res in results:
        ceiling = res.get("ceilings", {}).get("copy_gbps") or copy_gbps
        lines += ["", f"## {res['name']}", "",
                  "| op | shape | variant | median us | GB/s | % copy ceiling | upstream us | vs upstream | bf16 dense us |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in res["records"]:
            frac = r.gbps / ceiling if (r.gbps and ceiling) else None
            lines.append(f"| {r.op} | {_shape(r.shape)} | {r.variant} | {r.median_us:.1f} | {_fmt(r.gbps, '.0f')} | "
                         f"{_fmt(frac * 100 if frac else None, '.1f')} | {_fmt(r.anchor_us)} | "
                         f"{_fmt(r.vs_anchor, '.2f')} | {_fmt(r.dense_us)} |")
            if frac is not None or r.vs_anchor is not None:
                bars.append((f"{r.op} {_shape(r.shape)}", frac, r.vs_anchor))
    md = out_dir / "report.md"
    png = out_dir / "report.png" if bars else None
    if png:
        _plot(bars, png)
        lines += ["", "![achieved vs ceiling and anchors](report.png)"]
    atomic_write(md, "\n".join(lines) + "\n")
    return md, png


def _plot(bars, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(bars)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, max(3.0, 0.28 * n + 1.5)), sharey=True)
    y = list(range(n))
    labels = [b[0] for b in bars]
    a1.barh(y, [(b[1] or 0) * 100 for b in bars], color="tab:blue")
    a1.axvline(100, color="k", lw=0.8)
    a1.set_xlabel("achieved GB/s, % of the copy ceiling")
    a2.barh(y, [b[2] or 0 for b in bars], color=["tab:green" if (b[2] or 0) >= 1 else "tab:red" for b in bars])
    a2.axvline(1.0, color="k", lw=0.8)
    a2.set_xlabel("speed-up vs upstream H200 anchor (>1 faster)")
    a1.set_yticks(y, labels, fontsize=7)
    a1.invert_yaxis()
    fig.tight_layout()
    bk.save_figure(fig, png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="benchmarks to run: a prefix (exl3 -> bench_exl3*) or a glob")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results", help="results and report folder")
    ap.add_argument("--bench-dir", type=Path, default=HERE, help="where the bench_*.py files are")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per benchmark before it is stopped")
    ap.add_argument("--list", action="store_true", help="print the benchmarks that would run, run nothing")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from the JSON in --out-dir")
    a = ap.parse_args(argv)

    files = discover(a.bench_dir, a.names)
    if a.list:
        print("\n".join(str(f.relative_to(a.bench_dir)) for f in files) or "no benchmarks match")
        return 0
    out = a.out_dir
    try:
        anchors = bk.load_anchors()
    except bk.BenchError as e:
        print(f"warning: {e}; the report has no anchors", file=sys.stderr)
        anchors = None

    if a.report_only:
        paths = sorted(p for p in out.glob("*.json"))
        if not paths:
            print(f"no results in {out}; run the benchmarks first", file=sys.stderr)
            return 1
        results, skipped = [], []
        for p in paths:
            try:
                results.append(bk.load_results(p))
            except bk.BenchError as e:
                skipped.append(f"{p.name} ({e})")
        md, png = build_report(results, out, None, anchors, skipped)
        print(f"report: {md}" + (f", {png}" if png else ""))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench: no CUDA GPU is visible (torch.cuda.is_available() is False); run `nox -s bench` on a GPU "
              "machine", file=sys.stderr)
        return 2
    if not files:
        print(f"bench: no benchmark in {a.bench_dir} matches {' '.join(a.names) or 'bench_*.py'}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    copy = bk.copy_ceiling_gbps()
    print(f"copy ceiling: {copy:.0f} GB/s on {torch.cuda.get_device_name()}")
    results, failed = [], []
    for f in files:
        t0 = time.time()
        print(f"== {f.name}", flush=True)
        ok, secs, why = run_one(f, out, a.timeout)
        fresh = sorted(p for p in out.glob("*.json") if p.stat().st_mtime >= t0 - 1)
        if not ok or not fresh:
            failed.append(f"{f.name} ({why if not ok else 'wrote no results'})")
        for p in fresh:
            try:
                results.append(bk.load_results(p))
            except bk.BenchError as e:
                failed.append(f"{f.name} ({e})")
        print(f"   {'ok' if ok else 'FAILED: ' + why} in {secs:.1f} s, {len(fresh)} result file(s)")
    md, png = build_report(results, out, copy, anchors, failed)
    print(f"report: {md}" + (f", {png}" if png else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
