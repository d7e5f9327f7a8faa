"""invoke budget on generated headers shaped like the real 39-shard 2.9 bpw pack (sparse files: no tensor data)."""

from __future__ import annotations

import math

import fake_checkpoint as fake  # noqa: E402  (tests/client is on sys.path through rootdir conftest discovery)
import pytest
from twinspark.client import budget
from twinspark.safetensors_io import SafetensorsError

GiB = 1 << 30


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41")
    items = fake.write_v41_pack(root / "pack")
    engram = fake.write_engram_shards(root / "engram")
    return root, items, engram


def _expected(items: dict, tp: int, layers: int) -> dict[str, int]:
    """Per-rank bytes by class, computed from the generator's own list (independent of the header reader)."""
    out = dict.fromkeys(budget.CLASSES, 0)
    for name, (dt, shape) in items.items():
        b = fake.nbytes(dt, shape)
        out[budget.classify(name, layers)] += b if budget.replicated(name) else math.ceil(b / tp)
    return out


def test_classify_names():
    c = budget.classify
    assert c("model.layers.3.mlp.experts.17.down_proj.trellis", 42) == "routed experts"
    assert c("model.layers.3.mlp.shared_experts.up_proj.suh", 42) == "shared experts"
    assert c("model.layers.3.self_attn.kv_b_proj.svh", 42) == "attention"
    assert c("model.layers.3.self_attn.indexer.wq_b.trellis", 42) == "compressor + indexer"
    assert c("layers.2.attn.compressor.wgate.trellis", 40) == "compressor + indexer"
    assert c("lm_head.trellis", 42) == "lm_head"
    assert c("model.layers.42.mlp.experts.0.up_proj.trellis", 42) == "MTP"  # the block after the last layer
    assert c("mtp.0.enorm.weight") == "MTP"
    assert c("layers.14.engram.embed.weight") == "Engram tables"
    assert c("layers.14.engram.wkv.trellis") == "Engram"  # in the pack, loaded
    assert c("model.embed_tokens.weight", 42) == "other" and c("model.layers.3.mlp.gate.weight", 42) == "other"
    assert budget.replicated("model.layers.3.mlp.gate.weight")
    assert budget.replicated("model.layers.3.self_attn.q_a_proj.trellis")
    assert not budget.replicated("model.layers.3.mlp.experts.1.gate_proj.trellis")


def test_budget_of_the_v41_pack_at_tp2(pack):
    root, items, engram = pack
    b = budget.analyze(root / "pack", tp=2, engram_dir=root / "engram", mem_available=119 * GiB)
    assert b.shards == 41 and b.tensors == len(items) + len(engram)
    total = sum(fake.nbytes(*v) for v in items.values())
    assert 190 * GiB < total < 200 * GiB  # ~197 GiB like the real pack
    want = _expected({**items, **engram}, 2, fake.LAYERS)
    assert b.per_rank == want
    assert b.total["Engram tables"] == sum(fake.nbytes(*v) for v in engram.values())  # ~190 GiB, listed apart
    assert 95 * GiB < b.weights_per_rank < 104 * GiB  # the deployment notes say ~99.5 GiB per rank
    assert b.per_rank["routed experts"] > 0.9 * b.weights_per_rank
    # fp8_ds_mla on V4.1: the launcher's 2.5 GiB pool holds 774,400 tokens; a 600k context fits.
    assert b.kv_tokens == 774_400 and b.context_fits
    assert b.preflight_needs == b.weights_per_rank + 12 * GiB
    assert b.mem_after_boot == 119 * GiB - b.weights_per_rank - b.kv_pool_bytes - 6 * GiB
    text = budget.report(b)
    assert "774,400 tokens" in text and "context 600,000: fits" in text and "Engram" in text


def test_tp1_and_a_context_that_does_not_fit(pack):
    root, items, _ = pack
    b = budget.analyze(root / "pack", tp=1, max_model_len=1_048_576, kv_bytes=1 * GiB, mem_available=100 * GiB)
    assert b.per_rank == _expected(items, 1, fake.LAYERS)
    assert b.kv_tokens == int(GiB // (b.kv_token_bytes * 64)) * 64 < 1_048_576 and not b.context_fits
    assert "does NOT fit" in budget.report(b) and "will not boot" in budget.report(b)
    assert "no Engram tensors found" in budget.report(b)


def test_kv_cost_from_generic_configs():
    mla = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64}
    assert budget.kv_token_bytes(mla, "fp8_ds_mla", 2)[0] == 656 * 61
    assert budget.kv_token_bytes(mla, "auto", 2)[0] == 576 * 2 * 61
    gqa = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 256}
    assert budget.kv_token_bytes(gqa, "auto", 2)[0] == 2 * 2 * 64 * 2 * 2  # K+V, 2 heads per rank, bf16
    with pytest.raises(SafetensorsError, match="does not apply"):
        budget.kv_token_bytes(gqa, "fp8_ds_mla", 2)


def test_truncated_shard_and_missing_dir(pack, tmp_path):
    root, _, _ = pack
    with pytest.raises(SafetensorsError, match="is not a directory"):
        budget.analyze(tmp_path / "nope")
    bad = tmp_path / "bad"
    fake.write_shards(bad, {"model.layers.0.mlp.experts.0.up_proj.trellis": ("I16", [320, 144, 48])}, 1)
    shard = next(bad.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    with pytest.raises(SafetensorsError, match="truncated"):
        budget.analyze(bad)


def test_budget_of_the_real_dimension_shape_only_pack(tmp_path):
    """`invoke budget` on the published pack's names at V4.1's real dimensions (sparse shards): per-rank bytes by
    module class at TP 2 equal what the module table (shared/docs/deepseek-v41.md section 3) says each rank keeps."""
    from twinspark.exl3.reference import words_per_tile
    from twinspark.tiny_v41 import make_shape_only_v41
    from twinspark.v41_layout import V41Spec

    spec = V41Spec.real()
    b = budget.analyze(make_shape_only_v41(tmp_path / "real"), tp=2, mem_available=121 * GiB)
    lin, den = spec.tensors()
    # replicated at TP 2: fused wq_a + wkv, compressor, indexer, the draft's main_proj; the rest splits in half
    whole = ("attn.wq_a", "attn.wkv", "compressor.", "indexer.", "main_proj")
    want = 0
    for m in lin:
        nbytes = (m.k // 16) * (m.n // 16) * words_per_tile(m.K) * 2 + (m.k + m.n) * 2 + 4
        want += nbytes if any(w in m.name for w in whole) else math.ceil(nbytes / 2)
    split_dense = ("embed.weight", "attn_sink")  # vocabulary rows, heads: split; the rest replicated
    for d in den:
        nbytes = math.prod(d.shape) * (2 if d.dtype == "BF16" else 4)
        want += math.ceil(nbytes / 2) if d.name.endswith(split_dense) and "markov" not in d.name \
            else nbytes
    assert abs(b.weights_per_rank - want) < 0.001 * want, (b.weights_per_rank / GiB, want / GiB)
    assert 95 * GiB < b.weights_per_rank < 100 * GiB  # seed A's weight budget: 99.5 GiB per rank with the vision tower
    text = budget.report(b)
    for cls in ("routed experts", "shared experts", "attention", "compressor + indexer", "lm_head", "MTP", "Engram"):
        assert cls in text
