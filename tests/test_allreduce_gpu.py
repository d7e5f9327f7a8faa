"""All-reduce kernel tests (marker gpu). The reference part of each test (inputs, the rank-order reference, checked
against float64 sums) runs everywhere; the kernel part skips with a reason without a CUDA GPU. The timeout and
two-process tests have no reference part: they skip before starting (the cuda fixture).

On one GPU: virtual ranks (one communicator per rank in this process, each rank's call on its own stream) over the
peer-flag ("ipc") mode and over the host-memory path (loopback and TCP backends); CUDA-graph capture and replay;
a peer that never launches -> AllreduceTimeout; and two processes sharing the GPU over real CUDA IPC, under MPS
when the MPS daemon starts here, and without it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
from twinspark.allreduce import AllreduceTimeout
from twinspark.ports import free_port
from twinspark.reference.allreduce import allreduce as reference
from twinspark.testing import need_cuda

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SIZES = [1, 17, 33, 8 * 1024, 4096 + 3, 100_000, 2, 65536 + 8, 5]  # elements, changing call to call


# Significant bits of each dtype and its smallest subnormal: the reference's rounding of a float64 sum to it.
_BITS = {torch.bfloat16: (8, 2.0**-133), torch.float16: (11, 2.0**-24), torch.float32: (24, 2.0**-149)}


def _calls(world, gen, integer=True):
    """[(dtype, [input per rank], expected)] with the expected sum from the rank-order reference, checked against a
    float64 sum: exact for integer-valued inputs; else within the fp32 additions' error ((world - 1) 2^-24 sum |x|)
    plus one rounding to the dtype (2^-p relative, or half its smallest subnormal)."""
    out = []
    for dtype in DTYPES:
        for n in SIZES:
            if integer:
                hi = 64 if dtype != torch.float32 else 1 << 20
                xs = [torch.randint(-hi, hi, (n,), generator=gen).to(dtype) for _ in range(world)]
            else:
                xs = [torch.randn(n, generator=gen).to(dtype) for _ in range(world)]
            want = reference(xs)
            exact = sum(x.double() for x in xs)
            if integer:
                assert torch.equal(want.double(), exact)
            else:
                p, tiny = _BITS[dtype]
                bound = 2 * (world - 1) * 2.0**-24 * sum(x.double().abs() for x in xs) + 2.0**-p * exact.abs() + tiny
                assert want.dtype == dtype and bool(((want.double() - exact).abs() <= bound).all()), dtype
            out.append((dtype, xs, want))
    return out


def _group(kind, world, dev, capacity=1 << 21, timeout_s=10.0):
    from twinspark.allreduce.hostmem import HostTransport
    from twinspark.allreduce.ipc import IpcTransport
    from twinspark.allreduce.rendezvous import listen, tcp_mesh

    if kind == "ipc":
        return IpcTransport.local_group(world, capacity, dev, timeout_s=timeout_s)
    if kind == "host-loopback":
        return HostTransport.loopback_group(world, capacity, dev, timeout_s=timeout_s)
    servers = [listen("127.0.0.1") for _ in range(world)]
    addrs = [s.getsockname()[:2] for s in servers]
    socks = [None] * world

    def mesh(r):
        socks[r] = tcp_mesh(r, world, servers[r], addrs, 10.0)

    th = [threading.Thread(target=mesh, args=(r,)) for r in range(world)]
    [t.start() for t in th]
    [t.join(30) for t in th]
    for s in servers:
        s.close()
    return [HostTransport.connect(r, world, socks[r], capacity, dev, backend="tcp", timeout_s=timeout_s)
            for r in range(world)]


def _run_virtual(ts, inputs_per_call, dev):
    """Every call back to back, rank r's calls on stream r, no host sync in between; outputs by [call][rank]."""
    world = len(ts)
    streams = [torch.cuda.Stream(dev) for _ in range(world)]
    dev_inputs = [[x.to(dev) for x in xs] for xs in inputs_per_call]
    cur = torch.cuda.current_stream(dev)
    for s in streams:
        s.wait_stream(cur)
    outs = []
    for xs in dev_inputs:
        row = []
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                row.append(ts[r].allreduce(xs[r]))
        outs.append(row)
    torch.cuda.synchronize(dev)
    for t in ts:
        t.check()
    return outs


@pytest.mark.parametrize("kind,world", [("ipc", 2), ("ipc", 4), ("host-loopback", 2), ("host-tcp", 2),
                                        ("host-loopback", 3)])
@pytest.mark.parametrize("integer", [True, False], ids=["int-valued", "random"])
def test_virtual_ranks_exact_identical(kind, world, integer, gen):
    calls = _calls(world, gen, integer)
    dev = need_cuda()
    ts = _group(kind, world, dev)
    try:
        outs = _run_virtual(ts, [xs for _, xs, _ in calls], dev)
        for i, (dtype, _, want) in enumerate(calls):
            for r in range(world):
                got = outs[i][r].cpu()
                assert got.dtype == dtype and got.shape == want.shape
                assert torch.equal(got, want), f"{kind} call {i} ({dtype}, n={want.numel()}) rank {r} != reference"
    finally:
        for t in ts:
            t.close()


@pytest.mark.parametrize("kind", ["ipc", "host-loopback"])
def test_cuda_graph_capture_and_replay(kind, gen):
    world, n = 2, 5120 * 3  # a decode step's hidden state for 3 tokens, bf16
    rounds = [[torch.randint(-64, 64, (n,), generator=gen).to(torch.bfloat16) for _ in range(world)]
              for _ in range(4)]
    wants = [reference(xs) for xs in rounds]
    assert all(torch.equal(w.double(), sum(x.double() for x in xs)) for w, xs in zip(wants, rounds))  # exact: integers
    dev = need_cuda()
    ts = _group(kind, world, dev)
    try:
        static_in = [torch.zeros(n, dtype=torch.bfloat16, device=dev) for _ in range(world)]
        streams = [torch.cuda.Stream(dev) for _ in range(world)]
        graphs, static_out = [], []
        for r in range(world):  # buffers were registered when the group was made, before capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=streams[r]):
                static_out.append(ts[r].allreduce(static_in[r]))
            graphs.append(g)
        for xs, want in zip(rounds, wants):
            for r in range(world):
                with torch.cuda.stream(streams[r]):
                    static_in[r].copy_(xs[r])
                    graphs[r].replay()  # fresh epoch from device memory on every replay
            torch.cuda.synchronize(dev)
            for r in range(world):
                ts[r].check()
                assert torch.equal(static_out[r].cpu(), want)
    finally:
        torch.cuda.synchronize()
        for t in ts:
            t.close()


@pytest.mark.parametrize("kind", ["ipc", "host-loopback"])
def test_peer_that_never_launches_times_out(kind, cuda):
    x = torch.ones(4096, dtype=torch.bfloat16)
    dev = cuda
    ts = _group(kind, 2, dev, timeout_s=0.2)
    try:
        ts[0].allreduce(x.to(dev))  # rank 1 never calls: the kernel must give up, not hang
        torch.cuda.synchronize(dev)
        with pytest.raises(AllreduceTimeout, match="rank 0 waited 0.2 s in call 1 for rank 1, which never arrived"):
            ts[0].check()
        with pytest.raises(AllreduceTimeout):
            ts[0].allreduce(x.to(dev))  # the failure sticks
    finally:
        for t in ts:
            t.close()


# ------------------------------------------------------------------ two processes, one GPU, real CUDA IPC
class _Mps:
    """An MPS control daemon with private pipe/log folders; stopped (quit, then by PID) on close."""

    def __init__(self, root):
        self.env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(root / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(root / "log"))
        (root / "pipe").mkdir()
        (root / "log").mkdir()
        self.root = root

    def start(self) -> str | None:
        exe = shutil.which("nvidia-cuda-mps-control")
        if not exe:
            return "nvidia-cuda-mps-control is not installed here"
        r = subprocess.run([exe, "-d"], env=self.env, capture_output=True, text=True, timeout=30)
        if r.returncode:
            return f"the MPS daemon did not start: {(r.stderr or r.stdout).strip()[:300]}"
        probe = subprocess.run([sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); "
                                "torch.cuda.synchronize()"], env=self.env, capture_output=True, text=True, timeout=120)
        if probe.returncode:
            return f"a CUDA client could not run under MPS: {probe.stderr.strip()[-300:]}"
        return None

    def close(self) -> None:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe:
            subprocess.run([exe], input="quit\n", env=self.env, capture_output=True, text=True, timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("mps,gpus", [(True, 1), (False, 1), (False, 2)], ids=["mps", "no-mps", "two-gpus"])
def test_two_processes_over_ipc(mps, gpus, tmp_path, cuda):
    """Two ranks over real CUDA IPC: both on one GPU (with and without MPS), or one GPU each when two exist."""
    dev = cuda
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
    devices = [f"cuda:{r}" for r in range(2)] if gpus == 2 else [f"cuda:{dev.index or 0}"] * 2
    env = dict(os.environ)
    daemon = None
    try:
        if mps:
            daemon = _Mps(tmp_path)
            why = daemon.start()
            if why:
                pytest.skip(f"MPS did not work here ({why}); the no-mps case covers two processes")
            env = daemon.env
        store = f"127.0.0.1:{free_port()}"
        procs = []
        for r in range(2):
            cmd = [sys.executable, "-m", "twinspark.allreduce.selftest", "--rank", str(r), "--world", "2",
                   "--store", store, "--transport", "ipc", "--device", devices[r],
                   "--timeout", "30", "--out", str(tmp_path / f"rank{r}.json")]
            procs.append(subprocess.Popen(cmd, env=env, stdout=open(tmp_path / f"rank{r}.log", "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        try:
            for p in procs:
                p.wait(timeout=300)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        logs = "".join((tmp_path / f"rank{r}.log").read_text() for r in range(2))
        if "allreduce_ipc" in logs and "not supported" in logs:
            pytest.skip(f"CUDA IPC is not supported on this machine: {logs.strip().splitlines()[-1][:300]}")
        results = []
        for r in range(2):
            f = tmp_path / f"rank{r}.json"
            assert f.exists(), (tmp_path / f"rank{r}.log").read_text()[-3000:]
            results.append(json.loads(f.read_text()))
        for r, res in enumerate(results):
            assert "error" not in res, f"rank {r}: {res['error']}"
            assert res["transport"] == "ipc" and res["checks"] == 35
        assert results[0]["digests"] == results[1]["digests"], "ranks got different bits"
    finally:
        if daemon is not None:
            daemon.close()
