"""Typed deploy config: precedence (flag > environment > .env > recipe > default), one-sentence errors, recipes,
model defaults (issue 12) and .env.example kept in sync with the schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from twinspark.deploy import config
from twinspark.deploy.errors import DeployError
from twinspark.deploy.vllm_args import chat_template_kwargs, generation_override, rank_env, vllm_argv

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.lower() in config.Settings.model_fields:
            monkeypatch.delenv(k)


def test_precedence_flag_env_dotenv_recipe_default(tmp_path, monkeypatch):
    dot = tmp_path / ".env"
    dot.write_text("MAX_NUM_SEQS=3\nMAX_MODEL_LEN=1000\nBLOCK_SIZE=48\n")
    monkeypatch.setenv("MAX_MODEL_LEN", "2000")
    monkeypatch.setenv("BLOCK_SIZE", "96")
    s, where = config.load({"BLOCK_SIZE": "128", "recipe": "exl3-2.9bpw"}, env_file=dot)
    assert (s.block_size, where["BLOCK_SIZE"]) == (128, "flag")
    assert (s.max_model_len, where["MAX_MODEL_LEN"]) == (2000, "environment")
    assert (s.max_num_seqs, where["MAX_NUM_SEQS"]) == (3, ".env")
    assert (s.num_speculative_tokens, where["NUM_SPECULATIVE_TOKENS"]) == (3, "recipe")
    assert (s.ssh_port, where["SSH_PORT"]) == (22, "default")


def test_recipe_chosen_from_env(monkeypatch):
    monkeypatch.setenv("RECIPE", "exl3-2.77bpw")
    s, where = config.load({}, env_file=None)
    assert (s.max_model_len, s.num_speculative_tokens, s.api_port) == (262144, 7, 8000)
    assert where["RECIPE"] == "environment"


def test_published_defaults_of_the_29bpw_recipe():
    s, _ = config.load({"RECIPE": "exl3-2.9bpw"}, env_file=None)
    assert (s.max_model_len, s.max_num_seqs, s.max_num_batched_tokens) == (600000, 2, 1024)
    assert s.kv_cache_bytes == int(2.5 * (1 << 30)) and s.block_size == 64
    assert (s.spec_method, s.num_speculative_tokens) == ("dspark", 3)
    assert s.cuda_graph_sizes.split() == ["1", "2", "3", "4", "6", "8", "12", "18", "24"]
    assert s.served_model_name == "DeepSeek-v4.1-Flash-EXL3" and s.api_port == 8888
    argv = vllm_argv(s, "head", "/m")
    assert argv[argv.index("--speculative-config") + 1] == '{"method": "dspark", "num_speculative_tokens": 3}'
    assert json.loads(argv[argv.index("--compilation-config") + 1])["cudagraph_capture_sizes"][-1] == 24
    for flag in ("--tokenizer-mode", "--tool-call-parser", "--reasoning-parser"):
        assert argv[argv.index(flag) + 1] == "deepseek_v41"
    assert "--enable-auto-tool-choice" in argv and "--enable-prefix-caching" in argv


@pytest.mark.parametrize("recipe", ["exl3-2.9bpw", "exl3-2.77bpw", "tiny-cpu"])
def test_model_defaults_in_every_recipe(recipe):
    s, _ = config.load({"RECIPE": recipe}, env_file=None)
    assert generation_override(s) == {"temperature": 1.0, "top_p": 0.95}
    assert chat_template_kwargs(s) == {"thinking": True, "reasoning_effort": 75}
    argv = vllm_argv(s, "head", "/m")
    assert json.loads(argv[argv.index("--override-generation-config") + 1]) == {"temperature": 1.0, "top_p": 0.95}
    assert json.loads(argv[argv.index("--default-chat-template-kwargs") + 1])["reasoning_effort"] == 75


@pytest.mark.parametrize("value,expected", [("low", 50), ("high", 75), ("max", 100), ("1", 1), ("100", 100),
                                            ("HIGH", 75)])
def test_reasoning_effort_values(value, expected):
    s, _ = config.load({"REASONING_EFFORT": value}, env_file=None)
    assert s.effort == expected


@pytest.mark.parametrize("key,value,words", [
    ("MAX_MODEL_LEN", "1048577", "must be between 1 and 1048576"),
    ("API_PORT", "70000", "TCP port"),
    ("HEAD_IP", "10.0.0.300", "IPv4 address"),
    ("SYNC_MODE", "x", "Unknown setting SYNC_MODE"),
    ("SHIP_MODE", "fast", "'staged', 'stream' or 'auto'"),
    ("SPEC_METHOD", "eagle", "'dspark' or 'none'"),
    ("REASONING_EFFORT", "0", "low, high, max or an integer 1..100"),
    ("REASONING_EFFORT", "medium", "low, high, max or an integer 1..100"),
    ("TOP_P", "0", "(0, 1]"),
    ("VLLM_ENV", "{bad", "JSON object"),
    ("RECIPE", "nope", "Recipe 'nope' was not found"),
])
def test_errors_are_one_sentence(key, value, words):
    with pytest.raises(DeployError) as e:
        config.load({key: value}, env_file=None)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.endswith(".")


def test_error_names_its_source(tmp_path):
    dot = tmp_path / ".env"
    dot.write_text("MAX_MODEL_LEN=2000000\n")
    with pytest.raises(DeployError, match=r"MAX_MODEL_LEN='2000000' \(from \.env\) is invalid.*fix the \.env file .*/\.env\."):
        config.load({}, env_file=dot)


def test_max_model_len_limit_is_inclusive():
    s, _ = config.load({"MAX_MODEL_LEN": 1048576}, env_file=None)
    assert s.max_model_len == 1048576


def test_per_rank_fabric_env():
    s, _ = config.load({"HEAD_IFNAME": "enp1", "WORKER_IFNAME": "enp2", "HEAD_HCAS": "rocep1s0f0",
                        "WORKER_GID_INDEX": 5, "WORKER_HCAS": "rocep1s0f1", "HEAD_IP": "10.0.0.1",
                        "WORKER_IP": "10.0.0.2"}, env_file=None)
    h, w = rank_env(s, "head"), rank_env(s, "worker")
    assert (h["NCCL_SOCKET_IFNAME"], h["GLOO_SOCKET_IFNAME"], h["VLLM_HOST_IP"]) == ("enp1", "enp1", "10.0.0.1")
    assert (w["NCCL_IB_HCA"], w["NCCL_IB_GID_INDEX"], w["VLLM_HOST_IP"]) == ("rocep1s0f1", "5", "10.0.0.2")
    wa = vllm_argv(s, "worker", "/m")
    assert "--headless" in wa and wa[wa.index("--node-rank") + 1] == "1" and "--port" not in wa


def test_env_example_in_sync_with_schema():
    text = (REPO / ".env.example").read_text()
    assert text == config.env_example(), "regenerate: python -m twinspark.deploy.config > .env.example"
    keys = {line[2:].split("=")[0] for line in text.splitlines() if line.startswith("# ") and "=" in line[:40]
            and line[2:].split("=")[0].isupper()}
    assert keys == {k.upper() for k in config.Settings.model_fields}


def test_recipes_only_use_known_keys():
    for p in (REPO / "configs").glob("*.toml"):
        config.read_recipe(str(p))
        s, _ = config.load({"RECIPE": str(p)}, env_file=None)
        assert s.recipe == str(p)


def test_invoke_config_prints_value_and_source(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k.lower() not in config.Settings.model_fields}
    env |= {"MAX_NUM_SEQS": "4", "TWINSPARK_ENV_FILE": ""}  # empty: no .env
    r = subprocess.run([sys.executable, "-m", "invoke", "config", "--recipe", "exl3-2.9bpw", "--set", "BLOCK_SIZE=32"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if line.strip()}
    assert rows["BLOCK_SIZE"] == ["32", "flag"]
    assert rows["MAX_NUM_SEQS"] == ["4", "environment"]
    assert rows["MAX_MODEL_LEN"] == ["600000", "recipe"]
    assert rows["SSH_PORT"] == ["22", "default"]
    bad = subprocess.run([sys.executable, "-m", "invoke", "config", "--set", "MAX_MODEL_LEN=9999999"], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("MAX_MODEL_LEN='9999999' (from flag) is invalid")


def test_fabric_auto_refuses_a_loopback_head_address():
    """Detection runs for real on this host: 127.0.0.1 sits on lo, which NCCL cannot use."""
    from twinspark.deploy import api
    from twinspark.deploy.errors import DeployError
    from twinspark.deploy.hosts import make_hosts

    s, where = config.load({"HEAD_IP": "127.0.0.1", "WORKER_IP": "127.0.0.2"}, env_file=None)
    head, worker = make_hosts(s, dry_run=True)
    with pytest.raises(DeployError, match=r"The head address 127\.0\.0\.1 on lo is not a fabric address: loopback"):
        api.apply_fabric(s, where, head, worker)
    s2, where2 = config.load({"HEAD_IP": "127.0.0.1", "HEAD_IFNAME": "lo"}, env_file=None)
    assert api.apply_fabric(s2, where2, head, worker) is s2  # a user-set fabric key turns detection off


def test_dotenv_line_that_does_not_parse_is_refused_naming_file_and_line(tmp_path):
    dot = tmp_path / "my.env"
    dot.write_text("MAX_NUM_SEQS=3\nthis is not a setting\n")
    with pytest.raises(DeployError) as e:
        config.load({}, env_file=dot)
    assert str(e.value) == (f"The .env file {dot} line 2 is not KEY=VALUE ('this is not a setting'); fix or remove "
                            "that line.")


def test_own_api_key_is_taken_and_never_shown(tmp_path):
    from twinspark.deploy import apikey

    key = "my-own-key-0123456789"
    s, where = config.load({"API_KEY": key, "STATE_DIR": str(tmp_path)}, env_file=None)
    assert apikey.api_key(s) == key and apikey.key_path(tmp_path).read_text().strip() == key
    assert apikey.key_path(tmp_path).stat().st_mode & 0o777 == 0o600
    assert ("API_KEY", "(your key, not shown)", "flag") in config.describe(where, s)
    with pytest.raises(DeployError) as e:
        config.load({"API_KEY": "short secret"}, env_file=None)
    assert "short secret" not in str(e.value)
    assert str(e.value).startswith("API_KEY=(your key, not shown) (from flag) is invalid: must be generate, off, or")


def test_engram_settings_reach_both_ranks_and_invoke_config(tmp_path):
    """The V4.1 recipe's Engram settings (ENGRAM_DIR apart from MODEL_DIR, the pack folder, cache, threads, queue
    depth) reach the vLLM processes of both ranks as the plugin's TWINSPARK_ENGRAM_* variables, and the docker
    runtime mounts both folders read-only; `invoke config` lists them with their defaults."""
    from twinspark.deploy.runtime.docker import DockerRuntime

    s, where = config.load({"RECIPE": "exl3-2.9bpw", "ENGRAM_QUEUE_DEPTH": "64"}, env_file=None)
    assert s.engram_folder == Path("models/DeepSeek-V4.1-Flash-engram") and s.engram_folder != s.model_dir
    for rank in ("head", "worker"):
        env = rank_env(s, rank)
        assert env["TWINSPARK_ENGRAM_DIR"] == str(s.engram_folder.resolve())
        assert env["TWINSPARK_ENGRAM_PACK_DIR"] == str(Path("models/engram-packs").resolve())
        assert (env["TWINSPARK_ENGRAM_QUEUE_DEPTH"], env["TWINSPARK_ENGRAM_THREADS"],
                env["TWINSPARK_ENGRAM_CACHE_GIB"]) == ("64", "16", "0.0")
    argv = " ".join(DockerRuntime(s, None, None).run_argv("worker", "/x.env", False))
    for d in (s.engram_folder.resolve(), Path("models/engram-packs").resolve()):
        assert f"-v {d}:{d}:ro" in argv
    rows = {r[0]: r[1:] for r in config.describe(where, s)}
    assert rows["ENGRAM_CACHE_GIB"] == ("0.0", "default") and rows["ENGRAM_QUEUE_DEPTH"] == ("64", "flag")
    with pytest.raises(DeployError, match="ENGRAM_THREADS"):
        config.load({"ENGRAM_THREADS": "0"}, env_file=None)
    tiny, _ = config.load({"RECIPE": "tiny-cpu"}, env_file=None)
    assert "-engram" not in " ".join(DockerRuntime(tiny, None, None).run_argv("head", "/x.env", False))
