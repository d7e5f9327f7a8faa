"""Fuzz: deploy settings (twinspark.deploy.config.load) from task flags, the environment, .env and a TOML recipe.

One key set to anything a user could write, in one of the four places: accepted settings must equal the valid
ones except that key, which must hold a value that can work (its range, finite, not empty where it names something,
no NUL) and what was written; the key's source must be where it was written. Whole .env and recipe files of random
bytes and TOML, and .env / recipe paths that are not regular files, must end in DeployError or valid settings."""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from fuzzkit import JSON, NUMBERS, SPECIALS, fuzz, outcome
from hypothesis import given
from hypothesis import strategies as st
from twinspark.deploy import config
from twinspark.deploy.errors import DeployError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - py3.10 only
    import tomli as tomllib

READER = "deploy settings"
FIELDS = {k: f for k, f in config.Settings.model_fields.items() if k != "recipe"}  # RECIPE swaps every value
RANGES = {"ssh_port": (1, 65535), "api_port": (1, 65535), "master_port": (1, 65535), "head_gid_index": (0, math.inf),
          "worker_gid_index": (0, math.inf), "tensor_parallel": (1, 2), "max_model_len": (1, config.MAX_CONTEXT),
          "max_num_seqs": (1, math.inf), "max_num_batched_tokens": (1, math.inf), "kv_cache_bytes": (0, math.inf),
          "block_size": (1, math.inf), "num_speculative_tokens": (0, math.inf), "temperature": (0, 2),
          "top_p": (1e-300, 1), "health_timeout_s": (1, math.inf), "silence_s": (1, math.inf),
          "memguard_min_gib": (0, math.inf), "boot_margin_gib": (0, math.inf), "release_tokens": (1, math.inf),
          "release_below_gib": (0, math.inf), "long_prefill_tokens": (1, math.inf)}
NAMES_SOMETHING = {"model_dir", "state_dir", "wheel_dir", "log_dir", "sysfs_root", "served_model_name", "ssh_user",
                   "image", "vllm_python", "runtime", "sync", "api_host", "py_spy"}


@contextmanager
def environment(values: dict[str, str]):
    """os.environ without any setting key, plus `values`, for one case."""
    saved = {k: v for k, v in os.environ.items() if k.lower() in config.Settings.model_fields}
    for k in saved:
        del os.environ[k]
    os.environ.update(values)
    try:
        yield
    finally:
        for k in values:
            os.environ.pop(k, None)
        os.environ.update(saved)


def _can_work(name: str, v) -> str | None:
    """Why value `v` of setting `name` cannot work, or None (the contract, stated apart from the validators)."""
    if name in RANGES:
        lo, hi = RANGES[name]
        if type(v) not in (int, float) or not (math.isfinite(v) and lo <= v <= hi):
            return f"{v!r} is outside {lo}..{hi}"
    if isinstance(v, str | Path) and "\x00" in str(v):
        return "holds a NUL"
    if name in NAMES_SOMETHING and not str(v).strip():
        return "is empty"
    if isinstance(v, dict) and not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        return "is not a map of strings"
    return None


def _means(name: str, written, v) -> str | None:
    """Why `v` is not what `written` says (numbers, text and paths; bools and JSON maps have many spellings)."""
    ann = FIELDS[name].annotation
    try:
        if ann in (int, float) and not isinstance(written, bool):
            ok = float(str(written).strip()) == v
        elif ann is str:
            ok = written == v
        elif "Path" in str(ann) and isinstance(written, str) and written.strip():
            ok = Path(written) == v
        elif "Path" in str(ann) and isinstance(written, str):
            ok = name not in NAMES_SOMETHING and v is None  # empty: unset (optional paths only)
        else:
            ok = True
    except ValueError:
        ok = False
    return None if ok else f"{v!r} is not what was written ({written!r})"


def _toml(v) -> str:
    """A TOML value for a recipe line."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else "inf" if v > 0 else "-inf"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):  # a basic string: quote, backslash and control characters escaped
        return '"' + "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c
                             for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml(k)} = {_toml(x)}" for k, x in v.items() if x is not None) + "}"
    return '""'


@pytest.fixture(scope="module")
def baseline():
    with environment({}):
        return config.load({}, env_file=None)[0].model_dump()


TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "nan", "inf", "-1", "0", "3", "1e400", "true",
                                                        "{}", '{"A": "1"}', '{"A": {"B": 1}}', "[1]", "x\x00y",
                                                        "8888", "127.0.0.1", "-o", "a b"]))
VALUES = st.one_of(TEXT, NUMBERS, JSON)


@fuzz(1200)
@given(key=st.sampled_from(sorted(FIELDS)), source=st.sampled_from(["flag", "environment", ".env", "recipe"]),
       value=VALUES)
def test_one_key(scratch, baseline, key, source, value):
    if value is None and source == "flag":
        value = "None"  # a flag of None is a flag not given
    text = value if isinstance(value, str) else json.dumps(value)
    if source in ("environment", ".env") and not isinstance(value, str):
        value = text  # these places hold text only
    if source in ("environment", ".env") and ("\x00" in text or "\n" in text or "\r" in text or "'" in text):
        value = text = text.replace("\x00", "").replace("\n", "").replace("\r", "").replace("'", "")
    flags, env, env_file = {}, {}, None
    if source == "flag":
        flags = {key.upper(): value}
    elif source == "environment":
        env = {key.upper(): text}
    elif source == ".env":
        env_file = scratch.write(".env", f"{key.upper()}='{text}'\n")
    else:  # the default recipe with this key written over
        recipe = {k: v for k, v in config.read_recipe("tiny-cpu").items() if k != key}
        line = f"{key.upper()} = {_toml(value)}"
        value = tomllib.loads(line)[key.upper()]  # what the recipe now says
        body = "\n".join([line] + [f"{k.upper()} = {_toml(v)}" for k, v in recipe.items()])
        flags = {"RECIPE": str(scratch.write("r.toml", body))}

    def load():
        with environment(env):
            return config.load(flags, env_file=env_file)

    def expect(result):
        s, where = result
        got = s.model_dump()
        others = {k: v for k, v in got.items() if k not in (key, "recipe")}
        want = {k: v for k, v in baseline.items() if k not in (key, "recipe")}
        if others != want:
            diff = sorted(k for k in others if others[k] != want[k])
            return f"{key} from {source} changed other settings too: {diff}"
        if where[key.upper()] != source:
            return f"{key.upper()} is said to come from {where[key.upper()]}, not {source}"
        return _can_work(key, got[key]) or (None if source == ".env" else _means(key, value, got[key]))

    outcome(READER, load, DeployError, expect, names=None if source == "recipe" else key.upper())


@fuzz(400)
@given(kind=st.sampled_from([".env", "recipe"]), form=st.sampled_from(["bytes", "text", "special", "missing"]),
       raw=st.binary(max_size=60), text=st.text(max_size=60), special=SPECIALS)
def test_settings_files(scratch, baseline, kind, form, raw, text, special):
    name = ".env" if kind == ".env" else "r.toml"
    if form == "bytes":
        p = scratch.write(name, raw)
    elif form == "text":
        p = scratch.write(name, text)
    else:
        p = scratch.special(name, "missing" if form == "missing" else special)
    flags = {"RECIPE": str(p)} if kind == "recipe" else {}

    def load():
        with environment({}):
            return config.load(flags, env_file=p if kind == ".env" else None)

    def expect(result):
        s, where = result
        for k, v in s.model_dump().items():
            why = _can_work(k, v)
            if why:
                return f"{k.upper()} {why}"
        return None

    outcome(READER, load, DeployError, expect, names=str(p))
