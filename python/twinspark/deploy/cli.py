"""Glue for tasks.py: turn task flags into the highest-precedence config layer and user errors into one line.
Contract: `flags(recipe, sets, **named)` -> {KEY: value}; `call(fn, *a, **kw)` runs fn and maps DeployError to
invoke's Exit (exit code 1, the sentence only, no traceback); Ctrl-C ends with one line saying what state was left
and how to resume (exit code 130)."""

from __future__ import annotations

from invoke import Exit

from twinspark.deploy import progress
from twinspark.deploy.errors import DeployError

COMMON_HELP = {
    "recipe": "recipe in configs/ (e.g. exl3-2.9bpw, exl3-2.77bpw, tiny-cpu) or a .toml path",
    "set": "KEY=VALUE override, repeatable (highest precedence; `invoke config` lists the keys)",
    "dry_run": "print what would be done on each host, change nothing",
}


def flags(recipe: str | None, sets: list[str] | None, **named) -> dict:
    out = {}
    if recipe:
        out["RECIPE"] = recipe
    for item in sets or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise Exit(f"--set expects KEY=VALUE, got '{item}'; e.g. --set MAX_MODEL_LEN=262144.", code=1)
        out[key.strip().upper()] = value
    for k, v in named.items():
        if v is not None and v is not False:
            out[k.upper()] = v
    return out


def call(fn, *a, **kw):
    try:
        with progress.watch_interrupts():
            return fn(*a, **kw)
    except DeployError as e:
        raise Exit(str(e), code=getattr(e, "code", 1)) from None
    except KeyboardInterrupt:  # outside any step
        raise Exit("Interrupted (Ctrl-C); `invoke status` shows what runs.", code=130) from None


def table(rows) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(str(c).ljust(w) for c, w in zip(r, widths)), str(r[-1])]).rstrip() for r in rows)
