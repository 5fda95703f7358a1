"""Arithmetic with a retry on SmolLM2-135M-Instruct, sized for a 2-core CPU (its README: Results).

    python training/examples/rl/multi_turn_message_in/train.py

Runs the async recipe; for the synchronous one import from `training.recipes.rl_loop` instead
(drop the async-only field `max_head_offpolicy_versions`).
"""

import json

from training import restart_with_allocator, set_openmp_wait_policy

if __name__ == "__main__":
    restart_with_allocator()  # first, before torch loads: the run's memory through mimalloc (docs/allocator.md)
    set_openmp_wait_policy()  # before torch loads: idle OpenMP workers spin between operators (docs/cpu-sharing.md)

from training import SamplingConfig, TrainerConfig, rollout_evaluation
from training.examples.rl.multi_turn_message_in.make_data import load_split
from training.examples.rl.multi_turn_message_in.rollout import make_rollout_fn
from training.recipes.async_rl_loop import Config, main

rollout_extras = {"max_turns": 2}
cfg = Config(
    model="smollm2-135m-instruct", log_path="runs/multi_turn_message_in",
    completions_per_prompt=8, prompt_groups_per_step=8, max_steps=16, max_head_offpolicy_versions=1,
    sampling=SamplingConfig(max_tokens=32, temperature=0.8),
    # LoRA adapters at 15x full fine-tuning's learning rate, which the embedded engine runs over the trainer's own
    # base weights: no gradients, moments or second copy of the model. Activations recomputed in the backward
    # instead of kept: the turns make long training rows, and a laptop's memory is what bounds them
    # (docs/lora-examples.md weighs both against full fine-tuning).
    trainer=TrainerConfig(lora_rank=16, learning_rate=3e-4, gradient_checkpointing=True),
)

if __name__ == "__main__":
    # All 64 held-out rows × 2 draws: 128 draws, a standard error of about 0.044 at a reward near 0.4.
    evaluation_fn = rollout_evaluation(make_rollout_fn, load_split("eval"), samples_per_row=2)
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=load_split("train"), evaluation_fn=evaluation_fn,
                   rollout_extras=rollout_extras)
    print(json.dumps({k: summary[k] for k in ("steps", "ledger", "plots")}, indent=1))
