"""Watchdog after boot: `python -m twinspark.deploy.watch STATE_DIR`, started detached by deploy on the head.
Every WATCH_S seconds it checks both ranks; when one is gone it logs that, stops the other rank and records the
deployment as failed, so a dead worker is noticed within 15 s and never leaves a head that hangs on collectives."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from twinspark.deploy import plugins, state
from twinspark.deploy.config import Settings
from twinspark.deploy.hosts import make_hosts

WATCH_S = 5.0


def main(state_dir: str) -> int:
    rec = state.load(Path(state_dir))
    s = Settings.model_validate(rec["settings"])
    head, worker = make_hosts(s)
    rt = plugins.load("twinspark.runtime", rec["runtime"])(s, head, worker)
    started = rec["started"]
    while True:
        time.sleep(WATCH_S)
        cur = state.load(Path(state_dir), required=False)
        if not cur or cur.get("started") != started or cur.get("status") != "running":
            return 0  # stopped or replaced by a newer deployment
        for rank, other in (("worker", "head"), ("head", "worker")):
            alive = rt.alive(rank, rec["ranks"][rank])
            if alive is None:  # SSH hiccup: say so, decide on the next round
                print(f"watch: could not ask the {rank} at {time.strftime('%H:%M:%S')}", flush=True)
            if alive is False:
                reason = f"the {rank} rank died at {time.strftime('%H:%M:%S')}; stopped the {other} rank"
                print(f"watch: {reason}", flush=True)
                rt.stop(other, rec["ranks"][other])
                state.update(Path(state_dir), status="failed", reason=reason)
                return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
