"""Fixtures of the deploy suite: the two-host lab (root only), the served model, and a settings environment that
points the deploy tasks at both. The helpers the tests share (invoke, deploy_flags, read_state, ...) are in lab.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lab import Lab, deploy_flags, lab_reason  # noqa: E402
from models import make_model, make_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = lab_reason()
    if reason:
        pytest.skip(reason)
    lab = Lab(tmp_path_factory.mktemp("lab"))
    try:
        lab.up()
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The model the lab serves. TWINSPARK_LAB_MODEL=plugin switches to twinspark.tiny.make_tiny (the plugin's
    tiny EXL3 model); the default is a tiny random Llama made in-process."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    if os.environ.get("TWINSPARK_LAB_MODEL", "llama") == "plugin":
        return make_model(out)
    return make_tiny_llama(out)


@pytest.fixture
def lab_flags(lab, tmp_path, tiny_model) -> dict[str, str]:
    """deploy_flags for one test, in its own tmp_path."""
    return deploy_flags(lab, tmp_path, tiny_model)
