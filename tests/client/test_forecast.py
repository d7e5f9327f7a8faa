"""GB10 forecast: the floors recomputed by hand from the budget of the generated V4.1 pack."""

from __future__ import annotations

import fake_checkpoint as fake  # noqa: E402
import pytest
from twinspark import benchkit as bk
from twinspark.client import budget, forecast


@pytest.fixture(scope="module")
def b(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41f")
    fake.write_v41_pack(root / "pack")
    return budget.analyze(root / "pack", tp=2, mem_available=0)


def test_floors_from_bytes_and_h200_rates(b):
    f = forecast.forecast(b)
    embed = fake.VOCAB * fake.HIDDEN * 2 // 2
    dense = sum(v for k, v in b.per_rank.items() if k not in ("routed experts", "Engram", "MTP")) - embed
    want_bytes = dense + b.per_rank["routed experts"] * 6 / 384
    assert f.bytes_per_token == pytest.approx(want_bytes)
    assert f.bandwidth_tok_s == pytest.approx(273e9 * 0.9 / want_bytes)
    a = bk.load_anchors()
    rates = sorted(r.k * r.n / (r.upstream_us * 1e-6) for r in a.gemm_rows if r.m == 1)
    assert f.h200_weights_per_s == pytest.approx(rates[len(rates) // 2])  # 15 rows: the middle one
    assert f.work_tok_s == pytest.approx(rates[7] * 48 / 132 / f.weights_per_token)
    assert f.decode_tok_s == pytest.approx(min(f.bandwidth_tok_s, f.work_tok_s))
    assert 10 < f.decode_tok_s < 200  # a sane range for this model on two Sparks
    slower = forecast.forecast(b, overhead_ms=10)
    assert 1 / slower.decode_tok_s == pytest.approx(1 / f.decode_tok_s + 0.010)
    assert f.prefill_tok_s == pytest.approx(1e6 / (a.moe(K=3, T=512).us / 512 * 132 / 48 * fake.LAYERS))
    text = forecast.report(f, b)
    assert "31.6 tok/s" in text and "decode forecast" in text


def test_rates_from_bench_results(b, tmp_path):
    recs = [bk.Record(op="exl3_gemm", shape={"k": 5120, "n": 1152, "K": 3, "m": m}, median_us=us)
            for m, us in ((1, 5.0), (4, 50.0))]
    recs.append(bk.Record(op="exl3_moe", shape={"K": 3, "T": 512}, median_us=5120.0))
    p = bk.write_results("mine", recs, tmp_path, machine={})
    f = forecast.forecast(b, decode_results=p, moe_results=p)
    assert f.h200_weights_per_s == pytest.approx(5120 * 1152 / 5e-6)  # the m=4 record is ignored
    assert "records in" in f.work_source
    assert f.prefill_tok_s == pytest.approx(1e6 / (10.0 * 132 / 48 * fake.LAYERS))
