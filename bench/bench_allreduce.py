"""All-reduce latency, bf16, 2 ranks, 2 KB .. 2 MB (issue 6). Median µs per call.

GPU part (CUDA events via benchkit.time_cuda, calls queued back to back): two virtual ranks on one GPU,
each call = both ranks' kernels on their own streams; transports: one-shot over "ipc" (peer-flag mode; on one GPU
the "peer" buffer is the same GPU's memory; target <= 12 µs at 16 KB), the host-memory path with the loopback
backend (pinned buffers + proxy copy; target <= 40 µs at 16 KB) and with the TCP backend over localhost (report).
CPU part (wall clock, perf_counter; runs anywhere): the host-memory path with the TCP backend between two
processes, the PyTorch reference doing the sum, next to gloo's all_reduce over the same pair.

    python bench/bench_allreduce.py            # GPU part when a GPU is visible, CPU part always
    python bench/bench_allreduce.py --cpu      # CPU part only
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import benchkit as bk
import torch

SIZES = [2 << 10, 8 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
TARGET_US = {("ipc", 16 << 10): 12.0, ("host-loopback", 16 << 10): 40.0}
CAPACITY = 2 << 20


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


# ------------------------------------------------------------------------------------------------ GPU part
def _virtual_pair(kind: str, dev):
    from twinspark.allreduce.hostmem import HostTransport
    from twinspark.allreduce.ipc import IpcTransport
    from twinspark.allreduce.rendezvous import listen, tcp_mesh

    if kind == "ipc":
        return IpcTransport.local_group(2, CAPACITY, dev, timeout_s=10.0)
    if kind == "host-loopback":
        return HostTransport.loopback_group(2, CAPACITY, dev, timeout_s=10.0)
    servers = [listen("127.0.0.1") for _ in range(2)]
    addrs = [s.getsockname()[:2] for s in servers]
    import threading

    socks = [None, None]

    def mesh(r):
        socks[r] = tcp_mesh(r, 2, servers[r], addrs, 10.0)

    th = [threading.Thread(target=mesh, args=(r,)) for r in range(2)]
    [t.start() for t in th]
    [t.join() for t in th]
    for s in servers:
        s.close()
    return [HostTransport.connect(r, 2, socks[r], CAPACITY, dev, backend="tcp", timeout_s=10.0) for r in range(2)]


def gpu_records() -> list[bk.Record]:
    dev = torch.device("cuda")
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    records = []
    for kind in ("ipc", "host-loopback", "host-tcp"):
        ts = _virtual_pair(kind, dev)
        try:
            for nbytes in SIZES:
                n = nbytes // 2
                xs = [torch.randint(-8, 8, (n,), device=dev).to(torch.bfloat16) for _ in range(2)]

                def call(ts=ts, xs=xs):
                    cur = torch.cuda.current_stream()
                    for r in range(2):
                        streams[r].wait_stream(cur)
                        with torch.cuda.stream(streams[r]):
                            ts[r].allreduce(xs[r])
                    for r in range(2):
                        cur.wait_stream(streams[r])

                call()
                torch.cuda.synchronize()
                for t in ts:
                    t.check()
                timing = bk.time_cuda(call, warmup=5, iters=7)
                for t in ts:
                    t.check()
                target = TARGET_US.get((kind, nbytes))
                records.append(bk.Record(
                    op="allreduce", shape={"bytes": nbytes, "world": 2}, timing=timing, bytes=2 * nbytes,
                    variant=f"{kind}-virtual-ranks",
                    notes=f"target <= {target} us" if target else ""))
                print(f"{kind:14s} {_label(nbytes):>6s}  {timing.median_us:9.1f} us"
                      + (f"   (target <= {target} us)" if target else ""), flush=True)
        finally:
            torch.cuda.synchronize()
            for t in ts:
                t.close()
    return records


# ------------------------------------------------------------------------------------------------ CPU part
def _cpu_rank(rank: int, ports: list[int], store_port: int, iters: int, per: int, q) -> None:
    import torch.distributed as dist
    from twinspark.allreduce.hostmem import HostTransport
    from twinspark.allreduce.rendezvous import listen, tcp_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank, world_size=2)
    server = listen("127.0.0.1", ports[rank])
    socks = tcp_mesh(rank, 2, server, [("127.0.0.1", p) for p in ports], 30.0)
    server.close()
    t = HostTransport.connect(rank, 2, socks, CAPACITY, "cpu", backend="tcp", timeout_s=30.0)
    out = {}
    for nbytes in SIZES:
        x = torch.randint(-8, 8, (nbytes // 2,)).to(torch.bfloat16)
        for name, fn in (("host-tcp", lambda x=x: t.allreduce(x)), ("gloo", lambda x=x: dist.all_reduce(x.clone()))):
            for _ in range(5):
                fn()
            samples = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(per):
                    fn()
                samples.append((time.perf_counter() - t0) * 1e6 / per)
            out[name, nbytes] = samples
    t.close()
    dist.destroy_process_group()
    if rank == 0:
        q.put(out)


def _free_ports(k: int) -> list[int]:
    socks = [socket.socket() for _ in range(k)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def cpu_records(iters: int = 7, per: int = 20) -> list[bk.Record]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    *ports, store_port = _free_ports(3)
    procs = [ctx.Process(target=_cpu_rank, args=(r, ports, store_port, iters, per, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = q.get(timeout=600)
    for p in procs:
        p.join(60)
    records = []
    for (name, nbytes), samples in out.items():
        timing = bk.Timing(tuple(samples))
        records.append(bk.Record(
            op="allreduce", shape={"bytes": nbytes, "world": 2}, timing=timing, bytes=2 * nbytes,
            variant=f"{name}-cpu-2proc",
            notes=f"wall clock on the CPU ({os.cpu_count()} cores), reference sum, 2 processes on one host"))
        print(f"cpu {name:9s} {_label(nbytes):>6s}  {statistics.median(samples):9.1f} us", flush=True)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="all-reduce latency, bf16, 2 ranks")
    ap.add_argument("--cpu", action="store_true", help="only the CPU part (TCP between two processes)")
    args = ap.parse_args(argv)
    records = []
    if not args.cpu and torch.cuda.is_available():
        records += gpu_records()
    elif not args.cpu:
        print("no CUDA GPU visible: GPU part skipped, CPU part only", flush=True)
    records += cpu_records()
    path = bk.write_results("allreduce", records)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
