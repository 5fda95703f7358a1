"""While a trainer computes on the CPU, the embedded engine runs half of its torch threads; otherwise all of
them, and the trainer always all of its own; the shared clock runs while both compute
(training/utils/runtime/cpu_share.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import types

import pytest
import torch

from engine_support import peaked_tiny
from training.utils.config.rl import DeploymentConfig, TrainerConfig
from training.utils.deploy import Engine
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.runtime import cpu_share
from training.utils.trainer import Datum, Trainer


def _on_fresh_thread(fn):
    """`fn()` on a new thread (torch's thread count is per thread, and so is the share's memory of it)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    if "error" in out:
        raise out["error"]
    return out["value"]


FULL = 2


@pytest.fixture(autouse=True)
def two_threads():
    """Threads started now run FULL torch threads (the suite runs one: conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(FULL)
    yield
    torch.set_num_threads(before)


def test_the_engine_takes_half_only_while_a_trainer_computes():
    class CpuTrainer:
        device = torch.device("cpu")
        cpu_threads = FULL

        @cpu_share.trainer_compute
        def compute(self):
            return cpu_share.trainer_computing(), cpu_share.engine_threads(FULL)

    class GpuTrainer(CpuTrainer):
        device = torch.device("cuda")

    def counts():
        before, cpu, gpu = cpu_share.engine_threads(FULL), CpuTrainer().compute(), GpuTrainer().compute()
        return before, cpu, gpu, cpu_share.engine_threads(FULL)

    assert _on_fresh_thread(counts) == (FULL, (True, FULL // 2), (False, FULL), FULL)
    assert not cpu_share.trainer_computing()


def _tiny_trainer() -> Trainer:
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(260), device="cpu")
    return Trainer(model, TrainerConfig(learning_rate=1e-3, precision="fp32"))


def _datums() -> list[Datum]:
    return [Datum(input_ids=[1, 2, 3, 4, 5, 6], target_ids=[2, 3, 4, 5, 6, 7], weights=[0, 0, 1, 1, 1, 1],
                  behaviour_logprobs=[0.0] * 6, advantage=1.0, prompt_len=2) for _ in range(2)]


def test_the_trainer_counts_as_computing_and_keeps_every_thread():
    trainer = _tiny_trainer()
    seen = []

    def loss_fn(logprobs, mb):
        seen.append((torch.get_num_threads(), cpu_share.trainer_computing()))
        return -(logprobs * mb.weights).sum() / mb.num_tokens_total, {}

    def train():
        torch.set_num_threads(FULL)
        trainer.forward_backward(_datums(), loss_fn)

    _on_fresh_thread(train)
    assert seen and set(seen) == {(FULL, True)}
    assert not cpu_share.trainer_computing()


def test_a_trainer_thread_that_starts_while_the_engine_runs_half_still_gets_every_thread():
    trainer = _tiny_trainer()  # built while torch's default is FULL
    seen = []

    def loss_fn(logprobs, mb):
        seen.append(torch.get_num_threads())
        return -(logprobs * mb.weights).sum() / mb.num_tokens_total, {}

    # What the engine's switch to half does to the default a new thread starts with.
    _on_fresh_thread(lambda: torch.set_num_threads(FULL // 2))
    assert _on_fresh_thread(torch.get_num_threads) == FULL // 2
    _on_fresh_thread(lambda: trainer.forward_backward(_datums(), loss_fn))
    assert seen and set(seen) == {FULL}


def _engine_threads_while_generating() -> set[int]:
    """The torch threads the engine's forwards ran on in one small generation."""
    model, tokenizer = peaked_tiny(0)
    engine = Engine(model, tokenizer, DeploymentConfig(max_batch_requests=4))
    seen = set()

    def hook(module, args):
        seen.add(torch.get_num_threads())

    handle = engine.model.register_forward_pre_hook(hook)
    try:
        async def generate():
            async with asyncio.timeout(60):
                return await asyncio.gather(*[engine.generate([5, 6, 7], n=2, max_tokens=6, temperature=1.0)
                                              for _ in range(3)])

        asyncio.run(generate())
    finally:
        handle.remove()
        engine.close()
    return seen


@pytest.mark.parametrize("trainer_computing", [True, False])
def test_the_engine_shares_the_cores_only_while_the_trainer_computes(trainer_computing, monkeypatch):
    if trainer_computing:  # what a trainer's computing call on another thread holds
        monkeypatch.setattr(cpu_share, "_trainer_calls", 1)
    shared_before = cpu_share.shared_seconds()
    assert _engine_threads_while_generating() == {FULL // 2 if trainer_computing else FULL}
    # The engine's steps ran on the shared clock only beside a computing trainer.
    assert (cpu_share.shared_seconds() > shared_before) == trainer_computing


def test_the_shared_clock_runs_exactly_while_a_cpu_trainer_and_the_engine_both_compute(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(cpu_share, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    start = cpu_share.shared_seconds()
    engine = contextlib.ExitStack()  # the engine's steps, entered and left across the trainer's call
    seen = []

    class CpuTrainer:
        device = torch.device("cpu")
        cpu_threads = FULL

        @cpu_share.trainer_compute
        def compute(self):
            now[0] += 1.0  # the trainer alone
            engine.enter_context(cpu_share.engine_step(FULL))
            now[0] += 2.0  # both
            seen.append(cpu_share.shared_seconds() - start)  # read while it runs
            engine.close()
            now[0] += 1.0  # alone again
            engine.enter_context(cpu_share.engine_step(FULL))
            now[0] += 0.5  # both, until the trainer's call returns

    class GpuTrainer(CpuTrainer):
        device = torch.device("cuda")

    CpuTrainer().compute()
    now[0] += 4.0  # the engine alone
    engine.close()
    assert seen == [2.0]
    assert cpu_share.shared_seconds() - start == 2.5
    GpuTrainer().compute()  # a GPU trainer shares no cores with the engine
    assert cpu_share.shared_seconds() - start == 2.5
    assert not cpu_share.trainer_computing()
