"""A black-box Anthropic-SDK agent trained through the agent shim, SmolLM2-135M-Instruct on a 2-core CPU.

    python training/examples/rl/blackbox_agent/train.py

Runs the async recipe with the shim on, with the held-out evaluation before the first and after
the last step; prints the per-step shim statistics of the ledger at the end (`shim_stats.py`;
its README: Results).
"""

import json
from pathlib import Path

from training import restart_with_allocator, set_openmp_wait_policy

if __name__ == "__main__":
    restart_with_allocator()  # first, before torch loads: the run's memory through mimalloc (docs/allocator.md)
    set_openmp_wait_policy()  # before torch loads: idle OpenMP workers spin between operators (docs/cpu-sharing.md)

from training import AgentShimConfig, DeploymentConfig, SamplingConfig, TrainerConfig, rollout_evaluation
from training.examples.rl.blackbox_agent.make_data import load_split
from training.examples.rl.blackbox_agent.rollout import make_rollout_fn
from training.examples.rl.blackbox_agent.shim_stats import markdown_table, run_dir_stats
from training.recipes.async_rl_loop import Config, main

cfg = Config(
    model="smollm2-135m-instruct", log_path="runs/blackbox_agent",
    # P rows × G agent runs a step; one step of overlap between rollouts and training. Each agent run is a Python
    # process whose start-up (importing the SDK) costs CPU of its own, so on 2 cores many small steps beat a few
    # large ones.
    completions_per_prompt=8, prompt_groups_per_step=2, max_steps=15, max_head_offpolicy_versions=1,
    # 16 tokens hold any completed equation ("9 + 9 = 18"); a rambling reply is cut and misses the format.
    sampling=SamplingConfig(max_tokens=16, temperature=0.7),
    # LoRA adapters at 15x full fine-tuning's learning rate: no gradients or moments of the base weights.
    # Micro-batches of 512 tokens bound the float32 activations kept for the backward, so the run fits a laptop's
    # memory without recomputing them (docs/lora-examples.md weighs it against full fine-tuning).
    trainer=TrainerConfig(lora_rank=16, learning_rate=3e-4, max_tokens_per_microbatch=512),
    # The agents' rows reach the engine a few at a time, where adapters run unmerged over the trainer's base cost
    # each decode step most: the engine holds its own merged copy instead (half a GB in float32; still under 4 GB).
    deployment=DeploymentConfig(lora_weights="merged"),
    # The shim is the agent's model endpoint; one agent run may take minutes on a CPU.
    agent_shim=AgentShimConfig(enabled=True), rollout_timeout_s=300,
)
runs_log = Path(cfg.log_path) / "agent_runs.jsonl"
# Four model calls cover the answer, its check and a follow-up for a format miss in each.
rollout_extras = {"max_turns": 4, "agent_timeout_s": 240, "runs_log": str(runs_log)}
EVAL_SAMPLES_PER_ROW = 2
"""32 held-out rows × 2 = 64 agent runs before the first step and after the last."""

if __name__ == "__main__":
    runs_log.unlink(missing_ok=True)  # the rollout appends to it; keep this run's draws only
    evaluation_fn = rollout_evaluation(make_rollout_fn, load_split("eval"), samples_per_row=EVAL_SAMPLES_PER_ROW)
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=load_split("train"), evaluation_fn=evaluation_fn,
                   rollout_extras=rollout_extras)
    print(markdown_table(run_dir_stats(cfg.log_path)))
    print(json.dumps({k: summary[k] for k in ("steps", "ledger", "plots")}, indent=1))
