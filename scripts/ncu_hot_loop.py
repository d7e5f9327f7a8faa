#!/usr/bin/env python3
"""Where the warps of a kernel wait, per SASS instruction, from an ncu source page in CSV:

    ncu --kernel-name regex:moe_gemm --launch-skip 4 --launch-count 2 --section SourceCounters \\
        --page source --print-source sass --csv python3 bench/profile_exl3.py moe --K 2 --T 1 > src.csv
    python3 scripts/ncu_hot_loop.py src.csv [--groups 4] [--list 1]

Instructions are grouped by how often they executed (one count per code region: the tile loop, the A build, the
once-per-warp prologue, ...). Prints every group's share of the warp stall samples, then lists the instructions of
the --list hottest groups in address order with their samples and not-issued samples: in the tile loop, the
instructions where warps sit are the ones waiting for an operand or a pipe. Columns are found by name, so the
script follows ncu's CSV between versions; anything it cannot read it says, with the lines it saw.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path


def _col(header: list[str], *needles: str) -> int:
    """Index of the first column whose name holds every needle; an exact name first ("Instructions Executed", not
    "Thread Instructions Executed"). -1: none."""
    for i, h in enumerate(header):
        if len(needles) == 1 and h.strip().lower() == needles[0]:
            return i
    for i, h in enumerate(header):
        if all(n.lower() in h.lower() for n in needles):
            return i
    return -1


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def _reasons(why: dict[int, str], rows: list[list[str]], n: int) -> str:
    """The n largest stall reasons (stall_* columns) summed over rows."""
    tot: dict[str, float] = defaultdict(float)
    for r in rows:
        for i, name in why.items():
            tot[name] += _num(r[i])
    return " ".join(f"{k} {v:.0f}" for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:n] if v > 0)


def kernels(lines: list[str]):
    """(title lines, header, rows) per kernel block of the CSV source page."""
    title: list[str] = []
    header: list[str] | None = None
    rows: list[list[str]] = []
    for row in csv.reader(lines):
        if not row:
            continue
        if _col(row, "address") >= 0 and _col(row, "source") >= 0:
            if header is not None:
                yield title, header, rows
                title, rows = [], []
            header = row
        elif header is None or len(row) < len(header) // 2:
            if header is not None and rows:
                yield title, header, rows
                title, header, rows = [], None, []
            title.append(",".join(row))
        else:
            rows.append(row)
    if header is not None and rows:
        yield title, header, rows


def report(path: Path, n_groups: int, n_list: int) -> int:
    lines = path.read_text(errors="replace").splitlines()
    found = False
    seen = set()
    for title, header, rows in kernels(lines):
        key = (tuple(title), len(rows), tuple(rows[0]))
        if key in seen:  # ncu prints a kernel's table once per section that has source metrics
            continue
        seen.add(key)
        a, s = _col(header, "address"), _col(header, "source")
        smp, nis = _col(header, "stall sampling", "all"), _col(header, "not-issued")
        ex = _col(header, "instructions executed")
        if min(a, s, smp, ex) < 0:
            continue
        why = {
            i: h[6:]
            for i, h in enumerate(header)
            if h.startswith("stall_") and not any(x in h.lower() for x in ("not issued", "not_issued"))
        }

        found = True
        print("\n".join(t for t in title[-3:] if t.strip()) or "(kernel)")
        groups: dict[float, list[list[str]]] = defaultdict(list)
        for r in rows:
            groups[_num(r[ex])].append(r)
        total = sum(_num(r[smp]) for r in rows) or 1.0
        ranked = sorted(groups.items(), key=lambda kv: -sum(_num(r[smp]) for r in kv[1]))
        for cnt, rs in ranked[:n_groups]:
            g = sum(_num(r[smp]) for r in rs)
            gn = sum(_num(r[nis]) for r in rs) if nis >= 0 else 0
            print(
                f"  executed {cnt:10.0f} times: {len(rs):5d} instructions, {g:7.0f} samples ({100 * g / total:4.1f}%),"
                f" not issued {gn:7.0f}; {_reasons(why, rs, 6)}"
            )
        for cnt, rs in ranked[:n_list]:
            print(
                f"  -- instructions executed {cnt:.0f} times, address order: samples, not issued, SASS, top reasons"
            )
            for r in sorted(rs, key=lambda r: int(r[a], 16) if r[a].startswith("0x") else _num(r[a])):
                print(
                    f"    {r[a]:>8} {_num(r[smp]):6.0f} {_num(r[nis]) if nis >= 0 else 0:6.0f}  {r[s].strip():<60}"
                    f" {_reasons(why, [r], 2)}"
                )
    if not found:
        print(
            f"ncu_hot_loop.py: no source table with address, source, stall sampling and executed columns in "
            f"{path}; its first lines:",
            file=sys.stderr,
        )
        print("\n".join(lines[:15]), file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--groups", type=int, default=4, help="code regions (execution counts) to summarise")
    ap.add_argument("--list", type=int, default=1, help="hottest regions to list instruction by instruction")
    args = ap.parse_args()
    if not args.csv.is_file():
        print(
            f"ncu_hot_loop.py: {args.csv} is not a file; give the CSV that ncu --page source --csv wrote",
            file=sys.stderr,
        )
        return 2
    return report(args.csv, args.groups, args.list)


if __name__ == "__main__":
    sys.exit(main())
