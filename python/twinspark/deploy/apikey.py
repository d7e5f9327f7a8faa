"""API key: generated with a CSPRNG into a 0600 file in the state dir on first use, or the user's own (API_KEY=<key>,
written to the same file). Contract: `api_key(s)` -> key or None (API_KEY=off). The key only ever travels through
files and process environments (VLLM_API_KEY), never argv, and is never printed; `redact()` masks it in text that
is shown."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from twinspark.fileio import atomic_write

FILE = "api-key"


def key_path(state_dir: Path) -> Path:
    return Path(state_dir) / FILE


def api_key(s, dry_run: bool = False) -> str | None:
    """API_KEY off: None; your own key: it, kept in the key file too (the clients read the key there); generate:
    the key file's key, made on first use."""
    if s.api_key == "off":
        return None
    p = key_path(s.state_dir)
    if s.api_key != "generate":
        if not dry_run and (not p.is_file() or p.read_text().strip() != s.api_key):
            atomic_write(p, s.api_key + "\n", mode=0o600)
        return s.api_key
    if p.is_file():
        os.chmod(p, 0o600)  # repair a copy that lost its mode
        return p.read_text().strip()
    key = "sk-ts-" + secrets.token_urlsafe(32)
    if dry_run:
        return key
    atomic_write(p, key + "\n", mode=0o600)
    return key


def redact(text: str, key: str | None) -> str:
    return text.replace(key, "sk-ts-***") if key else text
