"""The long-prefill check (`invoke bench --long`): send the longest prompt the configuration allows while every
node's MemAvailable is sampled each second, and report each node's low-water mark. A short smoke test proves
little on a unified-memory node: a 3 GiB KV pool once passed it and died 470k tokens into a 600k prompt.

Nodes are given as readers (name -> callable returning /proc/meminfo text): the head reads its own file, the
worker is read over SSH by the deploy suite."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from twinspark.client.bench import Settings, _stream, make_prompt
from twinspark.client.http import Api
from twinspark.memory.meminfo import GIB

MeminfoReader = Callable[[], str]


def _mem_available(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemAvailable line in /proc/meminfo output")


@dataclass
class LowWater:
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def low(self, node: str) -> int | None:
        s = self.samples.get(node)
        return min(v for _, v in s) if s else None


class MemSampler:
    """Samples every node once per `interval` seconds in a background thread (bounded by stop())."""

    def __init__(self, readers: dict[str, MeminfoReader], interval: float = 1.0):
        self.readers, self.interval = readers, interval
        self.result = LowWater({n: [] for n in readers})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for node, read in self.readers.items():
                try:
                    self.result.samples[node].append((time.time(), _mem_available(read())))
                except Exception as exc:  # a node that cannot be read is reported, not fatal
                    self.result.errors[node] = str(exc)
            self._stop.wait(self.interval)

    def __enter__(self) -> MemSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.interval + 10)


def run_long(api: Api, max_model_len: int, readers: dict[str, MeminfoReader], guard_threshold_gib: float,
             safety_margin_gib: float = 2.0, output_tokens: int = 16, kind: str = "prose", log=print) -> dict:
    """Send one prompt of max_model_len - output_tokens tokens; return the result document with per-node
    low-water marks and warnings (low-water under the memory guard's threshold + the safety margin)."""
    target = max_model_len - output_tokens
    prompt, n = make_prompt(api, kind, target)
    log(f"long prefill: {n} prompt tokens (limit {max_model_len}), sampling MemAvailable on {', '.join(readers)}")
    with MemSampler(readers) as sampler:
        stream = _stream(api, prompt, n, output_tokens, Settings(vllm_extensions=True))
    nodes, warnings = {}, []
    floor = (guard_threshold_gib + safety_margin_gib) * GIB
    for node in readers:
        low = sampler.result.low(node)
        nodes[node] = {"low_water_bytes": low, "samples": len(sampler.result.samples[node]),
                       "error": sampler.result.errors.get(node)}
        if low is None:
            warnings.append(f"{node}: MemAvailable could not be sampled ({sampler.result.errors.get(node)})")
        elif low < floor:
            warnings.append(f"{node}: MemAvailable fell to {low / GIB:.2f} GiB, under the memory guard's threshold "
                            f"{guard_threshold_gib} GiB + {safety_margin_gib} GiB margin: shrink the KV pool or "
                            f"MAX_MODEL_LEN before serving prompts this long")
        log(f"  {node}: low-water MemAvailable {low / GIB:.2f} GiB" if low is not None else f"  {node}: no samples")
    ttft = stream.ttft_s
    doc = {"prompt_tokens": stream.prompt_tokens, "ttft_s": ttft,
           "prefill_tok_s": (stream.prompt_tokens / ttft) if ttft else None, "nodes": nodes, "warnings": warnings}
    for w in warnings:
        log(f"WARNING {w}")
    return doc
