"""docker runtime: one container per node (worker first), host network and IPC, oom-score-adj 1000 (the kernel
kills the server before the desktop), memlock unlimited + IPC_LOCK (RDMA registration), /dev/infiniband when the
host has it, GPUs per DOCKER_GPUS (empty in the lab). The per-rank environment goes in through an --env-file
(0600, in the state dir) so the API key never appears on a command line."""

from __future__ import annotations

import shlex
from pathlib import Path

from twinspark.deploy import gate
from twinspark.deploy.errors import DeployError
from twinspark.deploy.hosts import say
from twinspark.deploy.runtime import host_of
from twinspark.deploy.vllm_args import vllm_argv


def container_name(rank: str) -> str:
    return f"twinspark-{rank}"


class DockerRuntime:
    name = "docker"

    def __init__(self, s, head, worker):
        self.s, self.head, self.worker = s, head, worker

    def _state_dir(self, rank: str) -> Path:
        d = self.s.state_dir if rank == "head" else (self.s.worker_state_dir or self.s.state_dir)
        return Path(d).resolve()

    def run_argv(self, rank: str, env_file: str, has_ib: bool) -> list[str]:
        s = self.s
        model = str(s.model_dir.resolve() if rank == "head" else s.worker_dir)
        vargv = vllm_argv(s, rank, model)
        a = ["docker", "run", "-d", "--name", container_name(rank), "--network", "host", "--ipc", "host",
             "--oom-score-adj", "1000", "--cap-add", "IPC_LOCK",
             "--env-file", env_file, "-v", f"{model}:{model}:ro",
             "--label", "org.twinspark.rank=" + rank]
        if rank == "head":  # the watchdog's health file, read by the API server's gate
            health = str(gate.path_for(s.state_dir).parent)
            a += ["-v", f"{health}:{health}:ro"]
        if s.hf_engram_repo or s.engram_dir or s.engram_pack_dir:  # Engram tables, read by the plugin's store
            for d in dict.fromkeys(filter(None, (s.engram_folder, s.engram_pack_dir))):
                a += ["-v", f"{d.resolve()}:{d.resolve()}:ro"]
        if s.docker_memlock:
            a += ["--ulimit", f"memlock={s.docker_memlock}"]
        if has_ib:
            a += ["--device", "/dev/infiniband"]
        if s.docker_gpus:
            a += ["--gpus", s.docker_gpus]
        # vllm_serve gives `vllm serve` semantics (honours --headless) inside the image too.
        return a + ["--entrypoint", vargv[0], s.image, "-m", "twinspark.deploy.vllm_serve", *vargv[3:]]

    def preflight_launch(self) -> None:
        """GPU self-check in a throwaway container on both nodes (log in LOG_DIR), unless GPU_CHECK=0."""
        if not self.s.gpu_check:
            return
        code = ("import torch, twinspark; assert torch.cuda.is_available(), 'no CUDA device'; "
                "print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())")
        gpus = f"--gpus {shlex.quote(self.s.docker_gpus)} " if self.s.docker_gpus else ""
        for host in (self.worker, self.head):
            log = Path(self.s.log_dir).resolve() / f"gpu-check-{host.name}.log"
            r = host.run(f"mkdir -p {shlex.quote(str(log.parent))}; docker run --rm {gpus}--entrypoint "
                         f"{shlex.quote(self.s.vllm_python)} {shlex.quote(self.s.image)} -c {shlex.quote(code)} "
                         f"> {shlex.quote(str(log))} 2>&1", check=False, timeout=300)
            if r.returncode:
                raise DeployError(f"The GPU self-check container failed on the {host.name} (see {log}); check the "
                                  "driver and DOCKER_GPUS, or set GPU_CHECK=0 to skip it.")

    def start(self, rank: str, env: dict[str, str], secret_env: dict[str, str] | None = None) -> dict:
        host = host_of(self, rank)
        env_file = self._state_dir(rank) / f"{rank}.env"
        body = "".join(f"{k}={v}\n" for k, v in {**env, **(secret_env or {})}.items())
        name = container_name(rank)
        if host.dry_run:
            say(f"[dry-run] {rank}: write {env_file} (0600; {', '.join(sorted({**env, **(secret_env or {})}))})")
            say(f"[dry-run] {rank}: {shlex.join(self.run_argv(rank, str(env_file), False))}")
            return {"container": name}
        q = shlex.quote(str(env_file))
        host.run(f"mkdir -p $(dirname {q}) && umask 077 && cat > {q}.tmp && mv {q}.tmp {q}", input=body,
                 what="writing the rank's env file")
        has_ib = host.run("test -d /dev/infiniband", changes=False, check=False).returncode == 0
        host.run(f"docker rm -f {name} >/dev/null 2>&1; true", check=False)
        host.run(shlex.join(self.run_argv(rank, str(env_file), has_ib)), what=f"docker run of the {rank} rank",
                 timeout=300)
        return {"container": name}

    def alive(self, rank: str, info: dict) -> bool | None:
        """None when the host could not be asked (SSH down): unknown, not dead."""
        try:
            r = host_of(self, rank).run(f"docker inspect -f '{{{{.State.Running}}}}' {info['container']} 2>/dev/null "
                                        "|| echo gone", changes=False, check=False, timeout=30)
        except DeployError:
            return None
        if r.returncode != 0:
            return None
        return r.stdout.strip() == "true"

    def stop(self, rank: str, info: dict) -> None:
        host_of(self, rank).run(f"docker stop -t 20 {info['container']} >/dev/null 2>&1; "
                                f"docker rm -f {info['container']} >/dev/null 2>&1; true", timeout=90)

    def log_size(self, rank: str, info: dict) -> int:
        r = host_of(self, rank).run(f"docker logs {info['container']} 2>&1 | wc -c", changes=False, check=False)
        return int((r.stdout or "0").split()[0]) if r.stdout.strip().isdigit() else 0

    def read_log(self, rank: str, info: dict, offset: int = 0, limit: int = 1 << 20) -> str:
        r = host_of(self, rank).run(f"docker logs {info['container']} 2>&1 | tail -c +{offset + 1} | head -c {limit}",
                                    changes=False, check=False)
        return r.stdout

    def stacks(self, rank: str, info: dict) -> str:
        cmd = (f"docker exec {info['container']} sh -c 'for p in $(pgrep -f python); do echo \"### pid $p\"; "
               f"{self.s.py_spy} dump --pid $p 2>&1; done'")
        r = host_of(self, rank).run(cmd, changes=False, check=False, timeout=120)
        return r.stdout + r.stderr

    def guard_target(self, rank: str, info: dict) -> list[str]:
        return ["--container", info["container"]]
