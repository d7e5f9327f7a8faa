"""Kernel launch plans as data: the tunables of exl3_gemm (and exl3_gemm_grouped) and exl3_moe, one frozen table per
op, and the one override for experiments.

The ops read ``current()`` (a ``Plans``: ``.exl3_gemm``, ``.exl3_moe``), never the environment, on their call paths.
``current()`` is ``DEFAULT`` with ``$TWINSPARK_PLAN`` applied, parsed once per process on first use. exl3_gemm_grouped
has no table of its own: it asks exl3_gemm's about one matrix of G * n columns (ops/exl3_gemm_grouped.py).

Override syntax (``$TWINSPARK_PLAN``, ``override()``, ``parse()``): comma-separated ``op.key=value`` items, e.g.::

    TWINSPARK_PLAN="exl3_moe.split_k=3,exl3_gemm.sk_blocks=0" python bench/bench_exl3_moe.py --quick
    with plans.override("exl3_moe.pdl=1"):   # in-process (tests, benchmark sweeps); process-wide, not per thread
        ...
    plans.use("exl3_moe.pdl=1")              # the same for the rest of the process (a benchmark's own default)

A later item for the same key wins (so a script can append to a user's plan). ``auto`` gives a forcing key back to
the table. An unknown key or a value a key does not take is refused with one sentence naming the key and what it
takes; ``keys()`` lists every key with its default, accepted values and why (``changes()``: what differs from
``DEFAULT``, in this syntax; benchmarks print it). Plans are made for ``twinspark.ops.sms.sm_count`` SMs
(``TWINSPARK_SM_COUNT`` / ``sms.limit``). Why each default is what it is: the one-line ``why`` of its field below, the
measurements in cuda/<op>/DESIGN.md (older ones cited as "NOTES.md vN": ``git show 1fc0a13:cuda/<op>/NOTES.md``).

Build options (environment variables read by ``pip install .`` / CMake, not at run time):
- ``TWINSPARK_CUDA_ARCHS``: CUDA targets, ``;``/``,``-separated (default ``90a;121a``; the built list is compiled into
  the module as the define of the same name: ``twinspark._ext.built_archs()``).
- ``TWINSPARK_NO_CUDA=1``: a CPU-only build (sets the CMake option ``TWINSPARK_CUDA`` OFF, which
  ``-C cmake.define.TWINSPARK_CUDA=OFF`` also does; a CUDA build compiles with the define ``TWINSPARK_WITH_CUDA``).
- ``TWINSPARK_TRACE=1``: compile the per-block timeline marks in (cuda/common/trace.cuh; bench/profile_exl3.py).
- ``TWINSPARK_PTXAS_VERBOSE=1``: ptxas register / spill report per kernel in the build log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

ENV = "TWINSPARK_PLAN"


class PlanError(ValueError):
    """A plan override that names an unknown key or gives a value its key does not take."""


# ------------------------------------------------------------------------------------------ value parsers
def _auto(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text == "auto" else parse(text)


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError
    return text == "1"


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError
        return text
    return parse


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"\d+", text) or int(text) < lo or (hi is not None and int(text) > hi):
            raise ValueError
        return int(text)
    return parse


def _number(text: str) -> float:
    value = float(text)  # ValueError for anything else
    if not 0 < value < float("inf"):
        raise ValueError
    return value


def _int_in(*values: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if text not in {str(v) for v in values}:
            raise ValueError
        return int(text)
    return parse


def _split_k(text: str) -> str:
    if not re.fullmatch(r"[1-9]\d*m?", text):
        raise ValueError
    return text


# Shared memory per SM a plan may be sized for: from 100 KB (GB10, compute capability 12.x; every kernel launches
# there, full region or not) to the H200's 228 KB.
SMEM_PER_SM_RANGE = (100 * 1024, 228 * 1024)


def _smem_per_sm(text: str) -> int:
    value = _int(0)(text)
    if value and not SMEM_PER_SM_RANGE[0] <= value <= SMEM_PER_SM_RANGE[1]:
        raise ValueError
    return value


def knob(default: Any, accepts: str, why: str, parse: Callable[[str], Any] | None = None) -> Any:
    """A table field: its default, the values an override may give (``accepts``, as the error states them), why the
    default is what it is, and the text parser (None: not overridable). Mapping defaults (MappingProxyType) take
    ``key:value/key:value`` over the default's keys, or one number for every key."""
    meta = {"accepts": accepts, "why": why, "parse": parse}
    if isinstance(default, Mapping):
        return field(default_factory=lambda: MappingProxyType(dict(default)), metadata=meta)
    return field(default=default, metadata=meta)


def _mapping_parser(value_parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str, default: Mapping) -> MappingProxyType:
        if ":" not in text:
            return MappingProxyType(dict.fromkeys(default, value_parse(text)))
        out = dict(default)
        for pair in text.split("/"):
            k, sep, v = pair.partition(":")
            if not sep or not re.fullmatch(r"\d+", k.strip()) or int(k) not in default:
                raise ValueError
            out[int(k)] = value_parse(v.strip())
        return MappingProxyType(out)
    parse.mapping = True  # type: ignore[attr-defined]
    return parse


# ------------------------------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Exl3Gemm:
    """exl3_gemm's variant table (ops/exl3_gemm.py ``plan``, ``fused_shape``); exl3_gemm_grouped asks it too."""

    # forcing keys for experiments (None / auto: the table decides)
    variant: str | None = knob(None, "auto, small, fused, fused_mma or large", "every call on one path (sweeps, tests)",
                               _auto(_choice("small", "fused", "fused_mma", "large")))
    prep: bool | None = knob(None, "auto, 0 or 1", "the small kernel's x' prep kernel forced off / on (sweeps)",
                             _auto(_flag))
    block: int | None = knob(None, "auto, 0 or 2", "the fused kernel's block shape forced (exl3_gemm.FUSED_BLOCKS id)",
                             _auto(_int_in(0, 2)))
    sk_blocks: int | None = knob(None, "auto or a block count >= 0",
                                 "stream-K forced on fused block 0 with that many blocks (0: stream-K off)",
                                 _auto(_int(0)))
    mma_tokens: int | None = knob(None, "auto, 64, 128 or 256", "the fused_mma kernel's tokens per block forced "
                                  "(sweeps)", _auto(_int_in(64, 128, 256)))
    # the table's thresholds
    large_m: int = knob(64, "a token count >= 1", "m above this leaves the small kernel: fused on sm_90, else large "
                        "(H200 crossover)", _int(1))
    fused_max_m: int = knob(512, "a token count >= 1", "fused kernel up to this m, the whole-weight pass + cuBLAS "
                            "above (H200, NOTES.md v5, v8)", _int(1))
    fused_min_sms: int = knob(64, "an SM count >= 1", "the fused kernel only where plans are made for at least this many "
                              "SMs; fewer take the large path (set on the 48-SM proxy, m=512, V4.1 shapes: large 1.55x bf16 "
                              "geomean vs fused 1.74x, fused ahead on 2 of 7 shapes by 3-6%; large 1.50x since the "
                              "TMA-store dequant_w; bench_prefill.py)", _int(1))
    no_wgmma_mma_max_m: int = knob(256, "a token count >= 0", "without wgmma (GB10) the fused_mma kernel up to this m, "
                                   "the large path above (GB10 model from the 48-SM proxy, V4.1 shapes: fused_mma "
                                   "ahead of large and small on all 7 at m=256, mixed at 512, behind from 2048; "
                                   "bench_prefill.py); 0: the rule below", _int(0))
    no_wgmma_small_max_m: int = knob(256, "a token count >= 0", "where fused_mma does not take it: large layers stay on "
                                     "64-token small slices up to this m (the large path's 4kn-byte weight round trip "
                                     "costs more there; benchkit's GB10 model)", _int(0))
    no_wgmma_small_min_weights: int = knob(1 << 24, "a weight count >= 0", "... on layers of at least this many "
                                           "weights (the 5.9M-weight layers are faster on the large path)", _int(0))
    blocks_per_sm: Mapping[int, float] = knob(
        {1: 6.0, 2: 3.0, 4: 3.0, 8: 2.0}, "a number > 0 for every token-group count, or g:n/g:n over groups 1, 2, 4, 8",
        "small kernel's split-k target, blocks per SM by token groups of 8 (H200 graph replay, K=2, NOTES.md v4: m=1 "
        "6 best or tied on all 5 anchor shapes, m=64 2 best on 3 of 5)", _mapping_parser(_number))
    prep_groups: int = knob(4, "a group count >= 1", "the prep kernel makes x' once from this many token groups of 8 "
                            "(gain on 4096x5120, 5120x4096, 5120x12288 at m >= 32, NOTES.md v4)", _int(1))
    prep_work: int = knob(98304, "a count >= 0", "... on layers whose 128-column strips x k exceed this (a tie or a "
                          "loss on 1152x5120 and 5120x1152: 46k)", _int(0))
    fused_efficiency: Mapping[int, float] = knob(
        {0: 1.0, 2: 1.08}, "0:n/2:n (numbers > 0)", "relative cost of a fused block shape's work (2 128x128 blocks "
        "per SM ran ~8% slower than one 128x256 on 5120x12288 and 5120x4096, H200)", _mapping_parser(_number))
    mma_efficiency: Mapping[int, float] = knob(
        {64: 1.0, 128: 1.0, 256: 1.0}, "64:n/128:n/256:n (numbers > 0)", "relative cost of a fused_mma block's work by its tokens",
        _mapping_parser(_number))
    sk_min_tiles: float = knob(0.5, "a number > 0", "stream-K needs at least this many tiles per SM ...", _number)
    sk_max_fill: float = knob(0.85, "a number > 0", "... one tile per block filling less than this of the SMs' time "
                              "(H200 m=256 5120x12288, 96 tiles: 70.9 vs 77.4 us) ...", _number)
    sk_min_tile_chunks: int = knob(32, "a chunk count >= 1", "... and tiles at least this many 64-row chunks deep "
                                   "(m=512 1152x5120, 18 chunks: 27.5 -> 29.5 us with stream-K, NOTES.md v10)",
                                   _int(1))
    sk_min_chunks: int = knob(4, "a chunk count >= 1", "stream-K blocks get at least this many 64-row chunks each "
                              "(a tile's head block adds the others' partials one after another)", _int(1))


@dataclass(frozen=True)
class Exl3Moe:
    """exl3_moe's launch switches (ops/exl3_moe.py ``plan_launch``, ``_config``, ``gate_up_pdl``); the defaults are
    what plan_launch chose before they were data, each measured on the H200 (cuda/exl3_moe/DESIGN.md)."""

    split_k: str | None = knob(None, "auto, N or Nm (N >= 1)", "gate/up's decode split-k forced: N uniform parts, Nm "
                               "N parts with the mixed split on top (sweeps)", _auto(_split_k))
    down_blocks: int | None = knob(None, "auto, 2, 3 or 4", "the 16-row down kernel's blocks-per-SM sizing forced "
                                   "(4: mul1 one-rate kernels only)", _auto(_int_in(2, 3, 4)))
    early_down: bool | None = knob(None, "auto, 0 or 1", "down blocks start per item (1) or after all of gate/up (0); "
                                   "auto: per item where gate/up takes more than one wave (T=2 -5%, NOTES.md v13)",
                                   _auto(_flag))
    pdl: bool | None = knob(None, "auto, 0 or 1", "gate/up with programmatic dependent launch; auto: only inside a "
                            "CUDA-graph capture (GPU -4% at T=1, but eager calls pay 23-66 us more host time)",
                            _auto(_flag))
    bytesum: bool = knob(True, "0 or 1", "mul1 items of <= 4 rows use the byte-sum mma (0: the fp16 decode)", _flag)
    rate_kernels: bool = knob(True, "0 or 1", "decode runs the kernels compiled for one rate where a layer's gate/up "
                              "(down) matrices share it (T=1 -1.7..4.5%, NOTES.md v15; 0: per-expert dispatch)", _flag)
    packed: bool = knob(True, "0 or 1", "the one-rate kernels compute where a matrix starts in the packed layout "
                        "(0: load offsets[e], a cold round trip per block)", _flag)
    gate_up4: str = knob("auto", "auto, 0 or any", "mul1's one-rate gate/up kernel at 4 blocks per SM where the device "
                         "holds 4 with >= gate_up4_min_a_kb k-blocks of A (0: never, 3 per SM; any: wherever 4 fit)",
                         _choice("auto", "0", "any"))
    down4: str = knob("auto", "auto, 0 or any", "the same for mul1's one-rate down kernel (from two tokens on; 0: 2-3 "
                      "per SM)", _choice("auto", "0", "any"))
    gate_up4_min_a_kb: int = knob(5, "a k-block count >= 0", "gate/up at 4 per SM won with A regions of >= 5 k-blocks "
                                  "(T=2 -2.3..5.5%; NOTES.md v22); sized as on GB10, K=2 (2 k-blocks) lost 2.4% "
                                  "at T=1", _int(0))
    down4_min_a_kb: int = knob(7, "a k-block count >= 0", "down at 4 per SM won with regions of 7-10 k-blocks (T=4 "
                               "-1.9..3.9%)", _int(0))
    fit_smem: bool = knob(True, "0 or 1", "the 16-row kernels shrink the A region where the full one would cost blocks "
                          "per SM (GB10: 17-39% faster at T=1-512; 0: the full region, A/B)", _flag)
    smem_per_sm: int = knob(0, "0 or a byte count from 102400 to 233472", "size and hold the kernels as on a device "
                            "with this much shared memory per SM (GB10: 102400); 0: this device's", _smem_per_sm)
    prefill_rows: int = knob(16, "a row count >= 1", "64-row items once the experts average more than this many rows "
                             "(pairs / experts), 16-row items up to it (T=512, 8 rows: 64-row items 1.38x slower on "
                             "the 48-SM proxy and the H200, bench_prefill.py)", _int(1))
    prefill_prep: bool = knob(True, "0 or 1", "64-row items copy x' and the activations made once per pair by launches "
                              "of their own (0: every block builds them; 48-SM proxy, K=2/3: T=2048 0.45/0.47x, "
                              "T=8192 0.40/0.41x the time of 0; bench_prefill.py)", _flag)


@dataclass(frozen=True)
class Plans:
    """Every op's table."""

    exl3_gemm: Exl3Gemm = field(default_factory=Exl3Gemm)
    exl3_moe: Exl3Moe = field(default_factory=Exl3Moe)


DEFAULT = Plans()


# ------------------------------------------------------------------------------------------------ parsing
def _fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """'op.key' -> (op, field) for every overridable key."""
    out = {}
    for table in dataclasses.fields(Plans):
        for f in dataclasses.fields(table.default_factory()):
            if f.metadata.get("parse") is not None:
                out[f"{table.name}.{f.name}"] = (table.name, f)
    return out


_KEYS = _fields()


def text(value: Any) -> str:
    """A table value in override syntax."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, Mapping):
        return "/".join(f"{k}:{text(v)}" for k, v in value.items())
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def keys() -> dict[str, dict[str, str]]:
    """Every overridable key: its default (override syntax), the values it accepts and why the default is what it is."""
    return {key: {"default": text(getattr(getattr(DEFAULT, op), f.name)), "accepts": f.metadata["accepts"],
                  "why": f.metadata["why"]} for key, (op, f) in _KEYS.items()}


def parse(spec: str, base: Plans = DEFAULT, source: str = ENV) -> Plans:
    """``base`` with the comma-separated ``op.key=value`` items of ``spec`` applied (a later item for a key wins).
    Raises PlanError naming ``source``, the key and what it accepts."""
    changes: dict[str, dict[str, Any]] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not key:
            raise PlanError(f"{source}: {item!r} is not an op.key=value item; write comma-separated items such as "
                            "exl3_moe.pdl=1,exl3_gemm.variant=small")
        if key not in _KEYS:
            near = difflib.get_close_matches(key, _KEYS, n=1)
            raise PlanError(f"{source}: unknown key {key!r}{f' (did you mean {near[0]}?)' if near else ''}; the keys "
                            f"are {', '.join(_KEYS)} (twinspark.ops.plans.keys() says what each does)")
        op, f = _KEYS[key]
        parser = f.metadata["parse"]
        try:
            if getattr(parser, "mapping", False):
                parsed = parser(value, getattr(getattr(DEFAULT, op), f.name))
            else:
                parsed = parser(value)
        except ValueError:
            raise PlanError(f"{source}: {key}={value!r} is not accepted; {key} takes {f.metadata['accepts']} "
                            f"(default {text(getattr(getattr(DEFAULT, op), f.name))})") from None
        changes.setdefault(op, {})[f.name] = parsed
    return dataclasses.replace(base, **{op: dataclasses.replace(getattr(base, op), **kv) for op, kv in changes.items()})


def changes(plans: Plans | None = None) -> str:
    """The keys where ``plans`` (default: ``current()``) differs from DEFAULT, in override syntax ("" if none)."""
    p = current() if plans is None else plans
    out = []
    for key, (op, f) in _KEYS.items():
        value = getattr(getattr(p, op), f.name)
        if value != getattr(getattr(DEFAULT, op), f.name):
            out.append(f"{key}={text(value)}")
    return ",".join(out)


# ---------------------------------------------------------------------------------------------- the process's
_current: Plans | None = None


def from_env(environ: Mapping[str, str] | None = None) -> Plans:
    """DEFAULT with ``$TWINSPARK_PLAN`` of ``environ`` (default: this process's environment) applied."""
    return parse((os.environ if environ is None else environ).get(ENV, ""), DEFAULT, ENV)


def current() -> Plans:
    """The plans the ops launch with: ``from_env()`` (parsed on the first call, kept for the process), or inside
    ``override()`` its plans."""
    global _current
    p = _current
    if p is None:
        p = _current = from_env()
    return p


def use(spec: str) -> Plans:
    """From now on (until another ``use`` or the end of an enclosing ``override``), ``current()`` is
    ``parse(spec, current())``; returns the plans it replaced. For scripts that set their own default for the whole
    run (bench_exl3_moe.py: exl3_moe.pdl=1 unless $TWINSPARK_PLAN says otherwise); elsewhere prefer ``override``."""
    global _current
    before = current()
    _current = parse(spec, before, "plan override")
    return before


@contextlib.contextmanager
def override(spec: str = "", base: Plans | None = None) -> Iterator[Plans]:
    """Inside, ``current()`` is ``parse(spec, base)`` (base: ``current()``; ``DEFAULT`` ignores $TWINSPARK_PLAN).
    Process-wide (every thread, every device); CUDA graphs captured inside keep the plan they were captured with."""
    global _current
    before = current()
    p = parse(spec, before if base is None else base, "plan override")
    _current = p
    try:
        yield p
    finally:
        _current = before


__all__ = ["DEFAULT", "ENV", "Exl3Gemm", "Exl3Moe", "PlanError", "Plans", "changes", "current", "from_env", "keys",
           "override", "parse", "text", "use"]
