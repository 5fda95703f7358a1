"""A black-box Anthropic-SDK agent trained through the agent shim, SmolLM2-135M-Instruct on a 2-core CPU.

    python training/examples/rl/blackbox_agent/train.py

Runs the async recipe with the shim on; prints the per-step shim statistics of the ledger at the
end (`shim_stats.py`; README: what the default run measured).
"""

from pathlib import Path

from training.examples.rl.blackbox_agent.make_data import load_split
from training.examples.rl.blackbox_agent.rollout import make_rollout_fn
from training.examples.rl.blackbox_agent.shim_stats import markdown_table, run_dir_stats
from training.recipes.async_rl_loop import Config, main
from training.utils.config import AgentShimConfig, SamplingConfig, TrainerConfig

cfg = Config(
    model="smollm2-135m-instruct", log_path="runs/blackbox_agent",
    # P rows × G agent runs a step; one step of overlap between rollouts and training.
    completions_per_prompt=4, prompt_groups_per_step=2, max_steps=5, max_head_offpolicy_versions=1,
    sampling=SamplingConfig(max_tokens=64, temperature=1.0), trainer=TrainerConfig(learning_rate=2e-5),
    # The shim is the agent's model endpoint; one agent run may take minutes on a CPU.
    agent_shim=AgentShimConfig(enabled=True), rollout_timeout_s=300,
)
runs_log = Path(cfg.log_path) / "agent_runs.jsonl"
rollout_extras = {"max_turns": 3, "agent_timeout_s": 240, "runs_log": str(runs_log)}

if __name__ == "__main__":
    runs_log.unlink(missing_ok=True)  # the rollout appends to it; keep this run's draws only
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=load_split("train"), rollout_extras=rollout_extras)
    print(markdown_table(run_dir_stats(cfg.log_path)))
    print({k: summary[k] for k in ("steps", "ledger")})
