"""Async RL cookbook for language models: write a rollout function, the library does the rest.

The user contract and its helpers, in one import line:

    from training import RolloutSample, RolloutSetup, sample_from_completion, SamplingConfig

Recipes are imported from their own module, the one line an example changes to switch them:
`from training.recipes.async_rl_loop import Config, main` (or `training.recipes.rl_loop`).
Everything else under `training.utils` is the library's inside: it works, but it may move.

Names load on first use, so `import training` stays cheap and never imports torch by itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from training.utils.runtime import collector

__version__ = "0.1.0"

PUBLIC_NAMES: dict[str, str] = {
    # what a rollout returns and receives
    "RolloutSample": "training.utils.rl.rollout.types",
    "RolloutRun": "training.utils.rl.rollout.types",
    "RolloutSetup": "training.utils.rl.rollout.types",
    "PromptGroup": "training.utils.rl.rollout.types",
    "sample_from_completion": "training.utils.rl.rollout.types",
    "ChatAssembler": "training.utils.rl.rollout.messages",
    # the cookbook's rollout helpers (docs/coming-from-the-cookbook.md)
    "build_deployment_sampler": "training.utils.rl.rollout.cookbook_renderer",
    "build_renderer": "training.utils.rl.rollout.cookbook_renderer",
    "get_text_content": "training.utils.rl.rollout.cookbook_renderer",
    # errors a rollout raises or a user catches
    "RecoverableRolloutError": "training.utils.errors",
    "ConfigError": "training.utils.errors",
    # the parts of a recipe's Config
    "TrainerConfig": "training.utils.config.rl",
    "SamplingConfig": "training.utils.config.rl",
    "DeploymentConfig": "training.utils.config.rl",
    "AgentShimConfig": "training.utils.config.rl",
    "TISConfig": "training.utils.config.rl",
    "OverlongConfig": "training.utils.config.rl",
    # a policy loss of your own
    "register_policy_loss": "training.utils.rl.losses",
    "LossInputs": "training.utils.rl.losses",
    "TokenLoss": "training.utils.rl.losses",
    # data, evaluation, a deployment outside a training run
    "read_jsonl": "training.utils.run_files.jsonl",
    "write_jsonl": "training.utils.run_files.jsonl",
    "GeneratedSplits": "training.utils.rl.dataset",
    "rollout_evaluation": "training.utils.rl.evaluation",
    "serve_policy": "training.utils.rl.startup",
    "load_tokenizer": "training.utils.models.load",
    "load_model_and_tokenizer": "training.utils.models.load",
    # environments from other packages (docs/environments.md)
    "from_reasoning_gym": "training.environments.reasoning_gym",
    "from_openenv": "training.environments.openenv",
    "openenv_server": "training.environments.openenv",
    "from_verifiers": "training.environments.verifiers",
    "BadEnvironmentError": "training.environments.episodes",
    # the process a run lives in
    "restart_with_allocator": "training.utils.runtime.allocator",
    "set_openmp_wait_policy": "training.utils.runtime.openmp",
}
"""Public name -> the module that defines it (`tests/test_public_api.py` holds this list to the docs)."""

__all__ = sorted(PUBLIC_NAMES)


def __getattr__(name: str) -> Any:
    module = PUBLIC_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'training' has no attribute {name!r}")
    with collector.paused():  # importing torch and transformers makes nothing worth collecting (runtime/collector.py)
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC_NAMES))


if TYPE_CHECKING:  # for type checkers and IDEs; `X as X` marks a re-export
    from training.environments.episodes import BadEnvironmentError as BadEnvironmentError
    from training.environments.openenv import (
        from_openenv as from_openenv,
        openenv_server as openenv_server,
    )
    from training.environments.reasoning_gym import from_reasoning_gym as from_reasoning_gym
    from training.environments.verifiers import from_verifiers as from_verifiers
    from training.utils.config.rl import (
        AgentShimConfig as AgentShimConfig,
        DeploymentConfig as DeploymentConfig,
        OverlongConfig as OverlongConfig,
        SamplingConfig as SamplingConfig,
        TISConfig as TISConfig,
        TrainerConfig as TrainerConfig,
    )
    from training.utils.errors import (
        ConfigError as ConfigError,
        RecoverableRolloutError as RecoverableRolloutError,
    )
    from training.utils.models.load import (
        load_model_and_tokenizer as load_model_and_tokenizer,
        load_tokenizer as load_tokenizer,
    )
    from training.utils.rl.dataset import GeneratedSplits as GeneratedSplits
    from training.utils.rl.evaluation import rollout_evaluation as rollout_evaluation
    from training.utils.rl.losses import (
        LossInputs as LossInputs,
        TokenLoss as TokenLoss,
        register_policy_loss as register_policy_loss,
    )
    from training.utils.rl.rollout.cookbook_renderer import (
        build_deployment_sampler as build_deployment_sampler,
        build_renderer as build_renderer,
        get_text_content as get_text_content,
    )
    from training.utils.rl.rollout.messages import ChatAssembler as ChatAssembler
    from training.utils.rl.rollout.types import (
        PromptGroup as PromptGroup,
        RolloutRun as RolloutRun,
        RolloutSample as RolloutSample,
        RolloutSetup as RolloutSetup,
        sample_from_completion as sample_from_completion,
    )
    from training.utils.rl.startup import serve_policy as serve_policy
    from training.utils.run_files.jsonl import (
        read_jsonl as read_jsonl,
        write_jsonl as write_jsonl,
    )
    from training.utils.runtime.allocator import restart_with_allocator as restart_with_allocator
    from training.utils.runtime.openmp import set_openmp_wait_policy as set_openmp_wait_policy
