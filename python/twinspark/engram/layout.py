"""Which global row ids each rank serves: the tensor-parallel split is by whole hash heads, never by rows.

An Engram layer's table is the concatenation of its hash heads (24 per layer: n-gram orders 2..4 x 8 heads, each
a prime number of rows). With `world` ranks, rank r owns heads [r*H//world, (r+1)*H//world) and therefore the
contiguous rows from the first of those heads to the end of the last.

Head sizes come from a config file (JSON): ``{"engram_head_sizes": {"1": [...], "14": [...]}}``, either at the top
level or under an ``"engram"`` key. The synthetic checkpoint generator writes this key into its config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from twinspark.engram.errors import EngramError

ENGRAM_LAYERS = (1, 14)


@dataclass(frozen=True)
class RowRange:
    layer: int
    first_row: int  # first global row id this rank serves
    end_row: int    # one past the last
    first_head: int
    end_head: int

    @property
    def rows(self) -> int:
        return self.end_row - self.first_row


@dataclass(frozen=True)
class EngramLayout:
    head_sizes: dict[int, tuple[int, ...]]  # layer -> rows of each hash head, in table order

    def __post_init__(self):
        for layer, sizes in self.head_sizes.items():
            if not sizes or any(int(s) <= 0 for s in sizes):
                raise EngramError(f"Engram layer {layer}: head sizes must be positive integers, got {list(sizes)}; "
                                  "fix engram_head_sizes in the config")

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.head_sizes))

    def rows(self, layer: int) -> int:
        return sum(self._sizes(layer))

    def rank_range(self, layer: int, rank: int, world: int) -> RowRange:
        sizes = self._sizes(layer)
        if world < 1 or not 0 <= rank < world:
            raise EngramError(f"Engram: rank {rank} is not in 0..{world - 1}; pass --rank between 0 and world-1")
        if len(sizes) < world:
            raise EngramError(f"Engram layer {layer} has {len(sizes)} hash heads, fewer than {world} ranks; "
                              "ranks split whole heads, so use fewer ranks")
        h0, h1 = rank * len(sizes) // world, (rank + 1) * len(sizes) // world
        first = sum(sizes[:h0])
        return RowRange(layer, first, first + sum(sizes[h0:h1]), h0, h1)

    def _sizes(self, layer: int) -> tuple[int, ...]:
        if layer not in self.head_sizes:
            raise EngramError(f"Engram layer {layer} is not in the config (layers: {list(self.layers)}); "
                              "check the layer list")
        return self.head_sizes[layer]

    @classmethod
    def from_dict(cls, doc: dict, where: str = "config") -> EngramLayout:
        sizes = doc.get("engram_head_sizes")
        if sizes is None and isinstance(doc.get("engram"), dict):
            sizes = doc["engram"].get("engram_head_sizes", doc["engram"].get("head_sizes"))
        if not isinstance(sizes, dict) or not sizes:
            raise EngramError(f"{where} has no Engram head sizes; add \"engram_head_sizes\": "
                              "{\"1\": [rows of each head], \"14\": [...]}")
        try:
            return cls({int(k): tuple(int(s) for s in v) for k, v in sizes.items()})
        except (TypeError, ValueError):
            raise EngramError(f"{where}: engram_head_sizes must map layer numbers to lists of integers") from None

    @classmethod
    def from_config(cls, path: str | Path) -> EngramLayout:
        p = Path(path)
        try:
            doc = json.loads(p.read_text())
        except OSError as exc:
            raise EngramError(f"cannot read Engram config {p}: {exc.strerror}; pass --config with the model's "
                              "config.json (it must hold engram_head_sizes)") from None
        except ValueError:
            raise EngramError(f"Engram config {p} is not valid JSON; fix or re-download it") from None
        return cls.from_dict(doc, str(p))
