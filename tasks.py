"""invoke tasks that deploy and operate the two nodes (`invoke --list`). Each task is a thin wrapper: flags
with help, one call into twinspark's library. Anything that changes a host takes --dry-run."""

from __future__ import annotations

from invoke import Collection, Exit, task


# --- deploy suite (issue 9): library in twinspark.deploy, flags documented in twinspark.deploy.cli ------------
def _d():
    from twinspark.deploy import api, cli

    return api, cli


_COMMON_HELP = {
    "recipe": "recipe in configs/ (exl3-2.9bpw, exl3-2.77bpw, tiny-cpu) or a .toml path",
    "set": "KEY=VALUE override, repeatable, highest precedence (`invoke config` lists the keys)",
}


def _h(dry=True, **extra):
    dry_help = {"dry_run": "print what would be done on each host, change nothing"} if dry else {}
    return {**_COMMON_HELP, **dry_help, **extra}


@task(name="config", iterable=["set"], help=_h(dry=False))
def config_(c, recipe=None, set=None):
    """Print every effective setting and where it came from (flag > environment > .env > recipe > default)."""
    api, cli = _d()
    rows = cli.call(api.show_config, cli.flags(recipe, set))
    print(cli.table([("KEY", "VALUE", "SOURCE")] + rows))


@task(iterable=["set"], help=_h(sync="weight sync plugin: rsync, zfs or nfs", runtime="runtime plugin: docker or process",
                                skip_sync="do not sync the weights", memguard="start the memory guard on both nodes",
                                skip_preflight="skip the preflight checks"))
def deploy(c, recipe=None, set=None, sync=None, runtime=None, skip_sync=False, memguard=False, skip_preflight=False,
           dry_run=False):
    """Preflight, download, image, ship, sync and launch both ranks (worker first), then wait for /health."""
    api, cli = _d()
    f = cli.flags(recipe, set, sync=sync, runtime=runtime, skip_sync=skip_sync, memguard=memguard)
    print(cli.call(api.deploy, f, dry_run=dry_run, skip_preflight=skip_preflight))


@task(iterable=["set"], help=_h())
def ship(c, recipe=None, set=None, dry_run=False):
    """Build/pull the serving image as needed and copy it to the worker when it lacks the same layers."""
    api, cli = _d()
    print(cli.call(api.ship, cli.flags(recipe, set), dry_run=dry_run))


@task(iterable=["set"], help=_h(sync="weight sync plugin: rsync, zfs or nfs"))
def sync(c, recipe=None, set=None, sync=None, dry_run=False):
    """Copy the weights to the worker (rsync, zfs or nfs)."""
    api, cli = _d()
    print(cli.call(api.sync, cli.flags(recipe, set, sync=sync), dry_run=dry_run))


@task(iterable=["set"], help=_h(runtime="runtime plugin: docker or process"))
def launch(c, recipe=None, set=None, runtime=None, dry_run=False):
    """Start the worker rank, then the head rank, and wait for /health (no preflight, image or sync)."""
    api, cli = _d()
    print(cli.call(api.launch, cli.flags(recipe, set, runtime=runtime), dry_run=dry_run))


@task(iterable=["set"], help=_h(dry=False))
def status(c, recipe=None, set=None):
    """The deployment, both ranks, the link, the watchdog and the API's /health. Exit code: 0 serving, 1 nothing
    deployed, stopped or failed, 2 deployed but not serving now (booting, split, unwatched)."""
    api, cli = _d()
    rows, code = cli.call(api.status, cli.flags(recipe, set))
    print(cli.table(rows))
    if code:
        raise Exit(code=code)


@task(iterable=["set"], help=_h(dry=False, worker="show the worker's log instead of the head's", lines="how many lines (50)",
                                memory="summarize both ranks' memory lines: low-water MemAvailable and its phase"))
def logs(c, recipe=None, set=None, worker=False, lines=50, memory=False):
    """Show the head's (or the worker's) serving log, or (--memory) both ranks' memory summary."""
    api, cli = _d()
    if memory:
        print(cli.call(api.memory_summary, cli.flags(recipe, set)))
        return
    print(cli.call(api.logs, cli.flags(recipe, set), worker_rank=worker, lines=int(lines)))


@task(iterable=["set"], help=_h())
def stop(c, recipe=None, set=None, dry_run=False):
    """Stop both ranks (and the watchdog and memory guards)."""
    api, cli = _d()
    print(cli.call(api.stop, cli.flags(recipe, set), dry_run=dry_run))


@task(iterable=["set"], help=_h(sync="weight sync plugin: rsync, zfs or nfs (default: the deployment's)",
                                runtime="runtime plugin: docker or process (default: the deployment's)",
                                skip_sync="do not sync the weights again", memguard="start the memory guard on both nodes",
                                skip_preflight="skip the preflight checks"))
def restart(c, recipe=None, set=None, sync=None, runtime=None, skip_sync=False, memguard=False, skip_preflight=False,
            dry_run=False):
    """Stop, then deploy again with the settings the deployment was started with (flags given now override them);
    a sync method that does not match the worker's storage is refused before anything is stopped."""
    api, cli = _d()
    f = cli.flags(recipe, set, sync=sync, runtime=runtime, skip_sync=skip_sync, memguard=memguard)
    print(cli.call(api.restart, f, dry_run=dry_run, skip_preflight=skip_preflight))


@task(help={
    "source": "directory of the original checkpoint's Engram shards (47, 48 and model.safetensors.index.json; "
              "default: ENGRAM_DIR of the deploy config)",
    "out": "directory on the node's local disk for the pack files (default: ENGRAM_PACK_DIR)",
    "config": "the model's config.json (V4.1's Engram fields) or a JSON with engram_head_sizes "
              "(default: <source>/config.json)",
    "rank": "tensor-parallel rank whose rows to pack (default 0)",
    "world": "tensor-parallel size (default 2)",
    "layers": "comma-separated Engram layers (default 1,14)",
    "recipe": _COMMON_HELP["recipe"],
    "dry_run": "print what would be done, change nothing",
})
def pack(c, source=None, out=None, config=None, rank=0, world=2, layers="1,14", recipe=None, dry_run=False):
    """Copy each rank's Engram row range into one local file per layer (resumes; skips files up to date)."""
    from twinspark.engram import EngramError
    from twinspark.engram.pack import pack_command

    if source is None or out is None:
        from twinspark.deploy import config as deploy_config

        _, cli = _d()
        s, _ = cli.call(deploy_config.load, cli.flags(recipe, None))
        source = source or s.engram_folder
        out = out or s.engram_pack_dir
        if out is None:
            raise Exit("invoke pack: no --out and no ENGRAM_PACK_DIR in the deploy config; pass --out DIR (a folder "
                       "on this node's local disk) or set ENGRAM_PACK_DIR", code=1)
    try:
        layer_ids = [int(x) for x in str(layers).split(",") if x.strip()]
    except ValueError:
        raise Exit(f"invoke pack: --layers must be comma-separated layer numbers like 1,14, got {layers!r}",
                   code=1) from None
    try:
        pack_command(source, out, config=config, rank=int(rank), world=int(world), layers=layer_ids,
                     dry_run=dry_run)
    except EngramError as exc:
        raise Exit(str(exc), code=1) from None


# --- clients of a deployment (issues 10 and 12): library in twinspark.client, fabric in twinspark.deploy.fabric ---
def _client(name: str, **kw):
    from twinspark.client import cli

    try:
        code = getattr(cli, name)(**kw)
    except cli.Failed as exc:
        raise Exit(str(exc), code=1) from None
    if code:
        raise Exit(code=code)


_URL_HELP = {
    "url": "server root, e.g. http://192.168.100.10:8888 (default: HEAD_IP:API_PORT of the deploy config)",
    "api_key": "bearer key (default: $TWINSPARK_API_KEY, else STATE_DIR/api-key)",
    "recipe": _COMMON_HELP["recipe"],
}


@task(help={**_URL_HELP, "tool_choice": "auto (the server's tool parser), named or required (forced by grammar)",
            "image": "image file or URL for the optional vision request"})
def smoke(c, url=None, api_key=None, tool_choice="auto", image=None, recipe=None):
    """The 17*19 request with thinking off (must say 323), a tool call and an optional image request: PASS/FAIL
    table; exits non-zero on a failure."""
    _client("smoke", url=url, api_key=api_key, tool_choice=tool_choice, image=image, recipe=recipe)


@task(iterable=["set"], help={**_URL_HELP, "lengths": "prefill prompt lengths in tokens, comma-separated (default "
                                                      "1024,8192,32768, shrunk to the server's max_model_len)",
            "set": "with --long: a deploy setting KEY=VALUE (repeatable), as for deploy",
            "kinds": "prompt kinds: prose,code", "concurrency": "decode streams at once, comma-separated (1,2,4)",
            "decode_tokens": "tokens per decode stream (256; shrunk to fit the server's max_model_len)",
            "decode_prompt_tokens": "prompt of a decode stream (256; shrunk to fit)",
            "samples": "samples of every measurement; rows and --compare use their median and range (3)",
            "out": "folder for the JSON, markdown and PNG (bench/results/serve)",
            "compare": "a previous bench JSON: the change of every metric, and whether it is beyond the samples' noise",
            "no_vllm_extensions": "do not send ignore_eos/continuous_usage_stats (non-vLLM servers)",
            "long": "instead: the long-prefill check (the longest prompt MAX_MODEL_LEN allows, MemAvailable "
                    "low-water on both nodes, a warning under the memory guard threshold + margin)",
            "max_model_len": "with --long: the prompt limit to use (default: MAX_MODEL_LEN of the config)"})
def bench(c, url=None, api_key=None, lengths=None, kinds="prose,code", concurrency="1,2,4", decode_tokens=None,
          decode_prompt_tokens=None, out="bench/results/serve", compare=None, no_vllm_extensions=False, recipe=None,
          long=False, max_model_len=None, set=None, samples=3):
    """Prefill tok/s (prompt / TTFT, exact lengths via /tokenize) and decode tok/s per stream and aggregate at
    1, 2, 4 streams against an OpenAI-compatible server, each the median of --samples runs, within the context the
    server serves (/v1/models); the JSON names the commit and recipe; --long: the long-prefill memory check."""
    if long:
        _, cli = _d()
        _client("bench_long", url=url, api_key=api_key, flags=cli.flags(recipe, set), max_model_len=max_model_len,
                out=out)
        return
    _client("bench", url=url, api_key=api_key, lengths=lengths, kinds=kinds, concurrency=concurrency,
            decode_tokens=decode_tokens, decode_prompt_tokens=decode_prompt_tokens, out=out, compare=compare,
            no_vllm_extensions=no_vllm_extensions, recipe=recipe, samples=samples)


_BUDGET_HELP = {"model_dir": "checkpoint folder (*.safetensors, config.json); only headers are read",
                "tp": "tensor parallel size (2)"}


@task(help={**_BUDGET_HELP, "kv_bytes": "KV cache pool per rank, e.g. 2.5GiB (--kv-cache-memory-bytes)",
            "kv_token_bytes": "override the per-token KV cost in bytes (default: from config.json)",
            "kv_dtype": "KV cache dtype: fp8_ds_mla, fp8 or auto", "max_model_len": "context limit to check (600000)",
            "engram_dir": "folder with the original Engram shards (47, 48)",
            "mem_available_gib": "MemAvailable per node to forecast from (default: this host's /proc/meminfo)",
            "forecast": "also print the GB10 throughput forecast"})
def budget(c, model_dir, tp=2, kv_bytes="2.5GiB", kv_token_bytes=None, kv_dtype="fp8_ds_mla", max_model_len=600000,
           engram_dir=None, mem_available_gib=None, forecast=False):
    """Per-rank weight bytes by tensor class, the KV tokens that fit, whether the context fits, MemAvailable
    forecast: from safetensors headers only."""
    _client("budget", model_dir=model_dir, tp=tp, kv_bytes=kv_bytes, kv_token_bytes=kv_token_bytes,
            max_model_len=max_model_len, engram_dir=engram_dir, mem_available_gib=mem_available_gib,
            kv_dtype=kv_dtype, with_forecast=forecast)


@task(name="forecast", help={
    **_BUDGET_HELP,
    "draft_tokens": "DSpark draft tokens per step (3; 0: no speculation)",
    "acceptance_length": "mean tokens per step, accepted drafts + 1 (default 2.28: seed A's 31.6 tok/s x its 72 ms "
                         "k=3 step; vLLM logs it as the mean acceptance length)",
    "context": "tokens in context while decoding (1024): the KV reads",
    "prefill_context": "prompt length for the prefill forecast (8192)", "chunk": "prefill chunk in tokens (1024)",
    "gb10_gbps": "GB10 memory bandwidth in GB/s (273)",
    "bw_efficiency": "fraction of it twinspark's kernels stream at (0.85, assumed)",
    "allreduce_us": "one all-reduce over RoCE through host memory, µs (30, assumed)",
    "attention_us": "vLLM's attention core per layer per step, µs (default: calibrated on seed A's 23 tok/s)",
    "engram_us": "Engram lookup time not hidden by vLLM's prefetch stream, µs per step (0)",
    "overhead_ms": "any other cost per step, ms (0)",
    "step_results": "decode_step.json of the 48-SM proxy (default: bench/results/decode_step.json)",
    "moe_results": "exl3_moe.json with a T >= 512 record for prefill (default: bench/results/exl3_moe.json)",
    "kv_token_bytes": "as for budget: the KV pool's bytes per token (default: from config.json)",
    "kv_dtype": "as for budget: KV cache dtype, fp8_ds_mla, fp8 or auto"})
def forecast_(c, model_dir, tp=None, draft_tokens=None, acceptance_length=None, context=None, prefill_context=None,
              chunk=None, gb10_gbps=None, bw_efficiency=None, allreduce_us=None, attention_us=None, engram_us=None,
              overhead_ms=None, step_results=None, moe_results=None, kv_token_bytes=None, kv_dtype="fp8_ds_mla"):
    """GB10 decode tok/s (DSpark draft tokens at a mean acceptance length) and prefill tok/s of one stream on two
    Sparks, every term printed, from safetensors headers and twinspark.gb10; then the calibration table (the same
    model on every published two-Spark configuration: prediction, figure, residual)."""
    _client("forecast", model_dir=model_dir, tp=tp, draft_tokens=draft_tokens, acceptance_length=acceptance_length,
            context=context, prefill_context=prefill_context, chunk=chunk, gb10_gbps=gb10_gbps, bw_efficiency=bw_efficiency,
            allreduce_us=allreduce_us, attention_us=attention_us, engram_us=engram_us, overhead_ms=overhead_ms,
            step_results=step_results, moe_results=moe_results, kv_token_bytes=kv_token_bytes, kv_dtype=kv_dtype)


@task(name="pi-install", help={"url": "server root, e.g. http://192.168.100.10:8888",
                               "model": "served model id (default: asked from the server)",
                               "config_dir": "Pi's config folder (default: $PI_CODING_AGENT_DIR or ~/.pi/agent)",
                               "key_env": "environment variable Pi reads the API key from (TWINSPARK_API_KEY)",
                               "enable": "add the model to enabledModels in settings.json",
                               "default": "make it Pi's default model",
                               "context_window": "context window (default: the server's max_model_len)",
                               "max_tokens": "max output tokens Pi plans with (32768)",
                               "dry_run": "print the files that would change, change nothing",
                               "api_key": "key to ask the server for its model id (not written anywhere)"})
def pi_install(c, url, model=None, config_dir=None, key_env="TWINSPARK_API_KEY", enable=False, default=False,
               context_window=None, max_tokens=32768, dry_run=False, api_key=None):
    """Add or replace only our provider in Pi's models.json (timestamped backup, atomic write) and install the
    extension that drops max_tokens from our provider's requests."""
    _client("pi_install", url=url, model=model, config_dir=config_dir, key_env=key_env, enable=enable,
            default=default, context_window=context_window, max_tokens=max_tokens, dry_run=dry_run, api_key=api_key)


@task(help={"sysfs_root": "sysfs root to read RDMA and net devices from (/sys)", "json": "print JSON",
            "role": "key prefix to print: head or worker",
            "both": "detect on the head and (over SSH) the worker of the deploy config, print both nodes' keys",
            "recipe": _COMMON_HELP["recipe"]})
def fabric(c, sysfs_root="/sys", json=False, role="head", both=False, recipe=None):
    """The fabric: RDMA ports, GID tables, each interface used or refused (with the reason), and the
    HEAD_/WORKER_ IP, IFNAME, HCAS and GID index to use (this node, or --both nodes)."""
    _client("fabric", sysfs_root=sysfs_root, as_json=json, role=role, both=both, recipe=recipe)


@task(name="template-parity", help={
    "original": "folder with the original model's tokenizer files and encoding script (encoding/encoding*.py)",
    "script": "the original encoding script (default: found in --original)",
    "function": "its encoder function (encode_messages)",
    "url": "compare against this running server's template, token for token (default: the deploy config's head)",
    "api_key": _URL_HELP["api_key"], "template": "compare against a local template: model folder or .jinja file",
    "thinking_key": "chat-template argument that turns thinking on/off (enable_thinking)",
    "effort_key": "chat-template argument for the reasoning effort (reasoning_effort)", "recipe": _COMMON_HELP["recipe"]})
def template_parity(c, original=None, script=None, function="encode_messages", url=None, api_key=None, template=None,
                    thinking_key="enable_thinking", effort_key="reasoning_effort", recipe=None):
    """Render conversations (system, tools, multi-turn, each reasoning effort) through the served chat template
    and the original encoding script; report differences (skips with the reason when the files are absent)."""
    _client("template_parity", original=original, script=script, function=function, url=url, api_key=api_key,
            template=template, thinking_key=thinking_key, effort_key=effort_key, recipe=recipe)


@task(name="make-tiny", help={"out": "directory for bf16/ and exl3/ (default ~/.cache/twinspark/tiny)",
                               "force": "rebuild even when the same spec was made there before"})
def make_tiny_(c, out=None, force=False):
    """Make the tiny Qwen2-MoE model (bf16 original + EXL3 version, tokenizer, chat template) for the demo and tests."""
    from twinspark.demo import default_dir
    from twinspark.tiny import make_tiny

    model = make_tiny(out or default_dir(), force=force)
    print(f"bf16: {model.bf16}\nexl3: {model.exl3}")


ns = Collection(config_, deploy, ship, sync, launch, status, logs, stop, restart, pack, bench, smoke, budget,
                forecast_, pi_install, fabric, template_parity, make_tiny_)
