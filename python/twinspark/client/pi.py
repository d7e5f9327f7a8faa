"""Wire the Pi coding agent to our endpoint: add or replace only our provider in Pi's models.json (timestamped
backup, atomic write), optionally enable the model and make it the default in settings.json, and install the
extension that drops max_tokens from our provider's requests.

The API key is never written: models.json holds ``"$TWINSPARK_API_KEY"`` (Pi resolves ``$VAR`` from the
environment at request time). Pi's config folder: ``--config-dir``, else $PI_CODING_AGENT_DIR, else ~/.pi/agent.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from twinspark.client.http import API_KEY_ENV, ClientError
from twinspark.fileio import atomic_write

PROVIDER = "twinspark"
EXTENSION = "twinspark-drop-max-tokens.ts"


@dataclass
class Installed:
    written: list[Path] = field(default_factory=list)
    backups: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)


def config_dir(explicit: str | os.PathLike | None = None) -> Path:
    if explicit:
        return Path(explicit)
    if os.environ.get("PI_CODING_AGENT_DIR"):
        return Path(os.environ["PI_CODING_AGENT_DIR"])
    return Path.home() / ".pi" / "agent"


def provider_entry(url: str, model: str, *, key_env: str = API_KEY_ENV, context_window: int = 600_000,
                   max_tokens: int = 32_768, reasoning: bool = True, name: str = "twinspark") -> dict:
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    if not base.startswith(("http://", "https://")):
        base = "http://" + base
    return {
        "name": name,
        "baseUrl": base,
        "api": "openai-completions",
        "apiKey": f"${key_env}",  # the variable's name: Pi reads its value at request time
        "compat": {"supportsDeveloperRole": False},  # vLLM chat templates know system, not developer
        "models": [{"id": model, "name": f"{model} (twinspark)", "reasoning": reasoning, "input": ["text"],
                    "contextWindow": context_window, "maxTokens": max_tokens,
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}],
    }


def _load(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text() or "{}")
    except ValueError as e:
        raise ClientError(f"{path} is not valid JSON ({e}); fix or move it, then run pi-install again") from None
    if not isinstance(data, dict):
        raise ClientError(f"{path} does not hold a JSON object; fix or move it, then run pi-install again")
    return data


def _write(path: Path, text: str, stamp: str, out: Installed, dry_run: bool) -> None:
    """Backup (timestamped copy) then atomic replace; nothing at all when the content is unchanged."""
    if path.exists() and path.read_text() == text:
        out.unchanged.append(path)
        return
    if dry_run:
        out.written.append(path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        backup = path.with_name(f"{path.name}.bak-{stamp}")
        shutil.copy2(path, backup)
        out.backups.append(backup)
    atomic_write(path, text, mode=0o600)
    out.written.append(path)


def install(url: str, model: str, *, config: str | os.PathLike | None = None, key_env: str = API_KEY_ENV,
            enable: bool = False, default: bool = False, context_window: int = 600_000, max_tokens: int = 32_768,
            dry_run: bool = False) -> Installed:
    """Add/replace our provider (and nothing else) in models.json; settings.json only with enable/default."""
    if not key_env.replace("_", "").isalnum():
        raise ClientError(f"--key-env {key_env!r} is not an environment variable name")
    d = config_dir(config)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Installed()
    models_path = d / "models.json"
    models = _load(models_path)
    providers = models.setdefault("providers", {})
    if not isinstance(providers, dict):
        raise ClientError(f"{models_path}: 'providers' is not an object; fix the file, then run pi-install again")
    providers[PROVIDER] = provider_entry(url, model, key_env=key_env, context_window=context_window,
                                         max_tokens=max_tokens)
    _write(models_path, json.dumps(models, indent=2) + "\n", stamp, out, dry_run)
    if enable or default:
        settings_path = d / "settings.json"
        settings = _load(settings_path)
        ref = f"{PROVIDER}/{model}"
        if enable:
            enabled = settings.get("enabledModels")
            enabled = list(enabled) if isinstance(enabled, list) else []
            if ref not in enabled:
                enabled.append(ref)
            settings["enabledModels"] = enabled
        if default:
            settings["defaultProvider"] = PROVIDER
            settings["defaultModel"] = model
        _write(settings_path, json.dumps(settings, indent=2) + "\n", stamp, out, dry_run)
    ext = resources.files("twinspark.client").joinpath("pi_extension", EXTENSION).read_text()
    _write(d / "extensions" / EXTENSION, ext.replace("__PROVIDER__", PROVIDER), stamp, out, dry_run)
    return out
