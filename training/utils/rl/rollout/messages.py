"""Token-in/token-out assembly of a multi-turn chat into one training sequence.

A multi-turn rollout must train on the tokens the policy actually produced. Re-rendering the
conversation with the chat template each turn would re-tokenize earlier assistant replies
(a reply that ends mid-word, or whose text tokenizes differently, changes ids) and some
templates rewrite history (drop earlier `<think>` blocks), so the trained sequence would no
longer be what was sampled. `ChatAssembler` instead grows one token sequence:

    turn 1 prompt = encode(template(messages, generation prompt))
    turn k prompt = turn k-1 prompt + sampled ids of turn k-1 + bridge ids

The bridge comes from the template itself, as the difference between two renders of the
conversation in which the last reply's content is a placeholder: `template(history)` and
`template(history + appended, generation prompt)`. The text after the placeholder in the
first render is how the reply ends (any rendered tool calls, then e.g. `<|im_end|>\\n`); in the
second it is that ending followed by the appended messages and the generation prompt, and
the bridge is the difference. The placeholder keeps the renders independent of what the
model wrote, so a template that strips reasoning from earlier replies, or renders a final
reply's header differently, still yields the right bridge. The bridge starts with the
part of the template's end-of-turn text that the sampled ids do not already hold: a reply
stopped by the EOS token holds its first token, a reply cut at `max_tokens` none of it.

Sampled ids get loss mask 1 and their logprobs; everything else (prompt, bridges) is
context with mask 0 and logprob 0.0. The stitched sequence keeps every reply verbatim, so
with a history-rewriting template it is what the model saw while sampling, not what a
fresh render of the final conversation would be. It raises `ChatTemplateError` (naming the
message index) when that cannot be made consistent: appended messages change how the messages
before the last reply render (e.g. a late system message hoisted to the front), the
reply ends differently once something follows it, the template does not render assistant
content verbatim, or the tokenizer does not round-trip the template's text.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jinja2

from training.utils.errors import RolloutContractError, TrainingError
from training.utils.rl.rollout.types import RolloutSample

if TYPE_CHECKING:
    from training.utils.deploy.completion import Completion

# Stands in for the last assistant reply in template renders: no whitespace at its ends (templates
# trim) and no `</think>` (templates split on it), so any template renders it verbatim.
_PLACEHOLDER = "ASSISTANT-REPLY-PLACEHOLDER-5d41"


class ChatAssemblyError(TrainingError, ValueError):
    """A conversation cannot be extended token-in/token-out; `message_index` names the message at fault."""

    def __init__(self, message: str, message_index: int | None = None):
        super().__init__(message)
        self.message_index = message_index


class HistoryRewriteError(ChatAssemblyError):
    """The messages of a later turn change or drop a message that is already part of the token sequence."""


class ChatTemplateError(ChatAssemblyError):
    """The chat template cannot render the appended messages as an extension of the earlier ones."""


class ChatAssembler:
    """One conversation's exact token sequence, extended turn by turn.

    Per turn: `prompt_ids(messages)` with the whole message list so far, sample from
    those ids, then `add_completion(completion)`, which returns the assistant message to
    append before the next user/tool/system messages. `to_sample(reward)` builds the
    training sample.
    """

    def __init__(self, tokenizer, *, tools: list[dict] | None = None, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.tools = tools
        """Tool schemas passed to the chat template on every render."""
        self.template_kwargs = template_kwargs
        """Extra template variables (e.g. `enable_thinking=False`), passed on every render."""
        self.history: list[dict] = []
        """Messages the token sequence covers, ending with the last sampled assistant message."""
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.versions: list[int] | None = []
        self.finish_reasons: list[str] = []
        """Finish reason of each sampled turn."""
        self._last_reply_ids: list[int] = []
        self._pending_messages: list[dict] | None = None
        self._pending_prompt: list[int] | None = None

    @property
    def num_turns(self) -> int:
        return len(self.finish_reasons)

    @property
    def pending_messages(self) -> list[dict] | None:
        """The messages of the last `prompt_ids` call while its reply is not yet added; else None."""
        return copy.deepcopy(self._pending_messages)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Prompt for the next turn: the whole conversation as token ids, ending in the generation prompt.

        `messages` is the full list so far: the earlier messages unchanged (with each assistant
        message returned by `add_completion`), then the new user/tool/system messages.
        Calling it again before `add_completion` replaces the pending prompt (e.g. a retry).
        """
        messages = copy.deepcopy(list(messages))
        if not messages:
            raise ChatAssemblyError("messages is empty; the first turn needs at least one message")
        if not self.history:
            prompt = self._encode(self._render(messages, generation_prompt=True, first_new=0))
        else:
            appended = self._appended_messages(messages)
            prompt = self.tokens + self._encode(self._bridge_text(appended))
        self._pending_messages, self._pending_prompt = messages, prompt
        return list(prompt)

    def add_completion(self, completion: Completion, message: dict | None = None) -> dict:
        """Record the sampled reply to the pending prompt; return the assistant message for the history.

        `completion` is a `Completion` from `setup.sampler` (or anything with its fields); its
        `prompt_ids`, when not empty, must be the pending prompt. `message` is the assistant message as
        the conversation should hold it (e.g. with parsed `tool_calls`); by default the decoded
        reply. Either way the sampled ids themselves are what enters the token sequence.
        """
        if self._pending_prompt is None:
            raise ChatAssemblyError("add_completion called without a pending prompt; call prompt_ids(messages) first")
        output_ids = [int(t) for t in completion.output_ids]
        logprobs = [float(x) for x in completion.logprobs]
        if len(output_ids) != len(logprobs):
            raise RolloutContractError(
                f"completion has {len(output_ids)} output_ids but {len(logprobs)} logprobs"
            )
        if completion.prompt_ids and list(completion.prompt_ids) != self._pending_prompt:
            raise RolloutContractError(
                "completion.prompt_ids differ from the prompt prompt_ids() returned; "
                "sample from exactly the ids the assembler handed out"
            )
        if message is None:
            message = {"role": "assistant", "content": self.tokenizer.decode(output_ids, skip_special_tokens=True)}
        elif message.get("role") != "assistant":
            raise ChatAssemblyError(f"message must have role 'assistant', got {message.get('role')!r}")
        self._commit(output_ids, logprobs, completion.versions)
        self.finish_reasons.append(str(completion.finish_reason))
        self.history = self._pending_messages + [copy.deepcopy(message)]
        self._pending_messages = self._pending_prompt = None
        return copy.deepcopy(message)

    def to_sample(self, reward: float, **metadata: Any) -> RolloutSample:
        """The conversation as one training segment: mask 1 and logprobs exactly on sampled tokens."""
        if not self.num_turns:
            raise ChatAssemblyError("to_sample called before any completion was added")
        return RolloutSample(
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            loss_mask=list(self.loss_mask),
            reward=float(reward),
            finish_reason=self.finish_reasons[-1],
            text=self.history[-1].get("content") or "",
            versions=list(self.versions) if self.versions is not None else None,
            metadata={"num_turns": self.num_turns, "finish_reasons": list(self.finish_reasons), **metadata},
        )

    # ------------------------------------------------------------------ internals

    def _commit(self, output_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        context = self._pending_prompt[len(self.tokens):]
        self.tokens = self._pending_prompt + output_ids
        self._last_reply_ids = output_ids
        self.logprobs += [0.0] * len(context) + logprobs
        self.loss_mask += [0] * len(context) + [1] * len(output_ids)
        if self.versions is not None and len(versions) == len(output_ids):
            self.versions += [-1] * len(context) + [int(v) for v in versions]
        else:
            self.versions = None  # a turn without per-token versions: report none rather than guess

    def _appended_messages(self, messages: list[dict]) -> list[dict]:
        """The messages after the history, once the history is checked to be unchanged."""
        for i, old in enumerate(self.history):
            if i >= len(messages):
                raise HistoryRewriteError(
                    f"messages has {len(messages)} entries but the conversation already holds {len(self.history)}; "
                    f"messages[{i}] (role {old.get('role')!r}) was dropped. Turns already sampled cannot be removed",
                    i,
                )
            if messages[i] != old:
                raise HistoryRewriteError(
                    f"messages[{i}] (role {messages[i].get('role')!r}) differs from the message at that index in "
                    f"the conversation so far (role {old.get('role')!r}); earlier messages are already fixed token "
                    "ids, so a later turn may only append messages",
                    i,
                )
        appended = messages[len(self.history):]
        if not appended:
            raise ChatAssemblyError(
                f"messages adds nothing after the last assistant reply (messages[{len(messages) - 1}]); "
                "append the next user, tool or system message",
                len(messages) - 1,
            )
        for i, m in enumerate(appended, start=len(self.history)):
            if m.get("role") == "assistant":
                raise ChatAssemblyError(
                    f"messages[{i}] is an assistant message that was not sampled in this conversation; "
                    "only user, tool and system messages can be appended (assistant replies enter through "
                    "add_completion)",
                    i,
                )
        return appended

    def _bridge_text(self, appended: list[dict]) -> str:
        """Template text from the end of the sampled reply through the next generation prompt.

        Only the text after the reply's content is used: the template may render the reply's
        header differently once it is no longer the last message (reasoning templates add an
        empty think block to a final reply), which does not matter because the sampled ids
        stand in for the whole reply.
        """
        first_new = len(self.history)
        earlier, last_reply = self.history[:-1], self.history[-1]
        # The reply keeps its other fields (tool_calls) so tool messages render as they follow it.
        context = earlier + [{**last_reply, "content": _PLACEHOLDER}]
        _, tail_before = self._split_at_reply(self._render(context, generation_prompt=False, first_new=first_new))
        head_after, tail_after = self._split_at_reply(
            self._render(context + appended, generation_prompt=True, first_new=first_new)
        )
        history = self._history_text(earlier, first_new)
        if not head_after.startswith(history):
            at = _first_difference(history, head_after)
            raise ChatTemplateError(
                f"appending messages[{first_new}:] changes how the chat template renders messages[:{first_new - 1}] "
                f"(first difference at character {at}: {history[at:at + 40]!r} became {head_after[at:at + 40]!r}); "
                "such a template cannot be extended token-in/token-out",
                first_new,
            )
        if not tail_after.startswith(tail_before):
            raise ChatTemplateError(
                f"the chat template ends assistant message messages[{first_new - 1}] with {tail_before[:40]!r} when "
                f"it is the last message but with {tail_after[:40]!r} once messages[{first_new}:] follow; the "
                "tokens after the sampled reply are ambiguous",
                first_new,
            )
        closing = self._closing_text(earlier, first_new)
        if not tail_before.endswith(closing):
            raise ChatTemplateError(
                f"the chat template ends assistant message messages[{first_new - 1}] with {tail_before[-40:]!r}, "
                f"not with its plain end-of-turn text {closing!r}; the tokens after the sampled reply are ambiguous",
                first_new - 1,
            )
        return self._unsampled_part(closing) + tail_after[len(tail_before):]

    def _history_text(self, earlier: list[dict], first_new: int) -> str:
        """The render of the messages before the last reply, up to where that reply's turn starts.

        The common prefix of rendering them with and without the generation prompt, which
        drops any text a template writes only at the very end of a conversation.
        """
        closed = self._render(earlier, generation_prompt=False, first_new=first_new)
        opened = self._render(earlier, generation_prompt=True, first_new=first_new)
        return closed[: _first_difference(closed, opened)]

    def _closing_text(self, earlier: list[dict], first_new: int) -> str:
        """What the template writes after a plain assistant reply's content, e.g. `<|im_end|>\\n`."""
        plain_reply = {"role": "assistant", "content": _PLACEHOLDER}
        rendered = self._render(earlier + [plain_reply], generation_prompt=False, first_new=first_new)
        return self._split_at_reply(rendered)[1]

    def _split_at_reply(self, rendered: str) -> tuple[str, str]:
        """The render before and after the placeholder standing in for the last reply's content."""
        if rendered.count(_PLACEHOLDER) != 1:
            raise ChatTemplateError(
                f"the chat template does not render the content of assistant message "
                f"messages[{len(self.history) - 1}] verbatim, so where the sampled reply ends in its render is unknown",
                len(self.history) - 1,
            )
        head, tail = rendered.split(_PLACEHOLDER)
        return head, tail

    def _unsampled_part(self, closing: str) -> str:
        """The end of `closing` that the last reply's sampled ids do not already contain.

        A reply stopped by EOS usually ends with the closing's first token (`<|im_end|>`);
        one cut at max_tokens contains none of it, so the whole closing is context.
        """
        if self.finish_reasons[-1] != "stop":
            return closing
        closing_ids = self.tokenizer.encode(closing, add_special_tokens=False)
        reply_ids = self._last_reply_ids
        for k in range(min(len(closing_ids), len(reply_ids)), 0, -1):
            if reply_ids[-k:] == closing_ids[:k]:
                covered = self.tokenizer.decode(closing_ids[:k], skip_special_tokens=False)
                if closing.startswith(covered):
                    return closing[len(covered):]
        return closing

    def _render(self, messages: list[dict], *, generation_prompt: bool, first_new: int) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, tools=self.tools,
                **self.template_kwargs,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(
                f"the chat template failed to render messages[:{len(messages)}] "
                f"(new messages start at messages[{first_new}]): {e}",
                first_new,
            ) from e

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        decoded = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if decoded != text:
            raise ChatTemplateError(
                f"the tokenizer does not round-trip the template text {text[:60]!r} (decodes to "
                f"{decoded[:60]!r}); token-level stitching needs encode/decode to be exact"
            )
        return ids


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
