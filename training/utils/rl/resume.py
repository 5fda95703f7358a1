"""What a checkpoint records about the run's settings, and which changes a resume accepts.

The data cursor and the off-policy gate count rows and samples, so a checkpoint is only
meaningful under the settings that wrote it. On resume:

- refused, naming the field with its old and new value: the recipe, `completions_per_prompt`
  (G), `prompt_groups_per_step` (P), `seed` (the shuffle order) and the dataset (its row count
  and a hash of its row ids): the cursor would skip rows or train some twice;
- accepted: `max_head_offpolicy_versions` (O only bounds how far admission runs ahead of the
  published version, so a new O applies from the next admission and loses nothing) and
  `epochs` (the cursor's position stays valid; the run plans steps for the new count);
- a checkpoint written before these checks has no record: it resumes with a warning.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from training.utils.config import RLConfig
from training.utils.errors import ConfigError
from training.utils.rl.dataset import row_id_of

log = logging.getLogger("training")

FIXED = ("recipe", "completions_per_prompt", "prompt_groups_per_step", "seed", "dataset_rows", "dataset_row_ids")
ADJUSTABLE = ("max_head_offpolicy_versions", "epochs")


def run_settings(cfg: RLConfig, rows: list[dict[str, Any]], recipe: str) -> dict[str, Any]:
    """The settings a checkpoint records (in its progress, under "settings")."""
    row_ids = "\n".join(row_id_of(row, index) for index, row in enumerate(rows))
    return {
        "recipe": recipe,
        "completions_per_prompt": cfg.completions_per_prompt,
        "prompt_groups_per_step": cfg.prompt_groups_per_step,
        "seed": cfg.seed,
        "dataset_rows": len(rows),
        "dataset_row_ids": hashlib.sha256(row_ids.encode()).hexdigest()[:16],
        "max_head_offpolicy_versions": getattr(cfg, "max_head_offpolicy_versions", None),
        "epochs": cfg.epochs,
    }


def check_resumable(progress: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume whose settings the checkpoint's cursor cannot continue under; log accepted changes."""
    if not progress:
        return
    recorded = progress.get("settings")
    if recorded is None:
        log.warning("the checkpoint at step %d records no run settings (written by an older version): G, P, the "
                    "seed and the dataset cannot be checked against it", progress.get("step", 0))
        return
    changed = [name for name in FIXED if recorded.get(name) != current[name]]
    if changed:
        details = "; ".join(f"{name} was {recorded.get(name)!r}, now {current[name]!r}" for name in changed)
        raise ConfigError(
            f"cannot resume the checkpoint at step {progress.get('step', 0)}: {details}. Its data cursor and "
            "sample counts only hold under the settings that wrote it: restore them, or start the new run in "
            "another log_path"
        )
    for name in ADJUSTABLE:
        if recorded.get(name) != current[name]:
            log.info("resuming with %s=%r (the checkpoint was written with %r): applies from here on, no row lost",
                     name, current[name], recorded.get(name))
