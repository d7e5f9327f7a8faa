"""Chat-template parity on the tiny model: an original encoding script that matches the served ChatML
template reports no difference; one that drops a newline is caught where it differs; absent files skip."""

from __future__ import annotations

import shutil

import pytest
from twinspark.client import template_parity as tp
from twinspark.client.http import ClientError

CHATML = '''
def encode_messages(messages, add_generation_prompt=True, thinking_mode="thinking"):
    out = ""
    for m in messages:
        out += "<|im_start|>" + m["role"] + "{sep}" + str(m["content"]) + "<|im_end|>\\n"
    if add_generation_prompt:
        out += "<|im_start|>assistant\\n"
    return out
'''


@pytest.fixture(scope="module")
def original(tiny_model, tmp_path_factory):
    """The tiny model's tokenizer files plus an encoding script, laid out like the original DeepSeek repo."""
    d = tmp_path_factory.mktemp("original")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / f, d / f)
    (d / "encoding").mkdir()
    (d / "encoding" / "encoding_tiny.py").write_text(CHATML.replace("{sep}", "\\n"))
    (d / "broken.py").write_text(CHATML.replace("{sep}", ""))
    return d


def test_matching_script_reports_no_difference(original, tiny_model):
    p = tp.check(original, template=tiny_model)
    assert not p.skipped and p.ok, tp.report(p)
    assert [r.case for r in p.results] == ["system+user", "multi-turn", "tools", "thinking off", "effort low=50",
                                           "effort high=75", "effort max=100", "effort 30"]
    assert p.script_kwargs == ["add_generation_prompt", "thinking_mode"]  # only what its signature accepts
    assert "all cases render the same" in tp.report(p)


def test_broken_script_is_caught_where_it_differs(original, tiny_model):
    p = tp.check(original, script=original / "broken.py", template=tiny_model)
    assert not p.ok and all(not r.equal for r in p.results)
    first = p.results[0].detail
    # "<|im_start|>system" is 18 characters: the served template has "\n" there, the broken script does not.
    assert first.startswith("first difference at character 18:"), first
    assert "8 of 8 cases differ" in tp.report(p)


def test_absent_files_skip_with_a_reason(tmp_path, tiny_model):
    p = tp.check(tmp_path / "nope", template=tiny_model)
    assert p.skipped and "original model files not found" in p.reason
    p = tp.check(tmp_path, template=tiny_model)
    assert p.skipped and "no encoding script" in p.reason
    assert tp.report(p).startswith("SKIPPED: ")
    assert tp.check(None).skipped


def test_bad_script_and_missing_served_side(original, tmp_path, tiny_model):
    (tmp_path / "enc.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ClientError, match="failed to import"):
        tp.check(original, script=tmp_path / "enc.py", template=tiny_model)
    with pytest.raises(ClientError, match="has no function nope"):
        tp.check(original, function="nope", template=tiny_model)
    with pytest.raises(ClientError, match="give the served side"):
        tp.check(original)


@pytest.mark.vllm
def test_server_template_matches_token_for_token(original, vllm_server):
    url, key, _ = vllm_server
    p = tp.check(original, url=url, api_key=key)
    assert p.ok, tp.report(p)
    bad = tp.check(original, script=original / "broken.py", url=url, api_key=key)
    assert not bad.ok and bad.results[0].detail.startswith("first difference at token ")
