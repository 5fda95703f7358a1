"""The CPU's kind (`training/utils/runtime/cpu_kind.py`) and the defaults decided from it at start-up: torch's
threads fitted to the usable cores, the peaks' cache keyed by the kind, bf16 autocast only where its GEMMs measure
faster than float32's (`trainer/precision.py`)."""

from __future__ import annotations

import logging

import pytest
import torch

from training import DeploymentConfig, TrainerConfig
from training.utils.deploy.embedded import engine_dtype
from training.utils.runtime import cpu_kind, machine_peak
from training.utils.runtime.cpu_kind import CpuKind, cgroup_quota_cores, parse_cpuinfo
from training.utils.trainer import precision


def cpuinfo(name: str, family: int, model: int, flags: str) -> str:
    """Two processors' blocks of /proc/cpuinfo, as a 2-core VM shows them (the second one's name differs, to show
    that the first is read)."""
    block = ("processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
             "model name\t: {name}\nflags\t\t: fpu sse2 {flags}\n\n")
    return (block.format(n=0, family=family, model=model, name=name, flags=flags)
            + block.format(n=1, family=family, model=model, name="another", flags=""))


# The three kinds this project's machines have been: two of them report the same name.
ZEN2 = cpuinfo("AMD EPYC", 23, 49, "avx avx2 fma")
ZEN4 = cpuinfo("AMD EPYC", 25, 17, "avx2 avx512f avx512bw avx512_bf16 avx512_vnni")
SAPPHIRE_RAPIDS = cpuinfo("Intel(R) Xeon(R) Platinum 8480+", 6, 143,
                          "avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8")


@pytest.mark.parametrize(("text", "family", "model", "isa"), [
    (ZEN2, 23, 49, "AVX2, no AVX512, no bf16"),
    (ZEN4, 25, 17, "AVX512-BF16, no AMX"),
    (SAPPHIRE_RAPIDS, 6, 143, "AMX-BF16, AVX512-BF16"),
], ids=["zen2", "zen4", "sapphire_rapids"])
def test_the_kind_is_read_from_the_first_processor(text, family, model, isa):
    name, got_family, got_model, flags = parse_cpuinfo(text)
    kind = CpuKind(name, got_family, got_model, flags, affinity_cores=2, quota_cores=None)
    assert (got_family, got_model, kind.isa()) == (family, model, isa)
    assert "amx_tile" not in flags and "fpu" not in flags, "only the matrix flags are kept"
    assert kind.describe() == f"{name} (family {family} model {model}): {isa}; 2 cores usable"


def test_an_arm_cpuinfo_without_x86_fields_still_names_a_kind():
    name, family, model, flags = parse_cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16\n")
    kind = CpuKind(name, family, model, flags, 4, None)
    assert family is None and model is None and not flags and kind.name() == name != ""
    assert kind.isa().endswith(", no x86 flags")


@pytest.mark.parametrize(("files", "cores"), [
    ({"cpu.max": "200000 100000\n"}, 2.0),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
], ids=["v2", "v2_fraction", "v2_unlimited", "v1", "v1_unlimited", "unreadable", "none"])
def test_the_cgroup_quota_in_cores(tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_quota_cores(tmp_path) == cores


@pytest.mark.parametrize(("affinity", "quota", "usable"), [(16, 2.0, 2), (16, 1.5, 2), (16, 0.5, 1), (2, 8.0, 2),
                                                          (4, None, 4)])
def test_a_quota_caps_the_usable_cores(affinity, quota, usable):
    kind = CpuKind("AMD EPYC", 25, 17, frozenset(), affinity, quota)
    assert kind.usable_cores == usable
    assert ("cgroup quota" in kind.describe()) is (usable < affinity)


def test_torch_threads_are_lowered_to_the_usable_cores_and_kept_below_them(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        monkeypatch.setattr(cpu_kind, "usable_cores", lambda: 2)
        assert cpu_kind.fit_torch_threads() == "2, the usable cores (torch's default was 3)"
        assert torch.get_num_threads() == 2
        assert cpu_kind.fit_torch_threads() == "2, the usable cores"
        torch.set_num_threads(1)
        assert cpu_kind.fit_torch_threads() == "1 of 2 usable cores, as torch or OMP_NUM_THREADS set it"
        assert torch.get_num_threads() == 1, "a count below the cores was chosen: it stays"
    finally:
        torch.set_num_threads(before)


def test_two_kinds_of_one_name_keep_their_peaks_apart(monkeypatch):
    keys = []
    for text in (ZEN2, ZEN4):
        monkeypatch.setattr(machine_peak, "cpu_kind", lambda text=text: CpuKind(*parse_cpuinfo(text), 2, None))
        keys.append(machine_peak.machine_key(torch.device("cpu")))
    assert keys[0] != keys[1] and all(key.startswith("AMD EPYC (family ") for key in keys)
    assert "avx512_bf16" in keys[1] and "avx512_bf16" not in keys[0]


@pytest.mark.parametrize(("bf16_gflops", "chosen"), [(400.0, "bf16-autocast"), (110.0, "fp32")],
                         ids=["bf16_faster", "bf16_no_faster"])
def test_auto_trains_in_bf16_only_where_its_gemms_measure_faster(monkeypatch, caplog, bf16_gflops, chosen):
    monkeypatch.delenv("TRAINING_CPU_BF16", raising=False)
    monkeypatch.setattr(machine_peak, "native_bf16", lambda device: True)  # a CPU that reports bf16 instructions
    monkeypatch.setattr(machine_peak, "_warned_slow_bf16", set())
    peaks = {torch.bfloat16: bf16_gflops * 1e9, torch.float32: 100e9}
    monkeypatch.setattr(machine_peak, "peak_flops",
                        lambda device, dtype: machine_peak.Measurement(peaks[dtype], "cache"))
    caplog.set_level(logging.WARNING, logger="training")
    got, reason = precision.precision_choice(TrainerConfig(), torch.device("cpu"))
    assert got == chosen
    ratio = f"{bf16_gflops / 100:.1f}x float32's ({bf16_gflops:.0f} against 100 GFLOP/s)"
    assert ratio in reason
    # The embedded engine's `auto` dtype makes the same choice (one home: `machine_peak.fast_bf16`).
    assert engine_dtype(DeploymentConfig(), torch.device("cpu")) == (
        torch.bfloat16 if chosen == "bf16-autocast" else torch.float32)
    warned = [m for m in caplog.messages if "'auto' runs in float32" in m]
    assert len(warned) == (chosen == "fp32"), "the fallback says why, once; the bf16 choice is silent"
    # What the user sets is kept, measured or not.
    assert precision.precision_choice(TrainerConfig(precision="bf16-autocast"), torch.device("cpu")) == (
        "bf16-autocast", "as set")


def test_the_environment_override_decides_without_a_probe(monkeypatch):
    def no_probe(device, dtype):
        raise AssertionError("TRAINING_CPU_BF16 decides without measuring")

    monkeypatch.setattr(machine_peak, "peak_flops", no_probe)
    for value, chosen in (("0", "fp32"), ("1", "bf16-autocast")):
        monkeypatch.setenv("TRAINING_CPU_BF16", value)
        assert precision.precision_choice(TrainerConfig(), torch.device("cpu")) == (
            chosen, f"auto: TRAINING_CPU_BF16={value}")
