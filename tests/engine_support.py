"""Shared by the engine and deployment tests on CPU (`test_deploy.py`, `test_deployment_secret.py`,
`test_deploy_limits.py`, the prefix cache's) and on CUDA (`test_gpu.py`), and by the tests of what a raw connection
can hold open."""

import asyncio
import contextlib
import copy
import time

import torch

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import Engine, start_embedded_deployment
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config

LATE_S = 10.0
"""A server's deadline never fires early; on a loaded machine it may fire late, never this late."""


def reads(kv: torch.Tensor):
    """A `PrefixCache.add` reader of the keys/values `kv` (layers, 2, H, tokens, D): copies of its tokens[start:end]."""
    return lambda start, end: kv[:, :, :, start:end].clone()


def peaked_tiny(seed: int):
    """A tiny random Llama and its byte tokenizer whose logits are peaked: two seeds' models sample different
    greedy tokens."""
    torch.manual_seed(seed)
    config = tiny_config(260)
    config.initializer_range = 0.3
    model, tokenizer = load_model_and_tokenizer(config, device="cpu")
    return model.eval(), tokenizer


async def closed_after(host: str, port: int, sent: bytes) -> tuple[float, bytes]:
    """(seconds until the server closes a connection that sent `sent` and then nothing, everything it received);
    the client reads all the while."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(sent)
    await writer.drain()
    start, received = time.monotonic(), b""
    try:
        async with asyncio.timeout(LATE_S + 5):
            while chunk := await reader.read(1 << 16):
                received += chunk
    except ConnectionResetError:
        pass
    finally:
        writer.close()
    return time.monotonic() - start, received


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
