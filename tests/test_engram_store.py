"""twinspark.engram.EngramStore: fetched bytes equal direct file reads (shards and pack files, O_DIRECT and
buffered, cache on and off, every read path: io_uring, Linux AIO, blocking pread), zero rows outside the rank's
range, concurrent lookups, fallback when the asynchronous syscalls are filtered, clear errors; on a GPU the
graph-capturable staging lookup (capture/replay, two streams)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from twinspark.engram import (
    EngramError,
    EngramStore,
    locate,
    pack,
    staging_pinned_bytes,
    write_synthetic_checkpoint,
)
from twinspark.engram.source import RECORD_BYTES
from twinspark.reference.engram_dequant import engram_dequant
from twinspark.testing import need_cuda

ONE_SET_GIB = 8 * (264 + 12) / 2**30  # one 8-way cache set


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A synthetic checkpoint (shards 47/48, index, config) and rank 1-of-2 pack files, in /tmp (ext4 here)."""
    root = tmp_path_factory.mktemp("engram_ckpt")
    layout = write_synthetic_checkpoint(root / "ckpt", seed=7)
    pack(root / "ckpt", root / "pack", layout, 1, 2)
    return root, layout


def table(root: Path, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole layer read straight from the shard with numpy (the ground truth)."""
    t = locate(root / "ckpt", layer)
    w = np.memmap(t.weight.path, np.uint8, "r", offset=t.weight.start, shape=(t.rows, 256))
    s = np.memmap(t.scale.path, np.uint8, "r", offset=t.scale.start, shape=(t.rows, 8))
    return np.asarray(w), np.asarray(s)


def expected(root: Path, layer: int, ids: torch.Tensor, first: int, end: int):
    w, s = table(root, layer)
    ids = ids.long().numpy()
    inside = (ids >= first) & (ids < end)
    ew, es = np.zeros((len(ids), 256), np.uint8), np.zeros((len(ids), 8), np.uint8)
    ew[inside], es[inside] = w[ids[inside]], s[ids[inside]]
    return ew, es


def random_ids(n: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(-1, rows + 3, (n,), generator=gen)
    ids[:3] = torch.tensor([-1, 0, rows - 1])
    return ids


def check(store: EngramStore, root: Path, layer: int, ids: torch.Tensor, first: int, end: int) -> None:
    w, s = store.lookup(ids)
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
    ew, es = expected(root, layer, ids, first, end)
    np.testing.assert_array_equal(w.view(torch.uint8).numpy(), ew)
    np.testing.assert_array_equal(s.numpy(), es)


@pytest.mark.parametrize("source", ["shards", "pack"])
@pytest.mark.parametrize("io_mode", ["direct", "buffered"])
@pytest.mark.parametrize("cache_gib", [0.0, 64 * ONE_SET_GIB, 0.01])  # off, small (evicts), holds everything
def test_fetched_bytes_equal_direct_reads(ckpt, source, io_mode, cache_gib, gen):
    root, layout = ckpt
    layer = 14
    rng = layout.rank_range(layer, 1, 2)
    if source == "shards":
        store = EngramStore.from_checkpoint(root / "ckpt", layer, rng, threads=3, cache_gib=cache_gib,
                                            io_mode=io_mode)
    else:
        store = EngramStore.from_pack(root / "pack" / "engram-layer14-rank1of2.tspack", threads=3,
                                      cache_gib=cache_gib, io_mode=io_mode)
    assert store.direct == (io_mode == "direct")
    if io_mode == "buffered":
        assert (store.io_path, store.queue_depth) == ("pread", 1)
    assert (store.first_row, store.end_row) == (rng.first_row, rng.end_row)
    for _ in range(3):  # repeated lookups hit the cache when it is on
        check(store, root, layer, random_ids(700, layout.rows(layer), gen), rng.first_row, rng.end_row)
    if cache_gib:
        assert store.cache_hits > 0 and store.cache_bytes > 0
    else:
        assert store.cache_hits == 0 and store.cache_bytes == 0


def test_rank_zero_whole_heads_from_shards(ckpt, gen):
    root, layout = ckpt
    rng = layout.rank_range(1, 0, 2)
    assert rng.first_row == 0 and rng.end_head == 12
    store = EngramStore.from_checkpoint(root / "ckpt", 1, rng, threads=2)
    check(store, root, 1, random_ids(500, layout.rows(1), gen), 0, rng.end_row)


def test_int32_ids_async_and_given_buffers(ckpt, gen):
    root, layout = ckpt
    store = EngramStore.from_checkpoint(root / "ckpt", 1, threads=2)
    ids = random_ids(300, layout.rows(1), gen).to(torch.int32)
    w = torch.empty(300, 256, dtype=torch.float8_e4m3fn)
    s = torch.empty(300, 8, dtype=torch.uint8)
    pending = store.lookup_async(ids, w, s)
    got_w, got_s = pending.wait()
    assert got_w is w and got_s is s and pending.ready()
    ew, es = expected(root, 1, ids, 0, layout.rows(1))
    np.testing.assert_array_equal(w.view(torch.uint8).numpy(), ew)
    np.testing.assert_array_equal(s.numpy(), es)
    assert store.lookup(torch.empty(0, dtype=torch.int64))[0].shape == (0, 256)


def test_two_threads_look_up_at_once(ckpt):
    root, layout = ckpt
    store = EngramStore.from_checkpoint(root / "ckpt", 14, threads=4, cache_gib=32 * ONE_SET_GIB)
    errors = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(25):
                check(store, root, 14, random_ids(257, layout.rows(14), g), 0, layout.rows(14))
        except Exception as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


def engine_store(factory, engine: str, **kw) -> EngramStore:
    """A store on an explicit read path; skips (with the store's reason) where this kernel refuses the engine."""
    try:
        return factory(io_engine=engine, **kw)
    except EngramError as exc:
        if "is unavailable here" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.mark.parametrize("engine", ["io_uring", "aio", "pread"])
@pytest.mark.parametrize("source", ["shards", "pack"])
@pytest.mark.parametrize(("queue_depth", "cache_gib"), [(1, 0.0), (5, 0.0), (32, 64 * ONE_SET_GIB)])
def test_every_read_path_returns_the_file_bytes(ckpt, engine, source, queue_depth, cache_gib, gen):
    root, layout = ckpt
    layer = 14
    rng = layout.rank_range(layer, 1, 2)
    if source == "shards":
        def factory(**kw):
            return EngramStore.from_checkpoint(root / "ckpt", layer, rng, **kw)
    else:
        def factory(**kw):
            return EngramStore.from_pack(root / "pack" / "engram-layer14-rank1of2.tspack", **kw)
    store = engine_store(factory, engine, threads=2, queue_depth=queue_depth, cache_gib=cache_gib, io_mode="direct")
    assert store.io_path == engine and store.direct
    assert store.queue_depth == (1 if engine == "pread" else queue_depth)
    for n in (3, 700, 4):
        check(store, root, layer, random_ids(n, layout.rows(layer), gen), rng.first_row, rng.end_row)
    extents = 2 if source == "shards" else 1
    misses = store.cache_misses if cache_gib else None
    if misses is not None:
        assert store.reads == extents * misses


def test_many_batches_in_flight_on_one_thread(ckpt, gen):
    """One worker with 8 rows in flight moves on to the next batch while the previous one's reads are pending:
    every batch still gets exactly its own rows."""
    root, layout = ckpt
    store = EngramStore.from_checkpoint(root / "ckpt", 1, threads=1, queue_depth=8, io_mode="direct")
    batches = [random_ids(int(n), layout.rows(1), gen) for n in torch.randint(3, 40, (60,), generator=gen)]
    pending = [store.lookup_async(ids) for ids in batches]
    for ids, p in zip(batches, pending):
        w, s = p.wait()
        ew, es = expected(root, 1, ids, 0, layout.rows(1))
        np.testing.assert_array_equal(w.view(torch.uint8).numpy(), ew)
        np.testing.assert_array_equal(s.numpy(), es)


def test_auto_prefers_an_asynchronous_path_with_o_direct(ckpt):
    root, _ = ckpt
    store = EngramStore.from_checkpoint(root / "ckpt", 1, threads=2, io_mode="direct")
    if store.io_path == "pread":
        pytest.skip(f"neither io_uring nor Linux AIO works here: {store.io_note}")
    assert store.io_path in ("io_uring", "aio") and store.queue_depth == 32


@pytest.mark.parametrize("engine", ["io_uring", "aio"])
def test_asynchronous_engine_refused_for_buffered_reads(ckpt, engine):
    root, _ = ckpt
    with pytest.raises(EngramError, match=f"io_engine='{engine}' needs O_DIRECT reads but .* is read buffered; "
                                          "use io_engine='auto' or 'pread'"):
        EngramStore.from_checkpoint(root / "ckpt", 1, io_mode="buffered", io_engine=engine)


_SECCOMP_CHECK = """
import ctypes, errno, struct, sys
import numpy as np, torch
from twinspark.engram import EngramError, EngramStore

def forbid(blocked):  # seccomp filter: the given syscalls fail with the given errno, everything else is allowed
    ld, jeq, ret = 0x20, 0x15, 0x06
    m = len(blocked)
    prog = [(ld, 0, 0, 4), (jeq, 0, m + 1, 0xC000003E), (ld, 0, 0, 0)]
    prog += [(jeq, m, 0, nr) for nr, _ in blocked]  # -> the i-th return below
    prog += [(ret, 0, 0, 0x7FFF0000)] + [(ret, 0, 0, 0x00050000 | err) for _, err in blocked]
    code = b"".join(struct.pack("HBBI", *insn) for insn in prog)
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    fp = ctypes.create_string_buffer(fprog)
    assert libc.prctl(22, 2, ctypes.addressof(fp), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER
    forbid.keep = (buf, fp)

path, mode = sys.argv[1], sys.argv[2]
blocked = [(425, errno.EPERM)] + ([(206, errno.ENOSYS)] if mode == "both" else [])  # io_uring_setup, io_setup
forbid(blocked)
store = EngramStore.from_pack(path, threads=2, queue_depth=4, io_mode="direct")
want = "pread" if mode == "both" else "aio"
assert store.io_path == want, (store.io_path, store.io_note)
assert "io_uring_setup failed (Operation not permitted)" in store.io_note, store.io_note
if mode == "both":
    assert "io_setup failed (Function not implemented)" in store.io_note, store.io_note
h = store.header
ids = torch.randint(h.first_row - 5, h.last_row + 5, (500,))
w, s = store.lookup(ids)
raw = np.fromfile(path, np.uint8)[4096:].reshape(-1, 264)
for i, r in enumerate(ids.tolist()):
    row = raw[r - h.first_row] if h.first_row <= r <= h.last_row else np.zeros(264, np.uint8)
    assert (w[i].view(torch.uint8).numpy() == row[:256]).all() and (s[i].numpy() == row[256:]).all(), r
try:
    EngramStore.from_pack(path, io_mode="direct", io_engine="io_uring")
    raise SystemExit("io_engine='io_uring' was not refused under the filter")
except EngramError as exc:
    assert "io_engine='io_uring' is unavailable here: io_uring_setup failed" in str(exc), exc
print("SECCOMP-OK")
"""


@pytest.mark.parametrize("mode", ["io_uring", "both"])
def test_falls_back_when_the_syscalls_are_filtered(ckpt, tmp_path, mode):
    """Containers often filter io_uring (EPERM) and sometimes Linux AIO (ENOSYS): under a real seccomp filter the
    store picks the next path, says why, and still returns the file's bytes."""
    import platform
    import sys

    if platform.machine() != "x86_64" or sys.platform != "linux":
        pytest.skip("the seccomp filter in this test uses x86_64 syscall numbers")
    root, _ = ckpt
    script = tmp_path / "check.py"
    script.write_text(_SECCOMP_CHECK)
    src = root / "pack" / "engram-layer14-rank1of2.tspack"
    proc = subprocess.run([sys.executable, str(script), str(src), mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "SECCOMP-OK" in proc.stdout, proc.stdout + proc.stderr


_RAMFS_CHECK = """
import shutil, sys, numpy as np, torch
from twinspark.engram import EngramError, EngramStore
src, dst = sys.argv[1], sys.argv[2] + "/l14.tspack"
shutil.copy(src, dst)
store = EngramStore.from_pack(dst, threads=2)                    # auto
assert not store.direct, "auto mode kept O_DIRECT on ramfs"
assert store.io_path == "pread" and store.queue_depth == 1, store.io_path
h = store.header
ids = torch.randint(h.first_row - 5, h.last_row + 5, (300,))
w, s = store.lookup(ids)
raw = np.fromfile(src, np.uint8)[4096:].reshape(-1, 264)
for i, r in enumerate(ids.tolist()):
    want = raw[r - h.first_row] if h.first_row <= r <= h.last_row else np.zeros(264, np.uint8)
    assert (w[i].view(torch.uint8).numpy() == want[:256]).all() and (s[i].numpy() == want[256:]).all(), r
try:
    EngramStore.from_pack(dst, io_mode="direct")
    raise SystemExit("io_mode=direct did not refuse ramfs")
except EngramError as exc:
    assert "O_DIRECT reads do not work on" in str(exc) and "use io_mode='auto' or 'buffered'" in str(exc), exc
try:
    EngramStore.from_pack(dst, io_engine="io_uring")
    raise SystemExit("io_engine=io_uring did not refuse buffered ramfs reads")
except EngramError as exc:
    assert "needs O_DIRECT reads" in str(exc), exc
print("RAMFS-OK")
"""


def test_auto_falls_back_to_buffered_without_o_direct(ckpt, tmp_path):
    """ramfs has no O_DIRECT (tmpfs has had it since Linux 6.6): mounted in a private mount namespace, the
    store must fall back to buffered reads in auto mode and refuse io_mode='direct' with a clear message."""
    import os
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a ramfs in a private mount namespace")
    root, _ = ckpt
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    script = tmp_path / "check.py"
    script.write_text(_RAMFS_CHECK)
    src = root / "pack" / "engram-layer14-rank1of2.tspack"
    cmd = ["unshare", "-m", "sh", "-c", 'mount -t ramfs ramfs "$1" || exit 77; exec "$2" "$3" "$4" "$1"', "sh",
           str(mnt), sys.executable, str(script), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode == 77:
        pytest.skip(f"cannot mount ramfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0 and "RAMFS-OK" in proc.stdout, proc.stdout + proc.stderr


def test_truncated_shard_refused_at_open(ckpt, tmp_path):
    root, _ = ckpt
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "model-00048-of-00048.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(EngramError, match="is truncated .*re-download"):
        EngramStore.from_checkpoint(tmp_path / "ckpt", 14)


@pytest.mark.parametrize(("io_mode", "engine"), [("buffered", "pread"), ("direct", "pread"), ("direct", "io_uring"),
                                                 ("direct", "aio")])
def test_file_shrinking_under_the_store_is_an_error_not_a_crash(ckpt, tmp_path, gen, io_mode, engine):
    root, layout = ckpt
    pk = tmp_path / "l14.tspack"
    shutil.copy(root / "pack" / "engram-layer14-rank1of2.tspack", pk)
    store = engine_store(lambda **kw: EngramStore.from_pack(pk, **kw), engine, threads=2, io_mode=io_mode,
                         queue_depth=4)
    rng = layout.rank_range(14, 1, 2)
    with open(pk, "r+b") as f:
        f.truncate(4096 + 10 * RECORD_BYTES)
    ids = torch.tensor([rng.first_row + 2, rng.end_row - 1, -1])
    with pytest.raises(EngramError, match=r"l14.tspack: cannot read row .* \(file ends early\)"):
        store.lookup(ids)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"io_mode": "fast"}, "io_mode must be one of"),
    ({"threads": 0}, "threads must be 1..1024"),
    ({"queue_depth": 0}, "queue_depth must be 1..1024"),
    ({"io_engine": "spdk"}, "io_engine must be one of"),
    ({"cache_gib": -1}, "cache_gib must be >= 0"),
])
def test_bad_settings(ckpt, kwargs, message):
    root, _ = ckpt
    with pytest.raises(EngramError, match=message):
        EngramStore.from_checkpoint(root / "ckpt", 1, **kwargs)


def test_bad_ids(ckpt):
    root, _ = ckpt
    store = EngramStore.from_checkpoint(root / "ckpt", 1, threads=1)
    with pytest.raises(TypeError, match="expected ids to be a 1-D int64 or int32 tensor"):
        store.lookup(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"expected weight to be a contiguous host torch.float8_e4m3fn \[2, 256\]"):
        store.lookup(torch.tensor([1, 2]), weight=torch.empty(2, 256, dtype=torch.uint8))


def test_range_outside_table_refused(ckpt):
    root, layout = ckpt
    with pytest.raises(EngramError, match="outside the table's"):
        EngramStore.from_checkpoint(root / "ckpt", 1, (0, layout.rows(1) + 1))


def test_memory_accounting(ckpt):
    root, _ = ckpt
    store = EngramStore.from_checkpoint(root / "ckpt", 1, threads=4, cache_gib=0.001, io_engine="pread")
    assert 0 < store.cache_bytes <= 2**30 // 1000
    assert store.host_bytes == store.cache_bytes + 4 * 8192
    store = EngramStore.from_checkpoint(root / "ckpt", 1, threads=4, queue_depth=8, io_mode="direct")
    if store.io_path != "pread":  # 8 rows in flight x 2 extents (weight and scale shards) x 8 KiB, + 8 KiB
        assert store.host_bytes == 4 * (8 * 2 + 1) * 8192
    assert staging_pinned_bytes(1000) == 272_000 and store.pinned_bytes == 0


# ------------------------------------------------------------------------------------------------------ GPU
def _gpu_case(ckpt, gen, n=500):
    """Reference part (runs everywhere): ids and the bf16 rows they must give, from direct file reads."""
    root, layout = ckpt
    rng = layout.rank_range(14, 1, 2)
    ids = random_ids(n, layout.rows(14), gen)
    ew, es = expected(root, 14, ids, rng.first_row, rng.end_row)
    want = engram_dequant(torch.from_numpy(ew).view(torch.float8_e4m3fn), torch.from_numpy(es))
    assert (want[(ids < rng.first_row) | (ids >= rng.end_row)] == 0).all()
    return root / "pack" / "engram-layer14-rank1of2.tspack", ids, ew, es, want


@pytest.mark.gpu
def test_staging_lookup_matches_files(ckpt, gen):
    path, ids, ew, es, want = _gpu_case(ckpt, gen)
    cuda = need_cuda()
    store = EngramStore.from_pack(path, threads=4, cache_gib=0.001)
    staging = store.staging(1024)
    assert store.pinned_bytes == staging_pinned_bytes(1024)
    w, s = staging.lookup(ids.to(cuda))
    out = staging.fetch(ids.to(torch.int32).to(cuda))
    torch.cuda.synchronize()
    staging.check()
    np.testing.assert_array_equal(w.view(torch.uint8).cpu().numpy(), ew)
    np.testing.assert_array_equal(s.cpu().numpy(), es)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
def test_graph_capture_and_replay(ckpt, gen):
    path, ids, _, _, want = _gpu_case(ckpt, gen, 384)
    _, ids2, _, _, want2 = _gpu_case(ckpt, gen, 384)
    cuda = need_cuda()
    store = EngramStore.from_pack(path, threads=4)
    staging = store.staging(384)
    ids_dev = ids.to(cuda)
    out = torch.empty(384, 256, dtype=torch.bfloat16, device=cuda)
    staging.fetch(ids_dev, out=out)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        staging.fetch(ids_dev, out=out)
    for i, w in ((ids, want), (ids2, want2), (ids, want)):
        ids_dev.copy_(i.to(cuda))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        staging.check()
        assert torch.equal(out.cpu().view(torch.int16), w.view(torch.int16))


@pytest.mark.gpu
def test_two_streams_at_once(ckpt, gen):
    cases = [_gpu_case(ckpt, gen, 300) for _ in range(2)]
    cuda = need_cuda()
    store = EngramStore.from_pack(cases[0][0], threads=4, cache_gib=32 * ONE_SET_GIB)
    streams = [torch.cuda.Stream(cuda) for _ in cases]
    stagings = [store.staging(300) for _ in cases]
    ids_dev = [c[1].to(cuda) for c in cases]
    torch.cuda.synchronize()
    outs = []
    for _ in range(5):
        outs.clear()
        for st, sg, ids in zip(streams, stagings, ids_dev):
            with torch.cuda.stream(st):
                outs.append(sg.fetch(ids))
        torch.cuda.synchronize()
        for out, case in zip(outs, cases):
            assert torch.equal(out.cpu().view(torch.int16), case[4].view(torch.int16))
    for sg in stagings:
        sg.check()


@pytest.mark.gpu
def test_staging_reports_read_errors(ckpt, gen, tmp_path, request):
    root, layout = ckpt
    rng = layout.rank_range(14, 1, 2)
    pk = tmp_path / "l14.tspack"
    shutil.copy(root / "pack" / "engram-layer14-rank1of2.tspack", pk)
    cuda = request.getfixturevalue("cuda")
    store = EngramStore.from_pack(pk, threads=2, io_mode="buffered")
    with open(pk, "r+b") as f:
        f.truncate(4096)
    staging = store.staging(4)
    w, _ = staging.lookup(torch.tensor([rng.first_row, -1], device=cuda))
    torch.cuda.synchronize()
    assert (w.view(torch.uint8) == 0).all()
    with pytest.raises(EngramError, match="during a GPU lookup: .*file ends early"):
        staging.check()
