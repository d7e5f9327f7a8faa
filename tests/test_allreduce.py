"""All-reduce, the parts that run on any machine: the rank-order reference, the host-memory transport with its
real C++ proxy thread (loopback and TCP backends; ranks as threads of this process, the reference standing in
for the kernel), timeouts, peer failures, the RDMA backend's "no device" answer, and the config file.
Multi-process and two-host runs: test_allreduce_dist.py; kernel parts: test_allreduce_gpu.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from twinspark import _ext
from twinspark.allreduce import (
    AllreduceConfig,
    AllreduceError,
    AllreduceTimeout,
    ConfigError,
    Crossover,
    PeerFailed,
)
from twinspark.allreduce.communicator import Communicator
from twinspark.allreduce.hostmem import HostTransport
from twinspark.allreduce.rendezvous import listen, tcp_mesh
from twinspark.reference.allreduce import allreduce as reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SIZES = [1, 17, 33, 4096 + 3, 65536, 2, 70_000, 5]  # elements, changing call to call


def _fp32_rank_order(parts):
    acc = parts[0].float().clone()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


def test_reference_is_fp32_rank_order_sum(gen):
    parts = [torch.randn(1000, generator=gen).to(torch.bfloat16) for _ in range(3)]
    got = reference(parts)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _fp32_rank_order(parts).to(torch.bfloat16))  # one rounding, at the end
    # Rank order matters in fp32: the reference must not silently reorder.
    a, b, c = torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])
    assert reference([a, b, c]).item() == 1.0 and reference([a, c, b]).item() == 0.0


def test_reference_rejects_mismatched_parts():
    with pytest.raises(ValueError, match="part 1"):
        reference([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        reference([torch.zeros(3, dtype=torch.int32)])


def _run_ranks(transports, fn, timeout=60.0):
    """fn(rank, transport) on one thread per rank (a rank's call waits for the others); results by rank."""
    results, errors = [None] * len(transports), [None] * len(transports)

    def body(r):
        try:
            results[r] = fn(r, transports[r])
        except BaseException as exc:  # noqa: BLE001  (re-raised below on the main thread)
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(transports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors


def _tcp_group(world, capacity, timeout_s=10.0):
    servers = [listen("127.0.0.1") for _ in range(world)]
    addrs = [s.getsockname()[:2] for s in servers]
    socks, errs = _run_ranks(list(range(world)), lambda r, _: tcp_mesh(r, world, servers[r], addrs, 10.0))
    for s in servers:
        s.close()
    assert not any(errs), errs
    return [HostTransport.connect(r, world, socks[r], capacity, "cpu", backend="tcp", timeout_s=timeout_s)
            for r in range(world)]


@pytest.fixture(params=["loopback", "tcp"])
def backend(request):
    return request.param


def _group(backend, world, capacity=1 << 20, timeout_s=10.0):
    if backend == "loopback":
        return HostTransport.loopback_group(world, capacity, "cpu", timeout_s=timeout_s)
    return _tcp_group(world, capacity, timeout_s)


@pytest.mark.parametrize("world", [2, 3])
def test_host_path_exact_and_identical(backend, world):
    ts = _group(backend, world)
    try:
        assert all(t.backend == backend for t in ts)
        inputs = {}  # (call, rank) -> tensor: integer values, so every sum is exact in every dtype
        calls = [(d, n) for d in DTYPES for n in SIZES]
        for i, (dtype, n) in enumerate(calls):
            g = torch.Generator().manual_seed(i)
            hi = 64 if dtype != torch.float32 else 1 << 20
            for r in range(world):
                inputs[i, r] = torch.randint(-hi, hi, (n,), generator=g).to(dtype)

        def body(r, t):
            return [t.allreduce(inputs[i, r]) for i in range(len(calls))]  # back to back, sizes changing

        outs, errs = _run_ranks(ts, body)
        assert not any(errs), errs
        for i, (dtype, n) in enumerate(calls):
            want = sum(inputs[i, r].double() for r in range(world))
            for r in range(world):
                got = outs[r][i]
                assert got.dtype == dtype and got.shape == (n,)
                assert torch.equal(got.double(), want), f"call {i} ({dtype}, n={n}) rank {r}: wrong sum"
                assert torch.equal(got.view(torch.uint8), outs[0][i].view(torch.uint8)), "ranks differ in bits"
    finally:
        for t in ts:
            t.close()


def test_host_path_matches_reference_bits_on_random_values(gen):
    ts = _group("tcp", 2)
    try:
        xs = [torch.randn(3, 1001, generator=gen).to(torch.bfloat16) for _ in range(2)]
        outs, errs = _run_ranks(ts, lambda r, t: t.allreduce(xs[r]))
        assert not any(errs), errs
        want = reference(xs)
        for o in outs:
            assert o.shape == (3, 1001) and torch.equal(o, want)
    finally:
        for t in ts:
            t.close()


def test_peer_that_never_arrives_times_out_clearly(backend):
    ts = _group(backend, 2, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(AllreduceTimeout, match=r"rank 0 waited 0.3 s in call 1 for rank 1, which never arrived"):
            ts[0].allreduce(torch.ones(100))
        assert 0.25 < time.monotonic() - t0 < 5.0
        with pytest.raises(AllreduceTimeout):  # the communicator stays failed: epochs no longer agree
            ts[0].allreduce(torch.ones(100))
    finally:
        for t in ts:
            t.close()


def test_peer_that_dies_fails_fast_not_at_timeout():
    ts = _tcp_group(2, 1 << 16, timeout_s=30.0)
    try:
        ts[1].close()  # closes rank 1's socket, as a crashed process would
        t0 = time.monotonic()
        with pytest.raises(PeerFailed, match="connection to rank 1 was closed by the peer"):
            ts[0].allreduce(torch.ones(10))
        assert time.monotonic() - t0 < 10.0
    finally:
        ts[0].close()


def test_contract_errors_name_the_argument():
    ts = HostTransport.loopback_group(2, 4096, "cpu", timeout_s=1.0)
    try:
        with pytest.raises(TypeError, match="allreduce: expected x to be float32, float16 or bfloat16, got torch.int32"):
            ts[0].allreduce(torch.zeros(4, dtype=torch.int32))
        with pytest.raises(ValueError, match="expected x to be contiguous"):
            ts[0].allreduce(torch.zeros(8, 8).t())
        with pytest.raises(ValueError, match="more than this communicator's capacity 4096"):
            ts[0].allreduce(torch.zeros(2048))
    finally:
        for t in ts:
            t.close()


def test_rdma_backend_says_why_it_cannot_run_here():
    why = _ext.module().allreduce_rdma_unavailable_reason()
    if not why:
        pytest.skip("this machine has an RDMA device: the backend can run; nothing to refuse")
    assert "rdma" in why.lower() or "libibverbs" in why
    servers = [listen("127.0.0.1") for _ in range(2)]
    addrs = [s.getsockname()[:2] for s in servers]
    socks, _ = _run_ranks([0, 1], lambda r, _: tcp_mesh(r, 2, servers[r], addrs, 10.0))
    with pytest.raises(AllreduceError, match="use backend 'tcp'"):
        HostTransport.connect(0, 2, socks[0], 4096, "cpu", backend="rdma")
    for s in socks[0] + socks[1] + servers:
        if s is not None:
            s.close()


def test_unreachable_peer_is_one_clear_sentence():
    server = listen("127.0.0.1")
    dead = listen("127.0.0.1")
    addr = dead.getsockname()[:2]
    dead.close()  # nothing listens there any more
    with pytest.raises(ConnectionError, match="rank 1 could not connect to rank 0 at 127.0.0.1"):
        tcp_mesh(1, 2, server, [addr, server.getsockname()[:2]], timeout_s=0.5)
    server.close()


def test_communicator_routes_by_size():
    ts = HostTransport.loopback_group(2, 1 << 16, "cpu", timeout_s=5.0)
    try:
        comm = Communicator(ts[0], None, crossover_bytes=1024)
        assert comm.choose(1024) is ts[0]
        assert comm.choose(1 << 16) is ts[0]  # no fallback: the fast path up to its capacity
        other = Communicator(ts[1], ts[0], crossover_bytes=1024)
        assert other.choose(1024) is ts[1] and other.choose(1025) is ts[0]
    finally:
        for t in ts:
            t.close()


def test_config_roundtrip_and_errors(tmp_path):
    cfg = AllreduceConfig()
    cfg.set_crossover(Crossover("ipc", 2, "NVIDIA H200", 131072, "test"))
    cfg.set_crossover(Crossover("ipc", 2, "*", 65536, None))
    path = cfg.save(tmp_path / "allreduce.json")
    back = AllreduceConfig.load(path)
    assert back.crossover_bytes("ipc", 2, "NVIDIA H200") == 131072
    assert back.crossover_bytes("ipc", 2, "NVIDIA GB10") == 65536  # wildcard
    assert back.crossover_bytes("host", 4, "cpu") == 64 * 1024  # no entry: the documented fallback
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid .*fix it or delete it"):
        AllreduceConfig.load(tmp_path / "bad.json")
    (tmp_path / "bad2.json").write_text(json.dumps({"host": {"backend": "carrier-pigeon"}}))
    with pytest.raises(ConfigError, match="host.backend must be 'rdma' or 'tcp'"):
        AllreduceConfig.load(tmp_path / "bad2.json")


def test_shipped_config_is_valid():
    cfg = AllreduceConfig.load()
    assert cfg.path is not None and cfg.path.endswith("configs/allreduce.json")
    assert {c.transport for c in cfg.crossover} >= {"ipc", "host"}


def test_vllm_hook_is_off_unless_enabled(monkeypatch):
    from twinspark.allreduce import vllm_hook

    cfg = AllreduceConfig()
    monkeypatch.delenv("TWINSPARK_ALLREDUCE", raising=False)
    assert not vllm_hook.enabled(cfg)
    assert vllm_hook.install(group_coordinator=object(), config=cfg) is None  # disabled: touches nothing
    monkeypatch.setenv("TWINSPARK_ALLREDUCE", "1")
    assert vllm_hook.enabled(cfg)
    cfg.vllm.enabled = True
    monkeypatch.setenv("TWINSPARK_ALLREDUCE", "0")
    assert not vllm_hook.enabled(cfg)


def test_kernel_plan_validates_and_sizes_the_grid():
    C = _ext.module()
    if not hasattr(C, "AllreducePlan"):
        pytest.skip("CPU-only build of twinspark: no kernel plan to check")
    kw = dict(mode=0, max_blocks=24, timeout_s=1.0, status=0, counters=0, publish=[0, 0], capacity=4096)
    p = C.AllreducePlan(rank=0, world=2, src=[[0, 0]] * 2, post=[0, 0], wait=[0, 0], **kw)
    assert p.grid(8192, 2) == 2  # 16 KB of bf16 = 1024 16-byte vectors: 2 blocks of 512 threads
    assert p.grid(1, 2) == 1 and p.grid(17, 4) == 1
    assert p.grid(1 << 20, 2) == 24  # capped at max_blocks
    with pytest.raises(ValueError, match="rank must be in"):
        C.AllreducePlan(rank=2, world=2, src=[[0, 0]] * 2, post=[0, 0], wait=[0, 0], **kw)
    with pytest.raises(ValueError, match="world must be 1..8"):
        C.AllreducePlan(rank=0, world=9, src=[[0, 0]] * 9, post=[0] * 9, wait=[0] * 9, **kw)
    with pytest.raises(ValueError, match="one entry per rank"):
        C.AllreducePlan(rank=0, world=2, src=[[0, 0]], post=[0, 0], wait=[0, 0], **kw)
