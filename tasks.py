"""invoke tasks that deploy and operate the two nodes (`invoke --list`). Each task is a thin wrapper: flags
with help, one call into twinspark's library. Anything that changes a host takes --dry-run."""

from __future__ import annotations

from invoke import Collection, Exit, task


def _not_yet(name: str, issue: str):
    raise Exit(f"'invoke {name}' is not implemented yet ({issue}); nothing was done.", code=2)


@task(help={"dry_run": "print what would be done on each host, change nothing"})
def deploy(c, dry_run=False):
    """Preflight, download, image, ship, sync and launch both ranks, then wait for /health."""
    _not_yet("deploy", "deploy suite issue")


@task(help={"dry_run": "print what would be done, change nothing"})
def ship(c, dry_run=False):
    """Copy the serving image to the worker when it lacks the same layers."""
    _not_yet("ship", "deploy suite issue")


@task(help={"dry_run": "print what would be done, change nothing"})
def sync(c, dry_run=False):
    """Copy the weights to the worker (rsync, zfs or nfs)."""
    _not_yet("sync", "deploy suite issue")


@task(help={"dry_run": "print what would be done, change nothing"})
def launch(c, dry_run=False):
    """Start the worker rank, then the head rank."""
    _not_yet("launch", "deploy suite issue")


@task
def status(c):
    """Health of both ranks and the API."""
    _not_yet("status", "deploy suite issue")


@task
def logs(c):
    """Show the head's (or the worker's) serving log."""
    _not_yet("logs", "deploy suite issue")


@task(help={"dry_run": "print what would be done, change nothing"})
def stop(c, dry_run=False):
    """Stop both ranks."""
    _not_yet("stop", "deploy suite issue")


@task(help={"dry_run": "print what would be done, change nothing"})
def restart(c, dry_run=False):
    """Stop, then deploy again."""
    _not_yet("restart", "deploy suite issue")


@task(help={"dry_run": "print what would be done, change nothing"})
def pack(c, dry_run=False):
    """Copy each rank's Engram row range into one local file per layer."""
    _not_yet("pack", "Engram issue")


@task
def bench(c):
    """Prefill and decode tokens per second against an OpenAI-compatible server."""
    _not_yet("bench", "bench/smoke/budget issue")


@task
def smoke(c):
    """The 17*19 request, a tool call and an optional image request: PASS/FAIL table."""
    _not_yet("smoke", "bench/smoke/budget issue")


@task
def budget(c):
    """Per-rank weight bytes and the KV tokens that fit, from safetensors headers only."""
    _not_yet("budget", "bench/smoke/budget issue")


ns = Collection(deploy, ship, sync, launch, status, logs, stop, restart, pack, bench, smoke, budget)
