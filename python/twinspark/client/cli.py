"""What the client tasks of tasks.py run (smoke, bench, budget, forecast, pi-install, fabric, template-parity):
flag parsing into library calls and printing. Each function returns the process exit status; a user-caused
error raises ``Failed`` with one sentence (tasks.py turns it into ``invoke.Exit``)."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

from twinspark.client.http import Api, ClientError, resolve_api_key
from twinspark.safetensors_io import SafetensorsError

GiB = 1 << 30


class Failed(Exception):
    """One sentence for the user; no traceback."""


def _ints(text: str | None, what: str) -> list[int]:
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise Failed(f"{what} must be comma-separated integers, got {text!r}") from None


def _size(text: str | int | None, what: str) -> int | None:
    """'2.5GiB', '2684354560', '800MiB' -> bytes."""
    if text is None or text == "":
        return None
    s = str(text).strip().lower().replace(" ", "")
    mult = 1
    for suffix, m in (("gib", GiB), ("mib", 1 << 20), ("kib", 1 << 10), ("gb", 10**9), ("mb", 10**6), ("g", GiB)):
        if s.endswith(suffix):
            s, mult = s[: -len(suffix)], m
            break
    try:
        size = float(s) * mult
    except ValueError:
        size = math.nan
    if not (math.isfinite(size) and size >= 0):
        raise Failed(f"{what} must be a size like 2.5GiB or a byte count, got {text!r}")
    return int(size)


def _int(text, what: str, least: int = 1) -> int:
    """A flag's integer (invoke passes text or an int), at least `least`."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < least:
        raise Failed(f"{what} must be an integer >= {least}, got {text!r}")
    return value


def _number(text, what: str, unit: float = 1.0) -> float:
    """A flag's finite number >= 0, times `unit` (still finite)."""
    try:
        value = float(str(text).strip()) * unit
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise Failed(f"{what} must be a finite number >= 0, got {text!r}")
    return value


def endpoint(url: str | None, recipe: str | None = None) -> tuple[str, Path | None]:
    """--url, else http://HEAD_IP:API_PORT of the deploy config; and the API key file in its state dir."""
    try:
        from twinspark.deploy import apikey, config

        s, _ = config.load({"recipe": recipe} if recipe else {})
        return url or f"http://{s.head_ip}:{s.api_port}", apikey.key_path(s.state_dir)
    except Exception as e:  # noqa: BLE001 - any config problem: an explicit --url still works
        if url:
            return url, None
        raise Failed(f"no --url given and the deploy config cannot say where the server is ({e}); pass --url") from None


def _api(url, api_key, recipe) -> Api:
    u, key_file = endpoint(url, recipe)
    return Api(u, api_key=resolve_api_key(api_key, key_file))


def smoke(url=None, api_key=None, tool_choice="auto", image=None, recipe=None) -> int:
    from rich.console import Console

    from twinspark.client import smoke as sm

    try:
        with _api(url, api_key, recipe) as api:
            checks = sm.run(api, tool_choice=tool_choice, image=image)
            title = f"smoke: {api.model} at {api.root}"
            tiny = sm.is_tiny(api)
    except ClientError as e:
        raise Failed(str(e)) from None
    if tiny:
        print(sm.TINY_NOTE)
    Console().print(sm.table(checks, title))
    return 0 if sm.passed(checks) else 1


BENCH_DEFAULTS = {"lengths": "1024,8192,32768", "decode_tokens": 256, "decode_prompt_tokens": 256}


def run_meta(recipe: str | None) -> dict:
    """Commit and recipe for a bench document: the checkout's, and the recorded deployment's where there is one."""
    from twinspark.paths import checkout_commit

    meta = {"commit": checkout_commit(), "recipe": recipe}
    try:
        from twinspark.deploy import config, state

        s, _ = config.load({"recipe": recipe} if recipe else {})
        rec = state.load(s.state_dir, required=False) or {}
        meta["recipe"] = (rec.get("settings") or {}).get("recipe") or recipe or s.recipe
        if rec.get("commit"):
            meta["deploy_commit"] = rec["commit"]
    except Exception:  # noqa: BLE001 - no deploy config here: the checkout's commit and the flag's recipe
        pass
    return meta


def bench(url=None, api_key=None, lengths=None, kinds="prose,code", concurrency="1,2,4", decode_tokens=None,
          decode_prompt_tokens=None, out="bench/results/serve", compare=None, no_vllm_extensions=False, recipe=None,
          samples=3) -> int:
    from twinspark.client import bench as bn
    from twinspark.client import benchreport

    given = {"lengths": lengths, "decode_tokens": decode_tokens, "decode_prompt_tokens": decode_prompt_tokens}
    explicit = {k for k, v in given.items() if v is not None}
    v = {k: BENCH_DEFAULTS[k] if x is None else x for k, x in given.items()}
    s = bn.Settings(prefill_lengths=_ints(v["lengths"], "--lengths"), kinds=[k for k in kinds.split(",") if k],
                    concurrency=_ints(concurrency, "--concurrency"), decode_tokens=_int(v["decode_tokens"], "--decode-tokens", 2),
                    decode_prompt_tokens=_int(v["decode_prompt_tokens"], "--decode-prompt-tokens"),
                    vllm_extensions=not no_vllm_extensions, samples=_int(samples, "--samples"))
    try:
        previous = benchreport.load(compare) if compare else None
        with _api(url, api_key, recipe) as api:
            for note in bn.fit(s, api.max_model_len, explicit):
                print(f"bench: {note}")
            doc = bn.run(api, s, meta=run_meta(recipe))
    except ClientError as e:
        raise Failed(str(e)) from None
    stem = "bench-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    paths = benchreport.save(doc, Path(out), stem)
    print(benchreport.markdown(doc))
    if previous is not None:
        print(f"Change against {compare}:\n")
        print(benchreport.compare(doc, previous))
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


def bench_long(url=None, api_key=None, flags=None, max_model_len=None, out="bench/results/serve") -> int:
    """The long-prefill check: the longest prompt the configuration allows, MemAvailable sampled on both nodes
    (the worker over SSH), low-water marks and warnings; JSON into `out`."""
    import json

    from twinspark.client.longprefill import run_long
    from twinspark.deploy import config
    from twinspark.deploy.hosts import make_hosts

    try:
        s, _ = config.load(dict(flags or {}))
    except Exception as e:  # noqa: BLE001 - the deploy config's own sentence
        raise Failed(f"the long-prefill check needs the deploy config ({e})") from None
    from twinspark.deploy import apikey

    url = url or f"http://{s.head_ip}:{s.api_port}"
    api_key = resolve_api_key(api_key, apikey.key_path(s.state_dir))
    head, worker = make_hosts(s)
    readers = {"head": lambda: Path("/proc/meminfo").read_text(),
               "worker": lambda: worker.run("cat /proc/meminfo", changes=False, timeout=10).stdout}
    try:
        with Api(url, api_key=api_key) as api:
            doc = run_long(api, int(max_model_len or s.max_model_len), readers, s.memguard_min_gib)
    except ClientError as e:
        raise Failed(str(e)) from None
    finally:
        worker.close()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("long-prefill-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S") + ".json")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)
    print(f"written: {path}")
    return 1 if doc["warnings"] else 0


def _budget(model_dir, tp, kv_bytes, kv_token_bytes, max_model_len, engram_dir, mem_available_gib, kv_dtype):
    from twinspark.client import budget as bg

    kv_token = _number(kv_token_bytes, "--kv-token-bytes") if kv_token_bytes else None
    mem = int(_number(mem_available_gib, "--mem-available-gib", GiB)) if mem_available_gib else None
    try:
        return bg.analyze(model_dir, tp=_int(tp, "--tp"), kv_bytes=_size(kv_bytes, "--kv-bytes"), kv_dtype=kv_dtype,
                          kv_token_override=kv_token, max_model_len=_int(max_model_len, "--max-model-len"),
                          engram_dir=engram_dir, mem_available=mem)
    except SafetensorsError as e:
        raise Failed(str(e)) from None


def budget(model_dir, tp=2, kv_bytes="2.5GiB", kv_token_bytes=None, max_model_len=600_000, engram_dir=None,
           mem_available_gib=None, kv_dtype="fp8_ds_mla", with_forecast=False) -> int:
    from twinspark.client import budget as bg

    b = _budget(model_dir, tp, kv_bytes, kv_token_bytes, max_model_len, engram_dir, mem_available_gib, kv_dtype)
    print(bg.report(b))
    if with_forecast:
        from twinspark.client import forecast as fc

        try:
            f = fc.forecast(b)
        except SafetensorsError as e:  # ForecastError is one
            raise Failed(str(e)) from None
        print()
        print(fc.report(f, b))
    return 0 if b.context_fits and (b.mem_after_boot is None or b.mem_after_boot >= 0) else 1


def forecast(model_dir, tp=None, overhead_ms=None, gb10_gbps=None, step_results=None, moe_results=None,
             draft_tokens=None, acceptance_length=None, context=None, prefill_context=None, chunk=None,
             bw_efficiency=None, allreduce_us=None, attention_us=None, engram_us=None, kv_token_bytes=None,
             kv_dtype="fp8_ds_mla") -> int:
    """Flags arrive as text (or None: the forecast's default), so a bad value ends in one sentence."""
    from twinspark.client import forecast as fc

    b = _budget(model_dir, 2 if tp is None else tp, "2.5GiB", kv_token_bytes, 600_000, None, 0, kv_dtype)
    given = lambda v: v is not None and v != ""  # noqa: E731
    kw = {"step_results": Path(step_results) if step_results else None,
          "moe_results": Path(moe_results) if moe_results else None}
    for key, flag, v, least in (("k", "--draft-tokens", draft_tokens, 0), ("context", "--context", context, 1),
                                ("prefill_context", "--prefill-context", prefill_context, 1),
                                ("chunk", "--chunk", chunk, 1)):
        if given(v):
            kw[key] = _int(v, flag, least)
    for key, flag, v in (("acceptance_length", "--acceptance-length", acceptance_length),
                         ("gb10_gbps", "--gb10-gbps", gb10_gbps), ("bw_efficiency", "--bw-efficiency", bw_efficiency),
                         ("allreduce_us", "--allreduce-us", allreduce_us), ("attention_us", "--attention-us",
                                                                            attention_us),
                         ("engram_us", "--engram-us", engram_us), ("overhead_ms", "--overhead-ms", overhead_ms)):
        if given(v):
            kw[key] = _number(v, flag)
    if kw.get("k") == 0 and "acceptance_length" not in kw:
        kw["acceptance_length"] = 1.0
    try:
        r = fc.forecast(b, **kw)
    except SafetensorsError as e:  # ForecastError is one
        raise Failed(str(e)) from None
    print(fc.report(r, b))
    return 0


def pi_install(url, model=None, config_dir=None, key_env="TWINSPARK_API_KEY", enable=False, default=False,
               context_window=None, max_tokens=32_768, dry_run=False, api_key=None) -> int:
    """Model id and context window default to what the server serves (/v1/models: id, max_model_len)."""
    from twinspark.client import pi

    if not model or context_window is None:
        try:
            with Api(url, api_key=resolve_api_key(api_key), model=model) as api:
                model, served = api.model, api.max_model_len
        except ClientError as e:
            raise Failed(f"cannot ask {url} for its model id and context length ({e}); pass --model and "
                         "--context-window") from None
        if context_window is None:
            if served is None:
                raise Failed(f"{url} does not say its context length in /v1/models; pass --context-window")
            context_window = served
            print(f"context window {served} tokens: the server's max_model_len")
    max_tokens = min(_int(max_tokens, "--max-tokens"), _int(context_window, "--context-window"))
    try:
        out = pi.install(url, model, config=config_dir, key_env=key_env, enable=enable, default=default,
                         context_window=_int(context_window, "--context-window"), max_tokens=max_tokens,
                         dry_run=dry_run)
    except ClientError as e:
        raise Failed(str(e)) from None
    verb = "would write" if dry_run else "wrote"
    for p in out.written:
        print(f"{verb} {p}")
    for p in out.backups:
        print(f"backup  {p}")
    for p in out.unchanged:
        print(f"unchanged {p}")
    print(f"Pi reads the key from ${key_env} at request time; export it before starting pi.")
    return 0


def fabric(sysfs_root="/sys", as_json=False, role="head", both=False, recipe=None) -> int:
    from twinspark.deploy import fabric as fb

    if both:
        return _fabric_both(fb, sysfs_root, recipe)
    f = fb.detect(sysfs_root)
    if as_json:
        print(f.to_json())
        return 0
    print(fb.render(f))
    try:
        settings = fb.node_settings(f, role)
    except fb.FabricError as e:
        raise Failed(str(e)) from None
    for k, v in settings.items():
        print(f"{k}={v}")
    return 0


def _fabric_both(fb, sysfs_root, recipe) -> int:
    """Head (local shell) and worker (deploy's SSH) detections, then the settings of both nodes."""
    from twinspark.deploy import config, hosts
    from twinspark.deploy.errors import DeployError

    try:
        s, _ = config.load({"recipe": recipe} if recipe else {})
        found = {}
        for h in hosts.make_hosts(s):
            found[h.name] = fb.detect_host(lambda cmd, h=h: h.run(cmd, changes=False, what="fabric snapshot").stdout,
                                           sysfs_root)
            print(f"== {h.name} ({h.ip})\n{fb.render(found[h.name])}\n")
        pair = fb.choose_pair(found["head"], found["worker"])
    except (DeployError, fb.FabricError) as e:
        raise Failed(str(e)) from None
    for k, v in pair.items():
        print(f"{k}={v}")
    return 0


def template_parity(original=None, script=None, function="encode_messages", url=None, api_key=None, template=None,
                    thinking_key="enable_thinking", effort_key="reasoning_effort", recipe=None) -> int:
    from twinspark.client import template_parity as tp

    if url is None and template is None:
        url, key_file = endpoint(None, recipe)
        api_key = resolve_api_key(api_key, key_file)
    try:
        p = tp.check(original, script=script, function=function, url=url, api_key=api_key, template=template,
                     thinking_key=thinking_key, effort_key=effort_key)
    except ClientError as e:
        raise Failed(str(e)) from None
    print(tp.report(p))
    return 0 if p.ok or p.skipped else 1
