"""GRPO on single-digit addition with SmolLM2-135M-Instruct, on a laptop CPU.

    python training/examples/rl/single_turn_token_in/train.py
    python training/examples/rl/single_turn_token_in/train.py --vllm http://127.0.0.1:8000

Runs the async recipe; for the synchronous baseline import from `training.recipes.rl_loop`
instead (drop the async-only field `max_head_offpolicy_versions`). `--vllm URL` samples from a
vLLM server you started (README: Sampling from vLLM) instead of the embedded engine.
"""

import argparse
import json
from pathlib import Path

from training import restart_with_allocator, set_openmp_wait_policy

if __name__ == "__main__":
    restart_with_allocator()  # first, before torch loads: the run's memory through mimalloc (docs/allocator.md)
    set_openmp_wait_policy()  # before torch loads: idle OpenMP workers spin between operators (docs/cpu-sharing.md)

from training import DeploymentConfig, SamplingConfig, TrainerConfig, read_jsonl, rollout_evaluation
from training.examples.rl.single_turn_token_in.rollout import make_rollout_fn
from training.recipes.async_rl_loop import Config, main

DATA = Path(__file__).resolve().parent / "data"


def read_rows(name: str) -> list[dict]:
    return read_jsonl(DATA / name)


cfg = Config(
    model="smollm2-135m-instruct", policy_loss="grpo", log_path="runs/single_turn_token_in",
    completions_per_prompt=8, prompt_groups_per_step=8, max_steps=16, max_head_offpolicy_versions=1,
    sampling=SamplingConfig(max_tokens=12, temperature=1.0),
    # LoRA adapters at 15x full fine-tuning's learning rate, which the embedded engine runs over the trainer's own
    # base weights: no gradients, moments or second copy of the model. Micro-batches of 512 tokens bound the float32
    # activations kept for the backward, so the run fits a laptop's memory without recomputing them
    # (docs/lora-examples.md weighs it against full fine-tuning). The rate decays to a tenth over the run (cosine):
    # held constant, the last steps' updates, made from the few groups still mixed, cost held-out sums in some runs.
    trainer=TrainerConfig(lora_rank=16, learning_rate=3e-4, lr_schedule="cosine", min_lr_ratio=0.1,
                          max_tokens_per_microbatch=512),
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", metavar="URL", help="sample from the vLLM server at URL (weights synced every step)")
    args = parser.parse_args()
    if args.vllm:
        # The server may hold any weights: the run pushes its step-0 weights first, then syncs every step.
        cfg = cfg.model_copy(update={"deployment": DeploymentConfig(kind="vllm", base_url=args.vllm),
                                     "log_path": cfg.log_path + "_vllm"})
    summary = main(
        cfg,
        rollout_fn_factory=make_rollout_fn,
        rows=read_rows("train.jsonl"),
        evaluation_fn=rollout_evaluation(make_rollout_fn, read_rows("eval.jsonl"), samples_per_row=2),
    )
    print(json.dumps({k: summary[k] for k in ("steps", "ledger", "plots")}, indent=1))
