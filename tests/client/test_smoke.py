"""invoke smoke against a real vLLM server serving the tiny random model: smoke knows it (served as "tiny") and checks
what it can do (it answers, a grammar-forced answer and tool call parse) instead of 17*19; asked as a real model, the
17*19 check FAILs and says what came back."""

from __future__ import annotations

import pytest
from twinspark.client import smoke
from twinspark.client.http import Api, ClientError


def test_image_url_and_bad_tool_choice(tmp_path):
    png = tmp_path / "dot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 8)
    assert smoke._image_url(str(png)) == "data:image/png;base64,iVBORw0KGgoAAAAAAAAAAA=="
    assert smoke._image_url("https://example.org/a.jpg") == "https://example.org/a.jpg"
    with pytest.raises(ClientError, match="does not exist"):
        smoke._image_url(str(tmp_path / "missing.png"))
    with pytest.raises(ClientError, match="is not one of auto, required, named"):
        smoke.check_tool(None, tool_choice="sometimes")


@pytest.mark.vllm
def test_smoke_against_tiny_model(vllm_server, tmp_path):
    url, key, model = vllm_server
    with Api(url, api_key=key) as api:
        assert api.model == model and smoke.is_tiny(api)
        checks = smoke.run(api, tool_choice="auto", image=None)
        full = smoke.run(api, tool_choice="named", tiny=False)  # the real model's checks against random weights
    by = {c.name: c for c in checks}
    assert by["answers"].status == "PASS" and by["answers"].detail == "8 of 8 tokens (random weights: the text is " \
        "not checked)"
    assert by["grammar-forced answer"].status == "PASS", by["grammar-forced answer"].detail
    assert by["17*19 = 323 (thinking off)"].status == "SKIP"
    assert by["17*19 = 323 (thinking off)"].detail == "random weights cannot know it"
    assert by["tool call"].status == "PASS", by["tool call"].detail  # auto becomes named: forced by grammar
    assert by["tool call"].detail.startswith("get_weather(")
    assert by["image request"].status == "SKIP"
    assert smoke.passed(checks)
    real = {c.name: c for c in full}
    assert real["17*19 = 323 (thinking off)"].status == "FAIL"  # a random model: honest failure, with its answer
    assert real["17*19 = 323 (thinking off)"].detail.startswith(("answer '", "empty answer"))
    assert not smoke.passed(full)


@pytest.mark.vllm
def test_smoke_wrong_key_and_unreachable(vllm_server):
    url, _, _ = vllm_server
    with Api(url, api_key="wrong") as api, pytest.raises(ClientError, match=r"401 Unauthorized\): pass --api-key"):
        smoke.run(api)
    with Api(url) as api, pytest.raises(ClientError, match="401"):
        smoke.run(api)
    with Api("127.0.0.1:9", api_key="k") as api, pytest.raises(ClientError, match="cannot reach http://127.0.0.1:9"):
        smoke.run(api)
