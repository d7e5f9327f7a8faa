"""All-reduce across processes: the host-memory path with the TCP backend (reference in place of the kernel)
checked against torch.distributed.all_reduce (gloo), two processes on this machine and two processes on the
two lab hosts (network namespaces made by the test). Each rank is `python -m twinspark.allreduce.selftest`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from twinspark.ports import free_port


def _run_ranks(tmp_path, world, store, extra=(), prefixes=None, addresses=None, timeout=90):
    """Start one selftest process per rank, wait (bounded), kill leftovers by PID; results by rank."""
    procs = []
    try:
        for r in range(world):
            cmd = [sys.executable, "-m", "twinspark.allreduce.selftest", "--rank", str(r), "--world", str(world),
                   "--store", store, "--out", str(tmp_path / f"rank{r}.json"), *extra]
            if addresses:
                cmd += ["--address", addresses[r]]
            cmd = (prefixes[r] if prefixes else []) + cmd
            log = open(tmp_path / f"rank{r}.log", "w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for p in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(world)]
    results = []
    for r in range(world):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n{logs[r][-3000:]}"
        results.append(json.loads(f.read_text()))
    return results, logs


def _check_identical(results, world):
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res['error']}"
        assert res["checks"] == 35 and res["chosen"] == ["host", "nccl"]
    assert all(res["digests"] == results[0]["digests"] for res in results), "ranks got different bits"


def test_two_processes_tcp_against_gloo(tmp_path):
    store = f"127.0.0.1:{free_port()}"
    results, _ = _run_ranks(tmp_path, 2, store, ["--transport", "host", "--device", "cpu"],
                            addresses=["127.0.0.1"] * 2)
    assert [r["backend"] for r in results] == ["tcp", "tcp"]
    _check_identical(results, 2)


def test_two_processes_peer_never_arrives(tmp_path):
    store = f"127.0.0.1:{free_port()}"
    results, _ = _run_ranks(tmp_path, 2, store, ["--never-arrive", "1", "--timeout", "0.5"],
                            addresses=["127.0.0.1"] * 2)
    r0 = results[0]
    assert r0.get("timeout_type") == "AllreduceTimeout", r0
    assert "rank 0 waited 0.5 s in call 1 for rank 1, which never arrived" in r0["timeout_message"]
    assert r0["waited_s"] < 10


class _HostPair:
    """Two lab hosts (docs/test-lab.md): network namespaces joined by a veth pair, addresses only inside them.
    Lighter than tests/deploy/lab.py (no sshd, no address in the root namespace, a subnet of its own, so it does
    not collide with a deploy lab running at the same time). close() kills what runs inside by PID and removes
    both namespaces (and with them the veth pair), also after a failure."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.ns = [f"tsar{tag}a", f"tsar{tag}b"]
        self.ifname = [f"tsar{tag}x", f"tsar{tag}y"]
        net = f"10.215.{tag % 250}"
        self.ip = [f"{net}.1", f"{net}.2"]

    def up(self):
        def sh(cmd):
            r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30)
            if r.returncode:
                raise RuntimeError(f"lab: `{cmd}` failed: {r.stderr.strip()}")

        for ns in self.ns:
            sh(f"ip netns add {ns}")
            sh(f"ip -n {ns} link set lo up")
        sh(f"ip link add {self.ifname[0]} netns {self.ns[0]} type veth peer name {self.ifname[1]} netns {self.ns[1]}")
        for ns, ifn, ip in zip(self.ns, self.ifname, self.ip):
            sh(f"ip -n {ns} addr add {ip}/24 dev {ifn} && ip -n {ns} link set {ifn} up")
        return self

    def prefix(self, i):
        return ["ip", "netns", "exec", self.ns[i], "env", f"GLOO_SOCKET_IFNAME={self.ifname[i]}"]

    def close(self):
        for ns in self.ns:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.lab
@pytest.mark.slow
def test_two_lab_hosts_tcp_against_gloo(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: the lab makes network namespaces and a veth pair")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (`ip`): scripts/host-deps.sh installs it")
    lab = _HostPair()
    try:
        lab.up()
        # rank 0 on host A (it also hosts the store), rank 1 on host B; gloo and the mesh use the lab link only
        results, _ = _run_ranks(tmp_path, 2, f"{lab.ip[0]}:29500", ["--transport", "host", "--device", "cpu"],
                                prefixes=[lab.prefix(0), lab.prefix(1)], addresses=lab.ip)
        _check_identical(results, 2)
    finally:
        lab.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in lab.ns), "lab namespaces left behind"


def test_crossover_is_the_last_size_of_the_winning_prefix():
    from twinspark.allreduce.tune import crossover

    assert crossover([(2048, 5.0, 20.0), (65536, 9.0, 21.0), (1 << 20, 60.0, 40.0), (2 << 20, 10.0, 50.0)]) == 65536
    assert crossover([(2048, 30.0, 20.0)]) == 0  # never faster: everything goes to torch.distributed


@pytest.mark.slow
def test_tune_measures_and_writes_the_table(tmp_path):
    from twinspark.allreduce import AllreduceConfig

    cfg = tmp_path / "allreduce.json"
    AllreduceConfig().save(cfg)
    r = subprocess.run([sys.executable, "-m", "twinspark.allreduce.tune", "--spawn", "2", "--transport", "host",
                        "--device", "cpu", "--sizes", "2048", "16384", "--iters", "3", "--per", "3",
                        "--config", str(cfg)], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, TWINSPARK_ALLREDUCE_CONFIG=str(cfg)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "crossover" in r.stdout
    entry = [c for c in AllreduceConfig.load(cfg).crossover if c.device == "cpu"]
    assert len(entry) == 1 and entry[0].transport == "host" and entry[0].world == 2
    assert entry[0].measured and "tune" in entry[0].measured and entry[0].max_bytes in (0, 2048, 16384)
