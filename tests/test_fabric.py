"""Fabric detection on directory trees shaped like a DGX Spark's sysfs (no RDMA hardware needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from twinspark.deploy import fabric as fb

V1, V2 = "IB/RoCE v1", "RoCE v2"


def mapped(ip: str) -> str:
    a, b, c, d = (int(x) for x in ip.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


LINK_LOCAL = "fe80:0000:0000:0000:5a2f:3dff:fe01:0203"


def rdma(root: Path, dev: str, netdev: str, gids: list[tuple[int, str, str]], port: int = 1, state: str = "4: ACTIVE"):
    """One RDMA device port as the mlx5 driver lays it out (state, link_layer, gids, gid_attrs, device/net)."""
    p = root / "class" / "infiniband" / dev / "ports" / str(port)
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (p / sub).mkdir(parents=True, exist_ok=True)
    (p / "state").write_text(state + "\n")
    (p / "link_layer").write_text("Ethernet\n")
    for i in range(8):  # the kernel lists every slot; unused ones read as zero with no type
        (p / "gids" / str(i)).write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
        (p / "gid_attrs" / "types" / str(i)).write_text("")
        (p / "gid_attrs" / "ndevs" / str(i)).write_text("")
    for idx, gid, typ in gids:
        (p / "gids" / str(idx)).write_text(gid + "\n")
        (p / "gid_attrs" / "types" / str(idx)).write_text(typ + "\n")
        (p / "gid_attrs" / "ndevs" / str(idx)).write_text(netdev + "\n")
    (root / "class" / "infiniband" / dev / "device" / "net" / netdev).mkdir(parents=True, exist_ok=True)
    (root / "class" / "net" / netdev).mkdir(parents=True, exist_ok=True)


def spark_port(root: Path, ip: str, dev="rocep1s0f0", netdev="enp1s0f0np0", **kw):
    rdma(root, dev, netdev, [(0, LINK_LOCAL, V1), (1, LINK_LOCAL, V2), (2, mapped(ip), V1), (3, mapped(ip), V2)], **kw)


NOISE = {"lo": [("127.0.0.1", 8), ("10.0.0.1", 32)], "wlp2s0": [("192.168.1.5", 24)],
         "tailscale0": [("100.101.102.103", 32)], "docker0": [("172.17.0.1", 16)], "br-1a2b3c": [("172.18.0.1", 16)]}


def test_one_device_chooses_roce_v2_and_refuses_the_rest(tmp_path):
    spark_port(tmp_path, "192.168.100.10")
    (tmp_path / "class" / "net" / "wlp2s0" / "wireless").mkdir(parents=True)
    f = fb.detect(tmp_path, {**NOISE, "enp1s0f0np0": [("192.168.100.10", 24)]})
    c = f.chosen
    assert (c.ifname, c.ipv4, c.gid_index, c.hcas, c.transport) == ("enp1s0f0np0", "192.168.100.10", 3,
                                                                     ["rocep1s0f0:1"], "rdma")
    why = {(x.ifname, x.ipv4): x.reason for x in f.candidates if not x.ok}
    assert why[("lo", "10.0.0.1")].startswith("loopback interface")
    assert why[("lo", "127.0.0.1")].startswith("loopback interface")
    assert why[("wlp2s0", "192.168.1.5")].startswith("Wi-Fi")
    assert why[("tailscale0", "100.101.102.103")].startswith("Tailscale")
    assert why[("docker0", "172.17.0.1")].startswith("container/VM bridge")
    assert why[("br-1a2b3c", "172.18.0.1")].startswith("container/VM bridge")
    assert len(f.usable) == 1 and f.notice == ""
    assert fb.node_settings(f, "worker") == {"WORKER_IP": "192.168.100.10", "WORKER_IFNAME": "enp1s0f0np0",
                                             "WORKER_HCAS": "rocep1s0f0:1", "WORKER_GID_INDEX": 3}


def test_tailscale_range_refused_under_any_name(tmp_path):
    spark_port(tmp_path, "192.168.100.10")
    f = fb.detect(tmp_path, {"enp1s0f0np0": [("192.168.100.10", 24)], "eth9": [("100.64.3.4", 10)]})
    assert next(c for c in f.candidates if c.ifname == "eth9").reason.startswith("Tailscale")


def test_two_devices_of_one_port_are_both_listed_and_a_down_port_is_refused(tmp_path):
    spark_port(tmp_path, "192.168.100.10")
    rdma(tmp_path, "roceP2p1s0f0", "enP2p1s0f0np0", [(0, LINK_LOCAL, V1), (1, LINK_LOCAL, V2)])  # second PCIe link
    spark_port(tmp_path, "192.168.200.10", dev="rocep1s0f1", netdev="enp1s0f1np1", state="1: DOWN")
    f = fb.detect(tmp_path, {"enp1s0f0np0": [("192.168.100.10", 24)], "enp1s0f1np1": [("192.168.200.10", 24)]})
    assert f.chosen.hcas == ["roceP2p1s0f0:1", "rocep1s0f0:1"]
    down = next(c for c in f.candidates if c.ifname == "enp1s0f1np1")
    assert not down.ok and down.reason == "RDMA port rocep1s0f1:1 is DOWN, not ACTIVE"
    assert [p.device for p in f.ports] == ["roceP2p1s0f0", "rocep1s0f0", "rocep1s0f1"]


def test_all_zero_gid_is_skipped_for_the_real_v2_entry(tmp_path):
    ip = "192.168.100.10"
    rdma(tmp_path, "rocep1s0f0", "enp1s0f0np0", [(0, LINK_LOCAL, V1), (3, "0000:" * 7 + "0000", V2), (5, mapped(ip), V2)])
    f = fb.detect(tmp_path, {"enp1s0f0np0": [(ip, 24)]})
    assert f.chosen.gid_index == 5


def test_only_zero_or_v1_entries_refuse_with_the_gid_table(tmp_path):
    ip = "192.168.100.10"
    rdma(tmp_path, "rocep1s0f0", "enp1s0f0np0", [(0, LINK_LOCAL, V1), (2, mapped(ip), V1), (3, "0000:" * 7 + "0000", V2)])
    f = fb.detect(tmp_path, {"enp1s0f0np0": [(ip, 24)]})
    assert f.chosen is None
    r = f.candidates[0].reason
    assert r.startswith("no RoCE v2 GID entry for 192.168.100.10 on enp1s0f0np0: GID table ")
    assert "2=IB/RoCE v1 192.168.100.10" in r and "3=RoCE v2 zero" in r
    with pytest.raises(fb.FabricError, match="no usable fabric address"):
        fb.node_settings(f)


def test_ipv6_only_interface_gives_no_candidate(tmp_path):
    rdma(tmp_path, "rocep1s0f0", "enp1s0f0np0", [(0, LINK_LOCAL, V1), (1, LINK_LOCAL, V2),
                                                 (3, "2001:0db8:0000:0000:0000:0000:0000:0010", V2)])
    f = fb.detect(tmp_path, {"lo": [("127.0.0.1", 8)]})
    assert f.ports[0].gids[3].ipv4 is None and f.ports[0].active
    assert f.chosen is None and "no usable IPv4 interface" in f.notice


def test_without_rdma_falls_back_to_socket_with_a_notice(tmp_path):
    (tmp_path / "class" / "net" / "eno1").mkdir(parents=True)
    f = fb.detect(tmp_path, {**NOISE, "eno1": [("192.168.50.7", 24)]})
    assert f.ports == []
    assert (f.chosen.ifname, f.chosen.transport, f.chosen.hcas, f.chosen.gid_index) == ("eno1", "socket", [], None)
    assert "socket transport" in f.notice and str(tmp_path / "class" / "infiniband") in f.notice
    assert fb.node_settings(f) == {"HEAD_IP": "192.168.50.7", "HEAD_IFNAME": "eno1", "HEAD_HCAS": ""}
    assert "USE (socket)" in fb.render(f)


def test_non_rdma_interface_refused_when_rdma_exists(tmp_path):
    spark_port(tmp_path, "192.168.100.10")
    f = fb.detect(tmp_path, {"enp1s0f0np0": [("192.168.100.10", 24)], "eno1": [("10.1.1.5", 24)]})
    assert next(c for c in f.candidates if c.ifname == "eno1").reason.startswith("no RDMA device behind")


def test_choose_pair_and_json_roundtrip(tmp_path):
    head, worker = tmp_path / "h", tmp_path / "w"
    spark_port(head, "192.168.100.10")
    spark_port(worker, "192.168.100.11")
    rdma(worker, "roceP2p1s0f0", "enP2p1s0f0np0", [(1, LINK_LOCAL, V2)])
    fh = fb.detect(head, {**NOISE, "enp1s0f0np0": [("192.168.100.10", 24)]})
    fw = fb.Fabric.from_json(fb.detect(worker, {"enp1s0f0np0": [("192.168.100.11", 24)]}).to_json())
    assert fb.choose_pair(fh, fw) == {
        "HEAD_IP": "192.168.100.10", "WORKER_IP": "192.168.100.11", "HEAD_IFNAME": "enp1s0f0np0",
        "WORKER_IFNAME": "enp1s0f0np0", "HEAD_HCAS": "rocep1s0f0:1", "WORKER_HCAS": "roceP2p1s0f0:1,rocep1s0f0:1",
        "HEAD_GID_INDEX": 3, "WORKER_GID_INDEX": 3}
    other = fb.detect(worker, {"enp1s0f0np0": [("192.168.100.11", 24)]})
    other.candidates[0].ipv4 = "192.168.7.11"
    with pytest.raises(fb.FabricError, match="share a subnet"):
        fb.choose_pair(fh, other)


def test_cli_json_on_a_tree(tmp_path, capsys):
    spark_port(tmp_path, "192.168.100.10")
    assert fb.main(["--sysfs-root", str(tmp_path), "--json"]) == 0
    f = fb.Fabric.from_json(capsys.readouterr().out)
    assert f.ports[0].gids[3].ipv4 == "192.168.100.10" and f.ports[0].gids[3].v2
    json.loads(f.to_json())


def test_snapshot_through_a_real_shell_matches_local_detection(tmp_path):
    """The worker path: snapshot_cmd() run by bash on a tree, parsed back, gives the same ports and choice."""
    import subprocess

    spark_port(tmp_path, "192.168.100.10")
    rdma(tmp_path, "roceP2p1s0f0", "enP2p1s0f0np0", [(1, LINK_LOCAL, V2)])
    (tmp_path / "class" / "net" / "wlp2s0" / "wireless").mkdir(parents=True)
    out = subprocess.run(["bash", "-c", fb.snapshot_cmd(str(tmp_path))], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    local_addrs = {k: v for k, v in fb.local_addrs().items()}  # ip -j reports this host's real addresses
    remote = fb.from_snapshot(out.stdout, str(tmp_path))
    local = fb.detect(tmp_path, local_addrs)
    assert [(p.device, p.state, p.netdevs, [(g.index, g.gid, g.type, g.ndev) for g in p.gids]) for p in remote.ports] \
        == [(p.device, p.state, p.netdevs, [(g.index, g.gid, g.type, g.ndev) for g in p.gids]) for p in local.ports]
    assert {(c.ifname, c.ipv4, c.ok) for c in remote.candidates} == {(c.ifname, c.ipv4, c.ok) for c in local.candidates}
    # With the fabric address added the way `ip` reports it, the choice is the RoCE v2 entry of both devices.
    text = out.stdout.replace("[", '[{"ifname": "enp1s0f0np0", "addr_info": [{"family": "inet", "local": '
                              '"192.168.100.10", "prefixlen": 24}]},', 1)
    c = fb.from_snapshot(text, str(tmp_path)).chosen
    assert (c.ifname, c.gid_index, c.hcas) == ("enp1s0f0np0", 3, ["roceP2p1s0f0:1", "rocep1s0f0:1"])
    with pytest.raises(fb.FabricError, match="incomplete"):
        fb.from_snapshot("[]")


def test_snapshot_without_rdma_keeps_the_real_path_in_the_notice(tmp_path):
    import subprocess

    out = subprocess.run(["bash", "-c", fb.snapshot_cmd(str(tmp_path))], capture_output=True, text=True, timeout=30)
    f = fb.from_snapshot(out.stdout, str(tmp_path))
    assert f.ports == [] and f"under {tmp_path}/class/infiniband" in f.notice
