"""The tiny model builder and its pure-torch reference forward (no server)."""

from __future__ import annotations

import hashlib

import pytest
import torch

pytestmark = pytest.mark.vllm


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_make_tiny_is_deterministic_and_has_several_k(tiny, tmp_path):
    from safetensors import safe_open
    from twinspark.exl3 import reference as ref
    from twinspark.tiny import make_tiny

    again = make_tiny(tmp_path / "again")
    for sub in ("exl3", "bf16"):
        assert _sha(getattr(tiny, sub) / "model.safetensors") == _sha(getattr(again, sub) / "model.safetensors")
        assert _sha(getattr(tiny, sub) / "tokenizer.json") == _sha(getattr(again, sub) / "tokenizer.json")
    with safe_open(str(tiny.exl3 / "model.safetensors"), "pt") as f:
        rates = {n: ref.rate_from_last_dim(f.get_slice(n).get_shape()[-1]) for n in f.keys() if n.endswith("trellis")}
    assert rates["lm_head.trellis"] == 6
    assert rates["model.layers.0.self_attn.q_proj.trellis"] == 5
    assert rates["model.layers.0.mlp.experts.3.up_proj.trellis"] == 2
    assert rates["model.layers.1.mlp.experts.3.up_proj.trellis"] == 3
    assert rates["model.layers.1.mlp.shared_expert.down_proj.trellis"] == 4


def test_bf16_original_is_the_dequantized_exl3_model(tiny, reference):
    from safetensors import safe_open

    with safe_open(str(tiny.bf16 / "model.safetensors"), "pt") as f:
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts.5.down_proj", "lm_head"):
            want = reference.w[f"{name}.weight"].to(torch.bfloat16)  # dequantized from the EXL3 file
            assert torch.equal(f.get_tensor(f"{name}.weight"), want), name
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.bias"),
                           reference.w["model.layers.0.self_attn.q_proj.bias"].to(torch.bfloat16))


def test_reference_forward_matches_transformers(tiny, tokenizer):
    transformers = pytest.importorskip("transformers")
    from twinspark.tiny import TinyReference

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny.bf16), dtype=torch.float32)
    ids = tokenizer.encode("the model token expert layer").ids
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].double()
    got = TinyReference(tiny.bf16).logits(ids)
    assert (got - want).abs().max().item() < 1e-4  # float32 (transformers) vs float64 (reference)
