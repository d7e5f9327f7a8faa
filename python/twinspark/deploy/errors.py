"""The one error type of the deploy suite: a user-caused problem stated as one sentence that says what to do.

Tasks catch it and print only the sentence (no traceback); library callers can catch it like any exception."""

from __future__ import annotations


class DeployError(Exception):
    """A failure the user can fix; str() is a single sentence naming what was wrong and what to do."""
