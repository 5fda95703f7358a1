"""Per-step agent-shim statistics of a run, as a markdown table read from its metrics ledger.

The recipes sum the shim's per-session counters over each step's runs into the step's metrics
(`rollout/shim/turns`, `rollout/shim/compactions`, ...; `training/utils/rl/groups.py::shim_metrics`).
This prints them next to the step's reward and drops:

    python training/examples/rl/blackbox_agent/shim_stats.py runs/blackbox_agent

What the ledger does not hold, per draw (the agent's own tool-call counts, its exit code, the
start of the model's last reply), is in the run's `agent_runs.jsonl`, written by `rollout.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from training import read_jsonl

COLUMNS = {
    "step": "step",
    "perf/step_time": "step time (s)",
    "batch/samples": "runs trained",
    "rollout/draws_dropped": "draws dropped",
    "rollout/raw_reward": "mean reward",
    "rollout/shim/turns": "model calls (shim turns)",
    "rollout/shim/appends": "appends",
    "rollout/shim/branches": "branches",
    "rollout/shim/compactions": "compactions",
    "rollout/shim/parser_fallbacks": "parser fallbacks",
    "rollout/shim/render_fallbacks": "render fallbacks",
    "rollout/shim/sampling_failures": "sampling failures",
    "rollout/response_len_mean": "trained tokens per run",
}


def step_table(ledger: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `COLUMNS` of each step record of the ledger's last run."""
    return [{key: record.get(key) for key in COLUMNS} for record in last_run(ledger)]


def last_run(ledger: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records of the ledger's last run (a run that did not resume appends to the same ledger)."""
    steps = [r for r in ledger if "step" in r and "rollout/groups_accepted" in r]
    start = 0
    for i in range(1, len(steps)):
        if steps[i]["step"] <= steps[i - 1]["step"]:
            start = i
    return steps[start:]


def markdown_table(table: list[dict[str, Any]]) -> str:
    header = "| " + " | ".join(COLUMNS.values()) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    lines = ["| " + " | ".join(_cell(row[k]) for k in COLUMNS) + " |" for row in table]
    return "\n".join([header, rule, *lines])


def _cell(value: Any) -> str:
    return "" if value is None else f"{round(value, 3):g}"


def run_dir_stats(log_path: str | Path) -> list[dict[str, Any]]:
    """`step_table` of a run directory's ledger."""
    # A run killed mid-write leaves a torn last line in its ledger.
    return step_table(read_jsonl(Path(log_path) / "metrics.jsonl", skip_torn_lines=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_path", help="the run directory (cfg.log_path)")
    args = parser.parse_args()
    print(markdown_table(run_dir_stats(args.log_path)))


if __name__ == "__main__":
    main()
