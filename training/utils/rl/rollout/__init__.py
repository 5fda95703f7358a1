"""The rollout contract. The names the cookbook's rollouts import from `training.utils.rl.rollout` resolve here."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES: dict[str, str] = {
    "RolloutSample": "training.utils.rl.rollout.types",
    "RolloutRun": "training.utils.rl.rollout.types",
    "RolloutSetup": "training.utils.rl.rollout.types",
    "PromptGroup": "training.utils.rl.rollout.types",
    "MessageTrajectoryAssembler": "training.utils.rl.rollout.cookbook_chat",
    "TITOTokenizer": "training.utils.rl.rollout.cookbook_chat",
    "single_turn_renderer_rollout": "training.utils.rl.rollout.cookbook_renderer",
    "sample_vision_completion": "training.utils.rl.rollout.cookbook_renderer",
}
"""Name -> the module that defines it; loaded on first use, so importing this package stays cheap."""


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
