"""The machine's limits that utilisation is measured against: a dense matmul's FLOP/s per dtype, and the memory
bandwidth.

- Compute peak: on a CPU, a short GEMM probe (square matmuls: warm-ups, then the best of a few timed runs); on
  an H100 SXM, H200 SXM or A100, the vendor datasheet's dense figure; on any other GPU, the probe.
- Memory bandwidth: the bytes a large tensor copy reads and writes per second. Decoding reads every weight once
  per step, so it bounds the decode rate.

Measurements are cached per machine (`machine_key`) in `cache_dir()/machine_peak.json`, so only the first run on
a machine probes. A cache file that cannot be read or is not the cache's shape is measured again, never an
error. A probe measures the machine as it is: taken while other work runs, it reads low and stays cached; delete
the file (or run `benchmarks/machine_peak.py --remeasure`) to measure again on a quiet machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from training.utils.models.load import cache_dir, native_bf16
from training.utils.runtime.cpu_kind import cpu_kind

log = logging.getLogger(__name__)

CACHE_FILE = "machine_peak.json"
GEMM_SIZE = {"cpu": 2048, "cuda": 8192}
"""The probe's square matmul per device type: large enough to run near the peak, small enough to be quick."""
COPY_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}
"""Bytes the bandwidth probe copies: far more than any cache holds."""
WARMUPS, REPS = 2, 3
BANDWIDTH = "copy_bytes_per_s"
"""The cache's name for the memory bandwidth, beside each dtype's FLOP/s."""

DATASHEET_TFLOPS = {
    "H100 SXM": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "H200 SXM": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5},
}
"""Dense peaks (the tensor-core figures without 2:4 sparsity; float32 without TF32) from NVIDIA's datasheets: the
H100 Tensor Core GPU datasheet (H100 SXM), the H200 Tensor Core GPU datasheet (H200 SXM, the H100's compute), and
the A100 Tensor Core GPU datasheet (the same figures for its SXM and PCIe boards)."""


@dataclass(frozen=True)
class Measurement:
    value: float
    """FLOP/s, or bytes/s for the bandwidth."""
    source: str
    """Where it came from: `datasheet <model>`, `cache` or `probe`."""


def machine_key(device: torch.device) -> str:
    """What a measurement belongs to: the GPU's name, or the CPU's kind (model name, family, model and matrix
    instructions: generic names such as "AMD EPYC" cover kinds whose peaks differ several times, `cpu_kind`), its
    cores and torch's intra-op threads (on a CPU they set the peak), and torch's version (its kernels)."""
    kind = cpu_kind()
    cpu = kind.name() + (f" [{' '.join(sorted(kind.flags))}]" if kind.flags else "")
    parts = [cpu, f"{os.cpu_count()} cpus", f"{torch.get_num_threads()} threads", f"torch {torch.__version__}"]
    if device.type == "cuda":
        parts.insert(0, torch.cuda.get_device_name(device))
    return " | ".join(parts)


def datasheet_model(device_name: str) -> str | None:
    """The `DATASHEET_TFLOPS` entry of a CUDA device name, or None. H100 and H200 boards other than SXM (PCIe, NVL)
    run at other clocks and power, so they are probed."""
    if "A100" in device_name:
        return "A100"
    if "PCIe" in device_name or "NVL" in device_name:
        return None
    return next((f"{model} SXM" for model in ("H100", "H200") if model in device_name), None)


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> Measurement:
    """Dense matmul FLOP/s of `dtype` on `device`: a datasheet figure for a known GPU (float32 as TF32 when torch's
    float32 matmul precision allows it), else the cached probe. A CPU's peak for a dtype it does not run natively
    (anything but float32, and bfloat16 where `model.native_bf16`) is its float32 peak: emulation is no peak."""
    device = torch.device(device)
    if device.type == "cuda" and (model := datasheet_model(torch.cuda.get_device_name(device))):
        column = str(dtype).removeprefix("torch.")
        if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
            column = "tf32"
        if column in DATASHEET_TFLOPS[model]:
            return Measurement(DATASHEET_TFLOPS[model][column] * 1e12, f"datasheet {model}")
    if device.type == "cpu" and dtype != torch.float32 and not (dtype == torch.bfloat16 and native_bf16(device)):
        dtype = torch.float32
    return cached(device, str(dtype).removeprefix("torch."), lambda: gemm_flops(device, dtype))


BF16_MIN_SPEEDUP = 1.25
"""How much faster than float32 a CPU's bf16 GEMMs must measure for the `auto` choices (the trainer's precision, the
embedded engine's dtype) to take bf16 there: a CPU that reports AVX512-BF16 or AMX but runs them barely faster (an
emulating hypervisor) runs in float32, which is then as fast and exact."""

_warned_slow_bf16: set[str] = set()


def fast_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether bf16 pays on `device`, and why: native (`models.load.native_bf16`: CUDA, a CPU with AVX512-BF16 or
    AMX) and, on a CPU, its bf16 GEMMs measured (cached, once per machine) at least `BF16_MIN_SPEEDUP` times its
    float32 ones; a CPU that fails the check is warned about once. `TRAINING_CPU_BF16` decides without the check."""
    device = torch.device(device)
    if device.type == "cuda":
        return True, "bf16 is native on CUDA"
    override = os.environ.get("TRAINING_CPU_BF16", "") if device.type == "cpu" else ""
    if override:
        return native_bf16(device), f"TRAINING_CPU_BF16={override}"
    if not native_bf16(device):
        return False, f"no native bf16 on {f'this CPU ({cpu_kind().isa()})' if device.type == 'cpu' else device.type}"
    bf16, fp32 = (peak_flops(device, dtype).value for dtype in (torch.bfloat16, torch.float32))
    measured = (f"its bf16 GEMMs measured {bf16 / fp32:.1f}x float32's ({bf16 / 1e9:.0f} against {fp32 / 1e9:.0f} "
                "GFLOP/s)")
    if bf16 / fp32 < BF16_MIN_SPEEDUP:
        if (key := machine_key(device)) not in _warned_slow_bf16:
            _warned_slow_bf16.add(key)
            log.warning("'auto' runs in float32: this CPU reports bf16 instructions (%s) but %s, under the %gx bf16 "
                        "needs to pay; set trainer.precision='bf16-autocast' (and deployment.dtype='bfloat16') to use "
                        "it anyway", cpu_kind().isa(), measured, BF16_MIN_SPEEDUP)
        return False, f"{measured}, under {BF16_MIN_SPEEDUP}x, so float32"
    return True, f"native bf16 ({cpu_kind().isa()}), {measured}"


def memory_bandwidth(device: torch.device | str) -> Measurement:
    """Bytes per second a large copy reads and writes on `device`, cached."""
    device = torch.device(device)
    return cached(device, BANDWIDTH, lambda: copy_bandwidth(device))


def machine_peaks(device: torch.device | str) -> dict[str, Measurement]:
    """What a run measures at start-up: the float32 peak, the bfloat16 one where it is native, and the bandwidth."""
    device = torch.device(device)
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16(device) else [])
    return {str(d).removeprefix("torch."): peak_flops(device, d) for d in dtypes} | {
        BANDWIDTH: memory_bandwidth(device)}


def cached(device: torch.device, name: str, measure: Callable[[], float]) -> Measurement:
    """`name`'s value for this machine from the cache file, or `measure()`d and written there."""
    path = cache_dir() / CACHE_FILE
    key = machine_key(device)
    entries = read_cache(path)
    value = entries.get(key, {}).get(name)
    if type(value) in (int, float) and math.isfinite(value) and value > 0:
        return Measurement(float(value), "cache")
    value = measure()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's buffers back to the device: later sizing reads what is free
    entries.setdefault(key, {})[name] = value
    write_cache(path, entries)
    return Measurement(value, "probe")


def read_cache(path: Path) -> dict[str, dict]:
    """The cache's entries by machine key; {} for a file that is missing, unreadable or not a JSON object (its
    values are measured again), and an entry that is not an object is dropped."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}


def write_cache(path: Path, entries: dict[str, dict]) -> None:
    """Replace the cache file whole (a reader never sees half of it); a failure only costs a probe next time."""
    staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(staging, path)
    except OSError as error:
        with contextlib.suppress(OSError):  # the staging file may never have been made
            staging.unlink(missing_ok=True)
        log.warning("could not cache the machine's peak in %s (%s); the next run measures it again", path, error)


def gemm_flops(device: torch.device, dtype: torch.dtype, size: int | None = None) -> float:
    """FLOP/s of the fastest of `REPS` square matmuls of `size` in `dtype`, after `WARMUPS`."""
    size = size or GEMM_SIZE.get(device.type, GEMM_SIZE["cpu"])
    # A generator of its own: the probe runs inside a seeded run, on its first start only, and drawing from
    # torch's global one would make that run's samples differ from every later run's.
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, generator=generator).to(dtype) for _ in range(2))
    return 2 * size**3 / best_time(lambda: torch.matmul(a, b), device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes per second (read plus written) of the fastest of `REPS` copies of `nbytes` of float32, after
    `WARMUPS` (the first touches the pages)."""
    source = torch.ones((nbytes or COPY_BYTES.get(device.type, COPY_BYTES["cpu"])) // 4, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() * source.element_size() / best_time(lambda: target.copy_(source), device)


def best_time(run: Callable[[], object], device: torch.device) -> float:
    for _ in range(WARMUPS):
        run()
    best = math.inf
    for _ in range(REPS):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)  # a timer too coarse to see the run must not divide by 0


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer sees it (a CPU's ops return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
