"""Start-up pieces both recipes share: trainers, the rollout setup, evaluation calls."""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Callable

from training.utils.config import RLConfig
from training.utils.deploy import EmbeddedDeployment
from training.utils.logging import RunLogger
from training.utils.model import load_model_and_tokenizer
from training.utils.rl.rollout.types import RolloutSetup
from training.utils.trainer import Trainer


def setup_trainers(cfg: RLConfig, total_steps: int) -> tuple[Trainer, Trainer | None, Any]:
    """The policy trainer and, when kl_beta > 0, a frozen reference copy of the initial policy."""
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    trainer_cfg = cfg.trainer
    if trainer_cfg.total_steps is None:
        optimizer_steps = total_steps * cfg.ppo_epochs * cfg.ppo_minibatches
        trainer_cfg = trainer_cfg.model_copy(update={"total_steps": optimizer_steps})
    reference = Trainer(copy.deepcopy(model), trainer_cfg, trainable=False) if cfg.kl_beta > 0 else None
    return Trainer(model, trainer_cfg), reference, tokenizer


def make_rollout_setup(cfg: RLConfig, tokenizer, deployment: EmbeddedDeployment, extras) -> RolloutSetup:
    s = cfg.sampling
    return RolloutSetup(
        tokenizer=tokenizer,
        sampler=deployment.sampler,
        sample_kwargs=dict(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                           top_k=s.top_k, stop=list(s.stop), timeout=s.timeout_s),
        inference_base_url=deployment.base_url,
        model_name=cfg.model,
        completions_per_prompt=cfg.completions_per_prompt,
        extras=dict(extras or {}),
    )


async def maybe_evaluate(evaluation_fn: Callable | None, setup: RolloutSetup, step: int,
                         logger: RunLogger | None) -> dict[str, float]:
    """Run `evaluation_fn(setup, step)` (sync or async); its metrics are logged under `eval/`."""
    if evaluation_fn is None:
        return {}
    result = evaluation_fn(setup, step)
    if inspect.isawaitable(result):
        result = await result
    metrics = {k if k.startswith("eval/") else f"eval/{k}": float(v) for k, v in (result or {}).items()
               if isinstance(v, (int, float)) and math.isfinite(v)}
    if logger is not None:
        logger.log(step, metrics)
    return metrics
