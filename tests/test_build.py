"""The build itself: the installed module reports what it holds, and a CPU-only build (no CUDA) compiles, installs
and runs the CPU paths with a one-line notice."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from twinspark import _ext

ROOT = Path(__file__).resolve().parents[1]


def test_module_reports_what_it_holds():
    mod = _ext.module()
    archs = _ext.built_archs()
    assert bool(mod.with_cuda) == bool(archs)
    if shutil.which("nvcc") and not os.environ.get("TWINSPARK_NO_CUDA"):
        wanted = os.environ.get("TWINSPARK_CUDA_ARCHS", "90a;121a").replace(",", ";").split(";")
        assert sorted(archs) == sorted(a for a in wanted if a), archs


@pytest.mark.slow
def test_cpu_only_build_installs_and_runs(tmp_path):
    """TWINSPARK_NO_CUDA=1 stands in for a machine without nvcc (check_language(CUDA) finds none there)."""
    pytest.importorskip("scikit_build_core")
    env = dict(os.environ, TWINSPARK_NO_CUDA="1")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v",
                        "-w", str(tmp_path / "wheel"), f"-Cbuild-dir={tmp_path / 'build'}", str(ROOT)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    notice = [line for line in (r.stdout + r.stderr).splitlines() if "twinspark: no CUDA compiler found" in line]
    assert len(notice) == 1 and "CPU-only build" in notice[0], notice
    wheel = next((tmp_path / "wheel").glob("twinspark-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
    # an editable install's import hook would win over PYTHONPATH: drop it so the wheel under test is imported
    probe = ("import sys\nsys.meta_path = [f for f in sys.meta_path if 'ScikitBuild' not in type(f).__name__]\n"
             "import torch, twinspark._C as C\n"
             "from twinspark.ops import exl3_reconstruct\n"
             "from twinspark.exl3 import reference as ref\n"
             "t = torch.randint(-32768, 32768, (2, 2, 48), dtype=torch.int16)\n"
             "assert not C.with_cuda and C.built_archs() == []\n"
             "assert torch.equal(exl3_reconstruct(t, 3, 'mul1'), ref.inner_weight(t, 3, 'mul1'))\n"
             "print('cpu-only ok', C.__file__)\n")
    out = subprocess.run([sys.executable, "-c", probe], env=dict(env, PYTHONPATH=str(tmp_path / "site")),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and "cpu-only ok" in out.stdout and str(tmp_path) in out.stdout, out.stderr[-3000:]
