"""One rank of the multi-process all-reduce check (tests and the GPU machine start one process per rank):

    python -m twinspark.allreduce.selftest --rank R --world W --store HOST:PORT --transport host|ipc \
        --device cpu|cuda:0 --out result-R.json [--address IP] [--never-arrive RANK] [--timeout S]

Every rank joins a gloo group (rank 0 hosts the store), makes a communicator, then, back to back with sizes
that change every call: integer-valued inputs (exact sums) through the one-shot transport compared with
torch.distributed.all_reduce (gloo on CPU copies); random fp inputs compared bit for bit with the reference over
all_gather'ed parts; calls through ``twinspark.ops.allreduce`` on both sides of the crossover. The result file
holds a digest per call, so the caller can check all ranks got identical bits. ``--never-arrive R``: rank R skips
the call, every other rank must get AllreduceTimeout (the file records the message).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from datetime import timedelta

import torch

from twinspark.fileio import atomic_write

SIZES = [1, 17, 33, 4096 + 3, 8192, 65536, 7, 262144, 2, 100_000]  # elements; awkward and changing
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _ints(numel: int, dtype, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    hi = 64 if dtype != torch.float32 else 1 << 20  # sums stay exact in the dtype (bf16: 8 bits of mantissa)
    return torch.randint(-hi, hi, (numel,), generator=g).to(dtype)


def run(args) -> dict:
    import torch.distributed as dist

    from twinspark.allreduce import AllreduceConfig, AllreduceError, create
    from twinspark.allreduce.communicator import Communicator
    from twinspark.ops import allreduce as op_allreduce
    from twinspark.reference.allreduce import allreduce as reference

    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), args.world, is_master=args.rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = AllreduceConfig(timeout_s=args.timeout, capacity_bytes=1 << 21)
    if args.address:
        cfg.host.address = args.address
    cfg.host.backend = "tcp"
    comm = create(None, transport=args.transport, config=cfg, device=device)
    fast = comm.fast
    out = {"rank": args.rank, "transport": fast.name, "backend": getattr(fast, "backend", None),
           "device": str(device), "digests": [], "checks": 0}

    if args.never_arrive is not None:
        x = _ints(1024, torch.float32, args.rank, 0).to(device)
        if args.rank != args.never_arrive:
            t0 = time.monotonic()
            try:
                fast.allreduce(x)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                fast.check()
                out["error"] = "no error raised"
            except AllreduceError as exc:
                out["timeout_message"] = str(exc)
                out["timeout_type"] = type(exc).__name__
            out["waited_s"] = time.monotonic() - t0
        dist.barrier()  # the absent rank stays alive until the others timed out
        return out

    step = 0
    for dname in ("bfloat16", "float16", "float32"):
        dtype = DTYPES[dname]
        for numel in SIZES:
            step += 1
            x = _ints(numel, dtype, args.rank, step).to(device)
            y = fast.allreduce(x)
            want = x.cpu().clone()
            dist.all_reduce(want)  # gloo: exact for these integers
            if not torch.equal(y.cpu(), want):
                raise SystemExit(f"rank {args.rank}: {dname} n={numel}: one-shot differs from gloo all_reduce")
            out["digests"].append(_digest(y))
            out["checks"] += 1
    for numel in (5, 4099, 50_000):  # non-integer values: the kernel must equal the rank-order reference bit for bit
        step += 1
        g = torch.Generator().manual_seed(7 * step + args.rank)
        x = torch.randn(numel, generator=g).to(torch.bfloat16).to(device)
        y = fast.allreduce(x)
        parts = [torch.empty(numel, dtype=torch.bfloat16) for _ in range(args.world)]
        dist.all_gather(parts, x.cpu())
        if not torch.equal(y.cpu(), reference(parts)):
            raise SystemExit(f"rank {args.rank}: random bf16 n={numel}: differs from the rank-order reference")
        out["digests"].append(_digest(y))
        out["checks"] += 1
    # The op, across the crossover: small through the one-shot transport, large through torch.distributed.
    small = Communicator(fast, comm.fallback, crossover_bytes=4096)
    for numel in (1000, 3000):
        step += 1
        x = _ints(numel, torch.float32, args.rank, step).to(device)
        y = op_allreduce(x, small)
        want = x.cpu().clone()
        dist.all_reduce(want)
        if not torch.equal(y.cpu(), want):
            raise SystemExit(f"rank {args.rank}: ops.allreduce n={numel} differs from gloo")
        out["digests"].append(_digest(y))
        out["checks"] += 1
    out["chosen"] = [small.choose(1000 * 4).name, small.choose(3000 * 4).name]
    if device.type == "cuda":
        torch.cuda.synchronize()
    comm.check()
    dist.barrier()
    comm.close()
    dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True, help="this process's rank")
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    p.add_argument("--store", required=True, help="HOST:PORT of the torch.distributed store (rank 0 hosts it)")
    p.add_argument("--transport", default="host", choices=("host", "ipc"), help="one-shot transport to check")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--address", default="", help="this rank's address for the TCP mesh (default: hostname's)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds a rank waits for a peer")
    p.add_argument("--never-arrive", type=int, default=None, help="this rank skips the call (timeout check)")
    p.add_argument("--out", required=True, help="result JSON file")
    args = p.parse_args(argv)
    try:
        res = run(args)
    except SystemExit as exc:
        res = {"rank": args.rank, "error": str(exc)}
    atomic_write(args.out, json.dumps(res))
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
