"""The trainer and the embedded engine on one CPU: each side's speed alone and while they share the cores, and what
that allows the async recipe at most against `rl_loop` on this machine.

`async_rl_loop` overlaps sampling with training; on a CPU whose cores the engine and the trainer share, the overlap
only pays as far as the two together get more done per second than either alone. This measures it on TRL's task
shape (SmolLM2-135M-Instruct; one unit of training is `forward_backward` + `optim_step` over 4 prompts x 8 draws of
47 + 24 tokens, one unit of sampling is 32 draws of 24 tokens from 46-token prompts), in the recipes' arrangement:
the trainer on a thread of its own, the engine on its thread, halving its threads while the trainer computes
(`training/utils/runtime/cpu_share.py`). Every draw runs to its 24 tokens (the engine's end-of-sequence ids are
cleared), so
each unit is the same work.

1. Alone: `--units` units of training, then of sampling (the engine on all its threads, as in `rl_loop`).
2. Together: both loop at once for `--seconds`; each side's rate is its units completed over the span between its
   first and last completion inside the window.

It prints T_t and T_e (seconds per unit alone), r_t and r_e (each side's rate together as a fraction of its rate
alone), the shared clock's share of the window (`cpu_share.shared_seconds`, what `perf/trainer_cpu_shared_frac`
reads), and the async recipe's step against `rl_loop`'s at equal work if sampling and training overlap fully:
`rl_loop` takes T_t + T_e a step; async, while the engine samples the next batch, trains at r_t, so its step is
T_t + T_e (1 - r_t) / r_e (sampling done within the step, the rest of training alone), a speed-up of
(T_t + T_e) / (T_t + T_e (1 - r_t) / r_e).

    python benchmarks/cpu_sharing.py                  # about 2 minutes on 2 cores
    python benchmarks/cpu_sharing.py --lora-rank 16   # the main job's trainer (LoRA; the engine on its own copy)
    python benchmarks/cpu_sharing.py --model tiny-random --units 2 --seconds 3   # a quick check that it runs
"""

from __future__ import annotations  # noqa: I001 - the allocator's restart before torch loads

import argparse
import asyncio
import copy
import threading
import time

from training import restart_with_allocator

if __name__ == "__main__":
    restart_with_allocator()  # mimalloc, as the recipes' runs (`TRAINING_ALLOCATOR=system` keeps glibc's malloc)

import torch  # noqa: E402
from trainer_throughput import grouped_datums, pg_loss  # noqa: E402 - TRL's task shape ("trl"), and its loss

from training.utils.config.rl import DeploymentConfig, TrainerConfig  # noqa: E402
from training.utils.deploy import Engine, engine_dtype  # noqa: E402
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer  # noqa: E402
from training.utils.runtime import cpu_share  # noqa: E402
from training.utils.trainer import Trainer  # noqa: E402

PROMPTS, DRAWS, PROMPT_TOKENS, NEW_TOKENS = 4, 8, 46, 24
UNIT_TIMEOUT_S = 600.0
"""One unit of either side taking longer than this ends the benchmark with an error, not a hang."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=SMOLLM2_ALIAS, help="alias or local HF directory")
    p.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning (TRL's task); 16: the main job's")
    p.add_argument("--units", type=int, default=4, help="units of each side timed alone, after one warm-up")
    p.add_argument("--seconds", type=float, default=30.0, help="how long both run together")
    args = p.parse_args()
    if args.units < 1:
        p.error(f"--units {args.units}: must be at least 1")
    if not args.seconds > 0:
        p.error(f"--seconds {args.seconds}: must be positive")
    if args.lora_rank < 0:
        p.error(f"--lora-rank {args.lora_rank}: must be 0 (full fine-tuning) or more")
    return args


class Side:
    """One side's loop on a thread of its own: `unit()` again and again until stopped; each completion's time."""

    def __init__(self, name: str, unit):
        self.name, self.unit, self.done = name, unit, []
        self.stop, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                self.unit()
                self.done.append(time.monotonic())
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            self.error = e

    def rate_within(self, start: float, end: float) -> float:
        """Units per second between the first and the last completion inside [start, end]."""
        inside = [t for t in self.done if start <= t <= end]
        if len(inside) < 2:
            raise SystemExit(f"{self.name} completed {len(inside)} unit(s) in the window: raise --seconds")
        return (len(inside) - 1) / (inside[-1] - inside[0])


def time_alone(unit, units: int) -> float:
    """Seconds per unit, run on a fresh thread as the recipes run each side (after one warm-up unit)."""
    out = {}

    def run():
        unit()
        start = time.perf_counter()
        for _ in range(units):
            unit()
        out["s"] = (time.perf_counter() - start) / units

    thread = threading.Thread(target=run, daemon=True)  # a stuck unit must not keep the process alive
    thread.start()
    thread.join(timeout=UNIT_TIMEOUT_S * (units + 1))
    if "s" not in out:
        raise SystemExit("a unit did not finish in time alone")
    return out["s"]


def main() -> None:
    args = parse_args()
    model, tokenizer = load_model_and_tokenizer(args.model)  # float32, as the trainer holds it
    vocab_size = model.get_input_embeddings().num_embeddings
    engine_model = copy.deepcopy(model).to(engine_dtype(DeploymentConfig(), model.device)).eval()
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-6, lora_rank=args.lora_rank))
    engine = Engine(engine_model, tokenizer, DeploymentConfig(max_batch_requests=PROMPTS * DRAWS))
    engine.eos_token_ids = frozenset()  # every draw runs to NEW_TOKENS: each unit the same work
    datums = grouped_datums(PROMPTS * DRAWS, DRAWS, "trl", vocab_size)  # 47-token prompts, 24 trained tokens
    prompts = [torch.randint(10, vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(p)).tolist()
               for p in range(PROMPTS)]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()  # the engine's callers, as the recipes' loop

    def train_unit():
        trainer.forward_backward(datums, pg_loss)
        trainer.optim_step()

    def sample_unit():
        async def batch():
            return await asyncio.gather(*[engine.generate(p, n=DRAWS, max_tokens=NEW_TOKENS, temperature=1.0,
                                                          seed=i, timeout=UNIT_TIMEOUT_S)
                                          for i, p in enumerate(prompts)])

        asyncio.run_coroutine_threadsafe(batch(), loop).result(timeout=UNIT_TIMEOUT_S)

    try:
        print(f"model={args.model} lora_rank={args.lora_rank} precision={trainer.precision} "
              f"engine={str(engine_model.dtype).removeprefix('torch.')} threads={torch.get_num_threads()}",
              flush=True)
        t_train, t_sample = time_alone(train_unit, args.units), time_alone(sample_unit, args.units)
        print(f"alone: training {t_train:.3f} s a unit (T_t), sampling {t_sample:.3f} s a unit (T_e), "
              f"T_e/T_t {t_sample / t_train:.2f}", flush=True)

        sides = [Side("training", train_unit), Side("sampling", sample_unit)]
        shared_before, start = cpu_share.shared_seconds(), time.monotonic()
        for side in sides:
            side.thread.start()
        time.sleep(args.seconds)
        end, shared = time.monotonic(), cpu_share.shared_seconds() - shared_before
        for side in sides:
            side.stop.set()
        for side in sides:
            side.thread.join(timeout=UNIT_TIMEOUT_S)
            if side.error is not None:
                raise side.error
            if side.thread.is_alive():
                raise SystemExit(f"{side.name} did not stop within {UNIT_TIMEOUT_S:.0f} s")
        r_train = sides[0].rate_within(start, end) * t_train
        r_sample = sides[1].rate_within(start, end) * t_sample
        step_sync, step_async = t_train + t_sample, t_train + t_sample * (1 - r_train) / r_sample
        print(f"together for {end - start:.1f} s (shared clock {shared / (end - start):.0%} of it): training at "
              f"r_t {r_train:.2f} of its rate alone, sampling at r_e {r_sample:.2f}; together {r_train + r_sample:.2f}")
        print(f"a step at equal work: rl_loop {step_sync:.3f} s, async at most {step_async:.3f} s: "
              f"async/rl_loop at most {step_sync / step_async:.2f}x")
    finally:
        engine.close()
        loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
