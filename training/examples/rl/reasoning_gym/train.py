"""A mix of two reasoning-gym datasets, trained with SmolLM2-135M-Instruct on a 2-core CPU.

    pip install -e ".[reasoning-gym]"
    python training/examples/rl/reasoning_gym/train.py

`from_reasoning_gym` builds the training rows, the held-out rows and the rollout; each reply is scored by its
dataset's own `score_answer` (its README says why the whole reply is the answer here).
"""

import json

from training import restart_with_allocator, set_openmp_wait_policy

if __name__ == "__main__":
    restart_with_allocator()  # first, before torch loads: the run's memory through mimalloc (docs/allocator.md)
    set_openmp_wait_policy()  # before torch loads: idle OpenMP workers spin between operators (docs/cpu-sharing.md)

from training import SamplingConfig, TrainerConfig, from_reasoning_gym
from training.recipes.async_rl_loop import Config, main

DATASETS = {"chain_sum": 1.0, "basic_arithmetic": 1.0}
"""Two generators of sums and differences of two single digits, each with its own question and scorer."""
CONFIGS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
                         "allow_parentheses": False, "allow_negation": False},
}
SYSTEM_PROMPT = "Reply with only the answer: one number, nothing else."

cfg = Config(
    model="smollm2-135m-instruct", policy_loss="grpo", log_path="runs/reasoning_gym",
    completions_per_prompt=8, prompt_groups_per_step=8, max_steps=30, max_head_offpolicy_versions=1,
    # A bare number fits in a few tokens; a reply still explaining itself at 8 is cut, and scores little.
    sampling=SamplingConfig(max_tokens=8, temperature=1.0),
    # LoRA adapters (no gradients or moments of the base weights) in micro-batches of 512 tokens: the run fits a
    # laptop's memory (docs/lora-examples.md).
    trainer=TrainerConfig(lora_rank=16, learning_rate=1e-3, lr_schedule="cosine", min_lr_ratio=0.1,
                          max_tokens_per_microbatch=512),
)

if __name__ == "__main__":
    env = from_reasoning_gym(DATASETS, configs=CONFIGS, size=512, eval_size=64, system_prompt=SYSTEM_PROMPT,
                             answer_from="completion", eval_samples_per_row=2)
    summary = main(cfg, **env)
    print(json.dumps({k: summary[k] for k in ("steps", "ledger", "plots")}, indent=1))
