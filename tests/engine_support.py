"""Shared by the engine tests on CPU (`test_deploy.py`) and on CUDA (`test_gpu.py`)."""

import asyncio
import copy

from training.utils.config import DeploymentConfig
from training.utils.deploy import Engine


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
