"""Host memory and time of loading one DeepSeek V4.1 layer at its real dimensions onto the GPU, as rank 0 of TP 2.

The layer (layer 0 of the published pack: attention incl. 8 wo_a groups, 384 routed experts at K=3, shared experts,
norms, router, hc tensors; names and shapes from twinspark.v41_layout) is written with random values to one
safetensors file under --dir, then loaded twice in the same process, as the plugin loads it: safetensors' mapping
(safe_open / get_tensor, as vLLM's iterator reads), this rank's slice of every EXL3 matrix cut by Exl3Parts and
copied to the GPU, dense tensors copied whole:
  - staged: every tensor through twinspark.staging's one reusable pinned buffer (the plugin's path);
  - direct: straight from the mapping.
Printed per path: wall time, GB/s of file bytes, and the peak growth of the process's anonymous host memory
(RssAnon, sampled every millisecond) over the load, and the pinned staging buffer (page-locked by the CUDA
driver, not in RssAnon): what one layer's load costs in host memory. The H200's host
does not copy-on-write mapped pages the way GB10's driver does (deepseek-v41.md section 6), so the direct path's
figure here is a lower bound of GB10's; the staged path's is what it costs there too. Writes weight_load.json.

    python bench/bench_weight_load.py [--dir /tmp] [--experts 384]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import benchkit as bk  # noqa: E402
from twinspark.exl3.format import layer_tensors  # noqa: E402
from twinspark.exl3.layer import random_layer  # noqa: E402
from twinspark.staging import staged  # noqa: E402
from twinspark.v41_layout import V41Spec  # noqa: E402
from twinspark.vllm_plugin.parts import Cut, Exl3Parts  # noqa: E402

_DT = {"BF16": torch.bfloat16, "F32": torch.float32}


def rss_anon(field: str = "RssAnon") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Peak:
    """Samples RssAnon every millisecond in a thread; .peak is the largest value seen."""

    def __init__(self):
        self.peak, self._stop = rss_anon(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_anon())


def write_layer(path: Path, experts: int) -> tuple[dict, int]:
    """Layer 0's tensors (random) into one file; returns {EXL3 matrix name: Linear} and the file's bytes."""
    from safetensors.torch import save_file

    spec = V41Spec.real()
    lin, den = spec._layer("layers.0", 0, mtp=False)
    lin = [m for m in lin if ".experts." not in m.name or int(m.name.split(".")[4]) < experts]
    g = torch.Generator().manual_seed(0)
    tensors = {d.name: torch.randn(d.shape, generator=g).to(_DT[d.dtype]) for d in den}
    for m in lin:
        tensors |= layer_tensors(random_layer(m.k, m.n, m.K, "mul1", generator=g), m.name)
    save_file(tensors, str(path))
    return {m.name: m for m in lin}, path.stat().st_size


def load(path: Path, mats: dict, use_staging: bool) -> tuple[float, int, int, int]:
    """One load as rank 0 of 2; (seconds, peak RssAnon growth, pinned staging bytes, bytes kept on the GPU)."""
    from safetensors import safe_open

    gc.collect()
    torch.cuda.synchronize()
    base, kept = rss_anon(), []
    parts: dict[str, Exl3Parts] = {}
    stats = {"pinned_bytes": 0}
    t0 = time.perf_counter()
    with Peak() as peak, safe_open(str(path), framework="pt") as f:
        weights = ((n, f.get_tensor(n)) for n in sorted(f.keys()))
        for name, t in (staged(weights, torch.device("cuda"), stats) if use_staging else weights):
            head, _, suffix = name.rpartition(".")
            m = mats.get(head)
            if m is None:
                kept.append(t.to("cuda"))
                continue
            if head not in parts:  # column split where the width allows (the split kind does not change the bytes)
                cut = Cut(0, m.n // 2) if m.n % 256 == 0 else None
                parts[head] = Exl3Parts(head, None, cut, "mul1")
            parts[head].add(suffix, t, device="cuda")
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    on_gpu = sum(x.numel() * x.element_size() for x in kept) + sum(
        sum(v.numel() * v.element_size() for k, v in p.t.items() if k in ("trellis", "suh", "svh"))
        for p in parts.values())
    del parts, kept
    torch.cuda.empty_cache()
    return secs, peak.peak - base, stats["pinned_bytes"], on_gpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp", help="where the layer file goes (deleted afterwards)")
    ap.add_argument("--experts", type=int, default=384, help="routed experts written (384: the real layer)")
    args = ap.parse_args()
    bk._require_cuda()
    root = Path(tempfile.mkdtemp(prefix="twinspark-load-", dir=args.dir))
    records = []
    try:
        t0 = time.perf_counter()
        mats, nbytes = write_layer(root / "layer0.safetensors", args.experts)
        print(f"layer 0 at real dimensions: {len(mats)} EXL3 matrices, {nbytes / 2**30:.2f} GiB file "
              f"(written in {time.perf_counter() - t0:.1f} s)")
        for use in (True, False, True):  # staged twice: the first run also pays the page cache's first read
            secs, grow, pinned, on_gpu = load(root / "layer0.safetensors", mats, use)
            variant = "staged" if use else "direct"
            print(f"{variant:7s}: {secs:6.2f} s, {nbytes / secs / 1e9:5.2f} GB/s of file, host anon memory "
                  f"+{grow / 2**20:8.1f} MiB at peak, pinned staging {pinned / 2**20:6.1f} MiB, "
                  f"{on_gpu / 2**30:.2f} GiB kept on the GPU (rank 0 of 2)")
            records.append(bk.Record(op="weight_load", shape={"layer": 0, "experts": args.experts, "tp": 2},
                                     median_us=secs * 1e6, bytes=nbytes, variant=variant,
                                     notes=f"host anon +{grow / 2**20:.1f} MiB peak, pinned {pinned / 2**20:.1f} "
                                           f"MiB; {on_gpu / 2**30:.2f} GiB on GPU"))
        largest = max((m.k // 16) * (m.n // 16) * int(16 * m.K) * 2 for m in mats.values())
        print(f"largest EXL3 tensor of the layer: {largest / 2**20:.1f} MiB (the pinned buffer holds the largest "
              "tensor staged: the layer's, or the embedding's 1,263 MiB in a whole-model load)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bk.write_results("weight_load", records)


if __name__ == "__main__":
    main()
