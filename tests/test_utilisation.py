"""Utilisation: FLOP counts against hand counts, the trainer's FLOP counter, the machine-peak cache, and the
`perf/*` utilisation metrics of both recipes on a tiny model.

The tiny Llama config (`tiny_config(260)`): hidden 64, 2 layers, 4 query heads and 2 key/value heads of 16,
MLP 128, vocabulary 260. By hand:
- per layer q 64·64 = 4096, k 64·32 = 2048, v 2048, o 4096, MLP 3·64·128 = 24576: 36864; two layers: 73728
  matmul weights, so 147456 FLOPs per token;
- the vocabulary projection 64·260 = 16640 weights: 33280 FLOPs per projected position;
- attention 4·2 layers·4 heads·16 = 512 FLOPs per attended (query, key) pair.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, MixtralConfig

from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import DeploymentConfig, SamplingConfig, TrainerConfig
from training.utils.models.flops import cached_forward_flops, causal_pairs, decoder_shape, forward_flops
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.rl import telemetry
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.rl.telemetry import Utilisation
from training.utils.run_files.logging import read_ledger
from training.utils.runtime import cpu_share, machine_peak
from training.utils.sandbox.namespaces import choose_sandbox
from training.utils.trainer import Datum, Trainer

PER_TOKEN, PER_PROJECTED, PER_PAIR = 147456, 33280, 512
"""The tiny config's FLOPs per token, per projected position and per attended pair, counted by hand above."""


# ---- FLOP formulas ------------------------------------------------------------------------------------------------


def test_the_tiny_configs_shape_and_flops_match_the_hand_count():
    shape = decoder_shape(tiny_config(260))
    assert (shape.matmul_params, shape.lm_head_params) == (73728, 16640)
    # Sequences of 3 and 5 tokens, logits everywhere: 8 tokens, pairs 3·4/2 + 5·6/2 = 6 + 15 = 21, 8 projected:
    # 8·147456 + 8·33280 + 21·512 = 1179648 + 266240 + 10752.
    forward = forward_flops(shape, tokens=8, attention_pairs=causal_pairs(3) + causal_pairs(5), projected=8)
    assert forward == 1456640
    assert forward_flops(shape, tokens=8, attention_pairs=21, projected=8, backward=True) == 3 * 1456640
    # Frozen weights (LoRA) get no gradient: their matmuls twice; 100 adapter weights, 200 FLOPs a token, thrice.
    assert forward_flops(shape, tokens=8, attention_pairs=21, projected=8, adapter_params=100, backward=True,
                         weights_trained=False) == 2 * (1179648 + 266240) + 3 * 10752 + 3 * 8 * 200


def test_engine_prefill_and_decode_flops_match_the_hand_count():
    shape = decoder_shape(tiny_config(260))
    # Two prompts of 6 new tokens after 4 cached: 12 tokens; each 6·4 + 6·7/2 = 45 pairs, 90 in all; 2 projected.
    assert cached_forward_flops(shape, rows=2, new_tokens=6, cached_tokens=4) == 12 * PER_TOKEN + 2 * PER_PROJECTED \
        + 90 * PER_PAIR
    # A decode step of 3 rows after 10 tokens: 3 tokens, each seeing 11 keys, 3 projected.
    assert cached_forward_flops(shape, rows=3, new_tokens=1, cached_tokens=10) == 3 * PER_TOKEN + 3 * PER_PROJECTED \
        + 33 * PER_PAIR


def test_only_dense_decoder_configs_have_a_shape():
    assert decoder_shape(GPT2Config()) is None  # no intermediate_size: its FLOPs are not counted
    assert decoder_shape(MixtralConfig()) is None  # experts: a token passes through only some MLP weights
    grouped = decoder_shape(tiny_config(260, num_heads=8))
    assert (grouped.heads, grouped.kv_heads, grouped.head_dim) == (8, 4, 8)


# ---- the trainer's counter ----------------------------------------------------------------------------------------


def make_datum(tokens: list[int], prompt_len: int) -> Datum:
    return Datum(input_ids=tokens[:-1], target_ids=tokens[1:],
                 weights=[0.0] * (prompt_len - 1) + [1.0] * (len(tokens) - prompt_len),
                 behaviour_logprobs=[-1.0] * (len(tokens) - 1), advantage=1.0, prompt_len=prompt_len)


def sum_loss(logprobs, mb):
    return -(logprobs * mb.weights).sum() / mb.num_tokens_total, {}


@pytest.fixture
def tiny_trainer():
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(260), device="cpu")
    return Trainer(model, TrainerConfig(learning_rate=1e-3))


def test_the_trainer_counts_the_flops_of_what_it_ran(tiny_trainer):
    # Inputs of 3 and 5 tokens, 3 and 4 of them trained, padded to one micro-batch of 2·5 = 10 tokens; attention
    # over the real tokens: 6 + 15 = 21 pairs. Forward and backward: 3 · (10·147456 + 7·33280 + 21·512).
    datums = [make_datum([5, 6, 7, 8], prompt_len=1), make_datum([9, 10, 11, 12, 13, 14], prompt_len=2)]
    tiny_trainer.forward_backward(datums, sum_loss)
    assert tiny_trainer.flops == 3 * (1474560 + 232960 + 10752)
    # The no-grad logprobs pass projects every real token: 8.
    tiny_trainer.logprobs(datums)
    assert tiny_trainer.flops == 3 * 1718272 + (1474560 + 266240 + 10752)


def test_a_lora_backward_computes_no_gradient_of_the_frozen_weights():
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(260), device="cpu")
    policy = Trainer(model, TrainerConfig(learning_rate=1e-3, lora_rank=4))
    # Rank-4 adapters per layer, r·(in + out): q and o 4·128 = 512 each, k and v 4·96 = 384, gate, up and down
    # 4·192 = 768: 4096; two layers 8192 weights, 16384 FLOPs per token.
    datums = [make_datum([5, 6, 7, 8], prompt_len=1), make_datum([9, 10, 11, 12, 13, 14], prompt_len=2)]
    policy.forward_backward(datums, sum_loss)
    # The first test's micro-batch (10 tokens, 7 projected, 21 pairs): the model's weights twice (the forward and
    # the inputs' gradients, none of their own), attention and the adapters three times.
    weights, attention, adapters = 10 * PER_TOKEN + 7 * PER_PROJECTED, 21 * PER_PAIR, 10 * 16384
    assert policy.flops == 2 * weights + 3 * attention + 3 * adapters
    # Its reference is the policy with the adapters off: a forward without them, every real token projected.
    policy.adapter_disabled_reference().logprobs(datums)
    assert policy.flops == 2 * weights + 3 * attention + 3 * adapters + 10 * PER_TOKEN + 8 * PER_PROJECTED + attention


def test_a_shared_prefix_is_counted_once(tiny_trainer):
    # Inputs of 12 and 13 tokens sharing their first 10 run as one row of 10 + 2 + 3 = 15 tokens. Pairs: the prefix
    # 10·11/2 = 55, then the suffixes after it: 2·10 + 3 = 23 and 3·10 + 6 = 36, 114 in all (apart: 78 + 91).
    prefix = list(range(20, 30))
    datums = [make_datum(prefix + [40, 41, 42], prompt_len=11), make_datum(prefix + [50, 51, 52, 53], prompt_len=11)]
    tiny_trainer.logprobs(datums)
    assert tiny_trainer.flops == 15 * PER_TOKEN + 25 * PER_PROJECTED + 114 * PER_PAIR


# ---- the machine's peak -------------------------------------------------------------------------------------------


@pytest.fixture
def probes(monkeypatch, tmp_path):
    """The cache in a fresh directory, and probes that return fixed numbers and count their calls."""
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def gemm(device, dtype, size=None):
        calls.append(dtype)
        return 2e12 if dtype == torch.bfloat16 else 1e12

    def copy(device, nbytes=None):
        calls.append("copy")
        return 1e10

    monkeypatch.setattr(machine_peak, "gemm_flops", gemm)
    monkeypatch.setattr(machine_peak, "copy_bandwidth", copy)
    return SimpleNamespace(calls=calls, path=tmp_path / "cache" / machine_peak.CACHE_FILE)


def test_the_peak_is_measured_once_and_then_read_from_the_cache(probes):
    first = machine_peak.peak_flops("cpu", torch.float32)
    again = machine_peak.peak_flops("cpu", torch.float32)
    assert (first, again) == (machine_peak.Measurement(1e12, "probe"), machine_peak.Measurement(1e12, "cache"))
    assert machine_peak.memory_bandwidth("cpu") == machine_peak.Measurement(1e10, "probe")
    assert probes.calls == [torch.float32, "copy"]
    key = machine_peak.machine_key(torch.device("cpu"))
    assert json.loads(probes.path.read_text()) == {key: {"float32": 1e12, "copy_bytes_per_s": 1e10}}


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"KEY": 5}', b'{"KEY": {"float32": -1}}',
                                     b'{"KEY": {"float32": "fast"}}', b'{"KEY": {"float32": NaN}}'])
def test_a_corrupt_cache_is_measured_again(probes, content):
    key = machine_peak.machine_key(torch.device("cpu"))
    probes.path.parent.mkdir(parents=True)
    probes.path.write_bytes(content.replace(b"KEY", key.encode()))
    assert machine_peak.peak_flops("cpu", torch.float32) == machine_peak.Measurement(1e12, "probe")
    assert json.loads(probes.path.read_text())[key] == {"float32": 1e12}


def test_a_cache_that_cannot_be_written_costs_only_a_probe(probes, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("TRAINING_CACHE_DIR", str(blocker / "cache"))  # a directory cannot be made under a file
    assert machine_peak.peak_flops("cpu", torch.float32) == machine_peak.Measurement(1e12, "probe")
    assert "could not cache the machine's peak" in caplog.text


def test_a_cpu_without_native_bf16_is_held_to_its_float32_peak(probes, monkeypatch):
    monkeypatch.setenv("TRAINING_CPU_BF16", "0")
    assert machine_peak.peak_flops("cpu", torch.bfloat16).value == 1e12
    assert set(machine_peak.machine_peaks("cpu")) == {"float32", "copy_bytes_per_s"}
    monkeypatch.setenv("TRAINING_CPU_BF16", "1")
    assert machine_peak.peak_flops("cpu", torch.bfloat16).value == 2e12
    assert probes.calls == [torch.float32, "copy", torch.bfloat16]


def test_known_gpus_take_their_datasheet_peaks(probes, monkeypatch):
    assert [machine_peak.datasheet_model(name) for name in (
        "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 PCIe",
        "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GeForce RTX 4090")] == [
        "H100 SXM", "H200 SXM", "A100", "A100", None, None, None, None]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    bf16 = machine_peak.peak_flops(cuda, torch.bfloat16)
    assert (bf16.value, bf16.source) == (pytest.approx(989.4e12), "datasheet H100 SXM")
    assert machine_peak.peak_flops(cuda, torch.float32).value == pytest.approx(66.9e12)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # float32 matmuls in TF32
    try:
        assert machine_peak.peak_flops(cuda, torch.float32).value == pytest.approx(494.7e12)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert probes.calls == []


def test_the_probes_measure_something():
    cpu = torch.device("cpu")
    assert machine_peak.gemm_flops(cpu, torch.float32, size=64) > 0
    assert machine_peak.copy_bandwidth(cpu, nbytes=1 << 20) > 0


def test_the_probe_leaves_the_runs_random_draws_alone():
    """The probe runs inside a seeded run the first time a machine starts one: drawing its matrices from torch's
    global generator made that run sample differently from every later run on a cached machine."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    machine_peak.gemm_flops(torch.device("cpu"), torch.bfloat16, size=64)
    assert torch.equal(torch.rand(4), expected)


# ---- per-step metrics ---------------------------------------------------------------------------------------------


class CountingDeployment:
    """A deployment whose engine reports the cumulative counters it is given."""

    def __init__(self):
        self.stats = {}

    def engine_stats(self):
        return dict(self.stats)


def test_utilisation_divides_what_grew_since_the_last_step(probes, monkeypatch):
    shared_seconds = [7.0]  # the process's shared clock (cpu_share), before the run's first step
    monkeypatch.setattr(cpu_share, "shared_seconds", lambda: shared_seconds[0])
    shape = decoder_shape(tiny_config(260))
    policy = SimpleNamespace(flops=0.0, precision="fp32", device=torch.device("cpu"), flop_shape=shape,
                             model=torch.nn.Linear(10, 10))  # 110 weights: 440 bytes in float32
    cfg = DeploymentConfig(dtype="float32")
    deployment, utilisation = CountingDeployment(), Utilisation.for_run(policy, cfg)
    policy.flops = 3e9
    # 8 requests of 5-token prompts, all prefilled; 32 tokens in 4 decode steps (8 rows each).
    deployment.stats = {"prefill_tokens": 40, "prompt_tokens": 40, "requests": 8, "prefill_time_s": 0.001,
                        "output_tokens": 32, "decode_steps": 4, "decode_time_s": 0.5}
    times = {"perf/step_time": 2.0, "perf/train_time": 1.0, "perf/rollout_wait_time": 0.8,
             "perf/weight_sync_time": 0.1, "perf/fwd_bwd_time": 0.6, "perf/ref_forward_time": 0.2,
             "perf/old_policy_forward_time": 0.0, "perf/optim_step_time": 0.1}
    shared_seconds[0] = 7.25  # the engine computed beside the trainer for a quarter of its second
    first = utilisation.step_metrics(times, policy, None, deployment)
    # The real process's (test_cpu_util_* below checks it). Over this microsecond "step" it is noise: another
    # thread's CPU clock moves only at its scheduler tick, so the quotient can pass 1 here (over a real step, by a
    # tick).
    assert first.pop("perf/cpu_util") >= 0
    # The prefill as 8 whole prompts of 5 tokens: 40·147456 + 8·33280 + 8·15·512 FLOPs in 1 ms, against 1e12 FLOP/s.
    prefill = 40 * PER_TOKEN + 8 * PER_PROJECTED + 120 * PER_PAIR
    # Decoding one token is at least its weight matmuls and its vocabulary projection: at 1e12 FLOP/s, at most
    # 1e12 / (147456 + 33280) tokens/s whatever the rows; reading 440 bytes a step at 1e10 B/s, 8 rows a step.
    compute_bound = 1e12 / (PER_TOKEN + PER_PROJECTED)
    assert first == pytest.approx({"perf/trainer_mfu": 3e9 / 1.0 / 1e12, "perf/trainer_tflops": 3e9 / 1e12,
                                   "perf/trainer_cpu_shared_frac": 0.25,
                                   "perf/engine_prefill_mfu": prefill / 0.001 / 1e12,
                                   "perf/engine_decode_tokens_per_s": 64.0,
                                   "perf/engine_decode_bound_tokens_per_s": 1e10 / 440 * 8,
                                   "perf/engine_decode_compute_bound_tokens_per_s": compute_bound})
    # The next step: only what grew. No prefill and no decode this time; the trainer's FLOPs grew by 1e9.
    policy.flops = 4e9
    shared_seconds[0] = 7.75
    second = utilisation.step_metrics(times, policy, None, deployment)
    assert 0 <= second.pop("perf/cpu_util") <= 1
    assert second == pytest.approx({"perf/trainer_mfu": 1e9 / 1e12, "perf/trainer_tflops": 1e9 / 1e12,
                                    "perf/trainer_cpu_shared_frac": 0.5})
    summary = utilisation.summary()
    assert 0 <= summary.pop("cpu_util") <= 1
    assert summary == pytest.approx({
        "rollout_wait_share": 0.4, "train_share": 0.5, "weight_sync_share": 0.05, "ref_forward_share": 0.1,
        "old_policy_forward_share": 0.0, "fwd_bwd_share": 0.3, "optim_step_share": 0.05,
        "trainer_mfu": 4e9 / 2.0 / 1e12, "trainer_cpu_shared_frac": 0.75 / 2.0,
        "engine_prefill_mfu": prefill / 0.001 / 1e12,
        "engine_decode_tokens_per_s": 64.0, "engine_decode_bound_tokens_per_s": 1e10 / 440 * 8,
        "engine_decode_compute_bound_tokens_per_s": compute_bound})
    text = utilisation.summary_text()
    assert "rollout_wait 40%, train 50%, weight_sync 5% (of it ref_forward 10%" in text
    # The bounds as printed, the smaller first: compute 5,532,932 tokens/s, against 181,818,182 from the bandwidth.
    assert re.search(rf"utilisation: CPU \d+% of {utilisation.cores} cores; trainer 0.2% of", text)
    assert "trainer 0.2% of the float32 peak (the engine computed on the same cores for 38% of it)" in text
    assert ("decode 64 tokens/s of the 5532932 its bounds allow (5532932 at the float32 peak, 181818182 at the memory "
            "bandwidth)") in text
    assert "trainer_mfu_alone" not in summary, "no step had the cores to itself"
    # A third step in which the engine computed beside the trainer for 5% of it: the trainer had the cores to itself.
    policy.flops = 6e9
    shared_seconds[0] = 7.80
    third = utilisation.step_metrics(times, policy, None, deployment)
    assert third["perf/trainer_mfu_alone"] == third["perf/trainer_mfu"] == pytest.approx(2e9 / 1e12)
    assert utilisation.summary()["trainer_mfu_alone"] == pytest.approx(2e9 / 1.0 / 1e12)
    assert utilisation.summary()["trainer_mfu"] == pytest.approx(6e9 / 3.0 / 1e12)
    assert ("trainer 0.2% of the float32 peak (the engine computed on the same cores for 27% of it; 0.2% on the steps "
            "it had them to itself)") in utilisation.summary_text()


def test_an_external_server_gets_no_engine_utilisation(probes):
    deployment = CountingDeployment()  # reports no counters, as external servers do
    policy = SimpleNamespace(flops=1e9, precision="fp32", device=torch.device("cpu"),
                             flop_shape=decoder_shape(tiny_config(260)), model=torch.nn.Linear(2, 2))
    metrics = Utilisation.for_run(policy, DeploymentConfig()).step_metrics({"perf/train_time": 1.0}, policy, None,
                                                                          deployment)
    # nor the shared clock: another process
    assert set(metrics) == {"perf/cpu_util", "perf/trainer_mfu", "perf/trainer_tflops"}


def test_a_model_whose_flops_are_not_counted_gets_only_the_bandwidth_bound(probes):
    """No shape (experts, or a config without the sizes): no FLOPs, so no compute bound is claimed for decode."""
    policy = SimpleNamespace(flops=0.0, precision="fp32", device=torch.device("cpu"), flop_shape=None,
                             model=torch.nn.Linear(10, 10))  # 440 bytes in float32
    deployment, utilisation = CountingDeployment(), Utilisation.for_run(policy, DeploymentConfig(dtype="float32"))
    deployment.stats = {"prefill_tokens": 40, "prompt_tokens": 40, "requests": 8, "prefill_time_s": 0.001,
                        "output_tokens": 32, "decode_steps": 4, "decode_time_s": 0.5}
    metrics = utilisation.step_metrics({"perf/step_time": 1.0}, policy, None, deployment)
    assert 0 <= metrics.pop("perf/cpu_util") <= 1
    assert metrics == pytest.approx({"perf/engine_decode_tokens_per_s": 64.0,
                                     "perf/engine_decode_bound_tokens_per_s": 1e10 / 440 * 8})
    assert "decode 64 tokens/s of a 181818182 tokens/s bandwidth bound" in utilisation.summary_text()


def busy(seconds: float, clocks: list[float]) -> None:
    """Hash for `seconds` of wall time, appending this thread's own CPU seconds: hashlib lets go of the GIL on a
    large buffer, so two such threads run on two cores at once."""
    data, start, cpu = bytes(1 << 22), time.monotonic(), time.thread_time()
    while time.monotonic() - start < seconds:
        hashlib.sha256(data)
    clocks.append(time.thread_time() - cpu)


@pytest.mark.skipif(telemetry.usable_cores() < 2, reason="two busy threads need two cores")
def test_cpu_util_counts_every_thread_against_the_wall_and_the_cores(probes):
    """A pair of busy threads on 2 cores reads their own CPU clocks over the wall and the cores (near 1 on a quiet
    machine); an idle second near 0."""
    policy = SimpleNamespace(flops=0.0, precision="fp32", device=torch.device("cpu"), flop_shape=None,
                             model=torch.nn.Linear(2, 2))
    deployment, utilisation = CountingDeployment(), Utilisation.for_run(policy, DeploymentConfig(dtype="float32"))
    utilisation.cores = 2
    utilisation.step_metrics({}, policy, None, deployment)  # the window opens here
    clocks: list[float] = []
    start = time.monotonic()
    threads = [threading.Thread(target=busy, args=(1.5, clocks)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - start
    both = utilisation.step_metrics({}, policy, None, deployment)["perf/cpu_util"]
    # The threads' own clocks: about 0.97 on a quiet machine, less when other jobs take the cores. Either way a
    # clock of one of the two threads would read half of it, and one of the main thread next to nothing.
    threads_util = sum(clocks) / wall / 2
    assert threads_util > 0.05 and len(clocks) == 2
    assert both == pytest.approx(threads_util, rel=0.15)
    time.sleep(1.0)
    idle = utilisation.step_metrics({}, policy, None, deployment)["perf/cpu_util"]
    assert idle < 0.1
    # Over the run: the CPU seconds of the three windows over their wall seconds, not the mean of the three.
    assert utilisation.summary()["cpu_util"] == pytest.approx(
        utilisation.totals["cpu_s"] / utilisation.totals["wall_s"] / 2)
    assert (both + idle) / 2 < utilisation.summary()["cpu_util"] < both


ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]
UTILISATION_KEYS = {"perf/cpu_util", "perf/trainer_mfu", "perf/trainer_tflops", "perf/engine_prefill_mfu",
                    "perf/engine_decode_tokens_per_s", "perf/engine_decode_bound_tokens_per_s",
                    "perf/engine_decode_compute_bound_tokens_per_s"}


def sampling_rollouts(setup):
    async def rollout_fn(row, sample_index):
        (c,) = await setup.sampler.sample(row["prompt_token_ids"], seed=sample_index, **setup.sample_kwargs)
        return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs,
                                      reward=float(sum(c.output_ids) % 3), finish_reason=c.finish_reason)

    return rollout_fn


@pytest.mark.parametrize("recipe", [rl_loop, async_rl_loop], ids=["rl_loop", "async_rl_loop"])
def test_both_recipes_log_utilisation_every_step(recipe, probes, tmp_path):
    cfg = recipe.Config(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=2,
                        sampling=SamplingConfig(max_tokens=4, timeout_s=30), trainer=TrainerConfig(learning_rate=1e-3),
                        progress=False, kl_beta=0.05, log_path=str(tmp_path / "run"))
    summary = recipe.main(cfg, rollout_fn_factory=sampling_rollouts, rows=ROWS)
    steps = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert UTILISATION_KEYS <= set(record)
        assert 0 < record["perf/trainer_mfu"] <= 1 and 0 < record["perf/engine_prefill_mfu"] <= 1
        assert record["perf/trainer_tflops"] == pytest.approx(record["perf/trainer_mfu"])  # a peak of 1 TFLOP/s
        assert all(math.isfinite(record[key]) and record[key] > 0 for key in UTILISATION_KEYS)
        # The embedded engine beside a CPU trainer: rl_loop samples between training passes, so next to none (0.0
        # here; the bound leaves room for an engine thread descheduled in its step's last microseconds on a busy
        # machine, against a 10 ms training pass, and still fails a clock that ran while the trainer alone did).
        assert 0 <= record["perf/trainer_cpu_shared_frac"] <= (0.5 if recipe is rl_loop else 1)
        assert record["perf/cpu_util"] <= 1.01  # clocks read a few microseconds apart
    assert 0 < summary["utilisation"]["trainer_mfu"] <= 1
    assert 0 < summary["utilisation"]["cpu_util"] <= 1.01
    assert summary["utilisation"]["train_share"] > 0


def test_cpu_util_counts_the_agent_processes_a_sandbox_ran(probes, tmp_path):
    """An agent is a process of its own in the sandbox (bubblewrap or unshare where the machine has one): its CPU
    seconds reach the run's `cpu_util` once its sandbox is reaped. Under bubblewrap's own reaper as the namespace's
    pid 1 they never did: a 2-core agent example read 0.27 while the machine was busy (benchmarks/RESULTS.md)."""
    policy = SimpleNamespace(flops=0.0, precision="fp32", device=torch.device("cpu"), flop_shape=None,
                             model=torch.nn.Linear(2, 2))
    deployment, utilisation = CountingDeployment(), Utilisation.for_run(policy, DeploymentConfig(dtype="float32"))
    utilisation.cores = 1
    sandbox = choose_sandbox("auto")
    burn = [sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"]
    utilisation.step_metrics({}, policy, None, deployment)  # the window opens here
    exit_ = asyncio.run(sandbox.run(burn, env={"PATH": os.defpath}, workdir=tmp_path, timeout_s=60))
    assert exit_.returncode == 0
    before = utilisation.totals["cpu_s"]
    util = utilisation.step_metrics({}, policy, None, deployment)["perf/cpu_util"]
    # The agent's second of CPU, against a wall of a little more (the sandbox's start and the interpreter's).
    assert utilisation.totals["cpu_s"] - before >= 0.95, f"the {sandbox.kind} sandbox's agent was not counted"
    assert util > 0.5
