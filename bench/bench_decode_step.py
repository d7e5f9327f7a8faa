"""One DeepSeek V4.1 Flash decode step (`python bench/run.py decode_step`): the per-rank work twinspark owns at
tensor parallel 2, at the real dimensions and published rates (twinspark.v41_layout.V41Spec.real()), random
weights, all 40 layers (every layer its own weights: ~91 GiB of routed experts built on the GPU, nothing reused),
one CUDA graph per step, at T = 1 (one token) and T = 4 (one token + three DSpark draft tokens to verify).

In the step, per layer: attention (wq_a, wkv, wq_b, grouped wo_a through exl3_gemm_grouped, wo_b), the compressor
on kv-source layers, the indexer on index-source layers, the routed experts (exl3_moe, random top-6 routing), the
shared expert, an all-reduce after wo_b and one after the MoE; on Engram layers (1, 14) the Engram wkv (column
split) and its all-gather (an all-reduce of the same bytes); once per step the embedding all-reduce, the Engram
lookup of both layers (12 hash heads per rank x T rows each, EngramStore.staging(...).fetch on a pack file written
to this machine's disk, O_DIRECT: rows come from the disk every replay) and lm_head (K=6) with its logits gather.
Not in it: the attention core (vLLM's kernels: sparse MLA, indexer scoring, compressor kernels, norms, mHC, router;
the forecast, client/forecast.py, adds a per-layer time for it calibrated on seed A's published no-speculation decode)
and the DSpark draft (a forecast term).
The all-reduce is the IPC one-shot kernel with two virtual ranks on this GPU: rank 1's call runs on a second
stream forked and joined inside the graph. The 48-SM graphs leave it out (GB10's all-reduce crosses RoCE through
host memory: a forecast term) and so does any graph whose all-reduce fails its probe (said in the output).

Two machines in one run:
- H200: the whole GPU (132 SMs);
- proxy: a green context of 48 SMs (GB10's count; torch.cuda.green_contexts), every graph warmed up, captured and
  replayed on its stream, plans sized for 48 SMs (twinspark.ops.sms.limit: the device still reports 132).
For each: the step graph, one graph per kernel class (its kernels in every layer) and one per projection, at T in
--ts (default 1, 2, 4, 8: the step at 1 and 4, classes and projections at all). Timing: graph replays, CUDA events,
warm-up, median (benchkit). Per class: µs per step, bytes, GB/s, fraction of the copy ceiling measured on the
same SMs; for the proxy also its GB10 estimate (twinspark.gb10.kernel_us: bandwidth floor at 273 GB/s, proxy time
x 1.98/2.4 GHz, tensor-core floor) and which floor binds. Writes decode_step.json (benchkit) and decode_step.png
(µs per step by class: H200, proxy, GB10 estimate).

    python bench/bench_decode_step.py [--ts 1,2,4,8] [--steps 1,4] [--no-proxy] [--engram-gib 1]
    python bench/bench_decode_step.py --dry-run          # the plan, bytes and GB10 floors; no GPU
    python bench/bench_decode_step.py --tiny             # every op once at tiny dimensions on the CPU (wiring check)
    python bench/bench_decode_step.py --plot-only bench/results/decode_step.json   # GB10 notes + PNG again, no GPU
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import benchkit as bk  # noqa: E402
from twinspark import gb10  # noqa: E402
from twinspark.v41_layout import V41Spec  # noqa: E402

TP = 2
CLASSES = ("attention", "compressor", "indexer", "shared", "routed", "engram wkv", "engram rows", "all-reduce",
           "lm_head")
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Op:
    """One call of the step. gemm: k -> n at rate K (groups > 1: one grouped call); moe: the routed experts;
    lookup: ``rows`` Engram rows per token; allreduce: ``rows`` bf16 values per token."""

    cls: str
    name: str
    layer: int  # -1: once per step
    kind: str  # gemm | moe | lookup | allreduce
    k: int = 0
    n: int = 0
    K: float = 0
    groups: int = 1
    rows: int = 0

    def weight_bytes(self) -> int:
        """Trellis + suh + svh of a gemm (all groups)."""
        return int(self.groups * (self.k * self.n * self.K / 8 + 2 * self.k + 2 * self.n)) if self.kind == "gemm" else 0

    def mma_flops(self, T: int) -> float:
        """Tensor-core FLOPs as issued: every token group padded to 16 rows (m16n8k16)."""
        return 2.0 * 16 * math.ceil(T / 16) * self.k * self.n * self.groups if self.kind == "gemm" else 0.0


def plan_step(spec: V41Spec, tp: int = TP) -> list[Op]:
    """Every call of one rank's decode step, in order (shared/docs/deepseek-v41.md section 3: what each module keeps
    whole and what it splits at tensor parallel ``tp``)."""
    h = spec.hidden
    ops = [Op("all-reduce", "embedding", -1, "allreduce", rows=h)]
    for layer in spec.engram_layers:  # vLLM looks both layers' rows up before the decoder layers; 24 hash heads each
        ops.append(Op("engram rows", "lookup", layer, "lookup", rows=math.ceil(spec.engram_hash_cols / tp)))
    for L in range(spec.layers):
        K = spec.k_attn
        ops += [Op("attention", "wq_a", L, "gemm", h, spec.q_lora, K), Op("attention", "wkv", L, "gemm", h, spec.head_dim, K)]
        if L in spec.kv_sources:
            ops.append(Op("compressor", "wkv", L, "gemm", h, spec.head_dim, K))
            if spec.compress_ratios[L] == 2:
                ops.append(Op("compressor", "wgate", L, "gemm", h, spec.head_dim, K))
        if L in spec.index_sources:
            ops.append(Op("indexer", "wq_b", L, "gemm", spec.q_lora, spec.index_heads * spec.index_head_dim, K))
            if L in spec.kv_sources:
                ops.append(Op("indexer", "wk", L, "gemm", spec.head_dim, spec.index_head_dim, spec.k_indexer_wk))
        ops += [Op("attention", "wq_b", L, "gemm", spec.q_lora, spec.heads * spec.head_dim // tp, K),
                Op("attention", "wo_a", L, "gemm", spec.group_in, spec.o_lora, K, groups=spec.o_groups // tp),
                Op("attention", "wo_b", L, "gemm", spec.o_groups * spec.o_lora // tp, h, K),
                Op("all-reduce", "attention", L, "allreduce", rows=h)]
        if L in spec.engram_layers:
            i = spec.engram_layers.index(L)
            n = h * (spec.hc_mult + 1)
            ops += [Op("engram wkv", "wkv", L, "gemm", spec.engram_hash_cols * spec.engram_head_dim, n // tp,
                       spec.k_engram[i % len(spec.k_engram)]),
                    Op("all-reduce", "engram gather", L, "allreduce", rows=n)]
        inter = spec.shared_inter // tp
        Ks = spec.k_shared(L)
        ops += [Op("routed", "experts", L, "moe", h, spec.moe_inter // tp, spec.k_routed(L)),
                Op("shared", "w1", L, "gemm", h, inter, Ks), Op("shared", "w3", L, "gemm", h, inter, Ks),
                Op("shared", "w2", L, "gemm", inter, h, Ks),
                Op("all-reduce", "ffn", L, "allreduce", rows=h)]
    ops += [Op("lm_head", "head", -1, "gemm", h, spec.vocab // tp, spec.k_head),
            Op("all-reduce", "logits gather", -1, "allreduce", rows=spec.vocab)]
    return ops


def expert_bytes(op: Op) -> int:
    """One expert's three matrices and their scales (hidden op.k, intermediate op.n per rank)."""
    H, inter = op.k, op.n
    return int(3 * H * inter * op.K / 8) + 2 * (2 * H + 2 * inter + inter + H)


def expected_distinct(experts: int, top_k: int, T: int) -> float:
    """Distinct experts T tokens of uniform random top-k routing touch, on average."""
    return experts * (1 - (1 - top_k / experts) ** T)


def op_bytes(op: Op, T: int, spec: V41Spec, distinct: float | None = None) -> float:
    """Bytes one call moves: weights once, activations in and out (bf16), Engram rows (fp8 + scales in, bf16 out)."""
    if op.kind == "gemm":
        return op.weight_bytes() + 2 * T * op.groups * (op.k + op.n)
    if op.kind == "moe":
        d = expected_distinct(spec.experts, spec.top_k, T) if distinct is None else distinct
        return d * expert_bytes(op) + 2 * 2 * T * op.k
    if op.kind == "lookup":
        return T * op.rows * (264 + 2 * spec.engram_head_dim)
    return 2 * 2 * T * op.rows  # all-reduce: this rank's input read, the sum written


def class_bytes(ops: list[Op], T: int, spec: V41Spec) -> dict[str, float]:
    out = dict.fromkeys(CLASSES, 0.0)
    for op in ops:
        out[op.cls] += op_bytes(op, T, spec)
    return out


def dry_run(spec: V41Spec, ts: tuple[int, ...]) -> None:
    ops = plan_step(spec)
    gem = [o for o in ops if o.kind == "gemm"]
    moe = [o for o in ops if o.kind == "moe"]
    print(f"V4.1 decode step per rank at TP {TP}: {len(ops)} calls ({len(gem)} EXL3 GEMMs, {len(moe)} MoE layers, "
          f"{sum(o.kind == 'allreduce' for o in ops)} all-reduces, {sum(o.kind == 'lookup' for o in ops)} Engram lookups)")
    dense_w = sum(o.weight_bytes() for o in gem)
    routed_w = sum(spec.experts * expert_bytes(o) for o in moe)
    print(f"weights on the GPU: dense EXL3 {dense_w / 2**30:.2f} GiB, routed experts {routed_w / 2**30:.2f} GiB")
    for T in ts:
        cb = class_bytes(ops, T, spec)
        print(f"T={T}: {sum(cb.values()) / 1e6:,.1f} MB per step; GB10 bandwidth floor at "
              f"{float(gb10.BW) / 1e9:.0f} GB/s x {float(gb10.BW_EFFICIENCY)}: "
              f"{gb10.bw_floor_us(sum(cb.values())) / 1e3:.2f} ms")
        for c, b in cb.items():
            print(f"   {c:12s} {b / 1e6:10.2f} MB   floor {gb10.bw_floor_us(b):9.1f} µs")


# ----------------------------------------------------------------------------------------------- the GPU side
def _scales(shape, k, dev, gen):
    sign = torch.randint(0, 2, shape, device=dev, generator=gen).float() * 2 - 1
    mag = 0.75 + 0.5 * torch.rand(shape, device=dev, generator=gen)
    return (sign * mag / (math.sqrt(k) if k else 1.0)).half()


def _layer(op: Op, dev, gen):
    from twinspark.exl3.layer import Exl3Layer
    from twinspark.ops.exl3_gemm_grouped import Exl3GroupedLayer

    lead = (op.groups,) if op.groups > 1 else ()
    trellis = torch.randint(-32768, 32768, (*lead, op.k // 16, op.n // 16, int(16 * op.K)), dtype=torch.int16,
                            device=dev, generator=gen)
    suh, svh = _scales((*lead, op.k), op.k, dev, gen), _scales((*lead, op.n), 0, dev, gen)
    if op.groups > 1:
        return Exl3GroupedLayer(trellis, suh, svh, float(op.K), "mul1")
    return Exl3Layer(trellis, suh, svh, float(op.K), "mul1")


def _experts(op: Op, spec: V41Spec, dev, gen):
    from twinspark import moe_layout as ml

    if dev.type == "cpu":
        return ml.random_experts(spec.experts, op.k, op.n, (op.K,) * 3, generator=gen)
    ex = ml.empty([[op.K] * 3] * spec.experts, op.k, op.n, "mul1", device=dev)
    ex.trellis.random_(-32768, 32768, generator=gen)
    for t, k in ((ex.suh13, op.k), (ex.svh13, 0), (ex.suh2, op.n), (ex.svh2, 0)):
        t.copy_(_scales(t.shape, k, dev, gen))
    return ex


def write_pack(path: Path, gib: float, seed: int = 0):
    """A pack file of random valid rows (fp8 e4m3 without NaN codes, E8M0 scales near 2^0): PackHeader + rows."""
    import numpy as np
    from twinspark.engram.pack import PackHeader
    from twinspark.engram.source import RECORD_BYTES, WEIGHT_BYTES

    rows = max(1, int(gib * 2**30 / RECORD_BYTES))
    h = PackHeader(layer=1, first_row=0, last_row=rows - 1, table_rows=rows)
    rng = np.random.default_rng(seed)
    chunk = 1 << 18
    with open(path, "wb") as f:
        f.write(h.encode())
        for r0 in range(0, rows, chunk):
            n = min(chunk, rows - r0)
            block = rng.integers(0, 256, size=(n, RECORD_BYTES), dtype=np.uint8)
            w = block[:, :WEIGHT_BYTES]
            w[(w & 0x7F) == 0x7F] ^= 1  # 0x7F / 0xFF are e4m3fn NaN
            block[:, WEIGHT_BYTES:] = rng.integers(124, 131, size=(n, RECORD_BYTES - WEIGHT_BYTES), dtype=np.uint8)
            f.write(block.tobytes())
        f.flush()
        os.fsync(f.fileno())
    return h


class Step:
    """Weights, inputs and callables of every op; ``calls(T, sel)`` gives the step's calls at T tokens for the ops
    ``sel`` accepts (all by default)."""

    def __init__(self, spec: V41Spec, ops: list[Op], dev: torch.device, t_max: int, *, engram_dir: Path | None,
                 engram_gib: float, seed: int = 0, allreduce: bool = True):
        self.spec, self.ops, self.dev, self.t_max = spec, ops, dev, t_max
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        t0 = time.perf_counter()
        self.weights = {}
        for i, op in enumerate(ops):
            if op.kind == "gemm":
                self.weights[i] = _layer(op, dev, gen)
            elif op.kind == "moe":
                self.weights[i] = _experts(op, spec, dev, gen)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        print(f"weights built in {time.perf_counter() - t0:.1f} s")
        self.gen = gen
        self._x: dict = {}
        self._out: dict = {}
        self.routing: dict = {}
        self.engram = None
        self.pack_dir = None
        if engram_dir is not None and any(o.kind == "lookup" for o in ops):
            self._engram(engram_dir, engram_gib)
        self.transports = None
        self.side = None
        if allreduce and dev.type == "cuda":
            from twinspark.allreduce.ipc import IpcTransport

            self.transports = IpcTransport.local_group(2, 1 << 22, dev, timeout_s=1.0)
            self.side = torch.cuda.Stream(dev)

    # ------------------------------------------------------------------------------------------------- engram
    def _engram(self, root: Path, gib: float):
        from twinspark.engram import EngramStore

        self.pack_dir = Path(tempfile.mkdtemp(prefix="decode_step_engram_", dir=root))
        t0 = time.perf_counter()
        h = write_pack(self.pack_dir / "pack.bin", gib)
        store = EngramStore.from_pack(self.pack_dir / "pack.bin", threads=16, queue_depth=32)
        lookups = [i for i, o in enumerate(self.ops) if o.kind == "lookup"]
        cap = max(self.ops[i].rows for i in lookups) * self.t_max
        self.engram = {"store": store, "rows": h.rows, "staging": {i: store.staging(cap) for i in lookups}}
        print(f"Engram pack: {h.rows:,} rows ({h.file_bytes / 2**30:.2f} GiB) written in "
              f"{time.perf_counter() - t0:.1f} s; O_DIRECT {store.direct}, {store.io_path}{' (' + store.io_note + ')' if store.io_note else ''}")

    def close(self):
        if self.transports:
            for t in self.transports:
                t.close()
        if self.pack_dir is not None:
            shutil.rmtree(self.pack_dir, ignore_errors=True)

    def check(self):
        """Raise a failed all-reduce or Engram read since the last check."""
        for t in self.transports or ():
            t.check()
        for s in (self.engram or {}).get("staging", {}).values():
            s.check()

    # ------------------------------------------------------------------------------------------------- inputs
    def x(self, T: int, shape: tuple, tag: str = "") -> torch.Tensor:
        """A random bf16 input of this shape, one per (T, shape, tag)."""
        key = (T, shape, tag)
        if key not in self._x:
            self._x[key] = torch.randn(*shape, device=self.dev, generator=self.gen).to(torch.bfloat16)
        return self._x[key]

    def routing_for(self, T: int, i: int):
        if (T, i) not in self.routing:
            E, top_k = self.spec.experts, self.spec.top_k
            ids = torch.rand(T, E, device=self.dev, generator=self.gen).topk(top_k, dim=1).indices.to(torch.int32)
            w = torch.rand(T, top_k, device=self.dev, generator=self.gen) + 0.1
            self.routing[(T, i)] = (ids, (w / w.sum(1, keepdim=True)).float())
        return self.routing[(T, i)]

    def distinct(self, T: int, i: int) -> int:
        return int(torch.unique(self.routing_for(T, i)[0]).numel())

    # -------------------------------------------------------------------------------------------------- calls
    def call(self, T: int, i: int):
        from twinspark.ops import exl3_gemm, exl3_gemm_grouped, exl3_moe

        op = self.ops[i]
        if op.kind == "gemm":
            w = self.weights[i]
            if op.groups > 1:
                x = self.x(T, (T, op.groups, op.k))
                return lambda: exl3_gemm_grouped(x, w)
            x = self.x(T, (T, op.k))
            key = (T, i)
            if key not in self._out:
                self._out[key] = torch.empty(T, op.n, dtype=torch.bfloat16, device=self.dev)
            out = self._out[key]
            return lambda: exl3_gemm(x, w, out=out)
        if op.kind == "moe":
            ex = self.weights[i]
            x = self.x(T, (T, op.k))
            ids, wts = self.routing_for(T, i)
            return lambda: exl3_moe(x, ids, wts, ex)
        if op.kind == "lookup":
            if self.engram is None:
                return None
            key = ("ids", T, i)
            if key not in self._x:
                self._x[key] = torch.randint(0, self.engram["rows"], (T * op.rows,), device=self.dev,
                                             generator=self.gen)
            ids, staging = self._x[key], self.engram["staging"][i]
            return lambda: staging.fetch(ids)
        if self.transports is None:
            return None
        t0, t1 = self.transports
        x0 = self.x(T, (T * op.rows,), "rank0")
        x1 = self.x(T, (T * op.rows,), "rank1")
        side = self.side

        def allreduce():
            cur = torch.cuda.current_stream(self.dev)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                t1.allreduce(x1)
            t0.allreduce(x0)
            cur.wait_stream(side)

        return allreduce

    def calls(self, T: int, sel=None, allreduce: bool = True) -> list:
        out = []
        for i, op in enumerate(self.ops):
            if (sel is None or sel(op)) and (allreduce or op.kind != "allreduce"):
                f = self.call(T, i)
                if f is not None:
                    out.append(f)
        return out


# --------------------------------------------------------------------------------------------------- measuring
def capture(fns: list, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
        for f in fns:
            f()
    return g


def time_graph(g: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, iters: int = 7) -> bk.Timing:
    """Replays on ``stream``: CUDA events (benchkit), or, where events cannot be recorded on that stream, the host
    clock around synchronized batches of replays (said once)."""
    with torch.cuda.stream(stream):
        try:
            return bk.time_cuda(g.replay, warmup=2, iters=iters, calls_per_sample=3)
        except RuntimeError as e:
            if not _HOST_CLOCK:
                print(f"  (CUDA events failed on this stream: {e}; timing with the host clock)")
                _HOST_CLOCK.append(True)
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            samples = []
            for _ in range(iters):
                t0 = time.perf_counter()
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - t0) / 3 * 1e6)
            return bk.Timing(tuple(samples))


_HOST_CLOCK: list = []


def copy_gbps_on(stream: torch.cuda.Stream, dev, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + written) on this stream's SMs, from graph replays."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    with torch.cuda.stream(stream):
        dst.copy_(src)
    torch.cuda.synchronize(dev)
    g = capture([lambda: dst.copy_(src)], stream)
    t = time_graph(g, stream, iters=9)
    return bk.gbps(nbytes, t.median_us)


@dataclass
class Row:
    mode: str  # h200 | proxy
    sms: int
    T: int
    group: str  # step | class:<cls> | op:<cls>/<name>
    us: float
    bytes: float
    calls: int
    mma_flops: float
    samples: tuple = ()
    note: str = ""


def groups_for(ops: list[Op], T: int, steps: tuple[int, ...]) -> list[tuple[str, object]]:
    """(label, selector) of what is timed at T: the step (T in steps), each class, each EXL3 projection."""
    out = [("step", None)] if T in steps else []
    present = sorted({o.cls for o in ops}, key=CLASSES.index)
    out += [(f"class:{c}", lambda o, c=c: o.cls == c) for c in present]
    names = sorted({(o.cls, o.name) for o in ops if o.kind == "gemm"})
    out += [(f"op:{c}/{n}", lambda o, c=c, n=n: o.cls == c and o.name == n) for c, n in names]
    return out


def measure(st: Step, mode: str, sms: int, stream, ts, steps, ar_ok: bool) -> list[Row]:
    """Warm up at the largest T (workspaces reach their largest size before any capture), then each T's graphs."""
    from twinspark.ops import sms as sm

    rows = []
    with sm.limit(sms):
        try:
            with torch.cuda.stream(stream):
                for f in st.calls(max(ts), allreduce=ar_ok):
                    f()
            torch.cuda.synchronize(st.dev)
            st.check()
        except Exception as e:  # noqa: BLE001 - the groups below say what fails
            print(f"  {mode} warm-up at T={max(ts)}: {type(e).__name__}: {e}", flush=True)
        for T in ts:
            for label, sel in groups_for(st.ops, T, steps):
                fns = st.calls(T, sel, allreduce=ar_ok)
                if not fns:
                    continue
                try:
                    with torch.cuda.stream(stream):
                        for f in fns:  # eager once at this T on this stream
                            f()
                    g = capture(fns, stream)
                    t = time_graph(g, stream)
                    st.check()
                    del g
                except Exception as e:  # noqa: BLE001 - report, keep measuring the rest
                    print(f"  {mode:5s} T={T} {label:28s} FAILED: {type(e).__name__}: {e}", flush=True)
                    continue
                chosen = [o for o in st.ops if (sel is None or sel(o)) and (ar_ok or o.kind != "allreduce")
                          and (o.kind != "lookup" or st.engram is not None)]
                nbytes = sum(op_bytes(o, T, st.spec, st.distinct(T, st.ops.index(o)) if o.kind == "moe" else None)
                             for o in chosen)
                flops = sum(o.mma_flops(T) for o in chosen)
                note = "" if ar_ok or not any(o.kind == "allreduce" for o in st.ops if sel is None or sel(o)) \
                    else "all-reduce left out"
                rows.append(Row(mode, sms, T, label, t.median_us, nbytes, len(fns), flops, t.samples_us, note))
                print(f"  {mode:5s} T={T} {label:28s} {t.median_us:9.1f} µs  {bk.gbps(nbytes, t.median_us):7.0f} GB/s"
                      f"  ({len(fns)} calls){'  ' + note if note else ''}", flush=True)
    return rows


def probe_allreduce(st: Step, stream) -> tuple[bool, str]:
    """Two forked all-reduce calls eagerly, then in a graph replayed twice: does the virtual-rank pair run
    concurrently inside a graph here?"""
    if st.transports is None:
        return False, "no all-reduce transport"
    try:
        fns = st.calls(1, lambda o: o.kind == "allreduce")[:2]
        with torch.cuda.stream(stream):
            for f in fns:
                f()
        torch.cuda.synchronize(st.dev)
        st.check()
        g = capture(fns, stream)
        with torch.cuda.stream(stream):
            g.replay()
            g.replay()
        torch.cuda.synchronize(st.dev)
        st.check()
        return True, "ok"
    except Exception as e:  # noqa: BLE001 - any failure means: leave it out, say why
        st.transports = None  # a failed transport stays failed: no more calls, no more checks
        return False, f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------------------------ report
def gb10_estimate(group: str, nbytes: float, proxy_us: float | None, flops: float, calls: int) -> dict:
    """GB10 µs of one measured group: twinspark.gb10.kernel_us for kernels; the Engram lookup is disk I/O through a
    host function (not an SM's work: kept as measured, and overlapped in vLLM); the all-reduce crosses RoCE on
    two Sparks (calls x gb10.ALLREDUCE_US)."""
    if group.endswith("engram rows"):
        us = proxy_us or 0.0
        return {"us": us, "bound": "disk I/O (not scaled)", "bw_us": gb10.bw_floor_us(nbytes), "proxy_us": us,
                "tc_us": 0.0}
    if group.endswith("all-reduce"):
        us = calls * float(gb10.ALLREDUCE_US)
        return {"us": us, "bound": "RoCE (model)", "bw_us": 0.0, "proxy_us": 0.0, "tc_us": 0.0}
    return gb10.kernel_us(nbytes, proxy_us, flops)


def _gb10(r: Row) -> dict:
    return gb10_estimate(r.group, r.bytes, r.us if r.mode == "proxy" else None, r.mma_flops, r.calls)


def _notes(e: dict, extra: str = "") -> str:
    return (f"gb10_us={e['us']:.1f} bound={e['bound']} bw_us={e['bw_us']:.1f} proxy_scaled_us={e['proxy_us']:.1f} "
            f"tc_us={e['tc_us']:.1f}" + (f"; {extra}" if extra else ""))


def report(rows: list[Row], copy: dict[str, float]) -> None:
    ts = sorted({r.T for r in rows})
    for T in ts:
        steps = [r for r in rows if r.T == T and r.group == "step"]
        for r in steps:
            print(f"\nT={T} {r.mode} ({r.sms} SMs): {r.us:,.0f} µs per step, {r.bytes / 1e6:,.1f} MB, "
                  f"{bk.gbps(r.bytes, r.us):,.0f} GB/s = {bk.gbps(r.bytes, r.us) / copy[r.mode]:.0%} of the copy "
                  f"ceiling on those SMs ({copy[r.mode]:,.0f} GB/s); {r.calls} calls{'; ' + r.note if r.note else ''}")
        print(f"\nT={T}: per class (µs per step), largest first; GB10 = max(bytes / {float(gb10.BW) / 1e9:.0f} GB/s x "
              f"{float(gb10.BW_EFFICIENCY)}, proxy x {gb10.clock_scale():.3f}, MMA floor)")
        print(f"  {'class / projection':28s} {'H200':>8s} {'48 SMs':>8s} {'MB':>8s} {'GB/s 48':>8s} {'floor':>8s} "
              f"{'GB10':>8s}  bound")
        labels = [r.group for r in rows if r.T == T and r.mode == "h200" and r.group != "step"]
        by = {(r.mode, r.group): r for r in rows if r.T == T}
        keyed = sorted(labels, key=lambda g: (not g.startswith("class:"), -(by.get(("proxy", g)) or by[("h200", g)]).us))
        for g in keyed:
            h, p = by.get(("h200", g)), by.get(("proxy", g))
            ref = p or h
            est = _gb10(p) if p else None
            print(f"  {g:28s} {h.us if h else float('nan'):8.1f} {p.us if p else float('nan'):8.1f} "
                  f"{ref.bytes / 1e6:8.2f} {bk.gbps(ref.bytes, p.us) if p else float('nan'):8.0f} "
                  f"{gb10.bw_floor_us(ref.bytes):8.1f} {est['us'] if est else float('nan'):8.1f}  "
                  f"{est['bound'] if est else '-'}")
        above = [f"{g} ({_gb10(by[('proxy', g)])['proxy_us'] / _gb10(by[('proxy', g)])['bw_us']:.2f}x)"
                 for g in keyed if ("proxy", g) in by and _gb10(by[("proxy", g)])["bound"] in ("proxy", "tensor cores")]
        print(f"T={T}: above their GB10 bandwidth floor on the proxy (proxy x clock / floor): "
              f"{', '.join(above) or 'none'}")


NOT_MEASURED = ("not in these graphs: vLLM's attention core (`invoke forecast` adds layers x a per-layer time "
                "calibrated on seed A's published no-speculation decode) and the DSpark draft (a forecast term)")


def to_records(rows: list[Row]) -> list[bk.Record]:
    out = []
    for r in rows:
        notes = r.note
        if r.mode == "proxy":
            notes = _notes(_gb10(r), r.note)
        out.append(bk.Record(op="decode_step", shape={"T": r.T, "sms": r.sms, "calls": r.calls}, median_us=r.us,
                             bytes=int(r.bytes), flops=int(r.mma_flops), variant=f"{r.mode}:{r.group}", notes=notes,
                             samples_us=list(r.samples)))
    return out


def save(rows: list[Row], copy: dict[str, float]) -> Path:
    """decode_step.json and .png (rewritten after each machine, so a failure later keeps what was measured)."""
    recs = to_records(rows)
    path = bk.write_results("decode_step", recs, ceilings={f"copy_gbps_{k}": v for k, v in copy.items()})
    plot(recs, path.with_suffix(".png"))
    return path


def plot(records: list[bk.Record], png: Path) -> Path:
    """Stacked bars: µs per step by class, H200 / 48-SM proxy / GB10 estimate, one group per step T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({r.shape["T"] for r in records if r.variant.endswith(":step")})
    bars = []
    for T in steps:
        for mode in ("h200", "proxy", "gb10"):
            src = "proxy" if mode == "gb10" else mode
            per = {}
            for r in records:
                if r.shape["T"] == T and r.variant.startswith(f"{src}:class:"):
                    c = r.variant.split(":", 2)[2]
                    per[c] = (gb10_estimate(c, r.bytes or 0, r.median_us, r.flops or 0, r.shape["calls"])["us"]
                              if mode == "gb10" else r.median_us)
            ar = next((r for r in records if r.shape["T"] == T and r.variant == "h200:class:all-reduce"), None)
            if mode == "gb10" and per and ar is not None:  # the proxy leaves it out: RoCE, a model term
                per["all-reduce"] = gb10_estimate("all-reduce", 0, None, 0, ar.shape["calls"])["us"]
            if per:
                bars.append((f"T={T} {dict(h200='H200 132 SMs', proxy='H200 48 SMs', gb10='GB10 est.')[mode]}", per))
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(bars) + 2))
    colors = plt.get_cmap("tab10")
    for y, (_, per) in enumerate(bars):
        left = 0.0
        for j, c in enumerate(CLASSES):
            v = per.get(c, 0.0) / 1e3
            if v:
                ax.barh(y, v, left=left, color=colors(j), label=c if y == 0 else None)
                left += v
        ax.text(left, y, f" {left:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step, sum of per-class graphs (not included: attention core, DSpark draft; GB10: Engram "
                  "rows as this machine's disk served them, all-reduce = calls x gb10.ALLREDUCE_US)")
    ax.set_title("DeepSeek V4.1 Flash decode step per rank, TP 2: twinspark's kernels by class")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(j)) for j in range(len(CLASSES))]
    ax.legend(handles, CLASSES, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return bk.save_figure(fig, png, dpi=110)


# ---------------------------------------------------------------------------------------------------------- main
def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v)


def redo(path: Path) -> int:
    """Rewrite a results file's GB10 notes with this model (same measurements) and redraw its PNG; no GPU."""
    doc = bk.load_results(path)
    for r in doc["records"]:
        mode, _, group = r.variant.partition(":")
        if mode == "proxy":
            extra = r.notes.split("; ", 1)[1] if "; " in r.notes else ""
            r.notes = _notes(gb10_estimate(group, r.bytes or 0, r.median_us, r.flops or 0, r.shape["calls"]), extra)
    out = bk.write_results(path.stem, doc["records"], out_dir=path.parent, ceilings=doc["ceilings"],
                           machine=doc["machine"])
    print(f"wrote {out} and {plot(doc['records'], path.with_suffix('.png'))}")
    return 0


def tiny_check() -> int:
    """Every op of the tiny V4.1 once on the CPU through the references (no graphs, no Engram, no all-reduce)."""
    spec = V41Spec.tiny()
    ops = plan_step(spec)
    st = Step(spec, ops, torch.device("cpu"), 4, engram_dir=None, engram_gib=0, allreduce=False)
    for T in (1, 4):
        n = 0
        for f in st.calls(T):
            y = f()
            if isinstance(y, torch.Tensor) and not torch.isfinite(y.float()).all():
                raise SystemExit(f"tiny check: a call at T={T} gave non-finite values")
            n += 1
        print(f"tiny V4.1, T={T}: {n} calls ran on the CPU, outputs finite")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ts", type=_ints, default=(1, 2, 4, 8), help="T values for classes and projections")
    ap.add_argument("--steps", type=_ints, default=(1, 4), help="T values for the whole-step graph")
    ap.add_argument("--sms", type=int, default=int(gb10.SMS.value), help="SMs of the proxy's green context (48)")
    ap.add_argument("--no-proxy", action="store_true", help="the whole GPU only")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs; the real model has 40)")
    ap.add_argument("--engram-gib", type=float, default=1.0, help="size of the Engram pack file written (GiB)")
    ap.add_argument("--engram-dir", type=Path, default=ROOT, help="where the pack file goes (a disk, not tmpfs)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, bytes and GB10 floors; no GPU")
    ap.add_argument("--tiny", action="store_true", help="run every op once at tiny dimensions on the CPU")
    ap.add_argument("--plot-only", type=Path, help="rewrite a results file's GB10 notes with the current model and "
                    "redraw its PNG; no GPU")
    a = ap.parse_args(argv)
    spec = V41Spec.real()
    if a.layers:
        from dataclasses import replace

        spec = replace(spec, layers=a.layers)
    if a.dry_run:
        dry_run(spec, a.ts)
        return 0
    if a.tiny:
        return tiny_check()
    if a.plot_only:
        return redo(a.plot_only)
    if not torch.cuda.is_available():
        print("bench_decode_step: no CUDA GPU is visible; --dry-run and --tiny run without one", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    ops = plan_step(spec)
    dry_run(spec, a.steps)
    st = Step(spec, ops, dev, max(a.ts), engram_dir=a.engram_dir, engram_gib=a.engram_gib)
    try:
        full = torch.cuda.Stream(dev)
        copy = {"h200": bk.copy_ceiling_gbps(dev)}
        ar_ok, why = probe_allreduce(st, full)
        print(f"all-reduce (IPC, two virtual ranks) inside a graph: {'yes' if ar_ok else 'no: ' + why}")
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        rows = measure(st, "h200", sms, full, a.ts, a.steps, ar_ok)
        save(rows, copy)
        if not a.no_proxy:
            try:
                from torch.cuda.green_contexts import GreenContext

                gc = GreenContext.create(num_sms=a.sms, device_id=dev.index)
                proxy = gc.Stream()
            except Exception as e:  # noqa: BLE001 - the H200 part stands on its own
                print(f"proxy skipped: no green context of {a.sms} SMs here ({type(e).__name__}: {e})")
            else:
                copy["proxy"] = copy_gbps_on(proxy, dev)
                print(f"copy ceiling: {copy['h200']:,.0f} GB/s on 132 SMs, {copy['proxy']:,.0f} GB/s on {a.sms} SMs")
                rows += measure(st, "proxy", a.sms, proxy, a.ts, a.steps, False)
                save(rows, copy)
        report(rows, copy)
        print(NOT_MEASURED)
        print(f"wrote {save(rows, copy)}")
    finally:
        st.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
