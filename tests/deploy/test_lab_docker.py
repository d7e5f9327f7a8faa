"""Image build and ship in the lab: a dockerd on the head and one in the worker's namespace, a base image made by
`docker import` of a busybox-static rootfs (no registry). Build with the recipe stamp, ship staged and stream,
skip when the worker has the same layers, resume after an interrupted staged transfer. Root only."""

from __future__ import annotations

import re
import shutil

import pytest
from lab import invoke, sh

pytestmark = [pytest.mark.lab]


@pytest.fixture(scope="module")
def docker_lab(lab):
    if shutil.which("dockerd") is None:
        pytest.skip("dockerd is not installed (scripts/host-deps.sh)")
    lab.dockerd()
    lab.import_busybox(lab.head_docker_sock, "tsbase:1", ballast_mb=40)
    return lab


def _flags(lab, tmp_path, **kw):
    (tmp_path / "whl").mkdir(exist_ok=True)
    return {**lab.settings_flags(), "RECIPE": "tiny-cpu", "RUNTIME": "docker", "IMAGE": "twinspark-lab:1",
            "VLLM_BASE_IMAGE": "tsbase:1", "WHEEL_DIR": str(tmp_path / "whl"), "STATE_DIR": str(tmp_path / "state"),
            "WORKER_STATE_DIR": str(tmp_path / "wstate"), "LOG_DIR": str(tmp_path / "logs"), **kw}


def _inv(lab, task, flags, *extra):
    return invoke(task, flags, *extra, env_extra={"DOCKER_HOST": f"unix://{lab.head_docker_sock}"}, timeout=300)


def _worker_layers(lab):
    r = lab.ssh("docker image inspect -f '{{json .RootFS.Layers}}' twinspark-lab:1", check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def test_build_ship_staged_skip_stream(docker_lab, tmp_path):
    lab = docker_lab
    flags = _flags(lab, tmp_path)
    dry = _inv(lab, "ship", flags, "--dry-run")
    assert dry.returncode == 0 and "would build" in dry.stderr + dry.stdout, dry.stderr
    r = _inv(lab, "ship", flags)
    assert r.returncode == 0, r.stderr
    assert "built twinspark-lab:1" in r.stderr and "shipped twinspark-lab:1 staged" in r.stdout
    head_layers = sh(f"DOCKER_HOST=unix://{lab.head_docker_sock} docker image inspect -f "
                     "'{{json .RootFS.Layers}}' twinspark-lab:1").stdout.strip()
    assert _worker_layers(lab) == head_layers
    label = sh(f"DOCKER_HOST=unix://{lab.head_docker_sock} docker image inspect -f "
               "'{{index .Config.Labels \"org.twinspark.recipe-stamp\"}}' twinspark-lab:1").stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", label)
    assert not list((tmp_path / "state" / "images").glob("*.tar")), "the staged tar must be cleaned up"
    again = _inv(lab, "ship", flags)
    assert "matches the checkout" in again.stderr and "same layers; not shipped" in again.stdout
    lab.ssh("docker rmi twinspark-lab:1")
    st = _inv(lab, "ship", {**flags, "SHIP_MODE": "stream"})
    assert st.returncode == 0 and "streamed twinspark-lab:1" in st.stdout, st.stderr
    assert _worker_layers(lab) == head_layers


def test_staged_ship_resumes_after_interruption(docker_lab, tmp_path):
    lab = docker_lab
    flags = _flags(lab, tmp_path)
    assert _inv(lab, "ship", {**flags, "SKIP_SHIP": "1"}).returncode == 0  # build only
    lab.ssh("docker rmi -f twinspark-lab:1", check=False)
    sh(f"tc qdisc add dev {lab.veth_h} root tbf rate 48mbit burst 64kb latency 500ms")
    try:
        timer = lab.block_ssh_when(tmp_path / "wstate" / "images", 4 << 20)
        r = _inv(lab, "ship", flags)
        timer.join()
        assert r.returncode == 1, r.stdout + r.stderr
        assert "Copying the image to the worker failed" in r.stderr and "resumes" in r.stderr
    finally:
        lab.unblock_ssh()
        sh(f"tc qdisc del dev {lab.veth_h} root", check=False)
    tar = next((tmp_path / "state" / "images").glob("*.tar"))
    total = tar.stat().st_size
    part = tmp_path / "wstate" / "images" / ".rsync-partial" / tar.name
    kept = int(lab.ssh(f"for i in $(seq 50); do pgrep -x rsync >/dev/null || break; sleep 0.5; done; "
                       f"stat -c %s {part} 2>/dev/null || echo 0").stdout.split()[-1])
    assert 0 < kept < total
    r = _inv(lab, "ship", flags)
    assert r.returncode == 0, r.stderr
    sent = int(re.search(r"\((\d+) bytes sent", r.stdout).group(1))
    print(f"resume: tar {total} B, kept {kept} B, re-sent {sent} B")
    assert sent <= (total - kept) * 1.1 + (1 << 20)
    assert _worker_layers(lab) is not None


def test_docker_runtime_flags_worker_first_and_dead_rank(docker_lab, tmp_path):
    """The container spec (dry-run), then a real launch whose worker container exits at once (the busybox image
    has no Python): the boot fails naming the worker and quoting its container log."""
    lab = docker_lab
    model = tmp_path / "model"
    model.mkdir()
    flags = _flags(lab, tmp_path, MODEL_DIR=str(model), WORKER_MODEL_DIR=str(model), GPU_CHECK="0",
                   VLLM_PYTHON="/bin/sh", SILENCE_S="60", API_PORT="18931", MASTER_PORT="18932")
    dry = _inv(lab, "launch", flags, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = [x for x in dry.stderr.splitlines() if "docker run" in x]
    assert [x.split(":")[0] for x in lines] == ["[dry-run] worker", "[dry-run] head"]  # worker first
    for x in lines:
        for flag in ("--network host", "--ipc host", "--oom-score-adj 1000", "--ulimit memlock=-1:-1",
                     "--cap-add IPC_LOCK", "--env-file"):
            assert flag in x, (flag, x)
        assert "--gpus" not in x  # DOCKER_GPUS is empty in the tiny-cpu recipe
    assert "--headless" in lines[0] and "--headless" not in lines[1]
    assert "VLLM_API_KEY" in dry.stderr and "sk-ts-" not in dry.stderr  # key name only, never the value
    with_gpu = _inv(lab, "launch", {**flags, "DOCKER_GPUS": "all"}, "--dry-run")
    assert "--gpus all" in with_gpu.stderr

    _inv(lab, "ship", flags)
    # This machine may not raise RLIMIT_MEMLOCK inside containers: the real launch keeps the engine default.
    flags["DOCKER_MEMLOCK"] = ""
    r = _inv(lab, "launch", flags)
    assert r.returncode == 1, r.stdout + r.stderr
    msg = r.stderr.strip().splitlines()[-1]
    assert msg.startswith("The worker rank exited during boot") and "twinspark.deploy.vllm_serve" in msg, msg
    env_file = tmp_path / "wstate" / "worker.env"
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert "VLLM_HOST_IP=10.219.0.2" in env_file.read_text()
    head_env = (tmp_path / "state" / "head.env").read_text()
    assert "VLLM_API_KEY=sk-ts-" in head_env and (tmp_path / "state" / "head.env").stat().st_mode & 0o777 == 0o600
    # Both containers were removed when the boot failed.
    assert lab.ssh("docker ps -aq --filter name=twinspark-worker").stdout.strip() == ""
    assert sh(f"DOCKER_HOST=unix://{lab.head_docker_sock} docker ps -aq --filter name=twinspark-head").stdout.strip() == ""
