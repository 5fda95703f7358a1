"""Shared by the engine and deployment tests on CPU (`test_deploy.py`, `test_deployment_secret.py`) and on CUDA
(`test_gpu.py`)."""

import asyncio
import contextlib
import copy

from training.utils.config import DeploymentConfig
from training.utils.deploy import Engine, start_embedded_deployment


def greedy_and_sampled(model, tokenizer, cfg: DeploymentConfig, prompts, max_tokens, *, sampled_rows: int,
                       sampled_tokens: int):
    """Every prompt greedily (its own max_tokens), then the first `sampled_rows` sampled at T=0.7 with
    seeds, all concurrently through one engine on a copy of `model`; returns (greedy, sampled, stats)."""

    async def main():
        engine = Engine(copy.deepcopy(model), tokenizer, cfg)
        try:
            greedy = await asyncio.gather(*[engine.generate(p, max_tokens=n, temperature=0)
                                            for p, n in zip(prompts, max_tokens)])
            sampled = await asyncio.gather(*[engine.generate(p, max_tokens=sampled_tokens, temperature=0.7, seed=i)
                                             for i, p in enumerate(prompts[:sampled_rows])])
        finally:
            engine.close()
        return greedy, sampled, dict(engine.stats)

    return asyncio.run(main())


@contextlib.asynccontextmanager
async def deployed(model, tokenizer, *, model_name: str = "tiny", **cfg):
    """An embedded deployment serving a copy of `model` under `DeploymentConfig(**cfg)`, closed on exit."""
    dep = await start_embedded_deployment(
        copy.deepcopy(model), tokenizer, DeploymentConfig(**cfg), model_name=model_name, sampling_timeout_s=60
    )
    try:
        yield dep
    finally:
        await dep.close()
