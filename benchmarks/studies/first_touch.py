"""How much a page costs the first time this VM touches it, against the second time.

    python benchmarks/studies/first_touch.py --gigabytes 4 --out results/first_touch.json

A fresh VM's guest memory is backed by the host on first touch, and a `virtio_balloon` with free page
reporting hands freed pages back, so a process whose large tensors are fresh `mmap`s can pay that cost
call after call. The script fills `--gigabytes` of new memory twice (freeing it between) and prints both
rates; on the Intel Xeon VM of 2026-12-02 the first pass ran at 0.38 GB/s (~10 us a 4 KB page) and the
second at 5.6 GB/s. Run it before a benchmark to see whether the machine is still warming up."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def touch_rate_gb_s(gigabytes: float) -> float:
    """GB/s of filling `gigabytes` of freshly allocated memory (its pages touched once each)."""
    start = time.perf_counter()
    block = np.ones(int(gigabytes * (1 << 30)) // 8)
    seconds = time.perf_counter() - start
    del block
    return gigabytes / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=4.0)
    parser.add_argument("--out", default="results/first_touch.json")
    args = parser.parse_args()
    rates = [touch_rate_gb_s(args.gigabytes) for _ in range(2)]
    print(
        f"{args.gigabytes} GB of new memory: first pass {rates[0]:.2f} GB/s, second pass {rates[1]:.2f} GB/s"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gigabytes": args.gigabytes, "rates_gb_s": rates}, indent=1))


if __name__ == "__main__":
    main()
