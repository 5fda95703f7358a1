"""The cookbook's single-turn helpers, on our sampler and the tokenizer's chat template.

Published cookbook rollouts get their sampler from `build_deployment_sampler(setup)`, a renderer from
`build_renderer(tokenizer, tokenizer_id)`, and run `single_turn_renderer_rollout(row, renderer=...,
sample_with_prompt_tokens=..., message_builder=..., reward_fn=...)`; the cookbook's `rl_loop` samples each row's
`messages` and scores them with a `reward_fn(completion_text, row)`. These are those names here: the renderer is the
tokenizer's chat template, sampling is `setup.sampler`, and what they return is our `RolloutRun`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from training.utils.errors import RolloutContractError
from training.utils.rl.rollout.types import RolloutRun, RolloutSetup, sample_from_completion


def build_deployment_sampler(setup: RolloutSetup) -> Any:
    """The sampler bound to the run's deployment: `setup.sampler`."""
    return setup.sampler


def get_text_content(message: Any) -> str:
    """A message's text: its `content` string, or the text parts of a content list joined."""
    content = message.get("content", "") if isinstance(message, dict) else message
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type") == "text")
    return "" if content is None else str(content)


class ChatRenderer:
    """The cookbook's renderer interface over a tokenizer's chat template."""

    def __init__(self, tokenizer: Any, name: str | None = None, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.name = name or getattr(tokenizer, "name_or_path", "")
        self.template_kwargs = template_kwargs

    def build_generation_prompt(self, messages: list[dict], **_: Any) -> list[int]:
        """The prompt's token ids: the chat template with the generation prompt, encoded without extra specials."""
        for i, message in enumerate(messages):
            if not isinstance(message.get("content", ""), str | None) and any(
                    isinstance(p, dict) and p.get("type") != "text" for p in message["content"]):
                raise RolloutContractError(f"messages[{i}] holds non-text content; policies here are text-only")
        plain = [{**m, "content": get_text_content(m)} for m in messages]
        text = self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True,
                                                  **self.template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def parse_response(self, tokens: list[int]) -> tuple[dict, bool]:
        """The reply as an assistant message, and whether it ended with the end-of-turn token (not cut off)."""
        eos = self.tokenizer.eos_token_id
        ended = bool(tokens) and eos is not None and tokens[-1] == eos
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return {"role": "assistant", "content": text}, ended

    def get_stop_sequences(self) -> list[str]:
        """None beyond the tokenizer's end-of-turn token, which always stops the engine."""
        return []


def build_renderer(tokenizer: Any, tokenizer_id: str | None = None, renderer_name: str | None = None,
                   **template_kwargs: Any) -> ChatRenderer:
    """A renderer for `tokenizer`: its own chat template (`renderer_name` picks nothing else here)."""
    return ChatRenderer(tokenizer, tokenizer_id or renderer_name, **template_kwargs)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def single_turn_renderer_rollout(row: Any, *, renderer: Any, sample_with_prompt_tokens: Callable,
                                       message_builder: Callable, reward_fn: Callable,
                                       sample_kwargs: dict[str, Any] | None = None, tokenizer: Any = None,
                                       max_tokens: int | None = None, stop: list[str] | None = None,
                                       sample_with_vision: Callable | None = None, **_endpoint: Any
                                       ) -> RolloutRun | None:
    """One rendered prompt, one sample, `reward_fn(row, parsed_message, parse_success)`: a one-segment run, or None
    when the reward is None or nothing was sampled. `sample_with_vision` and the endpoint arguments
    (`inference_base_url`, `api_key`, `deployment_model`) are for image prompts, which text-only policies never
    send; a prompt with images is refused by the renderer."""
    messages = await _maybe_await(message_builder(row))
    prompt_ids = renderer.build_generation_prompt(messages)
    kwargs = dict(sample_kwargs or {})
    kwargs["n"] = 1
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    stops = renderer.get_stop_sequences() if stop is None else stop
    if stops:
        kwargs["stop"] = [s if isinstance(s, str) else tokenizer.decode([s], skip_special_tokens=False)
                          for s in stops]
    completions = await sample_with_prompt_tokens(prompt_ids, **kwargs)
    if not completions:
        return None
    completion = completions[0]
    output_ids = list(completion.full_tokens[completion.prompt_len:])
    if not output_ids:
        return None
    parsed, success = renderer.parse_response(output_ids)
    reward = await _maybe_await(reward_fn(row, parsed, bool(success)))
    if reward is None:
        return None
    sample = sample_from_completion(list(completion.full_tokens[:completion.prompt_len]), output_ids,
                                    list(completion.sampling_logprobs), float(reward),
                                    finish_reason=completion.finish_reason, text=completion.text)
    return RolloutRun(segments=[sample])


async def sample_vision_completion(**_: Any) -> Any:
    """Image prompts: not possible with the text-only policies trained here (a named error, never a sample)."""
    raise RolloutContractError("sample_vision_completion: image prompts need a vision-language policy; policies "
                               "here are text-only (render the prompt as text)")


def message_rollout_factory(reward_fn: Callable[[str, dict], float]) -> Callable[[RolloutSetup], Callable]:
    """The cookbook `rl_loop`'s own rollout: each row's `messages` through the chat template, one sample per draw,
    reward `reward_fn(completion_text, row)`."""

    def make_rollout_fn(setup: RolloutSetup) -> Callable:
        renderer = build_renderer(setup.tokenizer)

        async def rollout_fn(row: dict) -> RolloutRun | None:
            if not row.get("messages"):
                raise RolloutContractError("rl_loop's built-in rollout reads each row's `messages` (a chat); this "
                                           "row has none. Give main() a rollout_fn_factory for rows of other shapes")
            return await single_turn_renderer_rollout(
                row, renderer=renderer, sample_with_prompt_tokens=setup.sampler.sample_with_prompt_tokens,
                message_builder=lambda r: r["messages"], sample_kwargs=setup.sample_kwargs, tokenizer=setup.tokenizer,
                reward_fn=lambda r, message, _ok: reward_fn(get_text_content(message), r))

        return rollout_fn

    return make_rollout_fn
