"""The machine's peaks that `perf/*_mfu` divide by, and the memory bandwidth that bounds decoding.

    python benchmarks/machine_peak.py [--device cpu|cuda] [--threads N] [--remeasure]

Prints the float32 peak, the bfloat16 one where the device runs it natively, and the bandwidth, each with where it
came from: `probe` (measured now and cached), `cache` (an earlier measurement on this machine) or `datasheet`
(a known GPU). `--remeasure` drops this machine's cached entry first: run it on a quiet machine, as a probe taken
while other work runs reads low and stays cached. The cache key includes torch's intra-op threads, so measure with
the threads the run uses.
"""

from __future__ import annotations

import argparse

import torch

from training.utils.models.load import cache_dir, default_device
from training.utils.runtime import machine_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=str(default_device()), help="the device to measure (default: the one a "
                        "run trains on)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--remeasure", action="store_true", help="drop this machine's cached entry and measure again")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    path, key = cache_dir() / machine_peak.CACHE_FILE, machine_peak.machine_key(device)
    if args.remeasure and key in (entries := machine_peak.read_cache(path)):
        del entries[key]
        machine_peak.write_cache(path, entries)
    print(f"machine: {key}")
    print(f"cache:   {path}")
    for name, measurement in machine_peak.machine_peaks(device).items():
        if name == machine_peak.BANDWIDTH:
            print(f"memory bandwidth  {measurement.value / 1e9:10.1f} GB/s      ({measurement.source})")
        else:
            print(f"{name + ' peak':<17} {measurement.value / 1e9:10.1f} GFLOP/s  ({measurement.source})")


if __name__ == "__main__":
    main()
