"""DeepSeek V4.1 Flash as the published EXL3 pack stores it: dimensions, tensor names and per-tensor K.

One source of truth for the tiny V4.1 maker (``twinspark.tiny_v41``), the shape-only maker at the real dimensions,
and the tests. Every name, dimension and rate comes from shared/docs/deepseek-v41.md (the vLLM 0.32 module table
and the published quant's K table); where the doc says a value is unknown, the constant below says so.

``V41Spec.real()`` is the published model; ``V41Spec.tiny()`` keeps the structure (head_dim 512 / RoPE 64, which
vLLM's compressor asserts; grouped ``wo_a``; ratio-2 and ratio-1 compressed layers; owning and non-owning
indexers; Engram layers; DSpark draft layers) at dimensions a CPU builds in seconds, with every linear dimension a
multiple of 128 per rank at tensor parallel 2 (EXL3 Hadamard blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Unknown in the docs (deepseek-v41.md section 1): the exact K of the compressor, indexer wq_b and MTP
# non-expert tensors, and whether the DSpark Markov / confidence heads are EXL3 in the pack. We use the family
# defaults the doc gives (attention 5, MTP 4) and keep the DSpark heads dense.
UNKNOWN_K = ("attn.compressor.*", "attn.indexer.wq_b", "mtp.* non-expert linears", "mtp.*.markov_head / "
             "confidence_head (kept dense)")


@dataclass(frozen=True)
class Linear:
    """One stored EXL3 matrix: y = x @ W, W is (k, n)."""

    name: str
    k: int
    n: int
    K: float
    cls: str  # module class for budgets: attention, compressor, indexer, experts, shared, engram, head, mtp


@dataclass(frozen=True)
class Dense:
    """One stored native tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype: BF16, F32
    cls: str


@dataclass(frozen=True)
class V41Spec:
    hidden: int
    vocab: int
    layers: int
    heads: int
    q_lora: int
    o_groups: int
    o_lora: int
    compress_ratios: tuple[int, ...]  # one per backbone layer, then one per MTP layer
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int
    candidate_topk_blocks: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    engram_layers: tuple[int, ...]
    engram_vocab_size: int
    engram_heads: int
    engram_max_ngram: int
    engram_head_dim: int
    engram_compressed_vocab: int
    mtp_layers: int
    dspark_target_layers: tuple[int, ...]
    dspark_markov_rank: int
    dspark_experts: int
    dspark_top_k: int
    max_position: int
    sliding_window: int = 128
    head_dim: int = 512
    rope_dim: int = 64
    hc_mult: int = 4
    # K per family (deepseek-v41.md section 2); routed/shared per layer through the functions below
    k_attn: float = 5
    k_head: float = 6
    k_indexer_wk: float = 8
    k_mtp: float = 4
    k_routed_low_layers: tuple[int, ...] = field(default=tuple(range(18, 23)))  # routed K=2 there, else 3
    k_shared_low_layers: tuple[int, ...] = field(default=tuple(range(11, 29)))  # shared K=4 there, else 5
    k_engram: tuple[float, ...] = (5, 4)  # Engram wkv per Engram layer

    @classmethod
    def real(cls) -> V41Spec:
        return cls(hidden=5120, vocab=129280, layers=40, heads=64, q_lora=1280, o_groups=8, o_lora=1024,
                   compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0), kv_sources=(2, 8, 14, 20),
                   index_sources=(2, 8, 14, 20, 24, 28, 32, 36), candidate_source=20, candidate_topk_blocks=2048,
                   index_heads=32, index_head_dim=128, index_topk=512, experts=384, top_k=6, moe_inter=2304,
                   shared_inter=2304, engram_layers=(1, 14), engram_vocab_size=16_000_000, engram_heads=8,
                   engram_max_ngram=4, engram_head_dim=256, engram_compressed_vocab=99092, mtp_layers=3,
                   dspark_target_layers=(37, 38, 39), dspark_markov_rank=256, dspark_experts=128, dspark_top_k=3,
                   max_position=1_048_576)

    @classmethod
    def tiny(cls) -> V41Spec:
        # 5 layers: 0-1 sliding window, 2 ratio-2 kv+index source, 3 ratio-1 kv+index+candidate source,
        # 4 ratio-1 index consumer (no wk); Engram at 1 and 3; one DSpark layer. Routed K=2 on layer 2 and
        # shared K=4 on layers 1-2 stand for the published exceptions.
        return cls(hidden=256, vocab=512, layers=5, heads=4, q_lora=256, o_groups=2, o_lora=128,
                   compress_ratios=(0, 0, 2, 1, 1, 0), kv_sources=(2, 3), index_sources=(2, 3, 4),
                   candidate_source=3, candidate_topk_blocks=4, index_heads=2, index_head_dim=128, index_topk=16,
                   experts=8, top_k=2, moe_inter=256, shared_inter=256, engram_layers=(1, 3),
                   engram_vocab_size=1000, engram_heads=2, engram_max_ngram=4, engram_head_dim=256,
                   engram_compressed_vocab=437, mtp_layers=1, dspark_target_layers=(2, 3, 4),
                   dspark_markov_rank=128, dspark_experts=4, dspark_top_k=2, max_position=4096,
                   k_routed_low_layers=(2,), k_shared_low_layers=(1, 2))

    # ------------------------------------------------------------------------------------------- derived sizes
    @property
    def group_in(self) -> int:
        """wo_a input width per group: heads * head_dim / groups."""
        return self.heads * self.head_dim // self.o_groups

    def k_routed(self, layer: int) -> float:
        return 2 if layer in self.k_routed_low_layers else 3

    def k_shared(self, layer: int) -> float:
        return 4 if layer in self.k_shared_low_layers else 5

    @property
    def engram_hash_cols(self) -> int:
        return (self.engram_max_ngram - 1) * self.engram_heads

    def engram_head_sizes(self) -> dict[int, tuple[int, ...]]:
        """Rows of each hash head per Engram layer (twinspark.engram.layout.v41_head_sizes)."""
        from twinspark.engram.layout import v41_head_sizes

        return v41_head_sizes(self.engram_layers, self.engram_vocab_size, self.engram_heads, self.engram_max_ngram)

    # ---------------------------------------------------------------------------------------------- the tensors
    def _layer(self, p: str, layer: int, mtp: bool) -> tuple[list[Linear], list[Dense]]:
        h, lin, den = self.hidden, [], []
        k_attn = self.k_mtp if mtp else self.k_attn
        cls_attn = "mtp" if mtp else "attention"
        lin += [Linear(f"{p}.attn.wq_a", h, self.q_lora, k_attn, cls_attn),
                Linear(f"{p}.attn.wkv", h, self.head_dim, k_attn, cls_attn),
                Linear(f"{p}.attn.wq_b", self.q_lora, self.heads * self.head_dim, k_attn, cls_attn)]
        lin += [Linear(f"{p}.attn.wo_a.slice.{g}", self.group_in, self.o_lora, k_attn, cls_attn)
                for g in range(self.o_groups)]
        lin.append(Linear(f"{p}.attn.wo_b", self.o_groups * self.o_lora, h, k_attn, cls_attn))
        den += [Dense(f"{p}.attn.q_norm.weight", (self.q_lora,), "BF16", "norms"),
                Dense(f"{p}.attn.kv_norm.weight", (self.head_dim,), "BF16", "norms"),
                Dense(f"{p}.attn.attn_sink", (self.heads,), "F32", "attention")]
        if not mtp and layer in self.kv_sources:
            lin.append(Linear(f"{p}.attn.compressor.wkv", h, self.head_dim, self.k_attn, "compressor"))
            if self.compress_ratios[layer] == 2:
                lin.append(Linear(f"{p}.attn.compressor.wgate", h, self.head_dim, self.k_attn, "compressor"))
            den.append(Dense(f"{p}.attn.compressor.norm.weight", (self.head_dim,), "BF16", "norms"))
        if not mtp and layer in self.index_sources:
            lin.append(Linear(f"{p}.attn.indexer.wq_b", self.q_lora, self.index_heads * self.index_head_dim,
                              self.k_attn, "indexer"))
            den.append(Dense(f"{p}.attn.indexer.weights_proj.weight", (self.index_heads, h), "BF16", "indexer"))
            if layer in self.kv_sources:
                lin.append(Linear(f"{p}.attn.indexer.wk", self.head_dim, self.index_head_dim, self.k_indexer_wk,
                                  "indexer"))
                den.append(Dense(f"{p}.attn.indexer.k_norm.weight", (self.index_head_dim,), "BF16", "norms"))
        experts = self.dspark_experts if mtp else self.experts
        k_exp = self.k_mtp if mtp else self.k_routed(layer)
        for e in range(experts):
            for w, k, n in (("w1", h, self.moe_inter), ("w3", h, self.moe_inter), ("w2", self.moe_inter, h)):
                lin.append(Linear(f"{p}.ffn.experts.{e}.{w}", k, n, k_exp, "mtp" if mtp else "experts"))
        k_sh = self.k_mtp if mtp else self.k_shared(layer)
        for w, k, n in (("w1", h, self.shared_inter), ("w3", h, self.shared_inter), ("w2", self.shared_inter, h)):
            lin.append(Linear(f"{p}.ffn.shared_experts.{w}", k, n, k_sh, "mtp" if mtp else "shared"))
        den += [Dense(f"{p}.ffn.gate.weight", (experts, h), "BF16", "router"),
                Dense(f"{p}.ffn.gate.bias", (experts,), "F32", "router"),
                Dense(f"{p}.ffn.gate.bias_vl", (experts,), "F32", "router"),  # image tokens' routing bias
                Dense(f"{p}.attn_norm.weight", (h,), "BF16", "norms"),
                Dense(f"{p}.ffn_norm.weight", (h,), "BF16", "norms")]
        mix, hc_dim = (2 + self.hc_mult) * self.hc_mult, self.hc_mult * h
        for part in ("attn", "ffn"):
            den += [Dense(f"{p}.hc_{part}_fn", (mix, hc_dim), "F32", "hc"),
                    Dense(f"{p}.hc_{part}_base", (mix,), "F32", "hc"),
                    Dense(f"{p}.hc_{part}_scale", (3,), "F32", "hc")]
        if not mtp and layer in self.engram_layers:
            i = self.engram_layers.index(layer)
            lin.append(Linear(f"{p}.engram.wkv", self.engram_hash_cols * self.engram_head_dim,
                              h * (self.hc_mult + 1), self.k_engram[i % len(self.k_engram)], "engram"))
            den += [Dense(f"{p}.engram.q_weight", (self.hc_mult, h), "BF16", "engram"),
                    Dense(f"{p}.engram.k_weight", (self.hc_mult, h), "BF16", "engram")]
        return lin, den

    def tensors(self) -> tuple[list[Linear], list[Dense]]:
        """Every EXL3 matrix and every native tensor of the text model and its DSpark draft, in file order."""
        h = self.hidden
        lin, den = [], [Dense("embed.weight", (self.vocab, h), "BF16", "embedding"),
                         Dense("norm.weight", (h,), "BF16", "norms")]
        # the VL wrapper's image markers (its vision tower itself is not written: serve with no image input)
        den += [Dense(f"image_{m}", (h,), "F32", "embedding") for m in ("start", "end", "newline")]
        for layer in range(self.layers):
            a, b = self._layer(f"layers.{layer}", layer, mtp=False)
            lin += a
            den += b
        for i in range(self.mtp_layers):
            a, b = self._layer(f"mtp.{i}", self.layers + i, mtp=True)
            lin += a
            den += b
        # DSpark heads: context combiner on mtp.0, head stack on the last mtp layer (vLLM dspark.py remap)
        last = f"mtp.{self.mtp_layers - 1}"
        lin.append(Linear("mtp.0.main_proj", h * len(self.dspark_target_layers), h, self.k_mtp, "mtp"))
        den += [Dense("mtp.0.main_norm.weight", (h,), "BF16", "norms"),
                Dense(f"{last}.norm.weight", (h,), "BF16", "norms"),
                Dense(f"{last}.markov_head.embed.weight", (self.vocab, self.dspark_markov_rank), "BF16", "mtp"),
                Dense(f"{last}.markov_head.head.weight", (self.vocab, self.dspark_markov_rank), "BF16", "mtp"),
                Dense(f"{last}.confidence_head.proj.weight", (1, h + self.dspark_markov_rank), "F32", "mtp")]
        lin.append(Linear("head", h, self.vocab, self.k_head, "head"))
        return lin, den

    # ------------------------------------------------------------------------------------------------ config.json
    def text_config(self) -> dict:
        rows = [sum(s) for s in self.engram_head_sizes().values()]
        return {
            "hidden_size": self.hidden, "vocab_size": self.vocab, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_dim, "q_lora_rank": self.q_lora, "o_lora_rank": self.o_lora,
            "o_groups": self.o_groups, "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios), "kv_source_layer_ids": list(self.kv_sources),
            "index_source_layer_ids": list(self.index_sources),
            "candidate_source_layer_id": self.candidate_source,
            "candidate_topk_blocks": self.candidate_topk_blocks, "candidate_block_size": 8,
            "index_n_heads": self.index_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "n_routed_experts": self.experts,
            "num_experts_per_tok": self.top_k, "moe_intermediate_size": self.moe_inter, "n_shared_experts": 1,
            "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
            "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu", "n_group": 1,
            "topk_group": 1, "hc_mult": self.hc_mult, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 16.0,
                             "original_max_position_embeddings": self.max_position // 16,
                             "beta_fast": 32, "beta_slow": 1},
            "max_position_embeddings": self.max_position, "tie_word_embeddings": False,
            "engram_layer_ids": list(self.engram_layers), "engram_num_embeddings": rows,
            "engram_vocab_size": self.engram_vocab_size,
            "engram_n_heads": self.engram_heads, "engram_max_ngram_size": self.engram_max_ngram,
            "engram_head_dim": self.engram_head_dim,
            "engram_compressed_vocab_size": self.engram_compressed_vocab, "engram_pad_token_id": 2,
            "num_nextn_predict_layers": self.mtp_layers, "dspark_block_size": 5,
            "dspark_target_layer_ids": list(self.dspark_target_layers),
            "dspark_markov_rank": self.dspark_markov_rank, "dspark_n_routed_experts": self.dspark_experts,
            "dspark_num_experts_per_tok": self.dspark_top_k, "dspark_noise_token_id": self.vocab - 1,
        }

