"""Ship and sync throughput in the two-host lab (issue 9), against the raw tools on the same bytes in the same run:
  sync:   `invoke sync` (rsync plugin)       vs  raw `rsync -a -e ssh`                 (target >= 90 %)
  stream: ship SHIP_MODE=stream              vs  raw `docker save | ssh docker load`    (target >= 90 %)
  staged: ship SHIP_MODE=staged              vs  raw save to tar + rsync + docker load  (target >= 90 %)
  resume: bytes re-sent after an interrupted staged ship vs the bytes that were left (target <= +10 %)
Each timed run starts after os.sync(); ours and raw alternate, best of --repeat is kept. An extra line (information
only) compares the sync with raw rsync through the plugin's own SSH master, i.e. without the connection setup.
Root only (network namespace, sshd, two dockerds). Usage: python bench/bench_deploy_ship.py [--mb 200]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "deploy"))
sys.path.insert(0, str(REPO / "python"))

from lab import WORKER_IP, Lab, sh  # noqa: E402
from twinspark.deploy import api, config  # noqa: E402
from twinspark.deploy.errors import DeployError  # noqa: E402
from twinspark.deploy.hosts import make_hosts  # noqa: E402


def timed(fn):
    os.sync()  # flush the previous run's dirty pages first: their writeback would slow whichever case runs next
    t0 = time.monotonic()
    out = fn()
    return time.monotonic() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200, help="payload size in MiB (weights file and image ballast)")
    ap.add_argument("--rate", default="400mbit", help="tc rate limit on the link for the resume case")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case, ours and raw alternating; best is kept")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_deploy_ship: needs root (network namespace, sshd, dockerd)")
        return 2
    root = Path(tempfile.mkdtemp(prefix="ts-bench-ship-"))
    lab = Lab(root / "lab")
    rows = []
    try:
        lab.up()
        lab.dockerd()
        lab.import_busybox(lab.head_docker_sock, "tsbase:1", ballast_mb=a.mb)
        os.environ["DOCKER_HOST"] = f"unix://{lab.head_docker_sock}"
        ssh = ["ssh", "-i", str(lab.root / "id")] + [x for o in lab.ssh_options.split() for x in ("-o", o)]
        model = root / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        (model / "w.safetensors").write_bytes(os.urandom(a.mb << 20))
        size = a.mb << 20
        base = {**lab.settings_flags(), "RECIPE": "tiny-cpu", "STATE_DIR": str(root / "state"),
                "LOG_DIR": str(root / "logs"), "MODEL_DIR": str(model), "RUNTIME": "docker", "IMAGE": "tsbench:1",
                "VLLM_BASE_IMAGE": "tsbase:1", "WHEEL_DIR": str(root / "nowheel"),
                "WORKER_STATE_DIR": str(root / "wstate")}

        # --- sync vs raw rsync (after a warm-up: imports, entry-point scan and the SSH master are one-off costs)
        warm = root / "warm"
        warm.mkdir()
        (warm / "config.json").write_text("{}")
        api.sync({**base, "MODEL_DIR": str(warm), "WORKER_MODEL_DIR": str(root / "w0")})
        subprocess.run(ssh + [f"root@{WORKER_IP}", "true"], check=True)
        # Information only: raw rsync through the plugin's own SSH master (no connection setup, like ours after the
        # warm-up), to show what the plugin's own steps (marker read, remote mkdir and marker write) cost.
        mux = make_hosts(config.load({**base, "WORKER_MODEL_DIR": str(root / "w0")}, env_file=None)[0])[1].ssh_command()
        t_ours = t_raw = t_mux = float("inf")
        for i in range(a.repeat):
            t_ours = min(t_ours, timed(lambda i=i: api.sync({**base, "WORKER_MODEL_DIR": str(root / f"w1-{i}")}))[0])
            t_raw = min(t_raw, timed(lambda i=i: subprocess.run(["rsync", "-a", "-e", " ".join(ssh), f"{model}/",
                                                                 f"root@{WORKER_IP}:{root}/w2-{i}/"], check=True))[0])
            t_mux = min(t_mux, timed(lambda i=i: subprocess.run(["rsync", "-a", "-e", mux, f"{model}/",
                                                                 f"root@{WORKER_IP}:{root}/w3-{i}/"], check=True))[0])
            lab.ssh(f"rm -rf {root}/w1-{i} {root}/w2-{i} {root}/w3-{i}")
        rows.append(("sync (rsync plugin)", size / t_ours, size / t_raw))
        info = ("  sync vs raw rsync over the same SSH master (information only)", size / t_ours, size / t_mux)

        # --- image: build once; measure ship modes against the raw pipelines
        api.ship({**base, "SKIP_SHIP": "1"})
        tar_size = int(sh("docker -H " + os.environ["DOCKER_HOST"] + " image inspect -f '{{.Size}}' tsbench:1").stdout)

        def rmi():
            lab.ssh("docker rmi -f tsbench:1 >/dev/null 2>&1; true")

        raw_tar = root / "raw.tar"

        def raw_staged():
            subprocess.run(["docker", "save", "-o", str(raw_tar), "tsbench:1"], check=True)
            subprocess.run(["rsync", "-e", " ".join(ssh), str(raw_tar), f"root@{WORKER_IP}:{root}/raw-w.tar"], check=True)
            lab.ssh(f"docker load -i {root}/raw-w.tar >/dev/null && rm -f {root}/raw-w.tar")
            raw_tar.unlink()

        def raw_stream():
            subprocess.run(f"docker save tsbench:1 | {' '.join(ssh)} root@{WORKER_IP} docker load", shell=True,
                           check=True, capture_output=True)

        for name, mode, raw in (("ship stream", "stream", raw_stream), ("ship staged", "staged", raw_staged)):
            t_ours = t_raw = float("inf")
            for _ in range(a.repeat):
                rmi()
                t_ours = min(t_ours, timed(lambda m=mode: api.ship({**base, "SHIP_MODE": m}))[0])
                rmi()
                t_raw = min(t_raw, timed(raw)[0])
            rows.append((name, tar_size / t_ours, tar_size / t_raw))

        # --- interrupted staged ship: bytes re-sent vs bytes left
        rmi()
        sh(f"tc qdisc add dev {lab.veth_h} root tbf rate {a.rate} burst 256kb latency 500ms")
        timer = lab.block_ssh_when(root / "wstate" / "images", 16 << 20, timeout=120)
        try:
            api.ship({**base, "SHIP_MODE": "staged"})
            print("resume: the transfer finished before the interruption; raise --mb or lower --rate")
        except DeployError:
            pass
        finally:
            timer.join()
            lab.unblock_ssh()
            sh(f"tc qdisc del dev {lab.veth_h} root", check=False)
        tar = next((root / "state" / "images").glob("*.tar"), None)
        part = root / "wstate" / "images" / ".rsync-partial" / (tar.name if tar else "none")
        kept = int(lab.ssh(f"for i in $(seq 50); do pgrep -x rsync >/dev/null || break; sleep 0.5; done; "
                           f"stat -c %s {part} 2>/dev/null || echo 0").stdout.split()[-1])
        total = tar.stat().st_size if tar else 0
        msg = api.ship({**base, "SHIP_MODE": "staged"})
        m = re.search(r"\((\d+) bytes sent", msg)
        sent = int(m.group(1)) if m else -1

        print(f"payload {a.mb} MiB; image tar {tar_size >> 20} MiB; best of {a.repeat} runs per case")
        print(f"{'case':<22}{'ours MB/s':>12}{'raw MB/s':>12}{'ratio':>8}  target >= 90 %")
        for name, ours, raw in rows:
            print(f"{name:<22}{ours / 1e6:>12.1f}{raw / 1e6:>12.1f}{ours / raw * 100:>7.0f}%")
        print(f"{info[0]}: ours {info[1] / 1e6:.1f} MB/s, raw {info[2] / 1e6:.1f} MB/s, {info[1] / info[2] * 100:.0f}%")
        left = total - kept
        print(f"resume: tar {total} B, kept {kept} B, left {left} B, re-sent {sent} B "
              f"({(sent / left * 100 if left > 0 else float('nan')):.0f}% of left; target <= 110 %)")
        return 0
    finally:
        lab.close()
        subprocess.run(["rm", "-rf", str(root)], check=False)


if __name__ == "__main__":
    sys.exit(main())
