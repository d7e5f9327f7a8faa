"""Which global row ids each rank serves: the tensor-parallel split is by whole hash heads, never by rows.

An Engram layer's table is the concatenation of its hash heads (24 per layer: n-gram orders 2..4 x 8 heads, each
a prime number of rows). With `world` ranks, rank r owns heads [r*H//world, (r+1)*H//world) and therefore the
contiguous rows from the first of those heads to the end of the last.

Head sizes come from a config file (JSON): ``{"engram_head_sizes": {"1": [...], "14": [...]}}``, either at the top
level or under an ``"engram"`` key. The synthetic checkpoint generator writes this key into its config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from twinspark.checks import is_int
from twinspark.engram.errors import EngramError
from twinspark.fileio import read_json

ENGRAM_LAYERS = (1, 14)


def is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def v41_head_sizes(layer_ids, vocab_size: int, heads: int, max_ngram: int) -> dict[int, tuple[int, ...]]:
    """Rows of each hash head per Engram layer, as DeepSeek V4.1 defines them (engram.md): for every layer and
    n-gram order 2..max_ngram, ``heads`` primes walked up from ``vocab_size``, each prime used once across all
    layers; the heads of a layer in table order."""
    seen: set[int] = set()
    out = {}
    for layer in layer_ids:
        sizes = []
        for _ in range(max_ngram - 1):
            p = vocab_size - 1
            for _ in range(heads):
                p += 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                sizes.append(p)
        out[layer] = tuple(sizes)
    return out


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
            if not is_int(layer) or layer < 0:
                raise EngramError(f"Engram layer {layer!r:.40} is not a layer number (an integer >= 0); fix "
                                  "engram_head_sizes in the config")
            if not isinstance(sizes, tuple) or not sizes or not all(is_int(s) and s > 0 for s in sizes):
                raise EngramError(f"Engram layer {layer}: head sizes must be a non-empty list of positive integers, "
                                  f"got {sizes!r:.80}; fix engram_head_sizes in the config")

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.head_sizes))

    def rows(self, layer: int) -> int:
        return sum(self._sizes(layer))

    def rank_range(self, layer: int, rank: int, world: int) -> RowRange:
        sizes = self._sizes(layer)
        if not (is_int(rank) and is_int(world)) or world < 1 or not 0 <= rank < world:
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
        """From a parsed config: DeepSeek V4.1's Engram fields (``engram_layer_ids``, ``engram_vocab_size``,
        ``engram_n_heads``, ``engram_max_ngram_size``, at the top level or in ``text_config``), or
        ``engram_head_sizes`` (layer keys decimal strings, sizes lists of integers; synthetic checkpoints)."""
        if not isinstance(doc, dict):
            raise EngramError(f"{where} is a JSON {type(doc).__name__}, not an object; pass the model's config.json")
        text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
        if "engram_head_sizes" not in doc and "engram_layer_ids" in text:
            return cls._from_v41(text, where)
        sizes = doc.get("engram_head_sizes")
        if sizes is None and isinstance(doc.get("engram"), dict):
            sizes = doc["engram"].get("engram_head_sizes", doc["engram"].get("head_sizes"))
        if not isinstance(sizes, dict) or not sizes:
            raise EngramError(f"{where} has no Engram head sizes; add \"engram_head_sizes\": "
                              "{\"1\": [rows of each head], \"14\": [...]}")
        head_sizes: dict[int, tuple] = {}
        for key, v in sizes.items():
            layer = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
            if layer in head_sizes or not isinstance(v, list):
                raise EngramError(f"{where}: engram_head_sizes must map each layer number once to a list of "
                                  f"integers, got {key!r:.40}: {v!r:.60}")
            head_sizes[layer] = tuple(v)
        try:
            return cls(head_sizes)
        except EngramError as exc:
            raise EngramError(f"{where}: {exc}") from None

    @classmethod
    def _from_v41(cls, text: dict, where: str) -> EngramLayout:
        fields = ("engram_layer_ids", "engram_vocab_size", "engram_n_heads", "engram_max_ngram_size")
        # bounds far above V4.1's (16,000,000 / 8 / 4): the prime walk below would not end on absurd values
        limits = {"engram_vocab_size": 1 << 31, "engram_n_heads": 256, "engram_max_ngram_size": 16}
        bad = [f for f in fields[1:] if not isinstance(text.get(f), int) or isinstance(text.get(f), bool)
               or not 1 <= text.get(f) <= limits[f]]
        ids = text.get("engram_layer_ids")
        if bad or not isinstance(ids, list) or len(ids) > 64 or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise EngramError(f"{where}: the Engram fields {', '.join(bad) or 'engram_layer_ids'} must be positive "
                              "integers (engram_vocab_size < 2^31, engram_n_heads <= 256, engram_max_ngram_size <= "
                              "16; engram_layer_ids a list of layer numbers); use the model's config.json")
        sizes = v41_head_sizes(ids, text["engram_vocab_size"], text["engram_n_heads"], text["engram_max_ngram_size"])
        rows = text.get("engram_num_embeddings")
        if isinstance(rows, list) and [sum(sizes[i]) for i in ids] != rows:
            raise EngramError(f"{where}: engram_num_embeddings {rows} does not match the hash heads its other Engram "
                              f"fields give ({[sum(sizes[i]) for i in ids]}); use the model's own config.json")
        return cls(sizes)

    @classmethod
    def from_config(cls, path: str | Path) -> EngramLayout:
        p = Path(path)
        try:
            doc = read_json(p)
        except OSError as exc:
            raise EngramError(f"cannot read Engram config {p}: {exc.strerror}; pass --config with the model's "
                              "config.json (it must hold engram_head_sizes)") from None
        except ValueError as exc:
            raise EngramError(f"Engram config {p} is not valid JSON ({exc}); fix or re-download it") from None
        return cls.from_dict(doc, str(p))

