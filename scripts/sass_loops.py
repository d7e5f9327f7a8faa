#!/usr/bin/env python3
"""The instruction mix of a kernel's hot loops, read from its SASS (no GPU needed):

    python3 scripts/sass_loops.py cuda/exl3_moe/gemm_mul1.cu --kernel 'moe_gemm_kernel<2, 1, false, 3, 48>'
    python3 scripts/sass_loops.py path/to/_C.abi3.so --arch 90a --kernel moe_gemm   # a built extension or cubin
    python3 scripts/sass_loops.py listing.sass                                       # a saved `cuobjdump -sass`

A .cu file is compiled here with the build's flags for one arch (nvcc -cubin; ~35 s for a MoE codebook file), so a
change can be weighed before any device time is spent. A loop is the span from a backward branch's target to the
branch; printed are the innermost ones holding the anchor opcode (default IMMA|HMMA: the tile loops), with their
instruction count, the count per pipe class and the most frequent opcodes (cuda/exl3_moe/DESIGN.md "What bounds T = 4" reads the
MoE byte-sum loop this way: which cuts of it moved the H200's time and which did not). Pipe classes are the usual
sm_80/sm_90 assignment (IMAD/IMUL/IDP on the FMA pipe; LOP3/PRMT/SHF/IADD3 on the ALU; ...), approximate: ptxas can
issue some opcodes (MOV, FFMA) on more than one.

cuobjdump -sass needs nvdisasm: both come from the CUDA toolkit or the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels (the `test` extra installs them).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))  # this checkout's twinspark.buildinfo (stdlib only), installed or not
from twinspark.buildinfo import find_cuda_tool  # noqa: E402

PIPES = {
    "fma-int": ("IMAD", "IMUL", "IDP"),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "HFMA2", "HMUL2", "HADD2"),
    "fp64": ("DFMA", "DMUL", "DADD"),
    "alu": ("LOP3", "PRMT", "SHF", "IADD3", "VIADD", "ISETP", "SEL", "LEA", "IABS", "BMSK", "SGXT", "FLO", "POPC",
            "MOV", "PLOP3", "P2R", "R2P", "IMNMX", "VIMNMX"),
    "tensor": ("IMMA", "HMMA", "DMMA", "HGMMA", "IGMMA", "QGMMA", "UTCMMA"),
    "xu": ("I2F", "F2I", "I2FP", "F2FP", "MUFU", "F2F", "FRND"),
    "shared": ("LDS", "STS", "LDSM", "SHFL", "ATOMS", "LDGSTS", "STSM"),
    "global": ("LDG", "STG", "LDL", "STL", "ATOMG", "RED", "LD", "ST", "UBLKCP", "UTMALDG"),
    "uniform": ("UIADD3", "UMOV", "USEL", "UISETP", "ULEA", "ULOP3", "USHF", "UIMAD", "ULDC", "S2UR", "R2UR"),
    "control": ("BRA", "BAR", "DEPBAR", "NOP", "WARPSYNC", "BSYNC", "BSSY", "EXIT", "YIELD", "LDGDEPBAR", "CCTL"),
}
_PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops}


@dataclass
class Loop:
    kernel: str
    start: int
    end: int
    ops: Counter = field(default_factory=Counter)

    @property
    def size(self) -> int:
        return sum(self.ops.values())

    def pipes(self) -> Counter:
        c: Counter = Counter()
        for op, n in self.ops.items():
            c[_PIPE_OF.get(op, "other")] += n
        return c


def opcode(instr: str) -> str:
    """'@!P0 IMAD.WIDE R60, R5, 0x200, R60' -> 'IMAD'."""
    words = instr.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse_functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> {function name: [(address, instruction)]}."""
    funcs: dict[str, list[tuple[int, str]]] = {}
    for chunk in re.split(r"\n\s*Function : ", "\n" + sass)[1:]:
        name, _, body = chunk.partition("\n")
        funcs[name.strip()] = [(int(m.group(1), 16), m.group(2).strip())
                               for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]
    return funcs


def hot_loops(funcs: dict[str, list[tuple[int, str]]], anchor: str = "IMMA|HMMA", max_size: int = 2000) -> list[Loop]:
    """Innermost backward-branch loops of at most max_size instructions that hold an opcode matching `anchor`."""
    want = re.compile(rf"^(?:{anchor})$")
    found: list[Loop] = []
    for name, ins in funcs.items():
        spans = []
        for addr, text in ins:
            m = re.search(r"0x([0-9a-f]+)\s*$", text)  # BRA [predicate,] target
            if opcode(text) == "BRA" and m and int(m.group(1), 16) < addr:
                spans.append((int(m.group(1), 16), addr))
        for s, e in spans:
            if any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in spans):
                continue  # holds another loop: not innermost
            body = [opcode(t) for a, t in ins if s <= a <= e]
            if len(body) <= max_size and any(want.match(op) for op in body):
                found.append(Loop(name, s, e, Counter(body)))
    return found


def _fail(msg: str) -> NoReturn:
    """Bad input or a missing tool: one sentence on stderr, exit status 2."""
    print(msg, file=sys.stderr)
    raise SystemExit(2)


def demangle(names: list[str]) -> dict[str, str]:
    exe = shutil.which("c++filt")
    if not exe or not names:
        return {n: n for n in names}
    out = subprocess.run([exe], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def disassemble(binary: Path, arch: str | None) -> str:
    cuobjdump, nvdisasm = find_cuda_tool("cuobjdump"), find_cuda_tool("nvdisasm")
    if not cuobjdump or not nvdisasm:
        missing = " and ".join(n for n, t in (("cuobjdump", cuobjdump), ("nvdisasm", nvdisasm)) if not t)
        _fail(f"sass_loops: {missing} not found; install the CUDA toolkit or "
              "`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`.")
    env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = [cuobjdump, "-sass"] + (["-arch", f"sm_{arch}"] if arch else []) + [str(binary)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["no message"])[-1]
        _fail(f"sass_loops: cuobjdump could not read {binary} ({last}); give a .so / .cubin with device code.")
    return run.stdout


def compile_cu(src: Path, arch: str, out_dir: Path, defines: list[str]) -> Path:
    nvcc = find_cuda_tool("nvcc")
    if not nvcc:
        _fail("sass_loops: nvcc not found; a .cu file needs the CUDA toolkit (or give a built .so / .cubin).")
    cubin = out_dir / (src.stem + f".sm_{arch}.cubin")
    cmd = [nvcc, "-DTWINSPARK_WITH_CUDA=1", f"-I{REPO / 'cuda'}", "-O3", "-std=c++17", "--expt-relaxed-constexpr",
           f"--generate-code=arch=compute_{arch},code=[sm_{arch}]", "-cubin", "-x", "cu", str(src), "-o", str(cubin)]
    cmd[1:1] = [f"-D{d}" for d in defines]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        _fail(f"sass_loops: nvcc failed on {src}:\n{run.stderr[-3000:]}")
    return cubin


def report(loops: list[Loop], kernel_filter: str | None, top: int) -> str:
    names = demangle(sorted({lp.kernel for lp in loops}))
    pat = re.compile(kernel_filter) if kernel_filter else None
    lines = []
    for lp in loops:
        pretty = names.get(lp.kernel, lp.kernel)
        if pat and not (pat.search(pretty) or pat.search(lp.kernel)):
            continue
        pipes = ", ".join(f"{p} {n}" for p, n in lp.pipes().most_common())
        ops = ", ".join(f"{o} {n}" for o, n in lp.ops.most_common(top))
        lines.append(f"{pretty}\n  loop {lp.start:#x}-{lp.end:#x}: {lp.size} instructions | {pipes}\n  {ops}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", type=Path, help="a .cu file (compiled here), a .so / .cubin, or a cuobjdump -sass listing")
    ap.add_argument("--arch", default=None, help="target, e.g. 90a or 121a (a .cu needs one: default 90a)")
    ap.add_argument("--kernel", default=None, help="regex on the (demangled) kernel name")
    ap.add_argument("--anchor", default="IMMA|HMMA", help="opcode regex a loop must hold (default IMMA|HMMA)")
    ap.add_argument("--max-size", type=int, default=2000, help="longest loop reported, in instructions")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="extra macro for a .cu compile")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except SystemExit as exc:  # _fail: the sentence is printed
        return int(exc.code)


def _run(a: argparse.Namespace) -> int:
    for flag, pattern in (("--kernel", a.kernel), ("--anchor", a.anchor)):
        try:
            re.compile(pattern or "")
        except re.error as exc:
            _fail(f"sass_loops: {flag} {pattern!r} is not a regular expression ({exc}); escape ( ) [ ] * + ? with \\.")
    if not a.input.exists():
        _fail(f"sass_loops: {a.input} does not exist; give a .cu file, a built .so / .cubin, or a saved "
              "`cuobjdump -sass` listing.")
    if a.input.suffix == ".cu":
        with tempfile.TemporaryDirectory() as tmp:
            sass = disassemble(compile_cu(a.input, a.arch or "90a", Path(tmp), a.defines), None)
    elif a.input.suffix in (".so", ".cubin", ".o", ".fatbin"):
        sass = disassemble(a.input, a.arch)
    else:
        sass = a.input.read_text(errors="replace")
    funcs = parse_functions(sass)
    if not funcs:
        _fail(f"sass_loops: no SASS functions in {a.input} (is it a cuobjdump -sass listing, or a binary without "
              "device code for that arch?).")
    text = report(hot_loops(funcs, a.anchor, a.max_size), a.kernel, a.top)
    if not text:
        print(f"sass_loops: {len(funcs)} functions, but no loop holding /{a.anchor}/ of at most {a.max_size} "
              f"instructions{' in kernels matching ' + repr(a.kernel) if a.kernel else ''}.", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
