"""`twinspark`: one list of what the project offers (the console script; also `python -m twinspark.cli`).

    twinspark                    # invoke tasks and nox sessions of the checkout, and the python -m entry points
    twinspark tasks|sessions|modules
    twinspark --root DIR         # the checkout to read tasks.py and noxfile.py from (default: found from here)

The invoke tasks and nox sessions live in the checkout (tasks.py, noxfile.py), not in the wheel: they are listed
when a checkout is found from the current directory (or given with --root). The entry points come from the
installed package itself. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

SECTIONS = ("tasks", "sessions", "modules")


def find_checkout(start: Path) -> Path | None:
    """The nearest folder at or above `start` holding twinspark's tasks.py, noxfile.py and pyproject.toml."""
    for folder in (start, *start.parents):
        pyproject = folder / "pyproject.toml"
        if (folder / "tasks.py").is_file() and (folder / "noxfile.py").is_file() and pyproject.is_file():
            if re.search(r'^name\s*=\s*"twinspark"', pyproject.read_text(), re.M):
                return folder
    return None


def summary(doc: str | None, width: int = 100) -> str:
    """The first sentence of a docstring's first paragraph, cut to `width` characters."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    first = re.split(r"(?<=\.)\s", para, maxsplit=1)[0]
    return first if len(first) <= width else first[: width - 3].rsplit(" ", 1)[0] + "..."


def nox_sessions(noxfile: Path) -> list[tuple[str, str, bool]]:
    """(name, one-line docstring, runs by default) of every @nox.session in a noxfile, read without nox."""
    out = []
    for node in ast.parse(noxfile.read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if ast.unparse(target) not in ("nox.session", "session"):
                continue
            kw = {k.arg: k.value for k in getattr(dec, "keywords", [])}
            name = kw["name"].value if isinstance(kw.get("name"), ast.Constant) else node.name
            default = not (isinstance(kw.get("default"), ast.Constant) and kw["default"].value is False)
            out.append((name, summary(ast.get_docstring(node)), default))
    return out


def invoke_tasks(root: Path) -> list[tuple[str, str]] | str:
    """(name, help) of the checkout's invoke tasks, or why they cannot be listed."""
    if importlib.util.find_spec("invoke") is None:
        return "invoke is not installed here (pip install 'twinspark[deploy]')"
    cmd = [sys.executable, "-m", "invoke", "--list", "--list-format=json"]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        return f"`invoke --list` failed in {root}: {(res.stderr or res.stdout).strip().splitlines()[-1:]}"
    out: list[tuple[str, str]] = []

    def walk(coll: dict, prefix: str) -> None:
        for t in coll.get("tasks", []):
            out.append((prefix + t["name"], summary(t.get("help"))))
        for sub in coll.get("collections", []):
            walk(sub, prefix + sub["name"] + ".")

    walk(json.loads(res.stdout), "")
    return out


def entry_points() -> list[tuple[str, str]]:
    """(module, one-line docstring) of every module of the installed package that runs under `python -m`."""
    spec = importlib.util.find_spec("twinspark")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    out = []
    for path in sorted(pkg.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        parts = path.relative_to(pkg.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            parts = parts[:-1]
        elif not re.search(r"""^if __name__ == ["']__main__["']""", text, re.M):
            continue
        out.append((".".join(parts), summary(ast.get_docstring(ast.parse(text)))))
    return out


def _table(rows: list[tuple[str, str]], prefix: str) -> list[str]:
    width = max((len(prefix + name) for name, _ in rows), default=0)
    return [f"  {(prefix + name).ljust(width)}  {text}" for name, text in rows]


def render(sections: tuple[str, ...], root: Path | None) -> str:
    lines: list[str] = []
    if "tasks" in sections:
        lines.append("invoke tasks (deploy and operate two nodes; `invoke TASK --help`):")
        tasks = invoke_tasks(root) if root else "no checkout found here (run inside one, or give --root)"
        lines += _table(tasks, "invoke ") if isinstance(tasks, list) else [f"  {tasks}"]
    if "sessions" in sections:
        lines.append("nox sessions (developer menu; `nox -s NAME -- ARGS`):")
        if root:
            rows = [(name, doc + ("" if default else " [not default]")) for name, doc, default in
                    nox_sessions(root / "noxfile.py")]
            lines += _table(rows, "nox -s ")
        else:
            lines.append("  no checkout found here (run inside one, or give --root)")
    if "modules" in sections:
        lines.append("python -m entry points (installed package; `python -m MODULE --help`):")
        lines += _table(entry_points(), "python -m ")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="twinspark", description="List what twinspark offers: the checkout's invoke "
                                 "tasks and nox sessions, and the package's python -m entry points.")
    ap.add_argument("section", nargs="*", metavar="SECTION", help=f"one or more of {', '.join(SECTIONS)} (default: all)")
    ap.add_argument("--root", type=Path, help="the checkout (default: the nearest one at or above the current folder)")
    args = ap.parse_args(argv)
    unknown = [s for s in args.section if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section {unknown[0]!r}: choose from {', '.join(SECTIONS)}")
    if args.root is not None and find_checkout(args.root.resolve()) != args.root.resolve():
        ap.error(f"--root {args.root}: not a twinspark checkout (tasks.py, noxfile.py and pyproject.toml expected)")
    root = args.root.resolve() if args.root else find_checkout(Path.cwd())
    print(render(tuple(args.section) or SECTIONS, root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
