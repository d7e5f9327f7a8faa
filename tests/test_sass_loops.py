"""scripts/sass_loops.py (the hot loops' instruction mix from SASS): the parser on a hand-written listing, its answers
to bad input, and the whole path (nvcc -> cuobjdump -> report) on a small kernel where nvcc is here (CI has it)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sass_loops", ROOT / "scripts" / "sass_loops.py")
sass_loops = importlib.util.module_from_spec(_spec)
sys.modules["sass_loops"] = sass_loops  # dataclasses look their module up there
_spec.loader.exec_module(sass_loops)

# Two functions: k1 has an outer loop (0x0040-0x00d0) around an inner tile loop (0x0060-0x00b0) with an IMMA, then
# a loop without one; k2 has a forward branch only.
LISTING = """
\t\tFunction : _Z2k1Pj
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                      /* 0x0000000000007919 */
        /*0040*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0050*/                   LDS R4, [R3] ;
        /*0060*/                   PRMT R5, R4, 0x4421, RZ ;
        /*0070*/                   IMAD R6, R5, -0x7c232ed3, RZ ;
        /*0080*/              @!P0 IMAD.WIDE R8, R5, 0x200, R8 ;
        /*0090*/                   IMMA.16832.U8.S8 R12, R16.ROW, R20.COL, R12 ;
        /*00a0*/                   ISETP.GE.AND P1, PT, R2, R7, PT ;
        /*00b0*/               @!P1 BRA 0x60 ;
        /*00c0*/                   SHF.R.U32.HI R9, RZ, 0x10, R9 ;
        /*00d0*/               @!P2 BRA 0x40 ;
        /*00e0*/                   LOP3.LUT R9, R9, 0xff, RZ, 0xc0, !PT ;
        /*00f0*/               @!P3 BRA 0xe0 ;
        /*0100*/                   EXIT ;
\t\t..........

\t\tFunction : _Z2k2v
        /*0000*/                   BRA 0x20 ;
        /*0010*/                   NOP ;
        /*0020*/                   EXIT ;
"""


def test_parser_finds_the_innermost_anchored_loop():
    funcs = sass_loops.parse_functions(LISTING)
    assert sorted(funcs) == ["_Z2k1Pj", "_Z2k2v"]
    assert sass_loops.opcode("@!P0 IMAD.WIDE R8, R5, 0x200, R8") == "IMAD"
    loops = sass_loops.hot_loops(funcs)
    assert [(lp.kernel, lp.start, lp.end) for lp in loops] == [("_Z2k1Pj", 0x60, 0xB0)]
    lp = loops[0]
    assert lp.size == 6 and lp.ops["IMAD"] == 2 and lp.ops["IMMA"] == 1
    assert lp.pipes() == {"fma-int": 2, "alu": 2, "tensor": 1, "control": 1}
    # the IMMA-free loop at 0xe0 is found once the anchor allows its opcodes; the outer loop never (not innermost)
    assert [(lp.start, lp.end) for lp in sass_loops.hot_loops(funcs, anchor="LOP3")] == [(0xE0, 0xF0)]
    assert sass_loops.hot_loops(funcs, max_size=5) == []


def test_report_and_bad_input(tmp_path, capsys):
    listing = tmp_path / "k.sass"
    listing.write_text(LISTING)
    assert sass_loops.main([str(listing), "--kernel", "k1"]) == 0
    out = capsys.readouterr().out
    assert "loop 0x60-0xb0: 6 instructions" in out and "fma-int 2" in out and "IMAD 2" in out
    assert sass_loops.main([str(listing), "--kernel", "nothing-like-this"]) == 1
    assert "no loop holding" in capsys.readouterr().err
    assert sass_loops.main([str(listing), "--kernel", "k1("]) == 2
    assert "not a regular expression" in capsys.readouterr().err
    assert sass_loops.main([str(tmp_path / "missing.cu")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1
    empty = tmp_path / "empty.sass"
    empty.write_text("not a listing\n")
    assert sass_loops.main([str(empty)]) == 2
    assert "no SASS functions" in capsys.readouterr().err


KERNEL = r"""
#include <cstdint>
__global__ void probe(const uint32_t* a, int* out, int n) {
  int c[4] = {0, 0, 0, 0};
  for (int i = 0; i < n; ++i) {
    uint32_t x[4];
    for (int j = 0; j < 4; ++j) x[j] = a[i * 128 + j * 32 + threadIdx.x] * 0x83DCD12Du;
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(x[0] ^ x[1]), "r"(x[2] ^ x[3]));
  }
  out[threadIdx.x] = c[0] + c[1] + c[2] + c[3];
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it): the .cu path compiles here")
def test_compiles_and_reports_a_kernel(tmp_path, capsys):
    if not (sass_loops.find_cuda_tool("cuobjdump") and sass_loops.find_cuda_tool("nvdisasm")):
        pytest.skip("cuobjdump / nvdisasm not found (the test extra installs nvidia-cuda-cuobjdump and "
                    "nvidia-cuda-nvdisasm)")
    src = tmp_path / "probe.cu"
    src.write_text(KERNEL)
    assert sass_loops.main([str(src), "--arch", "90a", "--kernel", "probe"]) == 0
    out = capsys.readouterr().out
    assert "probe(" in out and "IMMA" in out
    # the four products per iteration are IMADs on the FMA pipe
    assert int(out.split("fma-int ")[1].split(",")[0]) >= 4
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an ELF with device code")
    assert sass_loops.main([str(junk)]) == 2
    assert "could not read" in capsys.readouterr().err
