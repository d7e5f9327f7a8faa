"""Host-to-device weight copies through one reusable pinned buffer (the load path of the vLLM plugin).

Why: safetensors maps shards MAP_PRIVATE; a device copy straight from such a mapping makes the GB10 driver pin the
pages with write intent, which copy-on-writes them into anonymous memory for the life of the mapping (~1.2 GiB per
layer measured there, shared/docs/deepseek-v41.md section 6). Copying each tensor into one pinned buffer first
keeps the mapping read-only: the host memory a load costs is the buffer (the largest tensor) plus what the loaders
keep. ``bench/bench_weight_load.py`` measures it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

STAGE_MIN_BYTES = 1 << 20  # smaller tensors are copied as they are (the buffer's reuse is for the big ones)


def staged(weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | None,
           stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) with every CPU tensor of at least STAGE_MIN_BYTES copied into one reusable pinned
    buffer first (grown by doubling) when the target device is CUDA; as is otherwise. The consumer must copy the
    tensor to the device before asking for the next one (vLLM's loaders and Exl3Parts do): the next tensor
    overwrites the buffer. A ``shard_id`` attribute (vLLM's stacked renames) is carried over. ``stats`` (a dict)
    gets ``pinned_bytes``: the buffer's size at the end."""
    if device is None or torch.device(device).type != "cuda":
        yield from weights
        return
    buf = None
    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes < STAGE_MIN_BYTES:
            yield name, t
            continue
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.numel()))
            buf = None  # free the old buffer before pinning the larger one
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            if stats is not None:
                stats["pinned_bytes"] = size
        view = buf[:nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        if hasattr(t, "shard_id"):
            view.shard_id = t.shard_id
        yield name, view
