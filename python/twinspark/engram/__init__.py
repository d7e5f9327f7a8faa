"""Engram conditional-memory rows: where they are (source), who serves which (layout), the per-rank pack files
(pack), the file-backed row store (store) and synthetic checkpoints for tests and benchmarks (synth).
See docs/engram.md for the data and cuda/engram_store/ for the C++ side."""

from twinspark.engram.errors import EngramError
from twinspark.engram.layout import ENGRAM_LAYERS, EngramLayout, RowRange
from twinspark.engram.pack import PackHeader, pack, pack_name, pack_range, read_pack_header
from twinspark.engram.source import LayerTensors, locate
from twinspark.engram.store import EngramStaging, EngramStore, PendingLookup, staging_pinned_bytes
from twinspark.engram.synth import synthetic_head_sizes, write_synthetic_checkpoint

__all__ = [
    "ENGRAM_LAYERS", "EngramError", "EngramLayout", "EngramStaging", "EngramStore", "LayerTensors", "PackHeader",
    "PendingLookup", "RowRange", "locate", "pack", "pack_name", "pack_range", "read_pack_header",
    "staging_pinned_bytes", "synthetic_head_sizes", "write_synthetic_checkpoint",
]
