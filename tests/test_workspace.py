"""twinspark.ops.workspace: the zeroing rule of the buffers the kernels keep zero between calls.

The rule only decides when to allocate and when to memset, so it runs here on CPU tensors; capture ids stand in
for CUDA graph captures (0: no capture). The GPU tests exercise it for real (test_exl3_gemm.py
test_graph_never_replayed_does_not_poison_the_next, test_exl3_moe.py test_kernel_first_call_inside_capture).
"""

from __future__ import annotations

import torch
from twinspark.ops.workspace import Workspace

CPU = torch.device("cpu")


def _dirty(t: torch.Tensor) -> None:
    t.fill_(7)  # what a kernel would leave if it did not clear, or what a captured allocation holds


def test_eager_allocation_is_zero_and_kept():
    ws = Workspace(CPU)
    a = ws.zeroed("acc", 10, torch.float32, 0)
    assert a.dtype == torch.float32 and a.numel() == 10 and not a.any()
    a[:3] = 1.0  # a kernel that did not clear: the rule trusts eager buffers, so nothing zeroes it again
    assert ws.zeroed("acc", 10, torch.float32, 0) is a and a[:3].eq(1.0).all()


def test_growth_reallocates_zeroed_and_keeps_the_larger_size():
    ws = Workspace(CPU)
    a = ws.zeroed("c", 4, torch.int32, 0)
    _dirty(a)
    b = ws.zeroed("c", 9, torch.int32, 0)
    assert b is not a and b.numel() == 9 and not b.any()
    assert ws.zeroed("c", 5, torch.int32, 0) is b  # smaller requests reuse it


def test_allocated_inside_a_capture_is_zeroed_once_per_capture_then_once_eagerly():
    ws = Workspace(CPU)
    t = ws.zeroed("n", 6, torch.int32, capture_id=11)  # inside capture 11: its zeros belong to that graph only
    _dirty(t)  # stands for "graph 11 was never replayed: the memory holds garbage"
    assert ws.zeroed("n", 6, torch.int32, capture_id=11) is t and t.eq(7).all()  # same capture: already zeroed there
    assert not ws.zeroed("n", 6, torch.int32, capture_id=12).any()  # another capture gets its own memset
    _dirty(t)
    assert not ws.zeroed("n", 6, torch.int32, capture_id=0).any()  # the first eager call zeroes it
    _dirty(t)
    assert ws.zeroed("n", 6, torch.int32, capture_id=13).eq(7).all()  # from then on the kernels keep it zero


def test_names_are_independent_and_scratch_follows_dtype():
    ws = Workspace(CPU)
    a = ws.zeroed("a", 3, torch.float32, 0)
    b = ws.zeroed("b", 3, torch.int32, 0)
    assert a.data_ptr() != b.data_ptr() and b.dtype == torch.int32
    s = ws.buffer("x", 8)
    assert s.dtype == torch.float16 and s.numel() == 8
    assert ws.buffer("x", 4).data_ptr() == s.data_ptr()
    f = ws.buffer("x", 4, torch.float32)
    assert f.dtype == torch.float32 and f.numel() == 4
