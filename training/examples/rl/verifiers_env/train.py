"""A verifiers 0.4.0 environment (`digit_sums/`: a taskset, a rubric of two weighted reward functions and a tool)
trained with SmolLM2-135M-Instruct on a 2-core CPU, each episode played by verifiers itself.

    pip install -e ".[verifiers]"        # it moves openai to 2.54 (docs/environments.md: verifiers)
    python training/examples/rl/verifiers_env/train.py

`from_verifiers` runs each draw's episode through the agent shim, which records every model call; the reward is
the environment's rubric (`rollout/reward/correct`, `rollout/reward/concise` in the ledger).
"""

import json
import os
import sys
from pathlib import Path

from training import restart_with_allocator, set_openmp_wait_policy

if __name__ == "__main__":
    restart_with_allocator()  # first, before torch loads: the run's memory through mimalloc (docs/allocator.md)
    set_openmp_wait_policy()  # before torch loads: idle OpenMP workers spin between operators (docs/cpu-sharing.md)

from training import AgentShimConfig, SamplingConfig, TrainerConfig, from_verifiers
from training.recipes.async_rl_loop import Config, main

# verifiers finds a taskset by importing it by name, as it would an installed package (`uv pip install -e .`);
# its tool server is a `python -m digit_sums.tools` child, so the path goes to the children too.
HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *filter(None, [os.environ.get("PYTHONPATH")])])

cfg = Config(
    model="smollm2-135m-instruct", policy_loss="grpo", log_path="runs/verifiers_env",
    completions_per_prompt=4, prompt_groups_per_step=4, max_steps=14, max_head_offpolicy_versions=1,
    # The sum and a few words fit; a reply still explaining at 24 tokens is cut, and is not concise.
    sampling=SamplingConfig(max_tokens=24, temperature=1.0),
    trainer=TrainerConfig(lora_rank=16, learning_rate=5e-4, lr_schedule="cosine", min_lr_ratio=0.1,
                          max_tokens_per_microbatch=512),
    # The shim is the episode's model endpoint; an episode starts a tool server and a chat program of its own.
    agent_shim=AgentShimConfig(enabled=True), rollout_timeout_s=300,
)

if __name__ == "__main__":
    env = from_verifiers({"taskset": {"id": "digit_sums", "split": "train"}},
                         eval_env={"taskset": {"id": "digit_sums", "split": "eval"}}, episode_timeout_s=240)
    summary = main(cfg, **env)
    print(json.dumps({k: summary[k] for k in ("steps", "ledger", "plots")}, indent=1))
