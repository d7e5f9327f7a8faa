"""vLLM command line and environment per rank. Contract: `vllm_argv(s, rank, model_dir)` -> argv list (no secret
in it: the API key reaches vLLM as VLLM_API_KEY in the environment), `rank_env(s, rank)` -> dict."""

from __future__ import annotations

import json
import shlex

from twinspark.deploy import gate
from twinspark.deploy.config import Settings

RANK_INDEX = {"head": 0, "worker": 1}
GATE = "twinspark.deploy.gate.Gate"


def generation_override(s: Settings) -> dict:
    """Recommended sampling (issue 12) through vLLM's generation-config override."""
    return {"temperature": s.temperature, "top_p": s.top_p}


def chat_template_kwargs(s: Settings) -> dict:
    """Thinking on/off and the effort integer (low=50, high=75, max=100) as default chat-template arguments."""
    return {"thinking": s.thinking, "reasoning_effort": s.effort}


def vllm_argv(s: Settings, rank: str, model_dir: str) -> list[str]:
    idx = RANK_INDEX[rank]
    a = [
        s.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--served-model-name", s.served_model_name,
        "--tensor-parallel-size", str(s.tensor_parallel),
        "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--block-size", str(s.block_size),
        "--distributed-executor-backend", s.distributed_backend,
        "--override-generation-config", json.dumps(generation_override(s)),
        "--default-chat-template-kwargs", json.dumps(chat_template_kwargs(s)),
    ]
    if s.tensor_parallel > 1:
        a += ["--nnodes", "2", "--node-rank", str(idx), "--master-addr", s.head_ip, "--master-port", str(s.master_port)]
    if rank == "worker":
        a.append("--headless")
    else:  # the health gate (twinspark.deploy.gate): /health that means serving, requests refused on a split
        a += ["--host", s.api_host, "--port", str(s.api_port), "--middleware", GATE]
    if s.kv_cache_bytes:
        a += ["--kv-cache-memory-bytes", str(s.kv_cache_bytes)]
    if s.spec_method != "none":
        a += ["--speculative-config",
              json.dumps({"method": s.spec_method, "num_speculative_tokens": s.num_speculative_tokens})]
    if s.enforce_eager:
        a.append("--enforce-eager")
    elif s.device == "cuda" and s.cuda_graph_sizes.strip():
        a += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": [int(x) for x in s.cuda_graph_sizes.split()]})]
    if s.tokenizer_mode:
        a += ["--tokenizer-mode", s.tokenizer_mode]
    if s.tool_call_parser:
        a += ["--tool-call-parser", s.tool_call_parser, "--enable-auto-tool-choice"]
    if s.reasoning_parser:
        a += ["--reasoning-parser", s.reasoning_parser]
    a.append("--enable-prefix-caching" if s.enable_prefix_caching else "--no-enable-prefix-caching")
    return a + shlex.split(s.extra_vllm_args)


def rank_env(s: Settings, rank: str) -> dict[str, str]:
    """Per-rank fabric variables (NCCL/GLOO interface, HCA, GID index, VLLM_HOST_IP), the head's health file
    (TWINSPARK_HEALTH_FILE), the memory hooks' settings (TWINSPARK_DROP_PAGE_CACHE, _MODEL_DIR, _RELEASE_TOKENS,
    _RELEASE_BELOW_GIB, _LONG_PREFILL_TOKENS: twinspark.memory.hooks), the Engram tables' (TWINSPARK_ENGRAM_*), plus
    the user's extras (vllm_env / head_env / worker_env: e.g. TWINSPARK_PLAN or TWINSPARK_FORCE_REFERENCE reach the
    ranks that way)."""
    ip, ifname, hcas, gid = (
        (s.head_ip, s.head_ifname, s.head_hcas, s.head_gid_index) if rank == "head"
        else (s.worker_ip, s.worker_ifname, s.worker_hcas, s.worker_gid_index)
    )
    env = {"VLLM_HOST_IP": ip, "PYTHONUNBUFFERED": "1"}
    if rank == "head":
        env[gate.ENV] = str(gate.path_for(s.state_dir))
    if ifname:
        env |= {"NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname}
    if hcas:
        env |= {"NCCL_IB_HCA": hcas, "NCCL_IB_GID_INDEX": str(gid)}
    # twinspark.memory hooks inside vLLM (see twinspark.memory.hooks): page-cache drop and allocator release
    model_dir = s.model_dir if rank == "head" else (s.worker_model_dir or s.model_dir)
    env |= {"TWINSPARK_DROP_PAGE_CACHE": "1" if s.drop_page_cache else "0", "TWINSPARK_MODEL_DIR": str(model_dir),
            "TWINSPARK_RELEASE_TOKENS": str(s.release_tokens), "TWINSPARK_RELEASE_BELOW_GIB": str(s.release_below_gib),
            "TWINSPARK_LONG_PREFILL_TOKENS": str(s.long_prefill_tokens)}
    env |= s.engram_env()  # DeepSeek V4.1's Engram tables (the same paths on both nodes)
    return env | s.vllm_env | (s.head_env if rank == "head" else s.worker_env)
