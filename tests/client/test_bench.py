"""invoke bench against the real vLLM server (tiny model): exact prompt lengths via /tokenize, the formulas on
the recorded timestamps, JSON/markdown/PNG output and --compare. (Speeds of a random model on a loaded CPU
mean nothing: only their consistency is checked.)"""

from __future__ import annotations

import json
import math

import pytest
from twinspark.client import bench, benchreport
from twinspark.client.http import Api, ClientError

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def doc(vllm_server):
    url, key, _ = vllm_server
    s = bench.Settings(prefill_lengths=[64, 160], concurrency=[1, 2, 4], decode_tokens=24, decode_prompt_tokens=64,
                       samples=2)
    with Api(url, api_key=key) as api:
        return bench.run(api, s, log=lambda *_: None)


def test_prompts_have_exact_lengths(vllm_server):
    url, key, _ = vllm_server
    with Api(url, api_key=key) as api:
        for kind in ("prose", "code"):
            text, n = bench.make_prompt(api, kind, 150)
            assert 140 <= n <= 150  # whole words: at most a word short of the target
            assert api.count_tokens(text) == n
        a, _ = bench.make_prompt(api, "prose", 100)
        b, _ = bench.make_prompt(api, "prose", 100)
        assert a != b  # fresh nonce: no prefix-cache hit
        with pytest.raises(ClientError, match="too short"):
            bench.make_prompt(api, "code", 3)


def test_prefill_rows(doc):
    assert [(r["kind"], r["target"]) for r in doc["prefill"]] == [("prose", 64), ("prose", 160), ("code", 64),
                                                                  ("code", 160)]
    for r in doc["prefill"]:
        assert r["target"] - 12 <= r["prompt_tokens"] <= r["target"]
        assert r["ttft_s"] > 0 and r["tok_s"] == pytest.approx(r["prompt_tokens"] / r["ttft_s"])


def test_decode_formulas_on_recorded_times(doc):
    assert [(r["kind"], r["concurrency"]) for r in doc["decode"]] == [(k, c) for k in ("prose", "code") for c in (1, 2, 4)]
    for r in doc["decode"]:
        streams = r["streams"]
        assert len(streams) == r["concurrency"] and all(s["tokens"] == 24 for s in streams)  # ignore_eos: exact
        span = max(s["t_last_s"] for s in streams) - min(s["t_first_s"] for s in streams)
        assert r["aggregate_tok_s"] == pytest.approx(sum(s["tokens"] for s in streams) / span)
        for s, v in zip(streams, r["per_stream_tok_s"]):
            assert math.isfinite(v) and v > 0
            assert v == pytest.approx((s["tokens"] - s["first_chunk_tokens"]) / (s["t_last_s"] - s["t_first_s"]))


def test_outputs_and_compare(doc, tmp_path):
    paths = benchreport.save(doc, tmp_path, "run1")
    assert json.loads(paths["json"].read_text())["meta"]["model"] == "tiny"
    md = paths["md"].read_text()
    assert "| prose | 1 |" in md and "| code | 4 |" in md and md.count("\n| prose |") == 5
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    prev = benchreport.load(paths["json"])
    row = prev["decode"][0]
    assert len(row["aggregate_tok_s_samples"]) == 2 and row["aggregate_tok_s"] in row["aggregate_tok_s_samples"]
    row["aggregate_tok_s_samples"] = [x / 2 for x in row["aggregate_tok_s_samples"]]
    table = benchreport.compare(doc, prev)
    assert "| decode prose x1 aggregate tok/s |" in table and "+100.0% |" in table
    assert doc["meta"]["max_model_len"] == 256
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ClientError, match="not a bench result"):
        benchreport.load(tmp_path / "bad.json")
