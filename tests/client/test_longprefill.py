"""The long-prefill memory sampler: low-water marks per node and the warning rule (no server needed for these)."""

from __future__ import annotations

import itertools
import time

import pytest
from twinspark.client.longprefill import MemSampler, _mem_available
from twinspark.memory.meminfo import GIB


def _meminfo(kib: int) -> str:
    return f"MemTotal: 131072000 kB\nMemFree: 1000 kB\nMemAvailable: {kib} kB\nCached: 5 kB\n"


def test_sampler_records_low_water_per_node():
    head_values = itertools.cycle([40 * 1024 * 1024, 3 * 1024 * 1024, 30 * 1024 * 1024])
    readers = {"head": lambda: _meminfo(next(head_values)), "worker": lambda: _meminfo(20 * 1024 * 1024),
               "broken": lambda: "garbage"}
    with MemSampler(readers, interval=0.01) as s:
        time.sleep(0.2)
    assert s.result.low("head") == 3 * GIB
    assert s.result.low("worker") == 20 * GIB
    assert s.result.low("broken") is None and "MemAvailable" in s.result.errors["broken"]


def test_parse_real_meminfo():
    with open("/proc/meminfo") as f:
        assert _mem_available(f.read()) > 0


@pytest.mark.vllm
def test_long_prefill_against_vllm(vllm_server):
    """The longest prompt the server allows (--max-model-len 256), sampled on this host."""
    from twinspark.client.http import Api
    from twinspark.client.longprefill import run_long

    url, key, model = vllm_server
    with Api(url, api_key=key, model=model) as api:
        doc = run_long(api, 256, {"head": lambda: open("/proc/meminfo").read()}, guard_threshold_gib=1.5,
                       output_tokens=8)
    assert 200 <= doc["prompt_tokens"] <= 248
    assert doc["nodes"]["head"]["samples"] >= 1 and doc["nodes"]["head"]["low_water_bytes"] > 0
    assert doc["prefill_tok_s"] > 0
