"""The library's inside. The names the Fireworks cookbook imports from `training.utils` resolve here
(docs/coming-from-the-cookbook.md); users of this library import from `training`."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES: dict[str, str] = {
    "DeployConfig": "training.utils.deployment_config",
    "TrainerConfig": "training.utils.trainer_config",
    "WandBConfig": "training.utils.cookbook_config",
    "InfraConfig": "training.utils.cookbook_config",
    "RunnerConfig": "training.utils.cookbook_config",
    "WeightSyncConfig": "training.utils.cookbook_config",
    "TISConfig": "training.utils.config",
}
"""Name -> the module that defines it; loaded on first use, so importing this package stays cheap."""


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
