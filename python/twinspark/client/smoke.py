"""Smoke test of a served model: the 17*19 question with thinking off (must contain 323), a tool call, and an
optional image request. ``run(api, ...) -> [Check]``; ``table(checks)`` renders PASS/FAIL/SKIP with rich.

The tiny model (served as "tiny": the tiny-cpu recipe, the lab, the tests) has random weights: it cannot know
17*19, so against it smoke checks what it can do instead (``TINY_NOTE``): that it answers a request through both
ranks with the asked number of tokens, and that a grammar-constrained answer comes back as one of the allowed ones.
A server without a tool-call parser is said to have none (FAIL for a real model, SKIP for the tiny one)."""

from __future__ import annotations

import base64
import json
import mimetypes
import re
import time
from dataclasses import dataclass
from pathlib import Path

from twinspark.client.http import Api, ClientError

QUESTION = "What is 17*19? Reply with the integer only."
ANSWER = "323"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 64}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TOOL_CHOICES = ("auto", "required", "named")
TINY_IDS = ("tiny",)
TINY_NOTE = ("tiny model (random weights): smoke checks that it answers through both ranks and that a grammar-forced "
             "answer is one of the allowed ones; it does not ask 17*19, which random weights cannot know")
NO_PARSER = "tool-call-parser"  # vLLM's 400 when the server has no tool parser (auto and named choices)


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0


def _chat(api: Api, messages: list, **extra) -> dict:
    body = {"model": api.model, "messages": messages, **extra}
    return api.post("/v1/chat/completions", body)["choices"][0]["message"]


def check_math(api: Api, max_tokens: int = 32) -> Check:
    t0 = time.monotonic()
    msg = _chat(api, [{"role": "user", "content": QUESTION}], temperature=0, max_tokens=max_tokens,
                chat_template_kwargs={"enable_thinking": False})
    text = (msg.get("content") or "").strip()
    ok = re.search(rf"(?<!\d){ANSWER}(?!\d)", text) is not None
    shown = text if len(text) <= 60 else text[:57] + "..."
    detail = f"answer {shown!r}" if text else "empty answer" + (" (only reasoning came back: is thinking really "
                                                                 "off?)" if msg.get("reasoning_content") else "")
    return Check("17*19 = 323 (thinking off)", "PASS" if ok else "FAIL", detail, time.monotonic() - t0)


def check_tool(api: Api, tool_choice: str = "auto", max_tokens: int = 256) -> Check:
    """auto exercises the server's tool parser (what agents use); named/required force a call by grammar."""
    if tool_choice not in TOOL_CHOICES:
        raise ClientError(f"tool choice {tool_choice!r} is not one of {', '.join(TOOL_CHOICES)}")
    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else tool_choice
    t0 = time.monotonic()
    msg = _chat(api, [{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}],
                tools=[WEATHER_TOOL], tool_choice=choice, temperature=0, max_tokens=max_tokens,
                chat_template_kwargs={"enable_thinking": False})
    calls = msg.get("tool_calls") or []
    if not calls:
        text = (msg.get("content") or "")[:60]
        return Check("tool call", "FAIL", f"no tool call (text {text!r})", time.monotonic() - t0)
    fn = calls[0].get("function", {})
    try:
        args = json.loads(fn.get("arguments") or "", strict=False)  # raw control characters in strings pass
    except ValueError:
        return Check("tool call", "FAIL", f"arguments are not JSON: {fn.get('arguments')!r:.60}", time.monotonic() - t0)
    ok = fn.get("name") == "get_weather" and isinstance(args, dict) and "city" in args
    return Check("tool call", "PASS" if ok else "FAIL", f"{fn.get('name')}({json.dumps(args)[:50]})",
                 time.monotonic() - t0)


def _image_url(image: str) -> str:
    if image.startswith(("http://", "https://", "data:")):
        return image
    p = Path(image)
    if not p.is_file():
        raise ClientError(f"image {image} does not exist; pass a file path or an http(s) URL")
    mime = mimetypes.guess_type(p.name)[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(p.read_bytes()).decode()


def check_image(api: Api, image: str | None, max_tokens: int = 64) -> Check:
    if not image:
        return Check("image request", "SKIP", "no --image given")
    t0 = time.monotonic()
    content = [{"type": "text", "text": "Describe this image in one sentence."},
               {"type": "image_url", "image_url": {"url": _image_url(image)}}]
    msg = _chat(api, [{"role": "user", "content": content}], temperature=0, max_tokens=max_tokens,
                chat_template_kwargs={"enable_thinking": False})
    text = (msg.get("content") or "").strip()
    return Check("image request", "PASS" if text else "FAIL", repr(text[:60]) if text else "empty answer",
                 time.monotonic() - t0)


def check_answers(api: Api, tokens: int = 8) -> Check:
    """A request runs through both ranks and returns exactly the asked number of tokens (the text is not judged)."""
    t0 = time.monotonic()
    out = api.post("/v1/chat/completions", {"model": api.model, "messages": [{"role": "user", "content": QUESTION}],
                                            "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    got = int((out.get("usage") or {}).get("completion_tokens") or 0)
    ok = got == tokens
    return Check("answers", "PASS" if ok else "FAIL", f"{got} of {tokens} tokens" + (
        " (random weights: the text is not checked)" if ok else ": the server stopped early"), time.monotonic() - t0)


def check_grammar(api: Api, choices: tuple[str, ...] = ("323", "324")) -> Check:
    """A grammar-constrained answer (vLLM structured outputs) is one of the allowed strings."""
    t0 = time.monotonic()
    msg = _chat(api, [{"role": "user", "content": QUESTION}], temperature=0, max_tokens=8,
                structured_outputs={"choice": list(choices)})
    text = (msg.get("content") or "").strip()
    ok = text in choices
    return Check("grammar-forced answer", "PASS" if ok else "FAIL",
                 f"{text!r} is one of {', '.join(choices)}" if ok else f"{text!r} is none of {', '.join(choices)}",
                 time.monotonic() - t0)


def _safely(name: str, fn, tiny: bool) -> Check:
    try:
        return fn()
    except ClientError as e:
        if NO_PARSER in str(e):
            why = "the server has no tool-call parser (TOOL_CALL_PARSER is empty"
            return Check(name, "SKIP" if tiny else "FAIL", f"{why} in the tiny-cpu recipe)" if tiny else
                         f"{why}: set it, e.g. deepseek_v41 as the exl3 recipes do)")
        return Check(name, "FAIL", str(e))


def is_tiny(api: Api) -> bool:
    return api.model in TINY_IDS


def run(api: Api, tool_choice: str = "auto", image: str | None = None, tiny: bool | None = None) -> list[Check]:
    """Every check; a request error fails its own check (one sentence), an unreachable server raises. `tiny`
    (default: the served id is one of TINY_IDS) checks what a random-weight model can do."""
    served = api.model  # unreachable server or wrong key: one ClientError, not three failed rows
    tiny = served in TINY_IDS if tiny is None else tiny
    if tiny:
        checks = [("answers", lambda: check_answers(api)), ("grammar-forced answer", lambda: check_grammar(api)),
                  ("17*19 = 323 (thinking off)", lambda: Check("17*19 = 323 (thinking off)", "SKIP",
                                                               "random weights cannot know it"))]
    else:
        checks = [("17*19 = 323 (thinking off)", lambda: check_math(api))]
    checks += [("tool call", lambda: check_tool(api, "named" if tiny and tool_choice == "auto" else tool_choice)),
               ("image request", lambda: check_image(api, image))]
    return [_safely(name, fn, tiny) for name, fn in checks]


def table(checks: list[Check], title: str = "smoke"):
    from rich.table import Table

    t = Table(title=title)
    for col in ("check", "result", "detail", "s"):
        t.add_column(col)
    colour = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}
    for c in checks:
        t.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail, f"{c.seconds:.2f}")
    return t


def passed(checks: list[Check]) -> bool:
    return all(c.status != "FAIL" for c in checks)
