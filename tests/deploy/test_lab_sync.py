"""Weight sync plugins against the lab's worker (real sshd, rsync, zfs-fuse), a full worker disk, and what is
refused before any host is touched (a typo'd plugin name, .env files that cannot be read); no vLLM. Root only."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from lab import invoke, sh

pytestmark = [pytest.mark.lab]


def _flags(lab, tmp_path, model: Path, **kw) -> dict[str, str]:
    return {**lab.settings_flags(), "RECIPE": "tiny-cpu", "MODEL_DIR": str(model),
            "WORKER_MODEL_DIR": str(tmp_path / "worker-model"), "STATE_DIR": str(tmp_path / "state"),
            "LOG_DIR": str(tmp_path / "logs"), **kw}


def _sent(text: str) -> int:
    return int(re.search(r"\((\d+) bytes sent", text).group(1))


def test_rsync_blocked_ssh_gives_clear_error_then_resumes(lab, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    size = 48 << 20
    (model / "big.safetensors").write_bytes(os.urandom(size))
    flags = _flags(lab, tmp_path, model)
    # ~6 MB/s on the link, so the copy is still running when SSH gets blocked.
    sh(f"tc qdisc add dev {lab.veth_h} root tbf rate 48mbit burst 64kb latency 500ms")
    try:
        timer = lab.block_ssh_when(tmp_path / "worker-model", 4 << 20)
        t0 = time.monotonic()
        r = invoke("sync", flags, timeout=120)
        took = time.monotonic() - t0
        timer.join()
        assert r.returncode == 1, r.stdout + r.stderr
        msg = r.stderr.strip().splitlines()[-1]  # the lines before it: the copy's progress
        assert "Traceback" not in r.stderr, r.stderr
        assert msg.startswith("Copying the weights to the worker failed") and "resumes" in msg, msg
        assert took < 60, f"the blocked link took {took:.0f} s to report"
    finally:
        lab.unblock_ssh()
        sh(f"tc qdisc del dev {lab.veth_h} root", check=False)
    marker = lab.ssh(f"test -e {tmp_path}/worker-model/.twinspark-sync", check=False)
    assert marker.returncode == 1, "an interrupted copy must not leave the skip marker"
    # The worker's rsync gives up too (--timeout) and keeps what it had in the partial dir.
    part = f"{tmp_path}/worker-model/.rsync-partial/big.safetensors"
    kept = int(lab.ssh(f"for i in $(seq 50); do pgrep -x rsync >/dev/null || break; sleep 0.5; done; "
                       f"stat -c %s {part} 2>/dev/null || echo 0").stdout.split()[-1])
    assert 0 < kept < size, f"no partial file kept ({kept} bytes)"
    r = invoke("sync", flags, timeout=120)
    assert r.returncode == 0, r.stderr
    sent = _sent(r.stdout)
    assert sent <= (size - kept) * 1.1 + (1 << 20), f"re-sent {sent} bytes, {size - kept} were left"
    same = lab.ssh(f"cmp {model}/big.safetensors {tmp_path}/worker-model/big.safetensors", check=False)
    assert same.returncode == 0
    assert "already matches" in invoke("sync", flags).stdout


def test_rsync_marker_is_written_only_after_a_complete_copy(lab, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    wdir = tmp_path / "deep" / "worker-model"  # its parents are made by the worker side of the one rsync session
    flags = _flags(lab, tmp_path, model, WORKER_MODEL_DIR=str(wdir))
    lab.ssh(f"mkdir -p {wdir}/.twinspark-sync.tmp/blocker")  # the marker's temp name cannot be written
    r = invoke("sync", flags)
    assert r.returncode == 1, r.stdout + r.stderr
    msg = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr and "could not write the sync marker" in msg, r.stderr
    assert lab.ssh(f"cat {wdir}/config.json").stdout == "{}", "the files themselves were copied"
    lab.ssh(f"rm -rf {wdir}/.twinspark-sync.tmp")
    r = invoke("sync", flags)
    assert r.returncode == 0 and "rsync: copied" in r.stdout, r.stdout + r.stderr
    assert lab.ssh(f"ls -A {wdir}").stdout.split() == [".twinspark-sync", "config.json"]
    assert "already matches" in invoke("sync", flags).stdout


@pytest.mark.skipif(shutil.which("zfs-fuse") is None, reason="zfs-fuse is not installed (scripts/host-deps.sh)")
def test_zfs_full_then_incremental_and_fallback(lab, tmp_path):
    hp, wp = lab.zfs_pools()
    sh(f"zfs create {hp}/models")
    head_dir = Path(sh(f"zfs get -H -o value mountpoint {hp}/models").stdout.strip())
    (head_dir / "config.json").write_text('{"a": 1}')
    (head_dir / "w.safetensors").write_bytes(os.urandom(1 << 20))
    wdir = tmp_path / "wz"
    flags = _flags(lab, tmp_path, head_dir, SYNC="zfs", ZFS_DATASET=f"{hp}/models",
                   WORKER_ZFS_DATASET=f"{wp}/models", WORKER_MODEL_DIR=str(wdir))
    dry = invoke("sync", flags, "--dry-run")
    assert dry.returncode == 0 and "zfs send" in dry.stderr, dry.stderr
    assert lab.ssh(f"zfs list -H {wp}/models", check=False).returncode != 0, "dry-run must not receive"
    r1 = invoke("sync", flags)
    assert r1.returncode == 0 and "(full)" in r1.stdout, r1.stdout + r1.stderr
    (head_dir / "config.json").write_text('{"a": 2}')
    r2 = invoke("sync", flags)
    assert r2.returncode == 0 and "incremental from @twinspark-" in r2.stdout, r2.stdout + r2.stderr
    # The worker sees the data through its own zfs-fuse mount (inside the worker's mount namespace).
    assert lab.ssh(f"cat {wdir}/config.json").stdout == '{"a": 2}'
    # A worker dataset found unmounted (zfs-fuse once left one so after a receive: the rank saw an empty MODEL_DIR)
    # is mounted again by the sync, before it returns.
    lab.ssh(f"zfs unmount {wp}/models")
    assert lab.ssh(f"zfs get -H -o value mounted {wp}/models").stdout.strip() == "no"
    (head_dir / "config.json").write_text('{"a": 3}')
    r2b = invoke("sync", flags)
    assert r2b.returncode == 0, r2b.stdout + r2b.stderr
    assert lab.ssh(f"cat {wdir}/config.json").stdout == '{"a": 3}'
    # Without the dataset: a clear notice and the rsync fallback.
    r3 = invoke("sync", {**flags, "ZFS_DATASET": f"{hp}/nope", "WORKER_MODEL_DIR": str(tmp_path / "fb")})
    assert r3.returncode == 0, r3.stderr
    assert "falling back to rsync" in r3.stderr and "rsync: copied" in r3.stdout


def test_nfs_says_clearly_when_kernel_nfs_is_missing(lab, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    flags = _flags(lab, tmp_path, model, SYNC="nfs")
    dry = invoke("sync", flags, "--dry-run")
    assert dry.returncode == 0 and "exportfs -ra" in dry.stderr and "mount -t nfs" in dry.stderr
    has_nfsd = "nfsd" in Path("/proc/filesystems").read_text()
    r = invoke("sync", flags)
    if has_nfsd:
        pytest.skip("this kernel has nfsd: the unavailable-NFS path cannot be shown here")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("NFS sync is unavailable: the head has no kernel NFS server"), \
        r.stderr


def test_preflight_unreachable_worker_and_restart_dry_run(lab, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.safetensors").write_bytes(b"\0" * 1024)
    flags = _flags(lab, tmp_path, model, VLLM_PYTHON=sys.executable)
    r = invoke("deploy", {**flags, "WORKER_IP": "10.219.0.3"}, "--dry-run", timeout=60)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Preflight failed: SSH to the worker root@10.219.0.3:22 failed"), last
    ok = invoke("deploy", flags, "--dry-run", timeout=60)
    assert ok.returncode == 0, ok.stderr
    for line in ("preflight ok   head address is local", "preflight ok   key SSH to worker",
                 "preflight NOTE RoCE GID on worker", "preflight ok   weights complete", "preflight ok   memory on worker"):
        assert line in ok.stderr, (line, ok.stderr)
    # boot margin: MemAvailable < per-rank weights + margin on either node refuses to start, naming node and numbers
    big = invoke("deploy", {**flags, "BOOT_MARGIN_GIB": "100000"}, "--dry-run", timeout=60)
    assert big.returncode == 1, big.stderr
    for node in ("head", "worker"):
        assert re.search(rf"MemAvailable on the {node} is [0-9.]+ GiB but a rank needs [0-9.]+ [KMG]?i?B of weights \+ "
                         r"BOOT_MARGIN_GIB=100000", big.stderr), big.stderr[-3000:]
    rs = invoke("restart", flags, "--skip-sync", "--dry-run", timeout=60)
    assert rs.returncode == 0, rs.stderr
    assert "[dry-run] head: rsync" not in rs.stderr and "[dry-run] worker: start" in rs.stderr and "[dry-run] head: start" in rs.stderr
    assert not (tmp_path / "state" / "deployment.json").exists() and not (tmp_path / "worker-model").exists()


def _counted_syn(lab, port: int) -> int:
    """Packets to `port` in the worker's namespace (an iptables rule that only counts)."""
    out = sh(f"ip netns exec {lab.ns} iptables -L INPUT -v -n -x").stdout
    return sum(int(ln.split()[0]) for ln in out.splitlines() if f"dpt:{port}" in ln)


def test_refused_in_under_2s_with_no_host_touched(lab, tmp_path):
    """A typo'd runtime and each .env that cannot be read end in one sentence before any host is touched: the
    worker's SSH port (2222 here, so no shared SSH connection hides a touch) sees no packet, no state is written."""
    model = tmp_path / "model"
    model.mkdir()
    flags = _flags(lab, tmp_path, model, SSH_PORT="2222", VLLM_PYTHON=sys.executable)
    rule = "INPUT -p tcp --dport 2222"
    sh(f"ip netns exec {lab.ns} iptables -I {rule}")
    cases = [(("--runtime", "dokcer"), None, "RUNTIME='dokcer' (from flag) is not a runtime plugin (did you mean "
                                             "docker?); choose one of: docker, process.")]
    env_file = tmp_path / "my.env"
    for body, sentence in [
            (b"SYNC=zsf\n", "SYNC='zsf' (from .env) is not a sync plugin (did you mean zfs?); choose one of: nfs, "
                             "rsync, zfs."),
            (b"MAX_NUM_SEQS=3\nthis is not a setting\n", f"The .env file {env_file} line 2 is not KEY=VALUE ('this "
                                                           "is not a setting'); fix or remove that line."),
            (b'HEAD_ENV={"A": 1\n', f"""HEAD_ENV='{{"A": 1' (from .env) is invalid: must be a JSON object like """
                                    f"""{{"KEY": "value"}}; fix the .env file {env_file}."""),
            (b"MAX_NUM_SEQS=3\xff\n", f".env file {env_file} is not UTF-8 text (byte 14); save it as UTF-8.")]:
        cases.append(((), body, sentence))
    try:
        for extra, body, sentence in cases:
            if body is not None:
                env_file.write_bytes(body)
            t0 = time.monotonic()
            r = invoke("deploy", flags, *extra, env_extra={"TWINSPARK_ENV_FILE": str(env_file)} if body else None)
            took = time.monotonic() - t0
            assert r.returncode == 1 and r.stderr.strip() == sentence, (sentence, r.stderr)
            assert took < 2, f"{sentence}: {took:.1f} s"
        assert _counted_syn(lab, 2222) == 0, "a host was touched"
        assert not (tmp_path / "state").exists() and not (tmp_path / "logs").exists()
        st = invoke("status", flags)
        assert st.returncode == 1
        assert st.stdout.strip() == f"deployment  none recorded in {tmp_path / 'state'}; `invoke deploy` starts one"
    finally:
        sh(f"ip netns exec {lab.ns} iptables -D {rule}", check=False)


def test_full_worker_disk_is_named_in_bytes_that_make_sense(lab, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.safetensors").write_bytes(os.urandom(4 << 20))
    wdir = tmp_path / "small-disk"
    lab.ssh(f"mkdir -p {wdir} && mount -t tmpfs -o size=1m tmpfs {wdir}")  # in the worker's mount namespace only
    flags = _flags(lab, tmp_path, model, WORKER_MODEL_DIR=str(wdir), VLLM_PYTHON=sys.executable)
    try:
        pre = invoke("deploy", flags, "--dry-run", timeout=60)
        assert pre.returncode == 1
        assert pre.stderr.strip().splitlines()[-1] == (
            f"Preflight failed: the worker has 1.0 MiB free at {wdir} but the sync needs 4.0 MiB more (of 4.0 MiB); "
            "free space on the worker or choose another WORKER_MODEL_DIR or SYNC."), pre.stderr[-2000:]
        r = invoke("sync", flags, timeout=120)
        assert r.returncode == 1
        msg = r.stderr.strip().splitlines()[-1]
        assert re.fullmatch(rf"The worker's disk is full: [0-9.]+ (B|KiB|MiB) free at {wdir} \(file system on {wdir}\) "
                            r"but the copy needs [0-9.]+ (KiB|MiB) more of 4\.0 MiB; free space there \(or set "
                            r"WORKER_MODEL_DIR to a larger disk\), then re-run: the copy resumes where it stopped\.",
                            msg), msg
    finally:
        lab.ssh(f"umount {wdir}", check=False)
