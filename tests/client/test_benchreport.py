"""invoke bench's lengths fitted to the server's context (max_model_len from /v1/models) and --compare over samples:
a change counts only beyond the samples' noise, and the header names both runs' commit and recipe. No server."""

from __future__ import annotations

import pytest
from twinspark.client import bench, benchreport
from twinspark.client.http import ClientError


def test_defaults_shrink_to_the_served_context_with_a_note():
    s = bench.Settings()
    notes = bench.fit(s, 256)
    assert s.prefill_lengths == [128] and (s.decode_prompt_tokens, s.decode_tokens) == (64, 192)
    assert notes == [
        "prefill lengths 1024, 8192, 32768 exceed the server's max_model_len 256 (from /v1/models): measuring 128 "
        "instead",
        "decode streams of 256 + 256 tokens exceed the server's max_model_len 256 (from /v1/models): using 64 + 192"]
    assert bench.fit(bench.Settings(), None) == []  # a server that does not say: nothing to fit


def test_lengths_the_user_gave_that_cannot_fit_are_refused():
    with pytest.raises(ClientError) as e:
        bench.fit(bench.Settings(prefill_lengths=[64, 1024]), 256, {"lengths"})
    assert str(e.value) == ("--lengths 1024 do not fit the server's max_model_len 256 (from /v1/models): a prompt has "
                            "at most 255 tokens; pass smaller --lengths")


def _doc(agg: list[float], commit: str) -> dict:
    return {"meta": {"commit": commit, "recipe": "tiny-cpu", "date": "d"}, "settings": {"samples": len(agg)},
            "prefill": [], "decode": [{"kind": "prose", "concurrency": 1, "per_stream_tok_s": [agg[0]],
                                       "aggregate_tok_s": sorted(agg)[(len(agg) - 1) // 2],
                                       "aggregate_tok_s_samples": agg, "per_stream_mean_tok_s_samples": agg}]}


def test_compare_tells_a_change_from_noise():
    old = _doc([30.0, 24.0, 33.0], "aaaa")
    noisy = benchreport.compare(_doc([31.0, 38.0, 29.0], "bbbb"), old)
    assert noisy.startswith("previous: commit aaaa, recipe tiny-cpu, d; now: commit bbbb, recipe tiny-cpu, d")
    assert "| decode prose x1 aggregate tok/s | 30.0 (24.0-33.0, n=3) | 31.0 (29.0-38.0, n=3) | +3.3% | within " \
           "noise |" in noisy
    real = benchreport.compare(_doc([40.0, 41.0, 42.0], "cccc"), old)
    assert "| +36.7% | beyond noise |" in real
    single = benchreport.compare(_doc([38.0], "dddd"), _doc([30.0], "aaaa"))
    assert "| +26.7% | one sample: cannot tell from noise |" in single
