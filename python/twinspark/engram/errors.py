"""The error of the Engram storage layer: one sentence naming the file or setting and what to do."""

from __future__ import annotations


class EngramError(ValueError):
    """A user-fixable problem with Engram files or settings (str() is one sentence that says what to do)."""
