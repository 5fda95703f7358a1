"""The wire-neutral request (`ChatRequest`) every wire format decodes into, and the errors a refused request raises.

Each wire format (`wire_<name>.py`) decodes a request body into one `ChatRequest` of
OpenAI-chat-like "chat messages":

    {"role": "system" | "user" | "assistant" | "tool", "content": str}
    assistant may add "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}]
                  and "reasoning_content": str
    tool adds "tool_call_id": str

A request the shim cannot take raises `WireError`, and one that leaves no room to generate
`ContextOverflowError`; the server answers either in the error shape of the wire it came in on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.utils.errors import TrainingError


class WireError(TrainingError, ValueError):
    """A request the shim answers with an error: HTTP `status` with the wire format's error body.

    `param` names the offending field as a path into the request body (`messages[3].content[0].input`);
    `code` is a machine-readable reason where the wire has one (e.g. "context_length_exceeded").
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def __reduce__(self):
        return (type(self), (str(self), self.status, self.param, self.code))


def overflow_message(prompt_tokens: int, limit: int) -> str:
    """The shim's own words for a prompt that leaves no room to generate; a wire whose clients act on their
    provider's words declares those instead (`WireFormat.overflow_message`)."""
    return (f"the prompt is {prompt_tokens} tokens, which leaves no room to generate within the context limit of "
            f"{limit} tokens (agent_shim.max_context_tokens); shorten or compact the conversation")


class ContextOverflowError(TrainingError, ValueError):
    """The prompt leaves no room to generate within `max_context_tokens` (HTTP 400, worded as the wire's clients
    expect)."""

    def __init__(self, message: str, prompt_tokens: int = 0, limit: int = 0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    def __reduce__(self):
        return (type(self), (str(self), self.prompt_tokens, self.limit))

    def note(self) -> str:
        """Appended to the wire's overflow message; empty when `prompt_tokens` is the exact count."""
        return ""


@dataclass(frozen=True)
class UnseenPart:
    """A content part the text-only prompt cannot carry (an image, a document, audio, ...), where it was sent."""

    where: str
    """Its path in the request body, e.g. `messages[2].content[1]`."""
    kind: str
    """Its type, e.g. `image`, `document`, `image_url`."""
    noun: str
    """What the wire calls a content entry: "block" (Anthropic) or "part" (OpenAI)."""


def unseen_placeholder(kind: str) -> str:
    """The text an unseen part becomes when `agent_shim.unseen_content="placeholder"`."""
    return f"[{kind} omitted]"


def refuse_unseen(unseen: list[UnseenPart]) -> None:
    """A WireError 400 naming the first part the model could not see; nothing when there is none."""
    if not unseen:
        return
    first = unseen[0]
    more = f" (and {len(unseen) - 1} more such part(s))" if len(unseen) > 1 else ""
    raise WireError(
        f"{first.where}: {first.kind} {first.noun}s are not supported: the model reads text only and would never "
        f"see this content{more}. Send it as text, or start the shim with agent_shim.unseen_content='placeholder' "
        f"to replace each with {unseen_placeholder(first.kind)!r}",
        param=first.where,
    )


@dataclass
class ChatRequest:
    """One model request in wire-neutral form."""

    system: str | None
    """Leading system text (Anthropic `system`, or OpenAI messages[0] when its role is system/developer)."""
    messages: list[dict]
    """Chat messages after the leading system one; later system messages are already folded into user ones."""
    tools: list[dict]
    """OpenAI function schemas `{"type": "function", "function": {"name", "description", "parameters"}}`."""
    max_tokens: int | None
    """The client's output cap (Anthropic max_tokens; OpenAI max_completion_tokens or max_tokens)."""
    stop: list[str]
    """The client's stop sequences."""
    stream: bool
    model: str
    unseen: list[UnseenPart] = field(default_factory=list)
    """Content parts that became placeholders (`refuse_unseen` turns them into a 400)."""
    logprobs: bool = False
    """OpenAI `logprobs: true`: the reply carries the sampled tokens' logprobs."""
    include_usage: bool = False
    """OpenAI `stream_options.include_usage`: a stream ends with a usage chunk (`choices: []`)."""


def system_reminder(text: str) -> dict:
    """A system message that is not the first one, folded in place into a user message.

    Folding (rather than hoisting it into the leading system text) keeps every earlier message
    and so the rendered prefix unchanged.
    """
    return {"role": "user", "content": f"<system-reminder>\n{text}\n</system-reminder>"}
