"""Run telemetry: the JSONL metrics ledger, console progress, optional W&B, and PNG plots.

The ledger (`metrics.jsonl` in the run directory) is always written, one JSON object per
record; it is the source of truth that plots are drawn from. W&B never blocks or fails
the run: any error there is logged once and W&B is switched off.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from training.utils.run_files.jsonl import read_jsonl

log = logging.getLogger("training")

LEDGER_NAME = "metrics.jsonl"

# (title, metric names) of each panel in the end-of-run plot.
PLOT_PANELS = (
    ("reward", ("rollout/raw_reward", "rollout/filtered_reward", "eval/reward")),
    ("KL", ("train/ppo_kl", "train/ref_kl")),
    ("entropy", ("train/entropy",)),
    ("response length", ("rollout/response_len_mean",)),
    ("step time (s)", ("perf/step_time", "perf/rollout_wait_time", "perf/train_time", "perf/weight_sync_time")),
)


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RunLogger:
    """Append metric records to the ledger, print progress, mirror to W&B."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        total_steps: int | None = None,
        progress: bool = True,
        wandb_project: str | None = None,
        config: dict[str, Any] | None = None,
        new_run: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ledger_path = self.run_dir / LEDGER_NAME
        if new_run and self.ledger_path.exists():
            # A run that does not resume must not mix its curves into an earlier run's ledger.
            self.ledger_path.rename(_free_path(self.run_dir, "metrics.{}.jsonl"))
        self._ledger = self.ledger_path.open("a", buffering=1)
        if self._ledger.tell() > 0 and not _ends_with_newline(self.ledger_path):
            # A resumed run appends to the ledger of a process that was killed mid-line:
            # end that torn line so it cannot swallow the first new record.
            self._ledger.write("\n")
        self.total_steps = total_steps
        self.progress = progress
        self._start = time.monotonic()
        self._streams: dict[str, int] = {}
        self._wandb = _start_wandb(wandb_project, self.run_dir, config) if wandb_project else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": round(time.monotonic() - self._start, 3)}
        record.update(
            {k: (float(v) if is_finite_number(v) else None if isinstance(v, float) else v) for k, v in metrics.items()}
        )
        self._ledger.write(json.dumps(record) + "\n")
        if self.progress:
            print(progress_line(step, self.total_steps, metrics), file=sys.stderr, flush=True)
        if self._wandb is not None:
            try:
                self._wandb.log({k: v for k, v in metrics.items() if is_finite_number(v)}, step=step)
            except Exception as exc:  # W&B must never fail the run
                log.warning("W&B logging failed (%s); continuing without W&B", exc)
                self._wandb = None

    def log_record(self, record: dict[str, Any]) -> None:
        """A record of its own, neither a step's nor a stream's (the run plan: `{"plan": {...}}`), as it is."""
        self._ledger.write(json.dumps(record) + "\n")

    def log_stream(self, axis: str, metrics: dict[str, Any]) -> None:
        """A record on its own axis instead of the step (e.g. `producer/event` for producer gauges).

        The axis counts 0, 1, 2, … per name; the record carries no `step`, so step-indexed
        readers (plots, progress) skip it. W&B plots the axis's family against it.
        """
        index = self._streams.get(axis, 0)
        self._streams[axis] = index + 1
        record = {axis: index, "time": round(time.monotonic() - self._start, 3)}
        record.update({k: (float(v) if is_finite_number(v) else None) for k, v in metrics.items()})
        self._ledger.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            try:
                if index == 0:
                    family = axis.split("/")[0]
                    self._wandb.define_metric(axis)
                    self._wandb.define_metric(f"{family}/*", step_metric=axis)
                self._wandb.log({k: v for k, v in record.items() if is_finite_number(v) and k != "time"}, commit=False)
            except Exception as exc:  # W&B must never fail the run
                log.warning("W&B logging failed (%s); continuing without W&B", exc)
                self._wandb = None

    def close(self, plots: bool = True) -> list[Path]:
        """Flush the ledger, finish W&B, and draw the plots unless told not to; returns the PNG paths."""
        self._ledger.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as exc:
                log.warning("W&B finish failed: %s", exc)
        return plot_ledger(self.ledger_path, self.run_dir) if plots else []


def _free_path(directory: Path, pattern: str) -> Path:
    index = 1
    while (directory / pattern.format(index)).exists():
        index += 1
    return directory / pattern.format(index)


def progress_line(step: int, total_steps: int | None, metrics: dict[str, Any]) -> str:
    """`step 3/40 [###.......] reward 0.41 kl 0.0012 step 7.9s 8.1 samples/s`."""
    width = 20
    if total_steps:
        filled = min(width, round(width * step / total_steps))
        head = f"step {step}/{total_steps} [{'#' * filled}{'.' * (width - filled)}]"
    else:
        head = f"step {step}"
    parts = [head]
    for label, key, fmt in (
        ("reward", "rollout/raw_reward", "{:.3f}"),
        ("eval", "eval/reward", "{:.3f}"),
        ("kl", "train/ppo_kl", "{:.2e}"),
        ("ref_kl", "train/ref_kl", "{:.2e}"),
        ("step", "perf/step_time", "{:.1f}s"),
        ("samples/s", "perf/samples_per_s", "{:.2f}"),
    ):
        if is_finite_number(metrics.get(key)):
            parts.append(f"{label} {fmt.format(metrics[key])}")
    filtered = metrics.get("rollout/groups_filtered")
    if is_finite_number(filtered) and filtered > 0:  # rows the filter rejected cost rollouts and trained nothing
        settled = metrics.get("rollout/groups_accepted", 0.0) + metrics.get("rollout/groups_rejected", 0.0)
        parts.append(f"filtered {filtered:.0f}/{settled:.0f} groups")
    return " ".join(parts)


def read_ledger(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a ledger, skipping a line torn by a killed process."""
    return read_jsonl(path, skip_torn_lines=True)


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def plot_ledger(ledger_path: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Draw `metrics.png` (all panels) and `reward.png` from a ledger; returns the files written."""
    records = read_ledger(ledger_path)
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(name):
        points = [(r["step"], r[name]) for r in records if "step" in r and is_finite_number(r.get(name))]
        return ([s for s, _ in points], [v for _, v in points]) if points else None

    out_dir = Path(out_dir)
    written = []
    panels = [(title, [(n, series(n)) for n in names]) for title, names in PLOT_PANELS]
    panels = [(title, [(n, s) for n, s in lines if s]) for title, lines in panels]
    panels = [(title, lines) for title, lines in panels if lines]
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), squeeze=False)
        for ax, (title, lines) in zip(axes[:, 0], panels):
            for name, (xs, ys) in lines:
                ax.plot(xs, ys, marker=".", label=name)
            ax.set_title(title)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(out_dir / "metrics.png", dpi=90)
        plt.close(fig)
        written.append(out_dir / "metrics.png")
    reward = series("rollout/raw_reward")
    if reward:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*reward, marker=".", label="mean reward per step")
        evaluation = series("eval/reward")
        if evaluation:
            ax.plot(*evaluation, marker="o", label="eval reward")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "reward.png", dpi=90)
        plt.close(fig)
        written.append(out_dir / "reward.png")
    return written


def _start_wandb(project: str, run_dir: Path, config: dict[str, Any] | None):
    """Online with an API key, offline files in the run directory otherwise; None if W&B cannot start."""
    try:
        import wandb

        has_key = bool(os.environ.get("WANDB_API_KEY")) or bool(wandb.api.api_key)
        return wandb.init(
            project=project,
            dir=str(run_dir),
            config=config or {},
            mode="online" if has_key else "offline",
            settings=wandb.Settings(init_timeout=30, silent=True),
        )
    except Exception as exc:
        log.warning("W&B could not start (%s); metrics stay in the JSONL ledger", exc)
        return None

