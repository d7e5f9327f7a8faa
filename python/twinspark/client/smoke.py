"""Smoke test of a served model: the 17*19 question with thinking off (must contain 323), a tool call, and an
optional image request. ``run(api, ...) -> [Check]``; ``table(checks)`` renders PASS/FAIL/SKIP with rich."""

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


def run(api: Api, tool_choice: str = "auto", image: str | None = None) -> list[Check]:
    """Every check; a request error fails its own check (one sentence), an unreachable server raises."""
    _ = api.model  # unreachable server or wrong key: one ClientError, not three failed rows
    out = []
    for name, fn in (("17*19 = 323 (thinking off)", lambda: check_math(api)),
                     ("tool call", lambda: check_tool(api, tool_choice)),
                     ("image request", lambda: check_image(api, image))):
        try:
            out.append(fn())
        except ClientError as e:
            out.append(Check(name, "FAIL", str(e)))
    return out


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
