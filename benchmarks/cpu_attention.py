"""The CPU attention paths (`training/utils/models/cpu_attention.py`) vs torch's sdpa, side by side in one run: the
embedded engine's decode and prefill (`cpu_decode_sdpa`), and the trainer's forward + backward (`cpu_sdpa`).

Engine: one engine, its model's attention switched between the two before each batch, the batches alternating. A
batch is the main job's shape by default: `--groups` prompts of `--prompt-len` random tokens, `--group-size` draws
each (the prefix cache shares a group's prompt), `--max-tokens` sampled tokens at temperature 1. Per
implementation it prints the best of `--repeats` batches: the engine's decode time per decode step
(`decode_time_s` / `decode_steps` from `Engine.stats`), its prefill time, and output tokens/s of the whole batch.

Trainer: one `Trainer` (the model's precision as a run picks it) on each `--trainer-workloads` shape of
`benchmarks/trainer_throughput.py` (main-job: 64 draws of 46-token prompts, a group per shared-prefix row of about
110 tokens; trl: 32 draws of 47-token prompts with 24 sampled tokens, rows of about 240; uneven: 16 unrelated
datums of up to `--uneven-len` tokens, padded rows). `forward_backward` alternates between the short-row path off
(`SHORT_ROW_KEYS` = 0: sdpa) and on, which goes first alternating, `--trainer-steps` times each after a warm-up; it
prints the median of each.

Shared-prefix rows (`--shared-workloads`): the trainer of `multi_turn_message_in` (rank-16 LoRA, checkpointing,
2048-token micro-batches) on `--shared-batch` draws of each grouped shape (multi-turn: 210-token prompts, draws of
14-106 tokens), `forward_backward` with the rows' attention a piece at a time (`prefix_attention.py`) and under
their dense mask (`Trainer.attention_by_pieces`), alternating which goes first; the median of each.

    python benchmarks/cpu_attention.py                       # SmolLM2-135M-Instruct, 8 x 8 draws, 12 tokens
    python benchmarks/cpu_attention.py --group-size 32 --max-tokens 64 --trainer-workloads
    python benchmarks/cpu_attention.py --no-engine --trainer-workloads --shared-workloads multi-turn
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from trainer_throughput import grouped_datums, pg_loss, rl_shaped_datums

import training.utils.models.cpu_attention as cpu_attention
from training.utils.config.rl import DeploymentConfig, TrainerConfig
from training.utils.deploy import engine_dtype
from training.utils.deploy.engine import Engine
from training.utils.models.load import load_model_and_tokenizer
from training.utils.trainer import Trainer

IMPLEMENTATIONS = {"sdpa": "sdpa", "cpu_decode_sdpa": cpu_attention.DECODE_NAME}


async def one_batch(engine: Engine, prompts: list[list[int]], args) -> dict:
    before = dict(engine.stats)
    start = time.perf_counter()
    groups = await asyncio.gather(*[engine.generate(prompt, n=args.group_size, max_tokens=args.max_tokens,
                                                    temperature=1.0) for prompt in prompts])
    wall = time.perf_counter() - start
    delta = {key: engine.stats[key] - before[key] for key in ("decode_time_s", "decode_steps", "prefill_time_s")}
    tokens = sum(len(completion.output_ids) for group in groups for completion in group)
    return {"wall": wall, "tokens_per_s": tokens / wall, "prefill_s": delta["prefill_time_s"],
            "decode_step_ms": 1e3 * delta["decode_time_s"] / max(1, delta["decode_steps"])}


async def run(args) -> None:
    model, tokenizer = load_model_and_tokenizer(args.model)
    cfg = DeploymentConfig()
    engine = Engine(model.to(engine_dtype(cfg, model.device)), tokenizer, cfg)  # the weights a run's engine gets
    print(f"model={args.model} dtype={engine.model.dtype} device={engine.model.device} "
          f"threads={torch.get_num_threads()} torch={torch.__version__}; {args.groups} prompts x {args.group_size} "
          f"draws, {args.prompt_len}-token prompts, {args.max_tokens} tokens")
    generator = torch.Generator().manual_seed(0)
    best: dict[str, dict] = {}
    try:
        for repeat in range(args.repeats + 1):  # the first round warms both up and is not counted
            for label, implementation in IMPLEMENTATIONS.items():
                engine.model.set_attn_implementation(implementation)
                prompts = [torch.randint(engine.vocab_size // 4, engine.vocab_size, (args.prompt_len,),
                                         generator=generator).tolist() for _ in range(args.groups)]
                result = await one_batch(engine, prompts, args)
                if repeat and (label not in best or result["wall"] < best[label]["wall"]):
                    best[label] = result
    finally:
        engine.close()
    print(f"{'attention':<16} {'decode ms/step':>15} {'prefill s':>10} {'tokens/s':>9}")
    for label, result in best.items():
        print(f"{label:<16} {result['decode_step_ms']:>15.1f} {result['prefill_s']:>10.3f} "
              f"{result['tokens_per_s']:>9.0f}")
    old, new = best["sdpa"], best["cpu_decode_sdpa"]
    print(f"cpu_decode_sdpa vs sdpa: decode step {old['decode_step_ms'] / new['decode_step_ms']:.2f}x faster, "
          f"prefill {old['prefill_s'] / max(new['prefill_s'], 1e-9):.2f}x, "
          f"tokens/s {new['tokens_per_s'] / old['tokens_per_s']:.2f}x")


def trainer_workload(name: str, vocab_size: int, args) -> list:
    if name == "uneven":
        return rl_shaped_datums(16, args.uneven_len, vocab_size)
    return grouped_datums(64 if name == "main-job" else 32, 8, name, vocab_size)


def alternating_medians(trainer: Trainer, datums: list, steps: int, choose, settings: tuple) -> list[float]:
    """Median `forward_backward` seconds under each of `settings` (applied by `choose`), in turn `steps` times after
    a round that warms them up; which goes first alternates, so that neither always follows the other."""
    seconds: dict = {setting: [] for setting in settings}
    for repeat in range(steps + 1):
        for setting in (settings if repeat % 2 else settings[::-1]):
            choose(setting)
            start = time.perf_counter()
            trainer.forward_backward(datums, pg_loss)
            if repeat:
                seconds[setting].append(time.perf_counter() - start)
            trainer.optimizer.zero_grad(set_to_none=True)
    return [statistics.median(seconds[setting]) for setting in settings]


def time_trainer(args) -> None:
    """Median `forward_backward` seconds with the short-row path off and on, alternating in one trainer."""
    model, _ = load_model_and_tokenizer(args.model)
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-7))
    default = cpu_attention.SHORT_ROW_KEYS
    print(f"trainer: precision={trainer.precision} threads={torch.get_num_threads()}; short-row path up to "
          f"{default} keys")
    print(f"{'workload':<10} {'sdpa s':>8} {'cpu_sdpa s':>11} {'speed-up':>9}")
    try:
        for name in args.trainer_workloads:
            datums = trainer_workload(name, model.config.vocab_size, args)
            old, new = alternating_medians(trainer, datums, args.trainer_steps,
                                           lambda keys: setattr(cpu_attention, "SHORT_ROW_KEYS", keys), (0, default))
            print(f"{name:<10} {old:>8.3f} {new:>11.3f} {old / new:>8.2f}x")
    finally:
        cpu_attention.SHORT_ROW_KEYS = default


def time_shared_rows(args) -> None:
    """Median `forward_backward` seconds with shared-prefix rows by pieces and under the dense mask, alternating."""
    model, _ = load_model_and_tokenizer(args.model)
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-9, lora_rank=16, gradient_checkpointing=True,
                                           max_tokens_per_microbatch=2048))
    print(f"shared-prefix rows: precision={trainer.precision}, LoRA rank 16, checkpointing, {args.shared_batch} draws")
    print(f"{'workload':<10} {'dense s':>8} {'pieces s':>9} {'speed-up':>9}")
    for name in args.shared_workloads:
        datums = grouped_datums(args.shared_batch, 8, name, model.config.vocab_size)
        dense, pieces = alternating_medians(trainer, datums, args.trainer_steps,
                                            lambda by_pieces: setattr(trainer, "attention_by_pieces", by_pieces),
                                            (False, True))
        print(f"{name:<10} {dense:>8.3f} {pieces:>9.3f} {dense / pieces:>8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=46)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer-workloads", nargs="*", default=["main-job", "trl", "uneven"],
                        choices=["main-job", "trl", "uneven"], help="none: the engine only")
    parser.add_argument("--trainer-steps", type=int, default=4)
    parser.add_argument("--uneven-len", type=int, default=400)
    parser.add_argument("--shared-workloads", nargs="*", default=[], choices=["main-job", "trl", "multi-turn"])
    parser.add_argument("--shared-batch", type=int, default=64)
    parser.add_argument("--no-engine", action="store_true", help="skip the engine's comparison")
    args = parser.parse_args()
    if not args.no_engine:
        asyncio.run(run(args))
    if args.trainer_workloads:
        time_trainer(args)
    if args.shared_workloads:
        time_shared_rows(args)


if __name__ == "__main__":
    main()
