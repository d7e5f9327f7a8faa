"""bench/benchkit (not in the wheel): statistics, rings, records, results files, anchors and the report on fixed
inputs, and time_cuda's sampling logic on a fake GPU clock (CPU). What the timings measure on a real GPU (host
time excluded, event overhead, ceilings) is a benchmark, bench/bench_timing.py, not a test."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import benchkit as bk  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/run.py runs on one)")


def _anchors_md() -> Path | None:
    for p in (REPO / "docs" / "anchors-h200.md", REPO.parent / "shared" / "docs" / "anchors-h200.md"):
        if p.is_file():
            return p
    return None


# ------------------------------------------------------------------------------------------------ pure Python
def test_timing_statistics():
    t = bk.Timing((5.0, 1.0, 3.0, 100.0))
    assert t.median_us == 4.0
    assert t.min_us == 1.0
    assert float(t) == 4.0
    assert t.spread == pytest.approx(99.0 / 4.0)


def test_rotate_reaches_total_and_counts_tensor_bytes():
    made = []

    def make():
        w = torch.empty(1000, dtype=torch.float16)  # 2000 bytes
        made.append(w)
        return (w, {"s": torch.empty(10, dtype=torch.float32)}, 3)  # + 40 bytes; the int counts nothing

    ring = bk.rotate(make, total_bytes=10_000)
    assert len(ring) == 5 == len(made)  # 4 x 2040 < 10000 <= 5 x 2040
    assert ring.bytes_per_set == 2040 and ring.total_bytes == 10_200
    assert all(isinstance(a, tuple) for a in ring)
    assert ring[0][0] is made[0] and ring[4][0] is made[4]


def test_rotate_wraps_single_tensor_and_custom_nbytes():
    ring = bk.rotate(lambda: torch.empty(4, dtype=torch.uint8), total_bytes=100, nbytes=lambda a: 50)
    assert len(ring) == 2 and isinstance(ring[0], tuple)
    one = bk.rotate(lambda: torch.empty(4096, dtype=torch.uint8), total_bytes=1)
    assert len(one) == 1  # at least one set even when one already exceeds the total


def test_rotate_rejects_empty_sets():
    with pytest.raises(bk.BenchError, match="no tensor bytes"):
        bk.rotate(lambda: (1, 2), total_bytes=10)
    with pytest.raises(bk.BenchError, match="argument sets hold only"):
        bk.rotate(lambda: torch.empty(1, dtype=torch.uint8), total_bytes=10_000, max_sets=10)


def test_gbps():
    assert bk.gbps(4260e9 * 1e-6, 1.0) == pytest.approx(4260.0)  # 4.26 MB in 1 us = 4260 GB/s


def test_record_derived_values_and_validation():
    r = bk.Record(op="exl3_gemm", shape={"k": 5120, "n": 1152, "K": 3, "m": 1}, timing=bk.Timing((9.0, 10.0, 11.0)),
                  bytes=2_000_000, anchor_us=17.4)
    assert r.median_us == 10.0 and r.samples_us == [9.0, 10.0, 11.0]
    assert r.gbps == pytest.approx(200.0)
    assert r.vs_anchor == pytest.approx(1.74)
    with pytest.raises(bk.BenchError, match="give timing= or median_us="):
        bk.Record(op="x", shape={})
    with pytest.raises(bk.BenchError, match="shape dict"):
        bk.Record(op="x", shape=[1], median_us=1.0)


def test_write_results_roundtrip(tmp_path):
    recs = [bk.Record(op="moe", shape={"K": 3, "T": 1}, median_us=50.0, bytes=10**6, anchor_us=69.6),
            bk.Record(op="moe", shape={"K": 3, "T": 4}, timing=bk.Timing((1.0, 2.0, 3.0)))]
    p = bk.write_results("moe", recs, tmp_path / "res", ceilings={"copy_gbps": 4000.0})
    assert p == tmp_path / "res" / "moe.json"
    assert [x.name for x in p.parent.iterdir()] == ["moe.json"]  # no temp file left behind
    raw = json.loads(p.read_text())
    assert raw["machine"]["torch"] == torch.__version__ and "date" in raw["machine"] and "gpu" in raw["machine"]
    assert raw["records"][0]["gbps"] == pytest.approx(20.0) and raw["records"][1]["gbps"] is None
    back = bk.load_results(p)
    assert back["ceilings"] == {"copy_gbps": 4000.0}
    assert back["records"][0].vs_anchor == pytest.approx(69.6 / 50.0)
    assert back["records"][1].samples_us == [1.0, 2.0, 3.0]
    with pytest.raises(bk.BenchError, match="plain name"):
        bk.write_results("a/b", recs, tmp_path)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(bk.BenchError, match="not a benchkit results file"):
        bk.load_results(tmp_path / "bad.json")


def test_anchor_lookups():
    a = bk.load_anchors()
    assert a.ceilings == bk.Ceilings(4260.0, 739.0)
    assert a.gemm(k=5120, n=12288, K=3, m=64).upstream_us == 80.6
    assert a.gemm(k=1152, n=5120, K=2, m=1).upstream_us == 11.3
    assert a.gemm(k=1152, n=5120, K=5, m=1) is None
    assert a.dense(k=5120, n=1152, m=64).us == 9.2
    assert a.moe(K=4, T=8) == bk.MoeAnchor(K=4, T=8, us=384.1, path="cooperative")
    assert a.moe(K=2, T=512).path == "fused_full"
    assert a.moe_mgemm(K=3, tokens=4).layer_us == 315.5
    assert a.engram(rows=65536).gbps == 311.0
    assert a.moe_shape == {"experts": 384, "hidden": 5120, "intermediate": 1152, "top_k": 6}
    assert a.moe_distinct_experts[4] == 23.6
    # Complete grid: 5 shapes x 3 K x 4 m, dense at m=1 and m=64 for each shape.
    assert len(a.gemm_rows) == 60 and len(a.dense_rows) == 10 and len(a.moe_rows) == 15


def test_anchors_match_the_markdown():
    md = _anchors_md()
    if md is None:
        pytest.skip("docs/anchors-h200.md is not in this checkout (nor ../shared/docs); nothing to compare")
    a = bk.load_anchors()
    text = md.read_text()
    seen = 0
    for line in text.splitlines():
        m = re.match(r"\| (\d+)x(\d+) \| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", line)
        if m:
            k, n, K = int(m[1]), int(m[2]), int(m[3])
            for mm, v in zip((1, 4, 16, 64), m.groups()[3:7]):
                assert a.gemm(k=k, n=n, K=K, m=mm).upstream_us == float(v), line
            assert a.dense(k=k, n=n, m=1).us == float(m[8]) and a.dense(k=k, n=n, m=64).us == float(m[9]), line
            seen += 1
        m = re.match(r"\| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| (\d+) \|$", line)
        if m:
            K = int(m[1])
            for T, v in zip((1, 4, 8, 32, 512), m.groups()[1:]):
                assert a.moe(K=K, T=T).us == float(v), line
            seen += 1
        m = re.match(r"\| (\d) \| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", line)
        if m:
            r = a.moe_mgemm(K=int(m[1]), tokens=int(m[2]))
            assert (r.gate_up_us, r.down_us, r.layer_us) == tuple(map(float, m.groups()[2:])), line
            seen += 1
        m = re.match(r"\| (\d+) \| ([\d.]+) \| (\d+) \|$", line)
        if m:
            r = a.engram(rows=int(m[1]))
            assert (r.us, r.gbps) == (float(m[2]), float(m[3])), line
            seen += 1
    assert seen == 15 + 3 + 6 + 2
    assert "copy 4260 GB/s" in text and "739 TFLOP/s" in text


def test_load_anchors_errors(tmp_path):
    with pytest.raises(bk.BenchError, match="cannot read the anchors file"):
        bk.load_anchors(tmp_path / "missing.json")
    doc = json.loads(bk.ANCHORS_PATH.read_text())
    doc["gemm"][3]["m"] = "four"
    (tmp_path / "a.json").write_text(json.dumps(doc))
    with pytest.raises(bk.BenchError, match=r"gemm\[3\]\.m = 'four' is not a int"):
        bk.load_anchors(tmp_path / "a.json")
    del doc["ceilings"]
    (tmp_path / "b.json").write_text(json.dumps(doc))
    with pytest.raises(bk.BenchError, match="lacks the entry 'ceilings'"):
        bk.load_anchors(tmp_path / "b.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_gpu_functions_say_no_gpu():
    with pytest.raises(bk.BenchError, match="no CUDA GPU"):
        bk.time_cuda(lambda: None)
    with pytest.raises(bk.BenchError, match="no CUDA GPU"):
        bk.copy_ceiling_gbps()


# ------------------------------------------------------------------------------------ time_cuda on a fake clock
class FakeGPU:
    """torch.cuda as time_cuda uses it, on a fake GPU clock: the timed function advances the clock by its cost in µs;
    an event reads the clock when recorded."""

    def __init__(self):
        self.now_us = 0.0
        self.sleeps: list[int] = []  # cycles of each torch.cuda._sleep, one per sample
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self, stream=None):
                self.at = gpu.now_us

            def elapsed_time(self, end) -> float:  # milliseconds, as torch's
                return (end.at - self.at) / 1000.0

        self.Event = Event

    def install(self, monkeypatch):
        for name, value in (("is_available", lambda: True), ("current_device", lambda: 0),
                            ("synchronize", lambda *a: None), ("current_stream", lambda *a: None),
                            ("_sleep", self.sleeps.append), ("Event", self.Event)):
            monkeypatch.setattr(torch.cuda, name, value)
        return self

    def run(self, us: float) -> None:
        self.now_us += us


@pytest.fixture
def fake_gpu(monkeypatch):
    return FakeGPU().install(monkeypatch)


def test_time_cuda_divides_each_sample_by_its_calls(fake_gpu):
    t = bk.time_cuda(lambda: fake_gpu.run(5.0), warmup=2, iters=4, calls_per_sample=8)
    assert t.samples_us == (5.0,) * 4 and fake_gpu.now_us == 5.0 * (2 + 4 * 8)
    # default without args: 16 back-to-back calls per sample (costs 2, 4, 2, 4, ... µs: 3 µs each on average)
    calls = []
    t = bk.time_cuda(lambda: (calls.append(1), fake_gpu.run(2.0 if len(calls) % 2 else 4.0)), warmup=1, iters=3)
    assert len(calls) == 1 + 3 * 16 and t.samples_us == (3.0,) * 3 and t.median_us == 3.0


def test_time_cuda_cycles_the_ring_one_pass_per_sample(fake_gpu):
    ring = [(1.0, "a"), (2.0, "b"), (6.0, "c")]
    seen = []
    t = bk.time_cuda(lambda us, name: (seen.append(name), fake_gpu.run(us)), args=ring, warmup=1, iters=5)
    assert seen == [ring[i % 3][1] for i in range(1 + 5 * 3)]  # one warm-up call, then 5 passes over the ring
    assert t.samples_us == (3.0,) * 5  # every pass is one of each set: (1 + 2 + 6) / 3
    seen.clear()
    t = bk.time_cuda(lambda us, name: (seen.append(name), fake_gpu.run(us)), args=[(1.0, "x")] * 100, warmup=0,
                     iters=2)
    assert len(seen) == 1 + 2 * 64 and t.samples_us == (1.0, 1.0)  # a sample is at most 64 calls of the ring


def test_time_cuda_setup_runs_outside_each_timed_call(fake_gpu):
    order = []
    t = bk.time_cuda(lambda: (order.append("call"), fake_gpu.run(7.0)),
                     setup=lambda: (order.append("setup"), fake_gpu.run(1000.0)), warmup=1, iters=2)
    assert order == ["setup", "call"] * 3
    assert t.samples_us == (7.0, 7.0)  # the setup's GPU work is before the start event


def test_time_cuda_sleep_follows_the_slowest_host_launch(fake_gpu):
    """Each sample's calls are queued behind a GPU sleep sized from the slowest host launch seen so far: a host that
    gets slower after the warm-up (here 2 ms per call from the 3rd call on) gets longer sleeps from then on."""
    calls = []
    bk.time_cuda(lambda: (calls.append(1), len(calls) > 2 and time.sleep(2e-3), fake_gpu.run(1.0)),
                 warmup=2, iters=4, calls_per_sample=4)
    hz = bk.timing._SLEEP_HZ
    floor = (2 * 4 * 20e-6 + 50e-6) * hz  # the sleep with an instant host
    assert len(fake_gpu.sleeps) == 4 and fake_gpu.sleeps[0] >= floor
    assert fake_gpu.sleeps == sorted(fake_gpu.sleeps)  # never shorter than an earlier one
    assert all(s >= (2 * 4 * (2e-3 + 20e-6) + 50e-6) * hz * 0.999 for s in fake_gpu.sleeps[1:])
    assert fake_gpu.sleeps[-1] <= 0.5 * hz  # capped at half a second


def test_time_cuda_argument_errors():
    for kw, says in (({"warmup": -1}, "warmup >= 0"), ({"iters": 0}, "iters >= 1"), ({"args": []}, "empty list"),
                     ({"setup": lambda: None, "calls_per_sample": 4}, "with setup= every call is timed alone")):
        with pytest.raises(bk.BenchError, match=says):
            bk.time_cuda(lambda *a: None, **kw)


# ------------------------------------------------------------------------------------------------ bench/run.py
def _run_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_discovers_by_prefix_and_glob(tmp_path):
    run = _run_module()
    for n in ("bench_exl3_gemm.py", "bench_exl3_moe.py", "bench_engram_gather.py", "helper.py"):
        (tmp_path / n).write_text("")
    names = lambda fs: [f.name for f in fs]  # noqa: E731
    assert names(run.discover(tmp_path, [])) == ["bench_engram_gather.py", "bench_exl3_gemm.py", "bench_exl3_moe.py"]
    assert names(run.discover(tmp_path, ["exl3"])) == ["bench_exl3_gemm.py", "bench_exl3_moe.py"]
    assert names(run.discover(tmp_path, ["bench_engram"])) == ["bench_engram_gather.py"]
    assert names(run.discover(tmp_path, ["*moe"])) == ["bench_exl3_moe.py"]
    assert run.discover(tmp_path, ["nothing"]) == []


def test_report_only_builds_markdown_and_png(tmp_path):
    run = _run_module()
    a = bk.load_anchors()
    up = a.gemm(k=5120, n=1152, K=3, m=1).upstream_us
    recs = [bk.Record(op="exl3_gemm", shape={"k": 5120, "n": 1152, "K": 3, "m": 1}, median_us=up / 2,
                      bytes=2_250_000, anchor_us=up, dense_us=8.4),
            bk.Record(op="exl3_gemm", shape={"k": 5120, "n": 1152, "K": 3, "m": 64}, median_us=50.0)]
    bk.write_results("exl3_gemm", recs, tmp_path, ceilings={"copy_gbps": 4000.0},
                     machine={"gpu": "NVIDIA H200", "torch": "x", "cuda": "13.0", "date": "d"})
    assert run.main(["--report-only", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    # 2.25 MB in 8.7 us = 259 GB/s = 6.5 % of 4000 GB/s; twice as fast as upstream.
    assert "| exl3_gemm | k=5120 n=1152 K=3 m=1 | twinspark | 8.7 | 259 | 6.5 | 17.4 | 2.00 | 8.4 |" in md
    assert "| exl3_gemm | k=5120 n=1152 K=3 m=64 | twinspark | 50.0 | - | - | - | - | - |" in md
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "other.json").write_text("[]")  # not a benchkit file: named in the report, not a crash
    assert run.main(["--report-only", "--out-dir", str(tmp_path)]) == 0
    assert "**Failed or unreadable:** other.json" in (tmp_path / "report.md").read_text()
    assert run.main(["--report-only", "--out-dir", str(tmp_path / "empty")]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine says")
def test_run_without_gpu_says_so_and_fails(tmp_path, capsys):
    run = _run_module()
    (tmp_path / "bench_x.py").write_text("raise SystemExit('must not run')\n")
    assert run.main(["--bench-dir", str(tmp_path), "--out-dir", str(tmp_path / "r")]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err
    assert run.main(["--list", "--bench-dir", str(tmp_path)]) == 0


@pytest.mark.gpu
@GPU
def test_run_end_to_end_on_gpu(tmp_path):
    """A real benchmark file (bf16 mm as the op) through bench/run.py: results JSON, report.md, report.png."""
    (tmp_path / "bench_mm.py").write_text(
        "import benchkit as bk\nimport torch\n"
        "dev = torch.device('cuda'); copy = bk.copy_ceiling_gbps(dev); a = bk.load_anchors()\n"
        "recs = []\n"
        "for m in (1, 64):\n"
        "    x = torch.randn(m, 5120, device=dev, dtype=torch.bfloat16)\n"
        "    ring = bk.rotate(lambda: (torch.randn(1152, 5120, device=dev, dtype=torch.bfloat16),))\n"
        "    t = bk.time_cuda(lambda w: torch.mm(x, w.t()), args=ring)\n"
        "    recs.append(bk.Record(op='mm', shape={'k': 5120, 'n': 1152, 'm': m}, timing=t, bytes=ring.bytes_per_set,\n"
        "                          anchor_us=a.dense(k=5120, n=1152, m=m).us, variant='torch'))\n"
        "bk.write_results('mm', recs, ceilings={'copy_gbps': copy})\n")
    (tmp_path / "bench_broken.py").write_text("raise SystemExit(3)\n")
    run = _run_module()
    out = tmp_path / "res"
    assert run.main(["--bench-dir", str(tmp_path), "--out-dir", str(out), "mm"]) == 0
    res = bk.load_results(out / "mm.json")
    assert [r.shape["m"] for r in res["records"]] == [1, 64] and res["machine"]["gpu"]
    assert all(r.gbps == bk.gbps(r.bytes, r.median_us) and len(r.samples_us) == 7 for r in res["records"])
    assert res["ceilings"]["copy_gbps"] > 0
    assert "## mm" in (out / "report.md").read_text() and (out / "report.png").is_file()
    assert run.main(["--bench-dir", str(tmp_path), "--out-dir", str(out), "broken"]) == 1
    assert "bench_broken.py (exit status 3)" in (out / "report.md").read_text()


def test_predict_gb10_us_takes_the_larger_floor():
    """Bandwidth-bound on the H200 (time = its copy time + launch): GB10 is its bandwidth floor + launch.
    Decode-bound (time far above the copy time): the H200's extra time scaled by SM throughput + launch."""
    nbytes, copy = 20e6, 4000.0  # 20 MB at 4000 GB/s: 5 us of copy on the H200
    p = bk.predict_gb10_us(nbytes, 5.0 + bk.H200_LAUNCH_US, copy)
    floor = nbytes / (bk.GB10_BW * bk.GB10_BW_FRACTION) * 1e6
    assert p["bw_floor_us"] == pytest.approx(floor) and p["decode_us"] == pytest.approx(0.0, abs=1e-9)
    assert p["bounded_us"] == pytest.approx(floor + bk.GB10_LAUNCH_US)
    scale = (bk.H200_SMS * bk.H200_CLOCK) / (bk.GB10_SMS * bk.GB10_CLOCK)
    q = bk.predict_gb10_us(nbytes, 200.0, copy, launches=2)
    assert q["decode_us"] == pytest.approx((200.0 - 2 * bk.H200_LAUNCH_US - 5.0) * scale)
    assert q["decode_us"] > floor and q["bounded_us"] == pytest.approx(q["decode_us"] + 2 * bk.GB10_LAUNCH_US)
    assert q["naive_us"] == pytest.approx(nbytes / (bk.GB10_BW * (nbytes / 200e-6 / (copy * 1e9))) * 1e6)


def test_predict_gb10_large_us_bandwidth_then_compute():
    """The large path on GB10: its two passes move the bf16 weight twice (bandwidth-bound at small m); at large m
    the matmul's FLOPs take over."""
    k, n = 5120, 12288
    w = 2.0 * k * n
    p = bk.predict_gb10_large_us(k, n, 1, w / 8, 0, 0)
    bw = bk.GB10_BW * bk.GB10_BW_FRACTION
    assert abs(p["dequant_us"] - (w / 8 + w) / bw * 1e6) < 1e-6
    assert abs(p["matmul_us"] - w / bw * 1e6) < 1e-6
    assert abs(p["us"] - (p["dequant_us"] + p["matmul_us"] + 2 * bk.GB10_LAUNCH_US)) < 1e-9
    q = bk.predict_gb10_large_us(k, n, 8192, w / 8, 0, 0)
    assert abs(q["matmul_us"] - 2.0 * 8192 * k * n / bk.GB10_BF16_FLOPS * 1e6) < 1e-6


def test_bench_exl3_moe_plot_only_redraws_the_png(tmp_path, capsys):
    """bench_exl3_moe.py --plot-only: the PNG from a results file, no GPU (records of two K with a baseline and
    anchors); a missing or foreign file is one clear line and exit status 2, with nothing written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_exl3_moe", REPO / "bench" / "bench_exl3_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    recs = []
    for K in (2, 3):
        for T, us in ((1, 40.0 + K), (4, 130.0 + K), (2048, 9000.0)):
            shape = {"E": 384, "H": 5120, "I": 1152, "top_k": 6, "K": K, "T": T}
            recs.append(bk.Record(op="exl3_moe", shape=shape, median_us=us, anchor_us=1.5 * us))
            recs.append(bk.Record(op="exl3_moe", shape=dict(shape), median_us=5 * us, variant="reconstruct+torch.mm"))
    path = bk.write_results("exl3_moe", recs, out_dir=tmp_path, machine={"gpu": "test"})
    assert mod.main(["--plot-only", str(path)]) == 0
    png = tmp_path / "exl3_moe.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exl3_moe.json", "exl3_moe.png"]  # no temp file left
    assert str(png) in capsys.readouterr().out

    bad = tmp_path / "other.json"
    bad.write_text('{"name": "x"}')
    gemm = bk.write_results("exl3_gemm", [bk.Record(op="exl3_gemm", shape={"m": 1}, median_us=5.0)], out_dir=tmp_path,
                            machine={})
    for f, why in ((bad, "is not a benchkit results file"), (tmp_path / "missing.json", "is not a benchkit results file"),
                   (gemm, "no exl3_moe records to plot")):
        assert mod.main(["--plot-only", str(f)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and why in err
    assert not any((tmp_path / n).exists() for n in ("other.png", "missing.png", "exl3_gemm.png"))


def test_the_wheel_holds_no_bench_code():
    """The bench kit lives in bench/; nothing under python/twinspark (the wheel) imports it."""
    root = REPO / "python" / "twinspark"
    assert not (root / "benchkit.py").exists() and not (root / "benchkit").exists()
    pattern = re.compile(r"^\s*(import benchkit|from benchkit\b|from twinspark import benchkit|import bench_)", re.M)
    assert [p.relative_to(REPO) for p in root.rglob("*.py") if pattern.search(p.read_text())] == []


def test_one_gb10_model_behind_benchkit_names():
    """benchkit's GB10 names are twinspark.gb10's parameters (one model for benchmarks, notes and the forecast)."""
    from twinspark import gb10

    assert bk.GB10_BW == float(gb10.BW) and bk.GB10_BW_FRACTION == float(gb10.BW_EFFICIENCY)
    assert (bk.GB10_SMS, bk.GB10_CLOCK) == (int(gb10.SMS.value), float(gb10.CLOCK))
    assert bk.GB10_BF16_FLOPS == float(gb10.GB10_BF16_FLOPS) and bk.GB10_LAUNCH_US == float(gb10.LAUNCH_US)
    assert bk.predict_gb10_us(1e6, 10.0, 4000.0) == gb10.predict_from_h200_us(1e6, 10.0, 4000.0)
    for p in (gb10.BW, gb10.BW_EFFICIENCY, gb10.CLOCK, gb10.ALLREDUCE_US, gb10.UPSTREAM_EFFICIENCY):
        assert p.source and p.unit


def test_bench_decode_step_plan_and_bytes():
    """The step plan at the real dimensions (no GPU): the calls per class and the bytes the forecast's budget counts."""
    import importlib.util

    spec_file = bk.REPO_ROOT / "bench" / "bench_decode_step.py"
    mod_spec = importlib.util.spec_from_file_location("bench_decode_step", spec_file)
    ds = importlib.util.module_from_spec(mod_spec)
    sys.modules["bench_decode_step"] = ds  # dataclasses look their module up there
    mod_spec.loader.exec_module(ds)
    from twinspark.v41_layout import V41Spec

    spec = V41Spec.real()
    ops = ds.plan_step(spec)
    count = lambda cls: sum(o.cls == cls for o in ops)  # noqa: E731
    assert (count("attention"), count("routed"), count("shared"), count("all-reduce")) == (200, 40, 120, 84)
    assert (count("compressor"), count("indexer"), count("engram rows"), count("lm_head")) == (7, 12, 2, 1)
    wo_a = next(o for o in ops if o.name == "wo_a")
    assert (wo_a.k, wo_a.n, wo_a.groups, wo_a.K) == (4096, 1024, 4, 5)
    assert sum(o.weight_bytes() for o in ops if o.cls == "attention") == pytest.approx(1.702e9, rel=1e-3)
    moe = [o for o in ops if o.kind == "moe"]
    assert sum(spec.experts * ds.expert_bytes(o) for o in moe) / 2**30 == pytest.approx(91.5, abs=0.1)
