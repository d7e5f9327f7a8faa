"""Fabric detection on one node: which interface, address, RDMA devices and RoCE v2 GID index NCCL should use.

Reads sysfs only (``<root>/class/infiniband`` and ``<root>/class/net``; root defaults to /sys, tests point it at
a tree of their own) plus the node's IPv4 addresses (psutil, or given). Contract:

- ``detect(sysfs_root="/sys", addrs=None) -> Fabric``: every RDMA port (state, link layer, net device, GID table)
  and every IPv4 interface as a candidate that is either usable or refused with a reason; ``Fabric.chosen``.
- ``choose_pair(head, worker) -> dict``: HEAD_IP, WORKER_IP, HEAD_IFNAME, WORKER_IFNAME, HEAD_HCAS, WORKER_HCAS,
  HEAD_GID_INDEX, WORKER_GID_INDEX (deploy's config keys), the two addresses on one subnet.
- ``detect_host(run)`` runs ``snapshot_cmd()`` (shell + iproute2 only, no Python) through ``run(cmd) -> stdout``,
  e.g. deploy's SSH host, and detects from its output; ``python -m twinspark.deploy.fabric [--json]`` prints one
  node's detection (``Fabric.from_json`` reads it back).

Refused: addresses on the loopback interface (NCCL cannot use 10.0.0.x aliases on lo), Wi-Fi, Tailscale (and
its 100.64.0.0/10 range), container and VM bridges, and interfaces without an ACTIVE RDMA port when some
interface has one. A RoCE v1 or all-zero GID entry is never chosen (an all-zero GID at the configured index
fails with `ibv_modify_qp errno 61` a minute into boot). Without any ACTIVE RDMA port the choice falls back to
NCCL's socket transport with a notice. A DGX Spark exposes each ConnectX-7 port as two RDMA devices (PCI
domains 0000 and 0002, e.g. rocep1s0f0 and roceP2p1s0f0): both are listed in *_HCAS, full bandwidth needs both.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

_VIRTUAL = re.compile(r"^(docker\d*|br-|veth|virbr|cni|flannel|cali|vxlan|tun|tap|podman|lxc|vnet|zt)")
_TAILSCALE = ipaddress.ip_network("100.64.0.0/10")
_DOMAIN = re.compile(r"^(en|roce)P\d+")  # enP2p1s0f0np0 / roceP2p1s0f0: PCI domain != 0 in the name


@dataclass
class Gid:
    index: int
    gid: str
    type: str  # "RoCE v2", "IB/RoCE v1", ...
    ndev: str

    @property
    def zero(self) -> bool:
        return set(self.gid.replace(":", "")) <= {"0"}

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
        try:
            a = ipaddress.IPv6Address(self.gid)
        except ValueError:
            return None
        return str(a.ipv4_mapped) if a.ipv4_mapped else None

    @property
    def v2(self) -> bool:
        return self.type.strip().lower() == "roce v2"


@dataclass
class Port:
    device: str
    port: int
    state: str  # ACTIVE, DOWN, ...
    link_layer: str
    netdevs: list[str]
    gids: list[Gid] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"

    @property
    def hca(self) -> str:
        return f"{self.device}:{self.port}"


@dataclass
class Candidate:
    ifname: str
    ipv4: str
    prefix: int
    ok: bool
    reason: str = ""
    hcas: list[str] = field(default_factory=list)
    gid_index: int | None = None
    transport: str = "rdma"  # rdma or socket

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_interface(f"{self.ipv4}/{self.prefix}").network


@dataclass
class Fabric:
    ports: list[Port]
    candidates: list[Candidate]
    notice: str = ""

    @property
    def usable(self) -> list[Candidate]:
        return [c for c in self.candidates if c.ok]

    @property
    def chosen(self) -> Candidate | None:
        u = self.usable
        rdma = [c for c in u if c.transport == "rdma"]
        return (rdma or u or [None])[0]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Fabric:
        d = json.loads(text)
        ports = [Port(**{**p, "gids": [Gid(**g) for g in p["gids"]]}) for p in d["ports"]]
        return cls(ports, [Candidate(**c) for c in d["candidates"]], d.get("notice", ""))


class FabricError(ValueError):
    """No usable fabric address (one sentence: what was found and what to set)."""


# ------------------------------------------------------------------------------------------------- sysfs
def _read(p: Path, default: str = "") -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return default


def read_ports(sysfs_root: str | Path = "/sys") -> list[Port]:
    base = Path(sysfs_root) / "class" / "infiniband"
    out = []
    if not base.is_dir():
        return out
    for dev in sorted(base.iterdir()):
        netdir = dev / "device" / "net"
        dev_netdevs = sorted(x.name for x in netdir.iterdir()) if netdir.is_dir() else []
        for pdir in sorted((dev / "ports").glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            state = _read(pdir / "state", "?").split(":")[-1].strip()  # "4: ACTIVE"
            gids = []
            for g in sorted((pdir / "gids").glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
                if not g.name.isdigit():
                    continue
                gids.append(Gid(int(g.name), _read(g), _read(pdir / "gid_attrs" / "types" / g.name),
                                _read(pdir / "gid_attrs" / "ndevs" / g.name)))
            ndevs = sorted({x.ndev for x in gids if x.ndev} | set(dev_netdevs))
            out.append(Port(dev.name, int(pdir.name), state, _read(pdir / "link_layer", "?"), ndevs, gids))
    return out


def local_addrs() -> dict[str, list[tuple[str, int]]]:
    """Interface -> [(IPv4, prefix length)] of this host (psutil)."""
    import psutil

    out: dict[str, list[tuple[str, int]]] = {}
    for ifname, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family.name == "AF_INET" and a.netmask:
                out.setdefault(ifname, []).append((a.address, ipaddress.IPv4Network(f"0.0.0.0/{a.netmask}").prefixlen))
    return out


def _refusal(ifname: str, ip: str, net_dir: Path) -> str:
    addr = ipaddress.IPv4Address(ip)
    if ifname == "lo" or addr.is_loopback:
        return "loopback interface: NCCL cannot use addresses on lo (10.0.0.x aliases included)"
    if (net_dir / ifname / "wireless").exists() or ifname.startswith("wl"):
        return "Wi-Fi interface: not the fabric"
    if ifname.startswith(("tailscale", "ts")) or addr in _TAILSCALE:
        return "Tailscale VPN address: not the fabric"
    if _VIRTUAL.match(ifname):
        return "container/VM bridge or virtual interface: not the fabric"
    if addr.is_link_local:
        return "link-local address"
    return ""


def _port_group(ifname: str) -> str:
    """Net device name without its PCI domain: both RDMA devices of one Spark port map to one key."""
    return _DOMAIN.sub(lambda m: m[1], ifname)


def detect(sysfs_root: str | Path = "/sys", addrs: dict[str, list[tuple[str, int]]] | None = None) -> Fabric:
    ports = read_ports(sysfs_root)
    addrs = local_addrs() if addrs is None else addrs
    net_dir = Path(sysfs_root) / "class" / "net"
    active = [p for p in ports if p.active]
    by_netdev: dict[str, list[Port]] = {}
    for p in ports:
        for nd in p.netdevs:
            by_netdev.setdefault(nd, []).append(p)
    cands: list[Candidate] = []
    for ifname, lst in sorted(addrs.items()):
        for ip, prefix in lst:
            c = Candidate(ifname, ip, prefix, ok=False)
            c.reason = _refusal(ifname, ip, net_dir)
            if not c.reason and active:
                mine = by_netdev.get(ifname, [])
                if not mine:
                    c.reason = "no RDMA device behind this interface (socket transport only)"
                elif not any(p.active for p in mine):
                    c.reason = f"RDMA port {mine[0].hca} is {mine[0].state}, not ACTIVE"
                else:
                    gid = _v2_gid(mine, ifname, ip)
                    if gid is None:
                        c.reason = f"no RoCE v2 GID entry for {ip} on {ifname}: " + _gid_summary(mine)
                    else:
                        c.gid_index = gid
                        group = _port_group(ifname)
                        c.hcas = sorted({p.hca for p in active for nd in p.netdevs if _port_group(nd) == group})
            if not c.reason and not active:
                c.transport = "socket"
            c.ok = not c.reason
            cands.append(c)
    notice = ""
    if not active:
        where = Path(sysfs_root) / "class" / "infiniband"
        notice = (f"no RDMA device with an ACTIVE port under {where}: NCCL falls back to its socket transport "
                  "(TCP) on the chosen interface, far slower than RoCE; check the cable and `ibv_devinfo`")
    if not any(c.ok for c in cands):
        notice = (notice + "; " if notice else "") + "no usable IPv4 interface was found"
    return Fabric(ports, cands, notice)


def _v2_gid(ports: list[Port], ifname: str, ip: str) -> int | None:
    for p in ports:
        if not p.active:
            continue
        for g in p.gids:
            if g.v2 and not g.zero and g.ipv4 == ip and g.ndev in ("", ifname):
                return g.index
    return None


def _gid_summary(ports: list[Port]) -> str:
    rows = [f"{g.index}={g.type or '?'} {g.ipv4 or ('zero' if g.zero else g.gid)}" for p in ports for g in p.gids
            if g.type or not g.zero]  # unused slots read as zero with no type: leave them out
    return "GID table " + (", ".join(rows) if rows else "empty")


# ---------------------------------------------------------------------------------------------- two nodes
def choose_pair(head: Fabric, worker: Fabric) -> dict[str, str | int]:
    """Deploy settings for both nodes: the first pair of usable addresses on one subnet (RDMA before socket)."""
    for h in sorted(head.usable, key=lambda c: c.transport != "rdma"):
        for w in sorted(worker.usable, key=lambda c: c.transport != "rdma"):
            if h.network == w.network and h.ipv4 != w.ipv4:
                out: dict[str, str | int] = {"HEAD_IP": h.ipv4, "WORKER_IP": w.ipv4, "HEAD_IFNAME": h.ifname,
                                             "WORKER_IFNAME": w.ifname, "HEAD_HCAS": ",".join(h.hcas),
                                             "WORKER_HCAS": ",".join(w.hcas)}
                if h.gid_index is not None:
                    out["HEAD_GID_INDEX"] = h.gid_index
                if w.gid_index is not None:
                    out["WORKER_GID_INDEX"] = w.gid_index
                return out
    hs = ", ".join(f"{c.ifname} {c.ipv4}/{c.prefix}" for c in head.usable) or "none"
    ws = ", ".join(f"{c.ifname} {c.ipv4}/{c.prefix}" for c in worker.usable) or "none"
    raise FabricError(f"no usable head and worker addresses share a subnet (head: {hs}; worker: {ws}); "
                      "give the fabric ports addresses on one subnet or set HEAD_IP/WORKER_IP yourself")


def node_settings(f: Fabric, role: str = "head") -> dict[str, str | int]:
    """This node's keys (HEAD_* or WORKER_*) from its own detection."""
    c = f.chosen
    if c is None:
        raise FabricError(f"no usable fabric address on this node ({f.notice or 'all were refused'}); "
                          "run `invoke fabric` to see why each interface was refused")
    r = role.upper()
    out: dict[str, str | int] = {f"{r}_IP": c.ipv4, f"{r}_IFNAME": c.ifname, f"{r}_HCAS": ",".join(c.hcas)}
    if c.gid_index is not None:
        out[f"{r}_GID_INDEX"] = c.gid_index
    return out


# ----------------------------------------------------------------------------------- over a shell (worker)
_MARK = "@@twinspark-fabric@@"


def snapshot_cmd(sysfs_root: str = "/sys") -> str:
    """A POSIX shell command printing what detect() reads: `ip -j -4 addr`, then every RDMA port file as
    path:content (grep -H), the RDMA devices' net devices and the wireless interfaces. Needs no Python."""
    ib, net = f"{sysfs_root}/class/infiniband", f"{sysfs_root}/class/net"
    files = " ".join(f"{ib}/*/ports/*/{x}" for x in ("state", "link_layer", "gids/*", "gid_attrs/types/*",
                                                       "gid_attrs/ndevs/*"))
    return (f"ip -j -4 addr show 2>/dev/null || echo '[]'; echo '{_MARK}'; grep -H -s . {files} 2>/dev/null; "
            f"echo '{_MARK}'; ls -d {ib}/*/device/net/* {net}/*/wireless 2>/dev/null; true")


def from_snapshot(text: str, sysfs_root: str = "/sys") -> Fabric:
    """detect() on the output of snapshot_cmd() (run on another host): the files are rebuilt in a temporary
    tree, so both paths share one implementation."""
    import tempfile

    parts = text.split(_MARK)
    if len(parts) != 3:
        raise FabricError("the fabric snapshot from the host is incomplete (is `ip` from iproute2 installed there?)")
    try:
        links = json.loads(parts[0].strip() or "[]")
    except ValueError:
        raise FabricError("the host's `ip -j -4 addr` output is not JSON; update iproute2 there") from None
    addrs: dict[str, list[tuple[str, int]]] = {}
    for link in links:
        for a in link.get("addr_info", []):
            if a.get("family") == "inet":
                addrs.setdefault(link["ifname"], []).append((a["local"], int(a["prefixlen"])))
    prefix = sysfs_root.rstrip("/") + "/"
    with tempfile.TemporaryDirectory(prefix="fabric.") as tmp:
        root = Path(tmp)
        for line in parts[1].splitlines():
            path, sep, value = line.partition(":")
            if sep and path.startswith(prefix):
                dst = root / path[len(prefix):]
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text(value + "\n")
        for line in parts[2].split():
            if line.startswith(prefix):
                (root / line[len(prefix):]).mkdir(parents=True, exist_ok=True)
        f = detect(root, addrs)
    f.notice = f.notice.replace(str(root), sysfs_root.rstrip("/"))
    return f


def detect_host(run, sysfs_root: str = "/sys") -> Fabric:
    """Detection on any host: ``run(cmd) -> stdout`` (e.g. deploy's ``lambda c: host.run(c, changes=False).stdout``)."""
    return from_snapshot(run(snapshot_cmd(sysfs_root)), sysfs_root)


def render(f: Fabric) -> str:
    lines = []
    for p in f.ports:
        lines.append(f"RDMA {p.hca:18s} {p.state:8s} {p.link_layer:9s} netdev {','.join(p.netdevs) or '-'}")
        for g in p.gids:
            tag = "zero" if g.zero else (g.ipv4 or g.gid)
            lines.append(f"    gid {g.index:3d} {g.type or '?':11s} {g.ndev or '-':16s} {tag}")
    if not f.ports:
        lines.append("no RDMA devices")
    for c in f.candidates:
        verdict = (f"USE ({c.transport}" + (f", gid {c.gid_index}, hcas {','.join(c.hcas)}" if c.hcas else "") + ")"
                   if c.ok else f"refused: {c.reason}")
        lines.append(f"{c.ifname:16s} {c.ipv4 + '/' + str(c.prefix):20s} {verdict}")
    if f.notice:
        lines.append(f"notice: {f.notice}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Detect this node's fabric interface for NCCL.")
    ap.add_argument("--sysfs-root", default="/sys", help="sysfs root (tests use a tree of their own)")
    ap.add_argument("--json", action="store_true", help="print the detection as JSON")
    ap.add_argument("--role", default="head", choices=["head", "worker"], help="prefix of the printed keys")
    a = ap.parse_args(argv)
    f = detect(a.sysfs_root)
    if a.json:
        print(f.to_json())
        return 0
    print(render(f))
    try:
        for k, v in node_settings(f, a.role).items():
            print(f"{k}={v}")
    except FabricError as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
