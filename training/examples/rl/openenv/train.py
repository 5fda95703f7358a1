"""A two-step OpenEnv environment trained with SmolLM2-135M-Instruct on a 2-core CPU.

    pip install -e ".[openenv]"
    python training/examples/rl/openenv/train.py

The environment's server (`arith_env.py`, openenv-core's `create_app`) runs as a local process for the run; each
draw is one episode over openenv-core's client, both replies trained as one run (its README).
"""

import json

from training import restart_with_allocator, set_openmp_wait_policy

if __name__ == "__main__":
    restart_with_allocator()  # first, before torch loads: the run's memory through mimalloc (docs/allocator.md)
    set_openmp_wait_policy()  # before torch loads: idle OpenMP workers spin between operators (docs/cpu-sharing.md)

from training import SamplingConfig, TrainerConfig, from_openenv, openenv_server
from training.recipes.async_rl_loop import Config, main

ROWS = [{"id": f"train{i}", "reset": {"seed": i}} for i in range(512)]
EVAL_ROWS = [{"id": f"eval{i}", "reset": {"seed": 1_000_000 + i}} for i in range(32)]
"""Other seeds, so other pairs of sums (the 81 single-digit pairs repeat across seeds; the pairs of two do less)."""

cfg = Config(
    model="smollm2-135m-instruct", policy_loss="grpo", log_path="runs/openenv",
    completions_per_prompt=8, prompt_groups_per_step=8, max_steps=30, max_head_offpolicy_versions=1,
    # The completed equation ("3 + 4 = 7") and its end fit in 12 tokens; a reply still explaining itself is cut.
    sampling=SamplingConfig(max_tokens=12, temperature=1.0),
    # LoRA adapters in micro-batches of 512 tokens, as the reasoning_gym example (docs/lora-examples.md).
    trainer=TrainerConfig(lora_rank=16, learning_rate=1e-3, lr_schedule="cosine", min_lr_ratio=0.1,
                          max_tokens_per_microbatch=512),
)

if __name__ == "__main__":
    with openenv_server("training.examples.rl.openenv.arith_env:app") as url:
        summary = main(cfg, **from_openenv(url, rows=ROWS, eval_rows=EVAL_ROWS, name="arith", max_turns=2,
                                           eval_samples_per_row=2))
    print(json.dumps({k: summary[k] for k in ("steps", "ledger", "plots")}, indent=1))
