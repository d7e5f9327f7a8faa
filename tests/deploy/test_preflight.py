"""Preflight checks that need no lab: RoCE GID table from sysfs-shaped trees, weights completeness, ports,
memory, and the API key file (CSPRNG, 0600)."""

from __future__ import annotations

import json
import socket

import pytest
from twinspark.deploy import apikey, config, preflight
from twinspark.deploy.hosts import Host

ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def v4gid(ip: str) -> str:
    a, b, c, d = (int(x) for x in ip.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def make_port(root, dev, port, entries, state="4: ACTIVE"):
    base = root / "class/infiniband" / dev / "ports" / str(port)
    (base / "gids").mkdir(parents=True)
    (base / "gid_attrs/types").mkdir(parents=True)
    (base / "gid_attrs/ndevs").mkdir(parents=True)
    (base / "state").write_text(state + "\n")
    for i, (gid, typ, nd) in enumerate(entries):
        (base / "gids" / str(i)).write_text(gid + "\n")
        (base / "gid_attrs/types" / str(i)).write_text(typ + "\n")
        (base / "gid_attrs/ndevs" / str(i)).write_text(nd + "\n")


@pytest.fixture
def head():
    return Host("head", "127.0.0.1")


def test_gid_good_index(tmp_path, head):
    make_port(tmp_path, "rocep1s0f1", 1, [("fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1", "enp1"),
                                          ("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2", "enp1"),
                                          (v4gid("192.168.100.10"), "IB/RoCE v1", "enp1"),
                                          (v4gid("192.168.100.10"), "RoCE v2", "enp1")])
    c = preflight.check_gid(head, tmp_path, "192.168.100.10", 3)
    assert c.ok and "index 3 is RoCE v2" in c.message


def test_gid_zero_entry_names_the_right_index(tmp_path, head):
    make_port(tmp_path, "rocep1s0f1", 1, [("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2", "enp1"),
                                          (v4gid("192.168.100.10"), "IB/RoCE v1", "enp1"),
                                          (v4gid("192.168.100.10"), "RoCE v2", "enp1"),
                                          (ZERO, "", "")])
    c = preflight.check_gid(head, tmp_path, "192.168.100.10", 3)
    assert not c.ok
    assert "errno 61" in c.message and "use GID index 2 (RoCE v2 for 192.168.100.10 on rocep1s0f1)" in c.message
    assert "table:" in c.message and "rocep1s0f1/1[2]" in c.message


def test_gid_v1_only_entry_fails(tmp_path, head):
    make_port(tmp_path, "mlx5_0", 1, [(v4gid("10.0.0.5"), "IB/RoCE v1", "enp1")])
    c = preflight.check_gid(head, tmp_path, "10.0.0.5", 0)
    assert not c.ok and "no RoCE v2 entry carries 10.0.0.5" in c.message


def test_no_rdma_is_a_notice(tmp_path, head):
    c = preflight.check_gid(head, tmp_path, "10.0.0.5", 3)
    assert c.ok and c.notice and "NCCL will use sockets" in c.message


def _model(d, shards=("a.safetensors", "b.safetensors"), present=("a.safetensors", "b.safetensors")):
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}))
    for s in present:
        (d / s).write_bytes(b"x" * 100)
    return d


def test_weights_complete_and_incomplete(tmp_path):
    assert preflight.weights_problem(_model(tmp_path / "ok")) is None
    p = preflight.weights_problem(_model(tmp_path / "miss", present=("a.safetensors",)))
    assert "lacks 1 shard" in p and "b.safetensors" in p
    d = _model(tmp_path / "parts")
    (d / "c.safetensors.part00").write_bytes(b"x")
    assert "split parts" in preflight.weights_problem(d)
    assert "no config.json" in preflight.weights_problem(tmp_path)


def test_memory_check_uses_weights_plus_margin(tmp_path, head):
    s, _ = config.load({"BOOT_MARGIN_GIB": 1}, env_file=None)
    have = preflight.mem_available(head)
    assert have > 0
    assert preflight.check_memory(s, head, 0).ok
    c = preflight.check_memory(s, head, have)  # weights alone as large as what is free
    assert not c.ok and "BOOT_MARGIN_GIB=1.0" in c.message


def test_busy_port_is_reported():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        s, _ = config.load({"API_PORT": port, "HEAD_IP": "127.0.0.1"}, env_file=None)
        c = preflight.check_ports(s)
    assert not c.ok and f"port(s) {port}" in c.message


def test_head_ip_must_be_local():
    s, _ = config.load({"HEAD_IP": "192.0.2.77"}, env_file=None)
    c = preflight.check_head_ip(s)
    assert not c.ok and "not an address of this machine" in c.message


def test_api_key_is_random_0600_and_stable(tmp_path):
    s, _ = config.load({"STATE_DIR": str(tmp_path)}, env_file=None)
    k1 = apikey.api_key(s)
    p = apikey.key_path(tmp_path)
    assert p.stat().st_mode & 0o777 == 0o600 and len(k1) > 40
    assert apikey.api_key(s) == k1
    s2, _ = config.load({"STATE_DIR": str(tmp_path / "other")}, env_file=None)
    assert apikey.api_key(s2) != k1
    s3, _ = config.load({"API_KEY": "off", "STATE_DIR": str(tmp_path / "off")}, env_file=None)
    assert apikey.api_key(s3) is None
    assert apikey.redact(f"key={k1}", k1) == "key=sk-ts-***"
