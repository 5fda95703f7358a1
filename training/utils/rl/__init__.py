"""RL pieces both recipes share. `TISConfig` and `PromptGroup` resolve here where the cookbook imports them."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES: dict[str, str] = {
    "TISConfig": "training.utils.config.rl",
    "PromptGroup": "training.utils.rl.rollout.types",
}
"""Name -> the module that defines it; loaded on first use, so importing this package stays cheap."""


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
