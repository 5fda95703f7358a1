"""A real agent CLI, unmodified, trained through the agent shim: Claude Code, Codex, Qwen Code or opencode.

    npm install -g @anthropic-ai/claude-code        # or @openai/codex, @qwen-code/qwen-code, opencode-ai
    python training/examples/rl/cli_agent/train.py [--agent claude|codex|qwen|opencode] [--agent-bin PATH]

Runs the async recipe with the shim on, with the held-out evaluation before the first and after the last step.
The model needs a context that holds the CLI's first prompt (its system prompt and tools) with room to work
(its README: Agents and their context).
"""

import argparse
import json
from pathlib import Path

from training import restart_with_allocator, set_openmp_wait_policy

if __name__ == "__main__":
    restart_with_allocator()  # first, before torch loads: the run's memory through mimalloc (docs/allocator.md)
    set_openmp_wait_policy()  # before torch loads: idle OpenMP workers spin between operators (docs/cpu-sharing.md)

from training import AgentShimConfig, SamplingConfig, TrainerConfig, rollout_evaluation
from training.examples.rl.cli_agent.clis import CLIS
from training.examples.rl.cli_agent.rollout import make_rollout_fn
from training.examples.rl.cli_agent.task import make_rows
from training.recipes.async_rl_loop import Config, main

cfg = Config(
    # A small open model whose chat template renders tools and tool calls, with a 40k context.
    model="Qwen/Qwen3-0.6B", log_path="runs/cli_agent",
    # P rows x G CLI runs a step; every run is a CLI process with a prompt of many thousand tokens.
    completions_per_prompt=4, prompt_groups_per_step=2, max_steps=20, max_head_offpolicy_versions=1,
    # A reply may hold a tool call with a file's content; the rollout's own limit leaves the CLI's (agent_timeout_s)
    # room.
    sampling=SamplingConfig(max_tokens=2048, temperature=1.0), rollout_timeout_s=900,
    # The backward recomputes activations, attention included, instead of keeping them: a CLI's first prompt alone
    # is 7k-17k tokens, and keeping them would outgrow a laptop's memory (benchmarks/RESULTS.md counts it). The shim
    # is the CLI's model endpoint.
    trainer=TrainerConfig(learning_rate=1e-6, gradient_checkpointing=True, recompute_attention=True),
    agent_shim=AgentShimConfig(enabled=True),
)
rollout_extras = {"agent": "claude", "agent_timeout_s": 600, "runs_log": str(Path(cfg.log_path) / "agent_runs.jsonl")}
TRAIN_ROWS, EVAL_ROWS = 256, 16

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", choices=sorted(CLIS), default=rollout_extras["agent"])
    parser.add_argument("--agent-bin", help="the CLI's executable (default: its command on PATH)")
    args = parser.parse_args()
    extras = rollout_extras | {"agent": args.agent} | ({"agent_bin": args.agent_bin} if args.agent_bin else {})
    Path(extras["runs_log"]).unlink(missing_ok=True)  # the rollout appends to it; keep this run's draws only
    evaluation_fn = rollout_evaluation(make_rollout_fn, make_rows(EVAL_ROWS, 0, "eval"), samples_per_row=1,
                                       timeout_s=cfg.rollout_timeout_s)
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=make_rows(TRAIN_ROWS, 0, "train"),
                   evaluation_fn=evaluation_fn, rollout_extras=extras)
    print(json.dumps({k: summary[k] for k in ("steps", "ledger", "plots")}, indent=1))
