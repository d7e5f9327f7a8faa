"""invoke pi-install on temporary Pi config folders: only our provider changes, backups, no key on disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from twinspark.client import pi
from twinspark.client.http import ClientError

OTHER = {"providers": {"ollama": {"baseUrl": "http://localhost:11434/v1", "api": "openai-completions",
                                  "apiKey": "ollama", "models": [{"id": "llama3.1:8b"}]},
                       "twinspark": {"baseUrl": "http://old:1/v1", "models": [{"id": "old"}]}},
         "someUnknownTopLevelKey": [1, 2, 3]}


def test_fresh_install(tmp_path, monkeypatch):
    secret = "sk-do-not-write-me-0123456789"
    monkeypatch.setenv("TWINSPARK_API_KEY", secret)
    out = pi.install("192.168.100.10:8888", "deepseek-v4.1-flash", config=tmp_path)
    models = json.loads((tmp_path / "models.json").read_text())
    prov = models["providers"]["twinspark"]
    assert prov["baseUrl"] == "http://192.168.100.10:8888/v1" and prov["api"] == "openai-completions"
    assert prov["apiKey"] == "$TWINSPARK_API_KEY"
    assert prov["models"][0]["id"] == "deepseek-v4.1-flash" and prov["models"][0]["contextWindow"] == 600_000
    assert out.backups == [] and not (tmp_path / "settings.json").exists()
    ext = (tmp_path / "extensions" / pi.EXTENSION).read_text()
    assert 'const PROVIDER = "twinspark";' in ext and "before_provider_request" in ext and "max_tokens" in ext
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert secret not in f.read_text(), f
    assert oct((tmp_path / "models.json").stat().st_mode & 0o777) == "0o600"


def test_replaces_only_our_provider_with_backup_and_settings(tmp_path):
    (tmp_path / "models.json").write_text(json.dumps(OTHER))
    (tmp_path / "settings.json").write_text(json.dumps({"enabledModels": ["ollama/llama3.1:8b"], "theme": "dark"}))
    out = pi.install("http://h:8888/v1", "m", config=tmp_path, enable=True, default=True)
    models = json.loads((tmp_path / "models.json").read_text())
    assert models["providers"]["ollama"] == OTHER["providers"]["ollama"]
    assert models["someUnknownTopLevelKey"] == [1, 2, 3]
    assert models["providers"]["twinspark"]["baseUrl"] == "http://h:8888/v1"
    assert list(models["providers"]) == ["ollama", "twinspark"]
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings == {"enabledModels": ["ollama/llama3.1:8b", "twinspark/m"], "theme": "dark",
                        "defaultProvider": "twinspark", "defaultModel": "m"}
    names = sorted(p.name for p in out.backups)
    assert len(names) == 2 and names[0].startswith("models.json.bak-") and names[1].startswith("settings.json.bak-")
    assert json.loads((tmp_path / names[0]).read_text()) == OTHER  # the backup is the old file
    again = pi.install("http://h:8888/v1", "m", config=tmp_path, enable=True, default=True)
    assert again.written == [] and again.backups == [] and len(again.unchanged) == 3  # idempotent
    assert not list(tmp_path.glob(".models.json.*"))  # no temp file left


def test_dry_run_changes_nothing(tmp_path):
    (tmp_path / "models.json").write_text(json.dumps(OTHER))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    out = pi.install("h:1", "m", config=tmp_path, enable=True, dry_run=True)
    assert [p.name for p in out.written] == ["models.json", "settings.json", pi.EXTENSION]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert json.loads((tmp_path / "models.json").read_text()) == OTHER


def test_env_config_dir_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("PI_CODING_AGENT_DIR", str(tmp_path / "pi"))
    pi.install("h:1", "m")
    assert (tmp_path / "pi" / "models.json").is_file()
    (tmp_path / "pi" / "models.json").write_text("{not json")
    with pytest.raises(ClientError, match="is not valid JSON"):
        pi.install("h:1", "m")
    with pytest.raises(ClientError, match="not an environment variable name"):
        pi.install("h:1", "m", config=tmp_path / "x", key_env="A B")


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the extension's logic runs in Pi")
def test_extension_drops_max_tokens_only_for_our_provider(tmp_path):
    pi.install("h:1", "m", config=tmp_path)
    src = (tmp_path / "extensions" / pi.EXTENSION).read_text()
    js = src.split("export default function", 1)[1]
    js = ("const PROVIDER = 'twinspark';\nconst f = function" + js.replace(" as Record<string, unknown>", "")
          .replace("(pi: ExtensionAPI)", "(pi)") + "\nlet h; f({on: (e, fn) => { h = fn; }});\n"
          "const a = h({payload: {model: 'm', max_tokens: 5, max_completion_tokens: 6, x: 1}}, {model: {provider: 'twinspark'}});\n"
          "const b = h({payload: {max_tokens: 5}}, {model: {provider: 'other'}});\n"
          "console.log(JSON.stringify([a, b === undefined]));\n")
    (tmp_path / "t.js").write_text(js)
    out = subprocess.run(["node", str(tmp_path / "t.js")], capture_output=True, text=True, timeout=30, env=os.environ)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"model": "m", "x": 1}, True]


@pytest.mark.vllm
def test_pi_install_writes_the_context_the_server_serves(vllm_server, tmp_path, capsys):
    from twinspark.client import cli

    url, key, model = vllm_server
    assert cli.pi_install(url, config_dir=str(tmp_path), api_key=key) == 0
    entry = json.loads((tmp_path / "models.json").read_text())["providers"]["twinspark"]["models"][0]
    assert (entry["id"], entry["contextWindow"], entry["maxTokens"]) == (model, 256, 256)
    assert "context window 256 tokens: the server's max_model_len" in capsys.readouterr().out
    assert cli.pi_install(url, config_dir=str(tmp_path), api_key=key, context_window=128) == 0  # a flag wins
    entry = json.loads((tmp_path / "models.json").read_text())["providers"]["twinspark"]["models"][0]
    assert (entry["contextWindow"], entry["maxTokens"]) == (128, 128)
