"""Throughput of a served model the way users judge it, against any OpenAI-compatible server (vLLM for exact
prompt lengths: /tokenize).

- prefill tok/s = prompt tokens / time to first token (one streamed request, max_tokens 1, per length and kind);
- decode per stream = (tokens - 1) / (t_last - t_first) (arrival times of the first and last streamed token);
- decode aggregate = sum of tokens / (max t_last - min t_first) over the streams run at once (concurrency 1, 2, 4).

Every prompt starts with a fresh nonce so a prefix cache cannot serve it. Prompts are prose or code. Each
measurement is taken `samples` times (a row's value is the median, its samples are kept), so a comparison can tell a
change from noise. ``fit(s, max_model_len, explicit)`` first makes the lengths fit the context the server serves
(read from /v1/models): defaults are shrunk with a note, a length the user gave that cannot fit is refused.
``run(api, Settings) -> dict`` (the JSON document); benchreport renders, plots and compares it.
"""

from __future__ import annotations

import datetime as dt
import secrets
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from twinspark.client.http import Api, ClientError

PROSE = (
    "The river left the valley late in the afternoon, when the light had already turned the colour of weak tea. "
    "Along the old towpath the poplars stood in their long uneven line, and every few hundred metres a bench that "
    "nobody remembered building looked out over the water. People who walked there in the evenings tended to "
    "speak quietly, as if the place had asked them to. A ferryman once kept a hut near the second bridge; his "
    "ledger, found decades later in a cupboard at the town hall, lists the names of travellers, the weather, and "
    "now and then a remark about the price of bread or a dispute between neighbours over a fence. Reading it, "
    "one has the impression of a small world that changed slowly and then all at once, when the railway came. "
)
CODE = (
    "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
    "    \"\"\"Merge overlapping closed intervals; the result is sorted by start.\"\"\"\n"
    "    out: list[tuple[int, int]] = []\n"
    "    for start, end in sorted(intervals):\n"
    "        if out and start <= out[-1][1]:\n"
    "            out[-1] = (out[-1][0], max(out[-1][1], end))\n"
    "        else:\n"
    "            out.append((start, end))\n"
    "    return out\n\n\n"
    "class LruCache:\n"
    "    def __init__(self, capacity: int) -> None:\n"
    "        if capacity < 1:\n"
    "            raise ValueError(f\"capacity must be positive, got {capacity}\")\n"
    "        self.capacity = capacity\n"
    "        self.items: dict[str, bytes] = {}\n\n"
    "    def get(self, key: str) -> bytes | None:\n"
    "        value = self.items.pop(key, None)\n"
    "        if value is not None:\n"
    "            self.items[key] = value\n"
    "        return value\n\n"
    "    def put(self, key: str, value: bytes) -> None:\n"
    "        self.items.pop(key, None)\n"
    "        self.items[key] = value\n"
    "        while len(self.items) > self.capacity:\n"
    "            self.items.pop(next(iter(self.items)))\n\n\n"
)
CORPUS = {"prose": PROSE, "code": CODE}
TASK = {"prose": "\n\nContinue the story above in the same style:\n",
        "code": "\n# Write more utility functions in the same style as the code above:\n"}


@dataclass
class Settings:
    prefill_lengths: list[int] = field(default_factory=lambda: [1024, 8192, 32768])
    kinds: list[str] = field(default_factory=lambda: ["prose", "code"])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    decode_tokens: int = 256
    decode_prompt_tokens: int = 256
    vllm_extensions: bool = True  # ignore_eos (exact lengths) and per-chunk usage (tokens in the first chunk)
    temperature: float = 0.0
    samples: int = 3


def fit(s: Settings, max_len: int | None, explicit: set[str] = frozenset()) -> list[str]:
    """Shrink the lengths to the server's context length `max_len`; one note per change. A length named in
    `explicit` (the user gave it: "lengths", "decode_tokens", "decode_prompt_tokens") that cannot fit raises."""
    if not max_len:
        return []
    src = f"the server's max_model_len {max_len} (from /v1/models)"
    notes = []
    long = [n for n in s.prefill_lengths if n > max_len - 1]  # the prompt and one generated token
    if long:
        if "lengths" in explicit:
            raise ClientError(f"--lengths {','.join(map(str, long))} do not fit {src}: a prompt has at most "
                              f"{max_len - 1} tokens; pass smaller --lengths")
        s.prefill_lengths = [n for n in s.prefill_lengths if n <= max_len - 1] or [max_len // 2]
        notes.append(f"prefill lengths {', '.join(map(str, long))} exceed {src}: measuring "
                     f"{', '.join(map(str, s.prefill_lengths))} instead")
    if s.decode_prompt_tokens + s.decode_tokens > max_len:
        if explicit & {"decode_tokens", "decode_prompt_tokens"}:
            raise ClientError(f"--decode-prompt-tokens {s.decode_prompt_tokens} + --decode-tokens {s.decode_tokens} "
                              f"exceed {src}; pass smaller values")
        prompt = min(s.decode_prompt_tokens, max_len // 4)
        tokens = min(s.decode_tokens, max_len - prompt)
        notes.append(f"decode streams of {s.decode_prompt_tokens} + {s.decode_tokens} tokens exceed {src}: using "
                     f"{prompt} + {tokens}")
        s.decode_prompt_tokens, s.decode_tokens = prompt, tokens
    return notes


def _median_row(rows: list[dict], key: str) -> dict:
    """The sample whose `key` is the median (the lower middle one for an even count), with every sample's value."""
    ranked = sorted(rows, key=lambda r: r[key])
    row = dict(ranked[(len(ranked) - 1) // 2])
    row[f"{key}_samples"] = [r[key] for r in rows]
    return row


@dataclass
class Stream:
    prompt_tokens: int
    tokens: int
    t_start: float
    t_first: float | None
    t_last: float | None
    first_tokens: int = 1  # tokens in the first streamed chunk (a server may coalesce several)

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def decode_tok_s(self) -> float | None:
        if self.t_first is None or self.tokens < 2 or self.t_last <= self.t_first:
            return None
        # (tokens - 1) / (t_last - t_first) when the first chunk holds one token, as it does on a real deployment;
        # a fast server may pack several tokens into the first chunk, which then did not take decode time.
        if self.tokens <= self.first_tokens:
            return None
        return (self.tokens - self.first_tokens) / (self.t_last - self.t_first)


def make_prompt(api: Api, kind: str, target: int) -> tuple[str, int]:
    """A prompt of at most ``target`` tokens (as close as whole words allow) and its exact length."""
    if kind not in CORPUS:
        raise ClientError(f"unknown prompt kind {kind!r}; use one of {', '.join(CORPUS)}")
    head = f"[{secrets.token_hex(4)}] "  # fresh per prompt: a prefix cache cannot serve it
    tail = TASK[kind]
    body = CORPUS[kind]
    fixed = api.count_tokens(head + tail)
    if target <= fixed:
        raise ClientError(f"prompt length {target} is too short: the frame alone is {fixed} tokens")
    per_char = api.count_tokens(body) / len(body)

    def text(c: int) -> str:
        return head + (body * (c // len(body) + 1))[:c].rsplit(" ", 1)[0] + tail

    lo, lo_n = 0, fixed  # longest body known to fit, and its length
    hi, hi_n = None, None  # shortest body known to be too long
    chars = max(int((target - fixed) / per_char), 1)
    for _ in range(30):  # interpolation between the bounds: a handful of /tokenize calls even at 600k tokens
        n = api.count_tokens(text(chars))
        if n <= target:
            if chars > lo:
                lo, lo_n = chars, n
            if n == target:
                break
        elif hi is None or chars < hi:
            hi, hi_n = chars, n
        if hi is None:
            chars = chars + max(int((target - n) / per_char), 8)
        elif hi - lo <= 2:
            break
        else:
            guess = lo + int((target - lo_n) * (hi - lo) / max(hi_n - lo_n, 1))
            chars = min(max(guess, lo + 1), hi - 1)
    return text(lo), lo_n


def _stream(api: Api, prompt: str, prompt_tokens: int, max_tokens: int, s: Settings) -> Stream:
    body = {"model": api.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": s.temperature,
            "stream_options": {"include_usage": True}}
    if s.vllm_extensions:
        body["ignore_eos"] = True
        body["stream_options"]["continuous_usage_stats"] = True
    t0 = time.monotonic()
    first = last = None
    chunks = 0
    first_tokens = 1
    usage = None
    for ev in api.stream("/v1/completions", body):
        now = time.monotonic()
        if ev.get("usage"):
            usage = ev["usage"]
        if any(ch.get("text") for ch in ev.get("choices") or []):
            chunks += 1
            if first is None:
                first = now
                if usage and usage.get("completion_tokens"):
                    first_tokens = int(usage["completion_tokens"])
            last = now
    tokens = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        prompt_tokens = int(usage["prompt_tokens"])
    return Stream(prompt_tokens, tokens, t0, first, last, first_tokens)


def _prefill_once(api: Api, s: Settings, kind: str, target: int) -> dict:
    prompt, n = make_prompt(api, kind, target)
    st = _stream(api, prompt, n, 1, s)
    if st.ttft_s is None:
        raise ClientError(f"the server streamed no token for a {n}-token {kind} prompt; check its log")
    return {"kind": kind, "target": target, "prompt_tokens": st.prompt_tokens, "ttft_s": st.ttft_s,
            "tok_s": st.prompt_tokens / st.ttft_s}


def prefill(api: Api, s: Settings, log=print) -> list[dict]:
    rows = []
    for kind in s.kinds:
        for target in s.prefill_lengths:
            row = _median_row([_prefill_once(api, s, kind, target) for _ in range(s.samples)], "tok_s")
            log(f"prefill {kind:5s} {row['prompt_tokens']:>7d} tokens: TTFT {row['ttft_s']:.3f} s, {row['tok_s']:.0f} "
                f"tok/s (median of {s.samples})")
            rows.append(row)
    return rows


def _decode_once(api: Api, s: Settings, kind: str, c: int) -> dict:
    prompts = [make_prompt(api, kind, s.decode_prompt_tokens) for _ in range(c)]
    with ThreadPoolExecutor(c) as pool:
        streams = list(pool.map(lambda p: _stream(api, p[0], p[1], s.decode_tokens, s), prompts))
    per = [x.decode_tok_s for x in streams]
    if any(v is None for v in per):
        raise ClientError(f"a {kind} stream at concurrency {c} streamed its tokens in one chunk; ask for "
                          "more --decode-tokens (or the server ignored ignore_eos: stopped early)")
    t_first = min(x.t_first for x in streams)
    agg = sum(x.tokens for x in streams) / (max(x.t_last for x in streams) - t_first)
    return {"kind": kind, "concurrency": c, "per_stream_tok_s": per, "aggregate_tok_s": agg,
            "per_stream_mean_tok_s": statistics.mean(per),
            "streams": [{"tokens": x.tokens, "first_chunk_tokens": x.first_tokens, "ttft_s": x.ttft_s,
                         "t_first_s": x.t_first - t_first, "t_last_s": x.t_last - t_first} for x in streams]}


def decode(api: Api, s: Settings, log=print) -> list[dict]:
    rows = []
    for kind in s.kinds:
        for c in s.concurrency:
            samples = [_decode_once(api, s, kind, c) for _ in range(s.samples)]
            row = _median_row(samples, "aggregate_tok_s")
            row["per_stream_mean_tok_s_samples"] = [r["per_stream_mean_tok_s"] for r in samples]
            per = row["per_stream_tok_s"]
            log(f"decode  {kind:5s} x{c}: per stream {min(per):.1f}-{max(per):.1f} tok/s, aggregate "
                f"{row['aggregate_tok_s']:.1f} tok/s (median of {s.samples})")
            rows.append(row)
    return rows


def run(api: Api, s: Settings, log=print, meta: dict | None = None) -> dict:
    """The whole bench: {"meta", "settings", "prefill": [...], "decode": [...]}; `meta` adds to the document's
    meta (the CLI: commit and recipe)."""
    bad = [c for c in s.concurrency if c < 1] + [n for n in s.prefill_lengths if n < 1]
    if bad or s.decode_tokens < 2 or s.samples < 1:
        raise ClientError("concurrency, prompt lengths and --samples must be positive and --decode-tokens at least 2")
    meta = {"url": api.root, "model": api.model, "max_model_len": api.max_model_len,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **(meta or {})}
    return {"meta": meta, "settings": asdict(s), "prefill": prefill(api, s, log), "decode": decode(api, s, log)}
