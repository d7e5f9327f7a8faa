"""What the built extension holds: `python -m twinspark.buildinfo [--check] [ARCH ...]`.

Lists the cubins inside twinspark._C per translation unit (cuobjdump --list-elf; the tool comes from the
`nvidia-cuda-cuobjdump` wheel when no CUDA toolkit provides it) and, with --check, fails when a requested
target (arguments, else TWINSPARK_CUDA_ARCHS, else the default 90a,121a) has no cubin."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

DEFAULT_ARCHS = ("90a", "121a")


def find_cuda_tool(name: str) -> str | None:
    """A CUDA binary (cuobjdump, nvdisasm, nvcc): on PATH, in /usr/local/cuda/bin, or from the NVIDIA wheels
    (nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm put them in nvidia/cu*/bin)."""
    for cand in (shutil.which(name), f"/usr/local/cuda/bin/{name}"):
        if cand and Path(cand).exists():
            return cand
    try:
        import nvidia

        for base in nvidia.__path__:
            for p in Path(base).glob(f"cu*/bin/{name}"):
                return str(p)
    except ImportError:
        pass
    return None


def find_cuobjdump() -> str | None:
    return find_cuda_tool("cuobjdump")


def ensure_cuobjdump() -> str:
    exe = find_cuobjdump()
    if exe is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "nvidia-cuda-cuobjdump"], check=True)
        exe = find_cuobjdump()
    if exe is None:
        raise SystemExit("buildinfo: cuobjdump not found; install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`")
    return exe


def cubins(so_path: str, cuobjdump: str) -> dict[str, list[str]]:
    """arch (e.g. '90a') -> translation units with a cubin for it."""
    out = subprocess.run([cuobjdump, "--list-elf", so_path], capture_output=True, text=True)
    found: dict[str, list[str]] = defaultdict(list)
    for line in out.stdout.splitlines():
        m = re.search(r"ELF file\s+\d+:\s+(.+)\.sm_(\w+)\.cubin", line)
        if m:
            found[m.group(2)].append(m.group(1))
    return dict(found)


def requested(args: list[str]) -> list[str]:
    raw = args or [a for a in re.split(r"[;, ]+", os.environ.get("TWINSPARK_CUDA_ARCHS", "")) if a]
    archs = raw or list(DEFAULT_ARCHS)
    return [a.removeprefix("sm_").removesuffix("-real") for a in archs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when a requested target has no cubin")
    ap.add_argument("archs", nargs="*", help="targets to require, e.g. 90a 121a")
    a = ap.parse_args(argv)
    from twinspark import _ext

    mod = _ext.module()
    print(f"twinspark._C: {mod.__file__}")
    print(f"built for (compile definition): {', '.join(_ext.built_archs()) or 'CPU only (no CUDA kernels)'}")
    want = requested(a.archs)
    if not _ext.with_cuda():
        print(f"this build has no CUDA kernels (no nvcc was found at build time); requested: {', '.join(want)}")
        return 1 if a.check else 0
    found = cubins(mod.__file__, ensure_cuobjdump())
    for arch in sorted(found):
        print(f"  sm_{arch}: {len(found[arch])} cubins ({', '.join(sorted(set(found[arch])))})")
    missing = [w for w in want if w not in found]
    if a.check and missing:
        print(f"MISSING cubins for: {', '.join('sm_' + m for m in missing)}; rebuild with "
              f"TWINSPARK_CUDA_ARCHS={';'.join(want)} pip install .")
        return 1
    # every translation unit that has device code should exist for every requested target
    units = set().union(*found.values()) if found else set()
    gaps = {w: sorted(units - set(found.get(w, []))) for w in want}
    gaps = {w: g for w, g in gaps.items() if g}
    if a.check and gaps:
        print(f"MISSING per-unit cubins: {gaps}")
        return 1
    print(f"OK: cubins for {', '.join('sm_' + w for w in want)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
