"""Shared pieces of the agent-shim tests: a tiny deployment, a spying sampler, exact-token checks.

The tiny random model writes bytes at random (often invalid UTF-8), which is what makes it a
good test of token-exact recording: re-encoding its decoded text would not give its ids back.
Turns that must hold a tool call get a scripted reply: the deployment still samples (so the
prompt echo and affinity are real), then `SpySampler.script` swaps in the scripted output.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import torch

from training.utils.config.rl import AgentShimConfig, DeploymentConfig
from training.utils.deploy import Completion, start_embedded_deployment
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.rl.agent import AgentShim

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ASSISTANT_HEADER = f"{IM_START}assistant\n"
CALL_TEXT = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
"""A Hermes tool call the scripted model replies with: one `read_file` of a.txt."""


def make_tiny(seed: int = 0):
    """Tiny random Llama + byte tokenizer; EOS never wins, so replies run to max_tokens ("length")."""
    torch.manual_seed(seed)
    config = tiny_config(260)
    config.initializer_range = 0.3
    model, tokenizer = load_model_and_tokenizer(config, device="cpu")
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    return model.eval(), tokenizer


class SpySampler:
    """Wraps the deployment's sampler: records every call and its answer; can delay, fail or script it."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[dict[str, Any]] = []
        """Per call: prompt_ids, kwargs (max_tokens, temperature, user, ...), completion (what the shim got)."""
        self.script: Callable[[int, Completion], Completion] | None = None
        self.delay = 0.0
        self.error: BaseException | None = None

    async def sample(self, prompt_ids, n=1, **kwargs):
        call = {"prompt_ids": list(prompt_ids), "kwargs": dict(kwargs), "completion": None}
        index = len(self.calls)
        self.calls.append(call)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        completions = await self.inner.sample(prompt_ids, n, **kwargs)
        if self.script is not None:
            completions = [self.script(index, c) for c in completions]
        call["completion"] = copy.deepcopy(completions[0])
        return completions

    def by_affinity(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for call in self.calls:
            out.setdefault(call["kwargs"]["user"], []).append(call)
        return out


def scripted(tokenizer, completion: Completion, text: str, *, eos: bool = True) -> Completion:
    """`completion` with its output replaced by `text` (+ EOS): distinct, valid logprobs, same prompt echo."""
    ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
    return dataclasses.replace(
        completion,
        output_ids=ids,
        logprobs=[-0.5 - 0.001 * i for i in range(len(ids))],
        versions=[0] * len(ids),
        finish_reason="stop" if eos else "length",
        text=text,
    )


@contextlib.asynccontextmanager
async def shim_stack(tiny, *, max_tokens: int = 8, temperature: float = 1.0, context_tokens: int = 1024,
                     **shim_cfg):
    """A real embedded deployment on the tiny model, a SpySampler on its sampler, and a started shim whose turns
    fit `context_tokens`."""
    model, tokenizer = tiny
    deployment = await start_embedded_deployment(
        copy.deepcopy(model), tokenizer, DeploymentConfig(), model_name="tiny", sampling_timeout_s=60
    )
    spy = SpySampler(deployment.sampler)
    sample_kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_p=1.0, top_k=0, stop=[], timeout=30)
    shim = AgentShim(spy, tokenizer, AgentShimConfig(**shim_cfg), sample_kwargs, model_name="tiny",
                     context_tokens=context_tokens)
    try:
        await shim.start()
        yield shim, spy
    finally:
        await shim.close()
        await deployment.close()


def chatml(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def bridge(previous: Completion, *appended: str) -> str:
    """Template text between a sampled reply and the next reply: the unsampled end of the reply's turn,
    the appended messages (ChatML text), the generation prompt."""
    closing = "\n" if previous.finish_reason == "stop" else f"{IM_END}\n"
    return closing + "".join(appended) + ASSISTANT_HEADER


def assert_chain(segment, calls: list[dict], bridges: list[str], tokenizer) -> None:
    """`segment` is calls[0]'s prompt, then each sampled output (mask 1, its logprobs) joined by the
    given bridge texts (mask 0, logprob 0.0); and each later prompt is exactly that sequence so far."""
    assert len(bridges) == len(calls) - 1
    assert segment.prompt_ids == calls[0]["prompt_ids"]
    response, mask, logprobs = [], [], []
    for k, call in enumerate(calls):
        if k:
            bridge_ids = tokenizer.encode(bridges[k - 1], add_special_tokens=False)
            assert call["prompt_ids"] == calls[0]["prompt_ids"] + response + bridge_ids, f"prompt of turn {k}"
            response += bridge_ids
            mask += [0] * len(bridge_ids)
            logprobs += [0.0] * len(bridge_ids)
        completion = call["completion"]
        response += completion.output_ids
        mask += [1] * len(completion.output_ids)
        logprobs += list(completion.logprobs)
    assert segment.response_ids == response
    assert segment.loss_mask == mask
    assert segment.logprobs == logprobs


def trained_tokens(segment) -> list[int]:
    return [t for t, m in zip(segment.response_ids, segment.loss_mask) if m]


def outputs(calls: list[dict], *indices: int) -> list[int]:
    return [t for i in indices for t in calls[i]["completion"].output_ids]


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def anthropic_client(session, **kw) -> anthropic.AsyncAnthropic:
    """The official Anthropic SDK pointed at a shim session, retries off (a test sees the first answer)."""
    return anthropic.AsyncAnthropic(base_url=session.base_url, api_key=session.key, max_retries=0, **kw)


def openai_client(session) -> openai.AsyncOpenAI:
    """The official OpenAI SDK pointed at a shim session, retries off."""
    return openai.AsyncOpenAI(base_url=session.base_url + "/v1", api_key=session.key, max_retries=0)
