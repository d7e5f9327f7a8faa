"""What benchkit's timing measures on this GPU (the method's own benchmark; tests/test_benchkit.py checks its logic on
a fake clock). Each case is timed as the kernel benchmarks are and written to timing.json; the properties the method
relies on are printed and a broken one ends with exit status 1:

- a 2 ms host pause between launches of a tiny kernel is not GPU time (calls queued behind a GPU sleep);
- a host that gets slower after the warm-up (300 µs per call) leaves at most the first sample with host time in it;
- one event pair per call costs more than a pass of back-to-back calls (event overhead, ~2 µs on the H200);
- a 4096^3 fp32 matmul takes longer than 64 MB of elementwise work;
- the ceilings measured in the run: device copy (GB/s), bf16 dense 1x5120 by 5120x1152 L2-cold, within what the copy
  ceiling allows.

    python bench/bench_timing.py        # or: python bench/run.py timing
"""

from __future__ import annotations

import sys
import time

import benchkit as bk
import torch


def main() -> int:
    dev = torch.device("cuda")
    bk._require_cuda(dev)
    x = torch.randn(4096, 4096, device=dev)
    tiny = torch.zeros(16, device=dev)
    cases: list[tuple[str, bk.Timing, str]] = []

    def case(name: str, t: bk.Timing, notes: str) -> bk.Timing:
        cases.append((name, t, notes))
        return t

    small = case("add 4096^2 fp32", bk.time_cuda(lambda: x.add_(1.0), warmup=2, iters=7), "64 MB elementwise")
    big = case("mm 4096^3 fp32", bk.time_cuda(lambda: torch.mm(x, x), warmup=2, iters=7), "137 GFLOP")
    paused = case("add 16, 2 ms host pause", bk.time_cuda(lambda: (time.sleep(0.002), tiny.add_(1.0)), warmup=2,
                                                           iters=7, calls_per_sample=1), "host time excluded")
    calls = []
    slowing = case("add 16, host slows to 300 us/call",
                   bk.time_cuda(lambda: (calls.append(1), len(calls) > 2 and time.sleep(300e-6), tiny.add_(1.0)),
                                warmup=2, iters=7, calls_per_sample=16), "second-largest sample")
    passes = case("add 16, 64 calls per event pair", bk.time_cuda(lambda: tiny.add_(1.0), iters=7,
                                                                  calls_per_sample=64), "back to back")
    single = case("add 16, an event pair per call", bk.time_cuda(lambda: tiny.add_(1.0), iters=7,
                                                                 calls_per_sample=1), "event overhead included")
    copy = bk.copy_ceiling_gbps(dev)
    dense = bk.bf16_dense_us(1, 5120, 1152, device=dev)
    dense_floor = bk.gbps(5120 * 1152 * 2, 1.0) / copy  # µs to read the weights at the whole copy rate

    checks = [
        ("host pause not counted", paused.median_us < 500, f"{paused.median_us:.1f} us (2000 us of host pause)"),
        ("slowing host: at most one sample caught", sorted(slowing.samples_us)[-2] < 100,
         f"second-largest sample {sorted(slowing.samples_us)[-2]:.1f} us"),
        ("event pair per call costs more", passes.median_us < single.median_us,
         f"{passes.median_us:.2f} us vs {single.median_us:.2f} us"),
        ("matmul slower than elementwise", big.median_us > small.median_us,
         f"{big.median_us:.0f} us vs {small.median_us:.0f} us"),
        ("copy ceiling plausible", 50 < copy < 20_000, f"{copy:.0f} GB/s (GB10 ~250, H200 ~4300)"),
        ("dense within the copy ceiling", 1.0 < dense < 10_000 and dense >= 0.5 * dense_floor,
         f"{dense:.1f} us (floor {dense_floor:.1f} us)"),
    ]
    records = [bk.Record(op="timing", shape={"case": i}, timing=t, variant=name, notes=notes)
               for i, (name, t, notes) in enumerate(cases)]
    records.append(bk.Record(op="timing", shape={"m": 1, "k": 5120, "n": 1152}, median_us=dense,
                             bytes=5120 * 1152 * 2, variant="bf16 dense L2-cold", notes="bf16_dense_us"))
    path = bk.write_results("timing", records, ceilings={"copy_gbps": copy})
    bad = 0
    for what, ok, detail in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}")
        bad += not ok
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
