"""Per (device, stream) scratch of the kernel launchers (exl3_gemm, exl3_moe).

Two kinds of buffer, looked up by name:
- ``zeroed``: zero between calls. The kernels that use one clear what they used before they finish (split-k
  accumulators, arrival counters), so no call needs a memset. Allocate them outside graph capture (a warm-up
  run) so nothing is allocated while capturing; if it happens inside a capture it still works: the allocation
  comes from the graph's pool, and until an eager call has zeroed it each captured graph gets one memset of its
  own (a graph that is never replayed cannot leave the next one garbage).
- ``buffer``: plain scratch, contents undefined.
One workspace per stream: two streams never share one. Do not replay one graph on two streams at once (they
would share its capture stream's workspace).
"""

from __future__ import annotations

import torch

from twinspark import _ext


class _Zeroed:
    def __init__(self, t: torch.Tensor, capture_id: int):
        self.t = t
        self.needs_zero = bool(capture_id)  # allocated inside a capture: garbage until something zeroes it
        self.zeroed_in = {capture_id}


class Workspace:
    def __init__(self, device: torch.device):
        self.device = device
        self._zeroed: dict[str, _Zeroed] = {}
        self._scratch: dict[str, torch.Tensor] = {}

    def zeroed(self, name: str, numel: int, dtype: torch.dtype, capture_id: int) -> torch.Tensor:
        """A buffer of at least ``numel`` elements that is zero on entry. ``capture_id``: the stream's active
        capture (0: none; ``capture_id()``)."""
        z = self._zeroed.get(name)
        if z is None or z.t.numel() < numel:
            old = 0 if z is None else z.t.numel()
            self._zeroed[name] = z = _Zeroed(torch.zeros(max(old, numel), dtype=dtype, device=self.device), capture_id)
        elif z.needs_zero:
            if not capture_id:
                z.t.zero_()
                z.needs_zero = False
            elif capture_id not in z.zeroed_in:
                z.t.zero_()
                z.zeroed_in.add(capture_id)
        return z.t

    def buffer(self, name: str, numel: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        t = self._scratch.get(name)
        if t is None or t.numel() < numel or t.dtype != dtype:
            t = torch.empty(numel, dtype=dtype, device=self.device)
            self._scratch[name] = t
        return t[:numel]


_WORKSPACES: dict[tuple[int, int], Workspace] = {}


def workspace(device: torch.device) -> Workspace:
    """The workspace of ``device``'s current stream."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = Workspace(device)
    return ws


def capture_id(device: torch.device) -> int:
    """The id of the capture active on ``device``'s current stream, 0 when it is not capturing."""
    if not torch.cuda.is_current_stream_capturing():
        return 0
    return _ext.module().exl3_gemm_capture_id(_ext.stream_ptr(device))


__all__ = ["Workspace", "capture_id", "workspace"]
