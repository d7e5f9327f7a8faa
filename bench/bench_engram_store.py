"""Engram row store on this machine's disk: cache-cold random rows/s from a multi-GB pack file.

For each thread count T (default 1, 8, 32, 96), in the same run and on the same file:
  - twinspark: EngramStore.from_pack(threads=T, queue_depth=QD, cache off), batches of random row ids (one ~4 KiB
    O_DIRECT read per row; a row crossing a 4 KiB boundary, 6% of them, needs 8 KiB); each thread keeps QD rows in
    flight through io_uring or Linux AIO (the store's io_path; blocking pread, QD = 1, where neither works);
  - fio: 4 KiB random reads, O_DIRECT, the same total outstanding I/O as the store: --numjobs=T --iodepth=QD with
    the store's engine (io_uring, libaio; psync with iodepth 1 when the store is on its pread path);
  - plain Python: a ThreadPoolExecutor of T threads doing os.preadv of the same aligned blocks (O_DIRECT fd), i.e.
    T reads outstanding: what a straightforward Python implementation gets.
Targets (issue 5): twinspark >= 70% of fio's IOPS, >= 5x plain Python. Also printed: CPU time per row (all
threads of this process; fio's is not counted), which is what is left to compare once the disk is the limit, and
the host and pinned bytes
the configuration costs (on GB10 both come out of the GPU's unified memory).

The file is a synthetic layer (write_synthetic_checkpoint) packed with twinspark.engram.pack, written under
--dir (default /tmp) and deleted at the end, also on failure. O_DIRECT keeps the page cache out; a hypervisor's
own cache below a virtual disk (if any) serves fio and the store alike.

    python bench/bench_engram_store.py [--gib 6] [--threads 1,8,32,96] [--queue-depth 32] [--seconds 3]
    python bench/bench_engram_store.py --decode-step    # V4.1's decode-step lookups in a CUDA graph (decode_step)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import mmap
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import benchkit as bk
import numpy as np
import torch
from twinspark.engram import EngramStore, pack, staging_pinned_bytes, synthetic_head_sizes
from twinspark.engram.pack import HEADER_BYTES
from twinspark.engram.source import RECORD_BYTES
from twinspark.engram.synth import write_synthetic_checkpoint

ALIGN = 4096


def make_pack_file(root: Path, gib: float) -> tuple[Path, int]:
    rows = int(gib * 2**30 / RECORD_BYTES)
    t0 = time.perf_counter()
    layout = write_synthetic_checkpoint(root / "ckpt", {1: synthetic_head_sizes(rows)}, seed=1)
    t1 = time.perf_counter()
    result = pack(root / "ckpt", root / "pack", layout, 0, 1, layers=[1])[0]
    t2 = time.perf_counter()
    shutil.rmtree(root / "ckpt")  # only the pack file is measured; free the disk
    size = result.path.stat().st_size
    print(f"file: {result.path} {size / 2**30:.2f} GiB, {result.header.rows:,} rows "
          f"(generated in {t1 - t0:.1f} s, packed in {t2 - t1:.1f} s = {size / (t2 - t1) / 1e9:.2f} GB/s)")
    return result.path, result.header.rows


FIO_ENGINES = {"io_uring": "io_uring", "aio": "libaio", "pread": "psync"}


def run_fio(path: Path, threads: int, depth: int, io_path: str, seconds: float) -> float | None:
    """fio 4k random reads with threads x depth outstanding, through the engine the store uses."""
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=engram", f"--filename={path}", "--readonly", "--rw=randread", "--bs=4k", "--direct=1",
           f"--ioengine={FIO_ENGINES[io_path]}", f"--iodepth={depth}", f"--numjobs={threads}", "--thread",
           "--group_reporting", "--time_based",
           f"--runtime={seconds}", "--randrepeat=0", "--norandommap", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, check=True).stdout
    return float(json.loads(out[out.index("{"):])["jobs"][0]["read"]["iops"])


def run_store(path: Path, rows: int, threads: int, seconds: float, io_mode: str = "auto", queue_depth: int = 32,
              io_engine: str = "auto") -> tuple[float, float, EngramStore]:
    store = EngramStore.from_pack(path, threads=threads, cache_gib=0.0, io_mode=io_mode, queue_depth=queue_depth,
                                  io_engine=io_engine)
    if not store.direct and io_mode == "auto":
        store.drop_page_cache()
    batch = max(1024, threads * max(64, 2 * store.queue_depth))  # two batches pending keep every queue full
    rng = np.random.default_rng(threads)
    pending, done = [], 0
    c0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        while len(pending) < 2:  # keep the pool busy while the previous batch is collected
            pending.append(store.lookup_async(torch.from_numpy(rng.integers(0, rows, batch, dtype=np.int64))))
        pending.pop(0).wait()
        done += batch
    for p in pending:
        p.wait()
        done += batch
    return done / (time.perf_counter() - t0), (time.process_time() - c0) * 1e6 / done, store


def run_python(path: Path, rows: int, threads: int, seconds: float, direct: bool = True) -> tuple[float, float]:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
    rng = np.random.default_rng(1000 + threads)
    chunk = 64

    def work(ids: np.ndarray) -> int:
        buf = mmap.mmap(-1, 2 * ALIGN)  # page-aligned, as O_DIRECT needs
        out = np.empty((len(ids), RECORD_BYTES), np.uint8)
        for i, r in enumerate(ids.tolist()):
            off = HEADER_BYTES + r * RECORD_BYTES
            start = off - off % ALIGN
            length = ALIGN if off % ALIGN + RECORD_BYTES <= ALIGN else 2 * ALIGN
            os.preadv(fd, [memoryview(buf)[:length]], start)
            out[i] = np.frombuffer(buf, np.uint8, RECORD_BYTES, off - start)
        return len(ids)

    done = 0
    try:
        with cf.ThreadPoolExecutor(threads) as pool:
            c0, t0 = time.process_time(), time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                ids = rng.integers(0, rows, max(1024, threads * chunk))
                done += sum(pool.map(work, np.array_split(ids, max(1, len(ids) // chunk))))
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        os.close(fd)
    return done / elapsed, cpu * 1e6 / done


def decode_step(root: Path, gib: float, tokens: tuple[int, ...], iters: int = 200) -> list[bk.Record]:
    """DeepSeek V4.1's Engram lookups of one decode step on one rank of TP 2, the way the vLLM plugin runs them
    (vllm_plugin/engram.py: StoreEngramEmbedding.lookup on a GPU): 2 Engram layers, 12 hash heads per rank, T
    tokens -> 12*T rows per layer from that layer's pack file (O_DIRECT, cache off), fetched and dequantized to
    bf16 by EngramStaging.fetch, both layers captured in one CUDA graph. Each replay gets fresh random ids (copied
    into the graph's id buffers before it); the first replay's rows are checked against the file read directly.
    Prints µs per step (median over `iters` replays, CUDA events) and the host memory the tables cost."""
    from twinspark.engram.source import SCALE_BYTES, WEIGHT_BYTES
    from twinspark.reference.engram_dequant import engram_dequant

    heads, out = 12, []
    files = []
    for layer in (1, 14):
        path, rows = make_pack_file(root / f"layer{layer}", gib)
        files.append((path, rows))
    for T in tokens:
        n = heads * T
        stores = [EngramStore.from_pack(p, threads=16, queue_depth=32) for p, _ in files]
        stagings = [st.staging(n) for st in stores]
        ids = [torch.zeros(n, dtype=torch.int64, device="cuda") for _ in stores]
        outs = [torch.empty(n, WEIGHT_BYTES, dtype=torch.bfloat16, device="cuda") for _ in stores]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for sg, i, o in zip(stagings, ids, outs):  # warm-up outside capture on the capture stream
                sg.fetch(i, out=o)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for sg, i, o in zip(stagings, ids, outs):
                    sg.fetch(i, out=o)
        gen = torch.Generator().manual_seed(T)
        times = []
        for it in range(iters + 5):
            host = [torch.randint(0, r, (n,), generator=gen) for _, r in files]
            for i, h in zip(ids, host):
                i.copy_(h)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if it >= 5:
                times.append(start.elapsed_time(end) * 1e3)
            if it == 0:
                for (path, _), h, o in zip(files, host, outs):
                    table = np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES)
                    raw = table.reshape(-1, RECORD_BYTES)[h.numpy()]
                    w = torch.from_numpy(raw[:, :WEIGHT_BYTES].copy()).view(torch.float8_e4m3fn)
                    sc = torch.from_numpy(raw[:, WEIGHT_BYTES:WEIGHT_BYTES + SCALE_BYTES].copy())
                    assert torch.equal(o.cpu(), engram_dequant(w, sc)), f"rows of {path} differ from the file"
        for sg in stagings:
            sg.check()
        med = float(np.median(times))
        host_b = sum(st.host_bytes for st in stores)
        pinned = sum(st.pinned_bytes for st in stores)
        print(f"decode step T={T}: 2 layers x {n} rows (12 heads x {T} tokens) in one CUDA graph: {med:.1f} µs "
              f"median over {iters} replays (min {min(times):.1f}); rows equal the file's; host memory "
              f"{host_b / 2**20:.2f} MiB (I/O buffers, cache off) + {pinned / 2**10:.1f} KiB pinned staging")
        out.append(bk.Record(op="engram_store", shape={"tokens": T, "rows": 2 * n, "layers": 2}, median_us=med,
                             bytes=2 * n * RECORD_BYTES, variant="decode-step-graph",
                             notes=f"host {host_b} B + pinned {pinned} B; {stores[0].io_path}"))
        del graph, stagings, stores
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=6.0, help="size of the pack file to read (GiB)")
    ap.add_argument("--threads", default="1,8,32,96", help="comma-separated thread counts (= fio numjobs)")
    ap.add_argument("--queue-depth", type=int, default=32, help="store rows in flight per thread (= fio iodepth)")
    ap.add_argument("--engine", default="auto", choices=["auto", "io_uring", "aio", "pread"],
                    help="store read path (fio follows it)")
    ap.add_argument("--seconds", type=float, default=3.0, help="measuring time per method and thread count")
    ap.add_argument("--dir", default="/tmp", help="where the temporary file goes (deleted afterwards)")
    ap.add_argument("--decode-step", action="store_true",
                    help="only the V4.1 decode step's lookups in a CUDA graph (T = 1 and 4; needs a GPU); its "
                         "records replace the decode-step records of engram_store.json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.decode_step:
        root = Path(tempfile.mkdtemp(prefix="twinspark-engram-decode-", dir=args.dir))
        try:
            new = decode_step(root, min(args.gib, 2.0), (1, 4))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        old = bk.default_out_dir() / "engram_store.json"
        kept = [r for r in bk.load_results(old)["records"] if r.variant != "decode-step-graph"] \
            if old.exists() else []
        bk.write_results("engram_store", kept + new)
        return

    root = Path(tempfile.mkdtemp(prefix="twinspark-engram-bench-", dir=args.dir))
    records, lines = [], []
    try:
        path, rows = make_pack_file(root, args.gib)
        probe = EngramStore.from_pack(path, threads=1, queue_depth=args.queue_depth, io_engine=args.engine)
        io_path, depth = probe.io_path, probe.queue_depth
        print(f"store read path: {io_path}, queue depth {depth} per thread, O_DIRECT "
              f"{'yes' if probe.direct else 'no'}" + (f" ({probe.io_note})" if probe.io_note else "")
              + f"; fio: --ioengine={FIO_ENGINES[io_path]} --iodepth={depth} --numjobs=T")
        del probe
        for t in threads:
            fio = run_fio(path, t, depth, io_path, args.seconds)
            ours, ours_cpu, store = run_store(path, rows, t, args.seconds, queue_depth=args.queue_depth,
                                              io_engine=args.engine)
            py, py_cpu = run_python(path, rows, t, args.seconds)
            lines.append((t, fio, ours, py, ours_cpu, py_cpu, store.io_path, store.queue_depth, store.host_bytes))
            for variant, rate in (("twinspark", ours), ("fio-4k", fio), ("python-preadv", py)):
                if rate:
                    qd, how = (1, "preadv pool") if variant == "python-preadv" else (store.queue_depth, store.io_path)
                    records.append(bk.Record(op="engram_store", shape={"threads": t, "queue_depth": qd, "rows": 1},
                                             median_us=1e6 / rate, bytes=ALIGN, variant=variant,
                                             notes=f"{rate:,.0f} rows/s (IOPS), {how}"))
            del store
        # Software ceiling: the first GiB of rows read once into the page cache, then buffered lookups of them, so
        # the disk is out of the picture and only the per-row cost of each method is left.
        warm_rows = min(rows, 2**30 // RECORD_BYTES)
        with open(path, "rb") as f:
            while f.tell() < HEADER_BYTES + warm_rows * RECORD_BYTES and f.read(64 << 20):
                pass
        tw = max(threads)
        warm = run_store(path, warm_rows, tw, args.seconds, io_mode="buffered")[:2], run_python(
            path, warm_rows, tw, args.seconds, direct=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"{'threads':>7} {'in flight':>9} {'fio 4k IOPS':>12} {'store rows/s':>13} {'% fio':>6} "
          f"{'python rows/s':>14} {'x python':>9} {'CPU µs/row store':>17} {'python':>7} {'path':>8} "
          f"{'host bytes':>11}")
    for t, fio, ours, py, ours_cpu, py_cpu, path_t, qd, host in lines:
        pct = f"{100 * ours / fio:5.0f}%" if fio else "  n/a"
        print(f"{t:>7} {t * qd:>9} {fio or float('nan'):>12,.0f} {ours:>13,.0f} {pct:>6} {py:>14,.0f} "
              f"{ours / py:>9.1f} {ours_cpu:>17.1f} {py_cpu:>7.1f} {path_t:>8} {host:>11,}")
    print("in flight: store and fio reads outstanding (threads x queue depth); the Python pool has `threads`")
    (ws, ws_cpu), (wp, wp_cpu) = warm
    print(f"page-cache-warm (1 GiB of rows, buffered, {tw} threads): store {ws:,.0f} rows/s "
          f"({ws_cpu:.1f} CPU µs/row), python {wp:,.0f} rows/s ({wp_cpu:.1f} CPU µs/row): {ws / wp:.1f}x")
    if shutil.which("fio") is None:
        print("fio is not installed (scripts/host-deps.sh installs it): no fio column")
    cap = 8192 * 24  # one 8k-token prefill chunk: 24 hash heads -> 24 rows per token per layer
    print(f"pinned staging: {staging_pinned_bytes(1):,} bytes per row of capacity; {cap:,} rows (8k-token chunk, "
          f"one layer) = {staging_pinned_bytes(cap) / 2**20:.1f} MiB per stream; host: 8,192 bytes of I/O buffer per "
          "thread and per row in flight + the RAM cache (cache_gib, off here)")
    bk.write_results("engram_store", records, machine={**bk.machine_info(), "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
