"""TRL's GRPOTrainer and ours side by side on one task: seconds per optimizer step at equal precision.

The task is `async_vs_sync.py --workload shared-cpu`: GRPO on SmolLM2-135M-Instruct with the main job's
single-digit addition prompts (`training/examples/rl/single_turn_token_in`, train.jsonl), G=8 completions
x P=4 prompts per optimizer step, 24 new tokens at temperature 1.0, lr 3e-5, no KL (`kl_beta` is 0 in our
config, so TRL gets `beta=0.0`). Both sides optimise the example's verifier (`verifier.score`) and see the
same 46 prompt tokens: TRL gets each row's prompt as plain text, the decoded `prompt_token_ids` (already
chat-rendered by make_data.py), which its tokenizer turns back into the same ids (checked at start-up).
Both take the same rows in the same order (our recipe's shuffled row order, handed to TRL unshuffled).

Variants, each in its own subprocess (so memory and threads do not carry over), torch's default threads:

  trl fp32      TRL GRPOTrainer, `bf16=False`: float32 weights and compute, HF `generate` on the CPU
  trl bf16      `bf16=True`: float32 weights, bf16 autocast (the same numerics as our `bf16-autocast`)
  trl default   GRPOConfig as shipped: `bf16=True` and `gradient_checkpointing=True` (TRL turns both on
                unless told otherwise, on a CPU too)
  rl_loop bf16  `rl_loop` with `precision="auto"`: bf16-autocast on a CPU with AVX512-BF16 or AMX
  rl_loop fp32  the same with `TRAINING_CPU_BF16=0` in the environment: float32 everywhere
  async bf16    `async_rl_loop`, `max_head_offpolicy_versions=1` (token-level TIS), default precision
  async fp32    the same with `TRAINING_CPU_BF16=0`

TRL's shape: `per_device_train_batch_size=32`, `gradient_accumulation_steps=1`, `num_generations=8`, so
`generation_batch_size` is 32 (4 prompts x 8) and every optimizer step generates once and trains on those
32 completions (`steps_per_generation=1`, `num_iterations=1`: no old-policy pass, as ours with one PPO
epoch and one minibatch). The rest is matched to our defaults: loss `dapo` (token mean over the batch, our
`token_mean`), clip 0.2, group-normalised advantages, constant lr, AdamW betas (0.9, 0.95), grad-norm clip 1,
`gradient_checkpointing=False` (except `trl default`), no eval, no saving, `report_to="none"`.

Our variants restart on mimalloc as the examples do (`TRAINING_ALLOCATOR=system` keeps them on glibc's malloc);
TRL's run on glibc's, as TRL ships. Each variant runs 1 warm-up step (not counted) and then `--steps` optimizer
steps. It prints the median seconds per step: ours is the ledger's `perf/step_time` (sampling, training, weight
sync), TRL's the time from `on_step_begin` to `on_step_end` of a TrainerCallback (generation, reward,
forward/backward, optimizer step); "wall" is the median time between the ends of consecutive steps, logging
included; "tokens" the mean completion length in tokens over the counted steps (a step's time falls as the
completions shorten, which they do as the reward rises; HF `generate` runs a batch until its longest row ends).
Then the mean reward over the first and second half of all steps run (the warm-up included), "others": the cores
that other processes of the machine kept busy on average meanwhile (/proc/stat less this variant's CPU time: on
a shared machine, a variant with others > 0 was slowed down), and the ratio TRL/ours.

    pip install -e '.[trl]'
    python benchmarks/trl_comparison.py                          # ~8 minutes on 2 quiet cores
    python benchmarks/trl_comparison.py --steps 1 --only "trl bf16" "rl_loop bf16"
    python benchmarks/trl_comparison.py --json results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

P, G, MAX_TOKENS, LR = 4, 8, 24, 3e-5

VARIANTS = {  # name -> (side, options); run in this order, so the pairs compared run close in time
    "trl fp32": ("trl", {"bf16": False}),
    "rl_loop fp32": ("ours", {"recipe": "rl_loop", "env": {"TRAINING_CPU_BF16": "0"}}),
    "async fp32": ("ours", {"recipe": "async_rl_loop", "env": {"TRAINING_CPU_BF16": "0"}}),
    "trl bf16": ("trl", {"bf16": True}),
    "rl_loop bf16": ("ours", {"recipe": "rl_loop"}),
    "async bf16": ("ours", {"recipe": "async_rl_loop"}),
    "trl default": ("trl", {"bf16": True, "gradient_checkpointing": True}),
}
PAIRS = [  # (TRL variant, our variant) compared in the table
    ("trl fp32", "rl_loop fp32"), ("trl bf16", "rl_loop bf16"), ("trl default", "rl_loop bf16"),
    ("trl fp32", "async fp32"), ("trl bf16", "async bf16"), ("trl default", "async bf16"),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="counted optimizer steps per variant, after 1 warm-up")
    p.add_argument("--only", nargs="+", default=None, metavar="VARIANT", help=f"of: {', '.join(VARIANTS)}")
    p.add_argument("--json", type=Path, default=None, help="also write every variant's numbers here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one variant, write --result
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = sorted(set(args.only or []) - set(VARIANTS))
    if unknown:
        p.error(f"--only {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def rows_in_our_order(n: int) -> list[dict]:
    """The first `n` rows our recipes train with seed 0, in the order they take them."""
    from training.examples.rl.single_turn_token_in.train import read_rows
    from training.utils.rl.dataset import RowCursor

    return [item.row for item in RowCursor(read_rows("train.jsonl"), seed=0).take(n)]


# ---- TRL side ---------------------------------------------------------------------------------------------

def run_trl(options: dict, steps: int, out_dir: Path) -> dict:
    # No Hub: the model is the local SmolLM2 directory, and TRL, datasets and transformers read these at import.
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from training.examples.rl.single_turn_token_in.verifier import score
    from training.utils.models.load import resolve_model_source

    model_dir = str(resolve_model_source("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    rows = rows_in_our_order(P * (steps + 1))
    prompts = [tokenizer.decode(r["prompt_token_ids"]) for r in rows]
    for row, text in zip(rows, prompts):  # TRL tokenizes a plain-text prompt with the tokenizer's defaults
        if tokenizer(text)["input_ids"] != row["prompt_token_ids"]:
            raise SystemExit(f"row {row['id']}: the decoded prompt does not tokenize back to its ids")
    dataset = Dataset.from_list([{"prompt": t, "answer": r["answer"]} for t, r in zip(prompts, rows)])

    def addition_reward(completions, answer, **_):
        return [score(c, a) for c, a in zip(completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.end, self.threads = [], [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.threads = torch.get_num_threads()
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(out_dir / "trl"), use_cpu=True, seed=0, max_steps=steps + 1,
        per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
        max_completion_length=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", adam_beta2=0.95, max_grad_norm=1.0, weight_decay=0.0,
        beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        bf16=options["bf16"], gradient_checkpointing=options.get("gradient_checkpointing", False),
        shuffle_dataset=False, logging_steps=1, eval_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=addition_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    return {
        "step_times": [e - b for b, e in zip(timer.begin, timer.end)],
        "walls": [b - a for a, b in zip(timer.end, timer.end[1:])],
        "rewards": [entry["reward"] for entry in logs],
        "lengths": [entry["completions/mean_length"] for entry in logs],
        "precision": "bf16-autocast" if config.bf16 else "fp32",
        "threads": timer.threads,
    }


# ---- our side ---------------------------------------------------------------------------------------------

def run_ours(options: dict, steps: int, out_dir: Path) -> dict:
    # OpenMP's wait policy before torch loads, as the examples set it (training/utils/runtime/openmp.py).
    import logging  # noqa: I001

    import training

    training.set_openmp_wait_policy()
    import torch

    from training.examples.rl.single_turn_token_in.rollout import make_rollout_fn
    from training.examples.rl.single_turn_token_in.train import read_rows
    from training.recipes import async_rl_loop, rl_loop
    from training.utils.config.rl import SamplingConfig, TrainerConfig
    from training.utils.models.load import native_bf16
    from training.utils.run_files.logging import read_ledger

    logging.getLogger("training").setLevel(logging.ERROR)
    recipe = {"rl_loop": rl_loop, "async_rl_loop": async_rl_loop}[options["recipe"]]
    extra = {"max_head_offpolicy_versions": 1} if recipe is async_rl_loop else {}
    cfg = recipe.Config(
        model="smollm2-135m-instruct", completions_per_prompt=G, prompt_groups_per_step=P,
        max_steps=steps + 1, seed=0, progress=False, log_path=str(out_dir / "ours"),
        sampling=SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0), trainer=TrainerConfig(learning_rate=LR),
        **extra,
    )
    summary = recipe.main(cfg, rollout_fn_factory=make_rollout_fn, rows=read_rows("train.jsonl"))
    ledger = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    ends = [r["time"] for r in ledger]
    return {
        "step_times": [r["perf/step_time"] for r in ledger],
        "walls": [b - a for a, b in zip(ends, ends[1:])],
        "rewards": [r["rollout/raw_reward"] for r in ledger],
        "lengths": [r["rollout/response_len_mean"] for r in ledger],
        "precision": "bf16-autocast" if native_bf16(torch.device("cpu")) else "fp32",
        "threads": torch.get_num_threads(),
        "kl_beta": cfg.kl_beta,
    }


def worker(name: str, steps: int, result: Path) -> None:
    side, options = VARIANTS[name]
    with tempfile.TemporaryDirectory(prefix="trl_comparison_") as tmp:
        start = time.perf_counter()
        r = (run_trl if side == "trl" else run_ours)(options, steps, Path(tmp))
    r["total_s"] = time.perf_counter() - start
    result.write_text(json.dumps(r))


# ---- driver -----------------------------------------------------------------------------------------------

def summarise(r: dict) -> dict:
    """Drop the warm-up step from the timings; reward halves over all steps run."""
    half = len(r["rewards"]) // 2
    return r | {
        "median_step_s": statistics.median(r["step_times"][1:]),
        "median_wall_s": statistics.median(r["walls"]) if r["walls"] else float("nan"),
        "mean_length": statistics.fmean(r["lengths"][1:]),
        "reward_first_half": statistics.fmean(r["rewards"][:half]) if half else float("nan"),
        "reward_second_half": statistics.fmean(r["rewards"][half:]) if r["rewards"] else float("nan"),
    }


def run_variant(name: str, steps: int, tmp: Path) -> dict | None:
    _, options = VARIANTS[name]
    result = tmp / f"{name.replace(' ', '_')}.json"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env |= options.get("env", {})
    cmd = [sys.executable, __file__, "--worker", name, "--steps", str(steps), "--result", str(result)]
    busy, child, start = cpu_busy_s(), children_cpu_s(), time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    others = (cpu_busy_s() - busy) - (children_cpu_s() - child)
    if proc.returncode != 0 or not result.exists():
        print(f"  {name}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
        return None
    return summarise(json.loads(result.read_text())) | {"others_cores": max(others, 0.0) / (time.monotonic() - start)}


def cpu_busy_s() -> float:
    """CPU seconds all processes of the machine have used since boot (Linux /proc/stat; 0 elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def print_table(results: dict[str, dict], steps: int) -> None:
    print()
    print(f"seconds per optimizer step (P={P} x G={G} = {P * G} completions, {MAX_TOKENS} new tokens), "
          f"median of {steps} steps after 1 warm-up")
    print(f"{'variant':<14} {'precision':<14} {'threads':>7} {'step s':>7} {'wall s':>7} {'min':>6} {'max':>6} "
          f"{'tokens':>6} "
          f"{'reward 1st half':>16} {'2nd half':>9} {'total s':>8} {'others':>7}")
    for name, r in results.items():
        counted = r["step_times"][1:]
        print(f"{name:<14} {r['precision']:<14} {r['threads']:>7} {r['median_step_s']:>7.2f} "
              f"{r['median_wall_s']:>7.2f} {min(counted):>6.2f} {max(counted):>6.2f} {r['mean_length']:>6.1f} "
              f"{r['reward_first_half']:>16.3f} {r['reward_second_half']:>9.3f} {r['total_s']:>8.0f} "
              f"{r['others_cores']:>7.2f}")
    pairs = [(t, o) for t, o in PAIRS if t in results and o in results]
    if pairs:
        print()
        print(f"{'TRL':<12} {'ours':<13} {'TRL s':>7} {'ours s':>7} {'TRL/ours':>9} {'wall ratio':>11}")
        for t, o in pairs:
            a, b = results[t], results[o]
            print(f"{t:<12} {o:<13} {a['median_step_s']:>7.2f} {b['median_step_s']:>7.2f} "
                  f"{a['median_step_s'] / b['median_step_s']:>8.2f}x "
                  f"{a['median_wall_s'] / b['median_wall_s']:>10.2f}x")


def main() -> None:
    args = parse_args()
    if args.worker:
        if VARIANTS[args.worker][0] == "ours":
            # As the examples run: restarted on mimalloc before torch loads (docs/allocator.md); TRL as shipped.
            from training import restart_with_allocator
            restart_with_allocator()
        worker(args.worker, args.steps, args.result)
        return
    if importlib.util.find_spec("trl") is None:
        print("trl is not installed; install it with: pip install -e '.[trl]'")
        sys.exit(2)
    import torch
    import transformers
    import trl

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="trl_comparison_") as tmp:
        for name in args.only or VARIANTS:
            r = run_variant(name, args.steps, Path(tmp))
            if r is not None:
                results[name] = r
                print(f"  {name}: {r['median_step_s']:.2f} s/step ({r['precision']}), "
                      f"{r['total_s']:.0f}s with start-up", flush=True)
    print_table(results, args.steps)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if len(results) < len(args.only or VARIANTS):
        sys.exit(1)


if __name__ == "__main__":
    main()
