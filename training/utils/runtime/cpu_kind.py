"""What kind of CPU a run is on: its model, family and the matrix instructions it has (AVX512-BF16, AMX), and the
cores this process may use. The run plan names it, the machine-peak cache keys its measurements by it, and the
defaults that depend on the machine (torch's threads, bf16 or float32) are decided from it at start-up.

Why the kind and not the model name: cloud CPUs report generic names ("AMD EPYC" covers Zen 2 without AVX512,
Zen 4 and Zen 5 with AVX512-BF16, at bf16 peaks 2-7x apart on the same 2 cores), so the name alone lets one kind's
cached peaks stand for another's.

Why the cores from the cgroup too: a container capped by a CPU quota (`docker run --cpus=2`) still sees every core
of the host in its affinity mask, and torch starts one OpenMP thread per core it sees. Twenty threads under a
two-core quota, spinning between operators (`openmp.py`), are throttled by the kernel every period.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

MATRIX_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "avx512f", "avx2"})
"""/proc/cpuinfo flags that decide the matrix kernels a CPU runs (`CpuKind.isa` names them)."""
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuKind:
    """One CPU kind, as /proc/cpuinfo and the cgroup describe it."""

    model_name: str
    family: int | None
    model: int | None
    flags: frozenset[str]
    """The `MATRIX_FLAGS` this CPU has (the others are left out: the list is long and says nothing here)."""
    affinity_cores: int
    """Cores in this process's affinity mask (which `taskset` or a cpuset narrows)."""
    quota_cores: float | None
    """The cgroup's CPU quota in cores (quota ÷ period), None when unlimited."""

    @property
    def usable_cores(self) -> int:
        """The cores this process can keep busy: its affinity mask, capped by the cgroup's quota (rounded up: a
        quota of 1.5 cores runs two threads, each at three quarters)."""
        if self.quota_cores is None:
            return self.affinity_cores
        return max(1, min(self.affinity_cores, math.ceil(self.quota_cores - 1e-9)))

    def isa(self) -> str:
        """The matrix instructions, e.g. "AVX512-BF16, no AMX" or "AVX2, no AVX512, no bf16"."""
        has = self.flags.__contains__
        if self.family is None and not self.flags:  # not x86 (Arm reports neither): torch's cpuinfo decides bf16
            return f"{platform.machine()}, no x86 flags"
        if has("amx_bf16"):
            return "AMX-BF16, AVX512-BF16" if has("avx512_bf16") else "AMX-BF16"
        if has("avx512_bf16"):
            return "AVX512-BF16, no AMX"
        if has("avx512f"):
            return "AVX512, no bf16"
        return ("AVX2" if has("avx2") else "no AVX2") + ", no AVX512, no bf16"

    def name(self) -> str:
        """The model name with its family and model numbers where the CPU reports them."""
        if self.family is None:
            return self.model_name
        return f"{self.model_name} (family {self.family} model {self.model})"

    def describe(self) -> str:
        """One line for the run plan: the kind, its matrix instructions and its usable cores (and why fewer than
        the affinity mask has, when a quota caps them)."""
        cores = f"{self.usable_cores} cores usable"
        if self.usable_cores < self.affinity_cores:
            cores += f" (a cgroup quota of {self.quota_cores:g} CPUs over {self.affinity_cores} in the affinity mask)"
        return f"{self.name()}: {self.isa()}; {cores}"


def cgroup_quota_cores(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in cores: cgroup v2's `cpu.max` ("<quota> <period>" or "max
    <period>"), else v1's `cpu.cfs_quota_us` ÷ `cpu.cfs_period_us` (-1: none). None when unlimited or unreadable."""
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def parse_cpuinfo(text: str) -> tuple[str, int | None, int | None, frozenset[str]]:
    """The first processor's model name, family, model and `MATRIX_FLAGS` from /proc/cpuinfo's text (x86's
    fields; an Arm CPU, which reports none of them, gets the platform's name and no flags)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: a VM's cores are one kind
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())

    def number(key: str) -> int | None:
        return int(fields[key]) if fields.get(key, "").isdigit() else None

    flags = frozenset(fields.get("flags", "").split()) & MATRIX_FLAGS
    return (fields.get("model name") or platform.processor() or platform.machine(), number("cpu family"),
            number("model"), flags)


def cpu_kind(cpuinfo: str | None = None, cgroup_root: Path = CGROUP_ROOT) -> CpuKind:
    """This machine's kind (`cpuinfo`: /proc/cpuinfo's text, read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    name, family, model, flags = parse_cpuinfo(cpuinfo)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CpuKind(name, family, model, flags, affinity, cgroup_quota_cores(cgroup_root))


def usable_cores() -> int:
    """The cores this process may keep busy (`CpuKind.usable_cores`): what CPU utilisation divides by and how many
    threads torch should run."""
    return cpu_kind().usable_cores


def fit_torch_threads() -> str:
    """At a run's start-up, before its trainer and engine threads first run torch (they start with the count set
    here): torch's intra-op threads lowered to the usable cores where its default exceeds them (a CPU quota), and
    why the count is what it is, for the run plan. A count below the usable cores was chosen (`OMP_NUM_THREADS`,
    `torch.set_num_threads`, or torch's one thread per physical core) and stays."""
    import torch

    usable, threads = usable_cores(), torch.get_num_threads()
    if threads > usable:
        torch.set_num_threads(usable)
        return f"{usable}, the usable cores (torch's default was {threads})"
    if threads == usable:
        return f"{threads}, the usable cores"
    return f"{threads} of {usable} usable cores, as torch or OMP_NUM_THREADS set it"
