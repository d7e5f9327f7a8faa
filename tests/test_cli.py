"""The `twinspark` console script (twinspark.cli): it resolves, `--help` works, and it lists a checkout's invoke
tasks, its nox sessions and the package's python -m entry points."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from twinspark import cli

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the deploy extra brings tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]

NOXFILE = '''import nox

@nox.session(venv_backend="none")
def alpha(session):
    """First session. More text."""

@nox.session(venv_backend="none", default=False, name="beta-x")
def beta(session):
    """Second session, not run by default."""

def helper():
    """Not a session."""
'''

TASKS = '''from invoke import Collection, task

@task
def say_hello(c):
    """Print a greeting."""

ns = Collection(say_hello)
'''


def _checkout(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "twinspark"\n')
    (tmp_path / "noxfile.py").write_text(NOXFILE)
    (tmp_path / "tasks.py").write_text(TASKS)
    (tmp_path / "sub").mkdir()
    return tmp_path


def test_declared_console_script_resolves():
    """pyproject's [project.scripts] target exists and is callable (it named a missing module before)."""
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["twinspark"]
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "usage: twinspark" in capsys.readouterr().out


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["nonsense"])
    assert exc.value.code == 2
    assert "unknown section 'nonsense'" in capsys.readouterr().err


def test_checkout_found_from_a_subfolder(tmp_path):
    root = _checkout(tmp_path)
    assert cli.find_checkout(root / "sub") == root
    (root / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert cli.find_checkout(root / "sub") is None


def test_nox_sessions_read_without_nox(tmp_path):
    root = _checkout(tmp_path)
    assert cli.nox_sessions(root / "noxfile.py") == [
        ("alpha", "First session.", True),
        ("beta-x", "Second session, not run by default.", False),
    ]


def test_invoke_tasks_listed(tmp_path):
    pytest.importorskip("invoke", reason="invoke comes with the deploy extra")
    root = _checkout(tmp_path)
    assert cli.invoke_tasks(root) == [("say-hello", "Print a greeting.")]


def test_entry_points_of_the_package():
    names = dict(cli.entry_points())
    assert "twinspark.buildinfo" in names and "twinspark.cli" in names
    assert "twinspark.ops.exl3_gemm" not in names  # a library module, no __main__ guard


def test_listing_outside_a_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("no checkout found here") == 2
    assert "python -m twinspark.buildinfo" in out


def test_listing_in_a_checkout(tmp_path, capsys):
    pytest.importorskip("invoke", reason="invoke comes with the deploy extra")
    root = _checkout(tmp_path)
    assert cli.main(["--root", str(root), "tasks", "sessions"]) == 0
    out = capsys.readouterr().out
    assert "invoke say-hello" in out and "nox -s alpha" in out and "[not default]" in out
    assert "python -m" not in out


def test_installed_console_script_help(tmp_path):
    """The script pip installed next to this Python, run outside the checkout (as a user of the wheel would)."""
    script = Path(sys.executable).parent / "twinspark"
    if not script.is_file():
        pytest.skip(f"no console script at {script} (twinspark is not pip-installed in this environment)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('twinspark.cli') is not None)"]
    if subprocess.run(probe, cwd=tmp_path, env=env, capture_output=True, text=True).stdout.strip() != "True":
        pytest.skip("the installed twinspark predates twinspark.cli (reinstall it: any nox session does)")
    res = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "usage: twinspark" in res.stdout
