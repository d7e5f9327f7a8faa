"""Fuzz: budget and forecast on a checkpoint folder (twinspark.client.budget.analyze, forecast.forecast and the
`invoke budget` / `invoke forecast` flags in client.cli).

Accepted input must give numbers that mean something: finite, non-negative, a KV cost per token > 0, the tokens a
pool holds consistent with it, the bytes of the shards as written (a flipped bit inside tensor data or in a tensor
name changes no total), positive tokens per second; flags must mean what they say. Anything else ends in
SafetensorsError (library) or cli.Failed (flags) in one sentence."""

from __future__ import annotations

import io
import json
import math
import struct
from contextlib import redirect_stdout

import pytest
import torch
from fuzzkit import JSON, NUMBERS, SPECIALS, byte_mutations, fuzz, outcome, some_replaced
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save
from twinspark.client import budget, cli, forecast
from twinspark.safetensors_io import SafetensorsError

READER = "budget/forecast"
CONFIG = {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32, "vocab_size": 64, "num_experts_per_tok": 2,
          "n_routed_experts": 4}


def _exl3(name: str, k: int, n: int) -> dict:
    return {f"{name}.trellis": torch.ones(k // 16, n // 16, 48, dtype=torch.int16),
            f"{name}.suh": torch.ones(k, dtype=torch.float16), f"{name}.svh": torch.ones(n, dtype=torch.float16)}


TENSORS = {"model.embed_tokens.weight": torch.ones(64, 32, dtype=torch.bfloat16),
           "model.layers.0.input_layernorm.weight": torch.ones(32, dtype=torch.bfloat16),
           **_exl3("model.layers.0.self_attn.q_proj", 32, 32), **_exl3("lm_head", 32, 64),
           **_exl3("model.layers.0.mlp.shared_experts.up_proj", 32, 64),
           **{k: v for e in range(4) for k, v in _exl3(f"model.layers.0.mlp.experts.{e}.gate_proj", 32, 64).items()},
           **_exl3("model.layers.1.mlp.experts.0.down_proj", 64, 32)}  # layer 1 of a 1-layer model: MTP
SHARD = save(TENSORS)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("budget_fuzz") / "ckpt"
    d.mkdir()
    (d / "model-00001-of-00001.safetensors").write_bytes(SHARD)
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d, budget.analyze(d, tp=2, kv_dtype="auto", mem_available=0)


def _folder(scratch, config: bytes | None = None, shard: bytes = SHARD):
    d = scratch.root / "ckpt"
    d.mkdir(parents=True, exist_ok=True)
    scratch.write("ckpt/model-00001-of-00001.safetensors", shard)
    scratch.write("ckpt/config.json", json.dumps(CONFIG).encode() if config is None else config)
    return d


def _sensible(b: budget.Budget, f: forecast.Result | None, valid: budget.Budget) -> str | None:
    numbers = {"kv_token_bytes": b.kv_token_bytes, "kv_tokens": b.kv_tokens, "weights": b.weights_per_rank,
               **{f"per_rank[{k}]": v for k, v in b.per_rank.items()}}
    if f is not None:
        numbers |= {"decode tok/s": f.decode_tok_s, "prefill tok/s": f.prefill_tok_s}
    bad = [k for k, v in numbers.items() if not (math.isfinite(v) and v >= 0)]
    if bad:
        return f"{bad[0]} = {numbers[bad[0]]}"
    if not b.kv_token_bytes > 0 or b.kv_tokens != int(b.kv_pool_bytes // (b.kv_token_bytes * 64)) * 64:
        return f"{b.kv_tokens} KV tokens at {b.kv_token_bytes} B per token"
    if sum(b.total.values()) != sum(valid.total.values()) or b.tensors != valid.tensors:
        return "the shard's bytes are counted differently"
    if f is not None and not f.decode_tok_s > 0:
        return f"{f.decode_tok_s} tok/s"
    budget.report(b)
    if f is not None:
        forecast.report(f, b)
    return None


def _run(d, kv_dtype="auto"):
    b = budget.analyze(d, tp=2, kv_dtype=kv_dtype, mem_available=0)
    return b, forecast.forecast(b)


CONFIG_KEYS = sorted(budget.CONFIG_INTS) + ["architectures", "model_type"]


@fuzz(600)
@given(key=st.sampled_from(CONFIG_KEYS), value=st.one_of(NUMBERS, JSON, st.integers(0, 8)),
       kv_dtype=st.sampled_from(["auto", "fp8", "fp8_ds_mla", "bfloat16", "int3", ""]))
def test_config_values(ckpt, scratch, key, value, kv_dtype):
    _, valid = ckpt
    d = _folder(scratch, json.dumps({**CONFIG, key: value}).encode())
    least = budget.CONFIG_INTS.get(key)
    typed = value is None or (type(value) is int and value >= least) if least is not None else True

    def expect(result):
        if not typed:
            return f"config.json {key}={value!r} was used"
        return _sensible(*result, valid)

    outcome(READER, lambda: _run(d, kv_dtype), SafetensorsError, expect)


@fuzz(300)
@given(form=st.sampled_from(["json", "bytes", "special"]), doc=JSON, raw=st.binary(max_size=40), kind=SPECIALS)
def test_config_files(ckpt, scratch, form, doc, raw, kind):
    _, valid = ckpt
    d = _folder(scratch, json.dumps(doc).encode() if form == "json" else raw)
    if form == "special":
        scratch.special("ckpt/config.json", kind)
    outcome(READER, lambda: _run(d), SafetensorsError, lambda result: _sensible(*result, valid), names="config.json")


@fuzz(500)
@given(mutation=byte_mutations(SHARD, 8 + struct.unpack("<Q", SHARD[:8])[0]))
def test_shard_bytes(ckpt, scratch, mutation):
    _, valid = ckpt
    d = _folder(scratch, shard=mutation[2])
    outcome(READER, lambda: _run(d), SafetensorsError, lambda result: _sensible(*result, valid))


INT_TEXT = st.one_of(st.integers(-3, 5).map(str), st.integers(1, 9), st.sampled_from(["x", "", " 2 ", "2.5", "inf",
                                                                                    "1e3", "nan", "0x2", "٣"]),
                     st.text(max_size=5))
SIZE_TEXT = st.one_of(st.sampled_from(["2.5GiB", "1g", "800MiB", "1024", "0", "-1", "inf", "nan", "1e400", "GiB",
                                       "2.5 GiB", "5kb", "-0.0"]), st.text(max_size=6), NUMBERS.map(str))
NUM_TEXT = st.one_of(st.sampled_from(["0", "1.5", "-1", "inf", "-inf", "nan", "1e400", "x", "3"]), st.text(max_size=5),
                     NUMBERS.map(str))


def _int_or_none(text) -> int | None:
    try:
        return int(str(text).strip())
    except ValueError:
        return None


GOOD_FLAGS = {"tp": "2", "kv_bytes": "2.5GiB", "kv_token_bytes": None, "max_model_len": "600000", "mem_gib": None,
              "overhead_ms": "0", "gbps": "273"}
FLAG_VALUES = {"tp": INT_TEXT, "kv_bytes": SIZE_TEXT, "kv_token_bytes": st.one_of(st.none(), NUM_TEXT),
               "max_model_len": INT_TEXT, "mem_gib": st.one_of(st.none(), NUM_TEXT), "overhead_ms": NUM_TEXT,
               "gbps": NUM_TEXT}


@fuzz(600)
@given(flags=some_replaced(GOOD_FLAGS, FLAG_VALUES, 3), task=st.sampled_from(["budget", "forecast"]))
def test_task_flags(ckpt, flags, task):
    tp, kv_bytes, kv_token_bytes, max_model_len, mem_gib, overhead_ms, gbps = (flags[k] for k in GOOD_FLAGS)
    d, valid = ckpt

    def run():
        with redirect_stdout(io.StringIO()):
            if task == "budget":
                return cli._budget(d, tp, kv_bytes, kv_token_bytes, max_model_len, None, mem_gib, "auto")
            return cli.forecast(d, tp, overhead_ms, gbps)

    def expect(result):
        if task == "forecast":
            ok = (_int_or_none(tp) or 0) >= 1 and math.isfinite(float(overhead_ms)) and float(gbps) > 0 \
                and math.isfinite(float(gbps))
            return None if ok and result == 0 else f"forecast ran with --tp {tp!r} --overhead-ms {overhead_ms!r} " \
                f"--gb10-gbps {gbps!r}"
        if result.tp != _int_or_none(tp) or result.max_model_len != _int_or_none(max_model_len):
            return f"--tp {tp!r} --max-model-len {max_model_len!r} read as {result.tp}, {result.max_model_len}"
        if kv_token_bytes and result.kv_token_bytes != float(kv_token_bytes):
            return f"--kv-token-bytes {kv_token_bytes!r} read as {result.kv_token_bytes}"
        return _sensible(result, None, valid)

    outcome(READER, run, cli.Failed, expect)


@fuzz(30)
@given(kind=SPECIALS, what=st.sampled_from(["folder", "config.json", "shard", "results"]))
def test_paths_that_are_not_files(ckpt, scratch, kind, what):
    _, valid = ckpt
    d = _folder(scratch)
    if what == "folder":
        d = scratch.special("ckpt2", kind)
    elif what == "config.json":
        scratch.special("ckpt/config.json", kind)
    elif what == "shard":
        scratch.special("ckpt/model-00001-of-00001.safetensors", kind)
    results = scratch.special("results.json", kind) if what == "results" else None

    def run():
        with redirect_stdout(io.StringIO()):
            return cli.forecast(d, step_results=results)

    outcome(READER, run, cli.Failed, lambda r: None if what in ("config.json", "results") and kind == "missing"
            else f"forecast ran on a {kind} {what}")
