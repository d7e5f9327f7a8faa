"""Head (local) and worker (OpenSSH with ControlMaster connection reuse) behind one interface.

Contract: `Host.run(cmd, changes=...)` runs a shell command string on that host and returns a CompletedProcess
(text). Commands that change the host (`changes=True`, the default) are only printed under dry-run. Secrets are
never put into a command line: pass them through `env=` of a local `spawn` (environment, not argv).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from twinspark.deploy.errors import DeployError


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Host:
    name: str  # "head" or "worker"
    ip: str
    dry_run: bool = False
    remote: bool = False
    user: str = "root"
    port: int = 22
    key: Path | None = None
    options: list[str] = field(default_factory=list)
    control_dir: Path = Path("state")

    # ------------------------------------------------------------------ transport
    def ssh_argv(self, tty: bool = False) -> list[str]:
        """ssh with a shared master connection: later commands reuse it (~0.03 s instead of ~0.6 s)."""
        # Unix socket paths are limited to ~104 bytes: keep the control sockets in a short private dir.
        cdir = Path(f"/tmp/tsssh-{os.getuid()}")
        cdir.mkdir(mode=0o700, exist_ok=True)
        argv = [
            "ssh", "-p", str(self.port), "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
            "-o", "ControlMaster=auto", "-o", f"ControlPath={cdir}/%C",
            "-o", "ControlPersist=120", "-o", "LogLevel=ERROR",
        ]
        if self.key:
            argv += ["-i", str(self.key), "-o", "IdentitiesOnly=yes"]
        for o in self.options:
            argv += ["-o", o]
        if tty:
            argv.append("-t")
        return argv + [f"{self.user}@{self.ip}"]

    def ssh_command(self) -> str:
        """The ssh invocation as one string, for `rsync -e`."""
        return shlex.join(self.ssh_argv()[:-1])

    def argv(self, cmd: str) -> list[str]:
        if self.remote:
            return self.ssh_argv() + ["--", cmd]
        return ["bash", "-c", cmd]

    def run(self, cmd: str, *, changes: bool = True, check: bool = True, timeout: float | None = 120,
            input: str | None = None, what: str = "") -> subprocess.CompletedProcess:
        if changes and self.dry_run:
            say(f"[dry-run] {self.name}: {cmd}")
            return subprocess.CompletedProcess(cmd, 0, "", "")
        try:
            r = subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout, input=input)
        except subprocess.TimeoutExpired:
            raise DeployError(f"{what or 'A command'} on the {self.name} ({self.ip}) did not finish within {timeout} s; "
                              "check that the host is reachable and not overloaded.") from None
        if check and r.returncode != 0:
            raise DeployError(self.failure(what or cmd.split()[0], r))
        return r

    def failure(self, what: str, r: subprocess.CompletedProcess) -> str:
        lines = [x.strip() for x in (r.stderr or r.stdout or "").strip().splitlines() if x.strip()]
        # The informative line is the error itself, not a trailing usage hint ("Run 'docker run --help' ...").
        errs = [x for x in lines if "rror" in x]
        detail = (errs or lines or [f"exit {r.returncode}"])[-1][:300]
        if self.remote and r.returncode == 255:
            return (f"SSH to the worker {self.user}@{self.ip}:{self.port} failed ({detail}); check the address, "
                    "the link and key-based login (ssh-copy-id), then re-run.")
        return f"{what} failed on the {self.name} ({detail}); fix that and re-run."

    def popen(self, cmd: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(cmd), **kw)

    def read(self, path: str | Path, default: str | None = None) -> str | None:
        r = self.run(f"cat {shlex.quote(str(path))}", changes=False, check=False)
        return r.stdout if r.returncode == 0 else default

    def write(self, path: str | Path, text: str) -> None:
        """Temp name then rename, so a reader never sees half a file."""
        p = shlex.quote(str(path))
        self.run(f"mkdir -p $(dirname {p}) && cat > {p}.tmp && mv {p}.tmp {p}", input=text)

    def close(self, force: bool = False) -> None:
        """End the shared SSH master. Only when forced (stop, after the watchdog is gone): other processes of this
        deployment (watchdog, a concurrent status) reuse it, and ControlPersist ends an idle one anyway."""
        if force and self.remote and not self.dry_run:
            subprocess.run(self.ssh_argv()[:-1] + ["-O", "exit", f"{self.user}@{self.ip}"],
                           capture_output=True, timeout=10)

    def spawn(self, argv: list[str], *, env: dict[str, str], log: Path, cwd: Path | None = None,
              secret_env: dict[str, str] | None = None) -> int:
        """Start a detached process (own session) logging to `log` on this host; returns its PID.

        `secret_env` is allowed only on the local head: it goes through the process environment, never argv."""
        if self.dry_run:
            say(f"[dry-run] {self.name}: start {shlex.join(argv)} > {log}")
            return 0
        if not self.remote:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as f:
                p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **env, **(secret_env or {})}, cwd=cwd,
                                     start_new_session=True)
            return p.pid
        if secret_env:
            raise DeployError("Refusing to pass a secret to the worker on a command line; this is a bug in twinspark.")
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        q = shlex.quote(str(log))
        # Only the simple command is backgrounded, with every stream redirected: otherwise ssh waits for it.
        cmd = (f"mkdir -p $(dirname {q}) {('&& cd ' + shlex.quote(str(cwd))) if cwd else ''} || exit 1; "
               f"env {envs} setsid {shlex.join(argv)} >> {q} 2>&1 < /dev/null & echo $!")
        r = self.run(cmd, what="starting the worker rank")
        return int(r.stdout.strip().splitlines()[-1])

    def alive(self, pid: int) -> bool | None:
        """True/False when the host answered; None when it could not be asked (SSH failed): unknown, not dead."""
        if not pid:
            return False
        try:
            r = self.run(f"if kill -0 {pid} 2>/dev/null && ! grep -q '^State:.*Z' /proc/{pid}/status; then echo up; "
                         "else echo down; fi", changes=False, check=False, timeout=15)
        except DeployError:
            return None
        word = r.stdout.strip().splitlines()[-1:] if r.returncode == 0 else []
        return {"up": True, "down": False}.get(word[0]) if word else None

    def reachable(self, timeout: float = 2.0) -> str | None:
        """None when the host's sshd greets ("SSH-...") within `timeout`: the link and the host are up. Else why not
        (No route to host, timed out, Connection refused). The greeting matters: with the link down, a route via
        another network may reach something that takes the connection but is not the worker."""
        end = time.monotonic() + timeout
        try:
            with socket.create_connection((self.ip, self.port), timeout=timeout) as sock:
                sock.settimeout(max(0.1, end - time.monotonic()))
                if sock.recv(4) == b"SSH-":
                    return None
                return "no SSH greeting"
        except OSError as e:
            return e.strerror or str(e) or type(e).__name__

    def kill_group(self, pid: int, grace_s: int = 15) -> None:
        """SIGTERM the session started by spawn, SIGKILL what is left after grace_s (bounded loop)."""
        if not pid:
            return
        self.run(f"kill -TERM -- -{pid} 2>/dev/null; for i in $(seq {grace_s * 2}); do kill -0 -- -{pid} 2>/dev/null "
                 f"|| exit 0; sleep 0.5; done; kill -KILL -- -{pid} 2>/dev/null; exit 0", timeout=grace_s + 30,
                 what="stopping a rank")


def make_hosts(s, dry_run: bool = False) -> tuple[Host, Host]:
    """(head, worker) for settings `s`."""
    opts = [o for o in s.ssh_options.split() if o]
    head = Host("head", s.head_ip, dry_run=dry_run, control_dir=Path(s.state_dir))
    worker = Host("worker", s.worker_ip, dry_run=dry_run, remote=True, user=s.ssh_user, port=s.ssh_port,
                  key=s.ssh_key, options=opts, control_dir=Path(s.state_dir))
    return head, worker
