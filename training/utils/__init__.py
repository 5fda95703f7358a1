"""The library's inside. The names the Fireworks cookbook imports from `training.utils` resolve here
(docs/coming-from-the-cookbook.md); users of this library import from `training`."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES: dict[str, str] = {
    "DeployConfig": "training.utils.config.deployment",
    "TrainerConfig": "training.utils.config.trainer",
    "WandBConfig": "training.utils.config.cookbook",
    "InfraConfig": "training.utils.config.cookbook",
    "RunnerConfig": "training.utils.config.cookbook",
    "WeightSyncConfig": "training.utils.config.cookbook",
    "TISConfig": "training.utils.config.rl",
}
"""Name -> the module that defines it; loaded on first use, so importing this package stays cheap."""


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
