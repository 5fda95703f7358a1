"""Per-step agent-shim statistics: the run ledger joined with the rollout's per-draw log.

The recipe logs rewards and timings per step but not what the shim saw. `rollout.py`
writes one JSON line per draw (`runs_log`) with the session's counters (`shim/turns`,
`shim/wipes`, `shim/parser_fallbacks`, ...), the run's segments and the agent's own counts.
This module assigns each draw to the step that trained its row (the ledger's
`batch/row_ids`) and sums them per step:

    python training/examples/rl/blackbox_agent/shim_stats.py runs/blackbox_agent

Draws of a row that no step trained (still in flight at the end) are left out. A row drawn
again in a later epoch is counted at its first step; the default run is far from a second epoch.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from training.utils.logging import LEDGER_NAME, read_ledger

RUNS_LOG_NAME = "agent_runs.jsonl"
COLUMNS = {
    "step": "step",
    "step_s": "step time (s)",
    "draws": "draws",
    "dropped": "dropped",
    "reward": "mean reward",
    "turns": "model calls (shim turns)",
    "multi_turn": "runs with > 1 turn",
    "tool_calls": "tool calls",
    "tool_errors": "failed tool calls",
    "segments": "segments",
    "wipes": "wipes",
    "branches": "branches",
    "parser_fallbacks": "parser fallbacks",
    "render_fallbacks": "render fallbacks",
    "sampling_failures": "sampling failures",
    "trained_tokens": "trained tokens",
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def step_stats(ledger: list[dict[str, Any]], draws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row of `COLUMNS` per trained step."""
    by_row: dict[str, list[dict]] = defaultdict(list)
    for draw in draws:
        if not draw.get("evaluation"):
            by_row[draw["row_id"]].append(draw)
    table = []
    for record in last_run(ledger):
        step_draws = [d for row_id in record["batch/row_ids"] for d in by_row.pop(row_id, [])]
        runs = [d for d in step_draws if d.get("outcome") == "run"]
        table.append({
            "step": record["step"],
            "step_s": round(record.get("perf/step_time") or 0.0, 1),
            "draws": len(step_draws),
            "dropped": len(step_draws) - len(runs),
            "reward": round(sum(d["reward"] for d in runs) / len(runs), 3) if runs else None,
            "turns": _total(step_draws, "shim/turns"),
            "multi_turn": sum(d.get("shim/turns", 0) > 1 for d in step_draws),
            "tool_calls": _total(step_draws, "tool_calls"),
            "tool_errors": _total(step_draws, "tool_errors"),
            "segments": _total(runs, "num_segments"),
            "wipes": _total(step_draws, "shim/wipes"),
            "branches": _total(step_draws, "shim/branches"),
            "parser_fallbacks": _total(step_draws, "shim/parser_fallbacks"),
            "render_fallbacks": _total(step_draws, "shim/render_fallbacks"),
            "sampling_failures": _total(step_draws, "shim/sampling_failures"),
            "trained_tokens": _total(runs, "trainable_tokens"),
        })
    return table


def last_run(ledger: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records of the ledger's last run (a run that did not resume appends to the same ledger)."""
    steps = [r for r in ledger if "step" in r and "batch/row_ids" in r]
    start = 0
    for i in range(1, len(steps)):
        if steps[i]["step"] <= steps[i - 1]["step"]:
            start = i
    return steps[start:]


def _total(draws: list[dict], key: str) -> int:
    return sum(int(d.get(key) or 0) for d in draws)


def markdown_table(table: list[dict[str, Any]]) -> str:
    header = "| " + " | ".join(COLUMNS.values()) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    lines = ["| " + " | ".join("" if row[k] is None else str(row[k]) for k in COLUMNS) + " |" for row in table]
    return "\n".join([header, rule, *lines])


def run_dir_stats(log_path: str | Path) -> list[dict[str, Any]]:
    """`step_stats` of a run directory (its `metrics.jsonl` and `agent_runs.jsonl`)."""
    log_path = Path(log_path)
    ledger = read_ledger(log_path / LEDGER_NAME) if (log_path / LEDGER_NAME).is_file() else []
    return step_stats(ledger, read_jsonl(log_path / RUNS_LOG_NAME))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_path", help="the run directory (cfg.log_path)")
    args = parser.parse_args()
    print(markdown_table(run_dir_stats(args.log_path)))


if __name__ == "__main__":
    main()
