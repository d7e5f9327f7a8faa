"""Measure where the one-shot transport stops beating torch.distributed and save it in the crossover table.

    torchrun --nproc-per-node 2 -m twinspark.allreduce.tune --transport ipc          # 2 GPUs of one host
    python -m twinspark.allreduce.tune --spawn 2 --transport host --device cpu      # 2 local processes
    (two Sparks: run under torchrun with --nnodes 2 and --transport host; the backend comes from the config)

Every rank times both transports per size (bf16, median of --iters samples of --per back-to-back calls; CUDA
events on a GPU, wall clock on the CPU). Rank 0 takes the largest size up to which the one-shot transport was
never slower, and writes it as the entry (transport, world, device) of the config (temp file, then rename).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import statistics
import sys
import time

import torch

from twinspark.ports import free_port

DEFAULT_SIZES = [2 << 10, 8 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]


def _time(fn, device, iters: int, per: int, barrier) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(per):
                fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3 / per)
        else:
            t0 = time.perf_counter()
            for _ in range(per):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / per)
    return statistics.median(samples)


def crossover(rows: list[tuple[int, float, float]]) -> int:
    """Largest size s such that the one-shot time <= the fallback's for every measured size <= s (0: never)."""
    best = 0
    for size, fast_us, slow_us in sorted(rows):
        if fast_us > slow_us:
            break
        best = size
    return best


def run(args) -> int:
    import torch.distributed as dist

    from twinspark.allreduce.communicator import create
    from twinspark.allreduce.config import AllreduceConfig, Crossover

    device = torch.device(args.device) if args.device else (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cpu_group = dist.new_group(backend="gloo")
    cfg = AllreduceConfig.load(args.config)
    cfg.capacity_bytes = max(cfg.capacity_bytes, max(args.sizes))
    comm = create(cpu_group, transport=args.transport, config=cfg, device=device)
    from twinspark.allreduce.nccl import DistTransport

    fallback = DistTransport(None)  # the default group: NCCL on GPUs, gloo on CPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for size in sorted(args.sizes):
        x = torch.randint(-8, 8, (size // 2,), device=device).to(torch.bfloat16)
        fast_us = _time(lambda x=x: comm.fast.allreduce(x), device, args.iters, args.per, lambda: dist.barrier(cpu_group))
        slow_us = _time(lambda x=x: fallback.allreduce(x), device, args.iters, args.per, lambda: dist.barrier(cpu_group))
        rows.append((size, fast_us, slow_us))
        if rank == 0:
            print(f"{size:>9d} B  {comm.fast.name:5s} {fast_us:9.1f} us   torch.distributed {slow_us:9.1f} us", flush=True)
    comm.check()
    # Every rank is past check() before any closes its connection: a peer that hangs up while this rank still checks
    # reads as a failed peer (CI: rank 1 closed while rank 0 printed its last row).
    dist.barrier(cpu_group)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        best = crossover(rows)
        stamp = f"{dt.date.today().isoformat()} {socket.gethostname()} {name}: tune"
        cfg.set_crossover(Crossover(args.transport, world, name, best, stamp))
        if args.dry_run:
            print(f"crossover {best} B (dry run: {cfg.path or 'config'} not written)")
        else:
            print(f"crossover {best} B -> {cfg.save(args.config)}")
    comm.close()
    dist.barrier(cpu_group)
    dist.destroy_process_group()
    return 0


def _spawned(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    run(_parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="measure and save the all-reduce crossover size")
    p.add_argument("--transport", choices=("ipc", "host"), default="ipc", help="the one-shot transport to tune")
    p.add_argument("--device", default="", help="cpu or cuda:N (default: cuda:$LOCAL_RANK when a GPU exists)")
    p.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="message sizes in bytes")
    p.add_argument("--iters", type=int, default=7, help="samples per size (median)")
    p.add_argument("--per", type=int, default=20, help="back-to-back calls per sample")
    p.add_argument("--config", default=None, help="config file to update (default: configs/allreduce.json)")
    p.add_argument("--spawn", type=int, default=0, help="start this many local ranks instead of using torchrun")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.spawn:
        import torch.multiprocessing as mp

        port = free_port()
        mp.spawn(_spawned, args=(args.spawn, port, _strip_spawn(argv)), nprocs=args.spawn, join=True)
        return 0
    if "RANK" not in os.environ:
        print("tune: run it under torchrun (RANK/WORLD_SIZE unset), or pass --spawn N for N local ranks",
              file=sys.stderr)
        return 2
    return run(args)


def _strip_spawn(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--spawn":
            skip = True
            continue
        if a.startswith("--spawn="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
