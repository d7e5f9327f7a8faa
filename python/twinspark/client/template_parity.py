"""Chat-template parity: render a fixed set of conversations (system, tools, multi-turn, each reasoning effort,
thinking off) through the template we serve and through the original model's own encoding script, and report
every difference.

The original: a folder with the original tokenizer files and an encoding script (DeepSeek ships a Python
``encoding/encoding_*.py`` with ``encode_messages(messages, ...)`` instead of a Jinja template). The script's
function is called with the keyword arguments its signature accepts out of: ``thinking_mode`` ("thinking" or
"chat"), ``enable_thinking``, ``thinking``, ``reasoning_effort``, ``tools``, ``add_generation_prompt``
(tools go into the first system message as ``tools`` when it takes no ``tools`` argument).

The served side: either a running server (``url``: vLLM's /tokenize renders with the served template and
returns token ids; the original text is tokenized with the original tokenizer) or a local template (a model
folder whose tokenizer_config.json holds ``chat_template``, or a .jinja file), compared as text.
``check(...) -> Parity``; ``Parity.skipped`` with a reason when the original files are absent.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinspark.client.http import Api, ClientError

EFFORTS = {"low": 50, "high": 75, "max": 100}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


@dataclass
class Case:
    name: str
    messages: list[dict]
    thinking: bool = True
    effort: int | None = EFFORTS["high"]
    tools: list | None = None


def cases() -> list[Case]:
    sys_user = [{"role": "system", "content": "You are a careful coding assistant."},
                {"role": "user", "content": "Explain what a trellis code is in two sentences."}]
    multi = [{"role": "user", "content": "What is 17*19?"}, {"role": "assistant", "content": "323"},
             {"role": "user", "content": "And 23*29?"}]
    tool_turns = [{"role": "system", "content": "Use tools when they help."},
                  {"role": "user", "content": "Show me setup.py."},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "read_file", "arguments": json.dumps({"path": "setup.py"})}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "from setuptools import setup\nsetup()"},
                  {"role": "user", "content": "Is anything missing?"}]
    out = [Case("system+user", sys_user), Case("multi-turn", multi), Case("tools", tool_turns, tools=TOOLS),
           Case("thinking off", sys_user, thinking=False, effort=None)]
    out += [Case(f"effort {name}={v}", multi, effort=v) for name, v in EFFORTS.items()]
    out.append(Case("effort 30", multi, effort=30))
    return out


@dataclass
class Result:
    case: str
    equal: bool
    detail: str = ""


@dataclass
class Parity:
    skipped: bool = False
    reason: str = ""
    results: list[Result] = field(default_factory=list)
    script_kwargs: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.skipped and all(r.equal for r in self.results)


def _load_encoder(script: Path, function: str):
    spec = importlib.util.spec_from_file_location(f"_original_encoding_{script.stem}", script)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - the user's script: say which and why in one sentence
        raise ClientError(f"the encoding script {script} failed to import ({type(e).__name__}: {e})") from None
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise ClientError(f"{script} has no function {function}(); pass --function with the encoder's name")
    return fn


def _script_kwargs(fn, case: Case) -> tuple[list[dict], dict[str, Any]]:
    params = inspect.signature(fn).parameters
    offer = {"thinking_mode": "thinking" if case.thinking else "chat", "enable_thinking": case.thinking,
             "thinking": case.thinking, "add_generation_prompt": True}
    if case.effort is not None:
        offer["reasoning_effort"] = case.effort
    messages = json.loads(json.dumps(case.messages))
    if case.tools is not None:
        if "tools" in params:
            offer["tools"] = case.tools
        elif messages and messages[0]["role"] == "system":
            messages[0]["tools"] = case.tools
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": case.tools})
    return messages, {k: v for k, v in offer.items() if k in params}


def _template_kwargs(case: Case, thinking_key: str, effort_key: str) -> dict[str, Any]:
    kw: dict[str, Any] = {thinking_key: case.thinking}
    if case.effort is not None:
        kw[effort_key] = case.effort
    return kw


def _first_diff(a, b) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _describe(a, b, unit: str) -> str:
    i = _first_diff(a, b)
    if isinstance(a, str):
        return (f"first difference at {unit} {i}: served {a[max(0, i - 20):i + 30]!r} vs original "
                f"{b[max(0, i - 20):i + 30]!r} (lengths {len(a)} / {len(b)})")
    return f"first difference at {unit} {i}: served {a[i:i + 8]} vs original {b[i:i + 8]} (lengths {len(a)} / {len(b)})"


def _local_template(source: Path) -> str:
    if source.is_file():
        return source.read_text()
    cfg = source / "tokenizer_config.json"
    if cfg.is_file():
        tpl = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(tpl, str) and tpl:
            return tpl
    jinja = source / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    raise ClientError(f"no chat template in {source} (tokenizer_config.json chat_template or chat_template.jinja)")


def _render_local(template: str, case: Case, kwargs: dict[str, Any]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[case.messages], tools=case.tools, chat_template=template,
                                        add_generation_prompt=True, **kwargs)
    return rendered[0]


def check(original: str | Path | None, *, script: str | Path | None = None, function: str = "encode_messages",
          url: str | None = None, api_key: str | None = None, template: str | Path | None = None,
          thinking_key: str = "enable_thinking", effort_key: str = "reasoning_effort") -> Parity:
    """Compare every case; skipped (with the reason) when the original files are absent."""
    if not original or not Path(original).is_dir():
        return Parity(skipped=True, reason=f"original model files not found ({original or 'no path given'}); "
                                           "pass the folder with the original tokenizer and encoding script")
    orig = Path(original)
    if script is None:
        found = sorted(orig.glob("encoding/encoding*.py")) + sorted(orig.glob("encoding*.py"))
        if not found:
            return Parity(skipped=True, reason=f"no encoding script in {orig} (encoding/encoding*.py); pass --script")
        script = found[0]
    elif not Path(script).is_file():
        return Parity(skipped=True, reason=f"encoding script {script} not found")
    if url is None and template is None:
        raise ClientError("give the served side: --url of a running server or --template (model folder or .jinja)")
    encode = _load_encoder(Path(script), function)
    out = Parity()
    tok = None
    if url is not None:
        from tokenizers import Tokenizer

        tj = orig / "tokenizer.json"
        if not tj.is_file():
            return Parity(skipped=True, reason=f"no tokenizer.json in {orig}: token-level comparison needs it")
        tok = Tokenizer.from_file(str(tj))
    tpl = _local_template(Path(template)) if template is not None else None
    api = Api(url, api_key=api_key) if url is not None else None
    try:
        for case in cases():
            messages, skw = _script_kwargs(encode, case)
            out.script_kwargs = sorted(set(out.script_kwargs) | set(skw))
            try:
                want = encode(messages, **skw)
            except Exception as e:  # noqa: BLE001 - report, do not crash on one case
                out.results.append(Result(case.name, False, f"the original script failed: {type(e).__name__}: {e}"))
                continue
            tkw = _template_kwargs(case, thinking_key, effort_key)
            if api is not None:
                body = {"model": api.model, "messages": case.messages, "add_generation_prompt": True,
                        "chat_template_kwargs": tkw, "add_special_tokens": False}
                if case.tools:
                    body["tools"] = case.tools
                got = api.post("/tokenize", body)["tokens"]
                want_ids = tok.encode(want, add_special_tokens=False).ids
                eq = got == want_ids
                detail = ""
                if not eq:
                    i = _first_diff(got, want_ids)
                    detail = (_describe(got, want_ids, "token") + f"; text {tok.decode(got[i:i + 8])!r} vs "
                              f"{tok.decode(want_ids[i:i + 8])!r}")
                out.results.append(Result(case.name, eq, detail))
            else:
                got = _render_local(tpl, case, tkw)
                eq = got == want
                out.results.append(Result(case.name, eq, "" if eq else _describe(got, want, "character")))
    finally:
        if api is not None:
            api.close()
    return out


def report(p: Parity) -> str:
    if p.skipped:
        return f"SKIPPED: {p.reason}"
    lines = [f"{'SAME' if r.equal else 'DIFF'}  {r.case}" + (f": {r.detail}" if r.detail else "") for r in p.results]
    lines.append(f"original script called with: {', '.join(p.script_kwargs) or 'messages only'}")
    lines.append("all cases render the same" if p.ok else
                 f"{sum(not r.equal for r in p.results)} of {len(p.results)} cases differ")
    return "\n".join(lines)
