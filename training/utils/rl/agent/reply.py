"""What the client is told about a sampled reply: its text, why it ended, and its tokens' logprobs.

The recorded turn always holds exactly what was sampled; only the client's view is shaped here:

- A stop string ended the reply (finish "stop"): the sampled ids hold everything up to and
  including the token that completed the string, and the decoded text may go on past the string
  within that token. When the string is one of the client's own stop sequences, the client gets
  the text before it, with the sequence named (Anthropic `stop_reason: "stop_sequence"`, OpenAI
  `finish_reason: "stop"`). The trainer's own `sampling.stop` strings are not the client's
  business: the text keeps them and the reply is an ordinary end of turn, so an echo of it
  renders what was sampled.
- A reply cut at max_tokens (finish "length") is reported as cut (`max_tokens` / `length`) when
  the client's own max_tokens set the limit; a cut by a limit the client did not ask for (the
  trainer's `sampling.max_tokens`, or the context left) is reported as
  `agent_shim.report_trainer_cap_as` says.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.utils.rl.agent.chat_format import ChatFormat
from training.utils.rl.agent.chat_request import ChatRequest
from training.utils.rl.agent.hermes import ParsedOutput, parse_assistant_text
from training.utils.rl.rollout.stitching import TurnRecord


@dataclass
class ClientReply:
    """A sampled reply as the wire response shows it."""

    parsed: ParsedOutput
    finish_reason: str
    """"stop" or "length": what the client is told, not necessarily what the turn records."""
    stop_sequence: str | None
    """The client's stop sequence that ended the reply, or None."""
    token_logprobs: list[tuple[str, float]] | None
    """(text, logprob) of each sampled token before the end of turn, when the client asked (OpenAI `logprobs`)."""


def client_reply(
    chat_format: ChatFormat, record: TurnRecord, request: ChatRequest, *, limited_by: str,
    trainer_stop: list[str], report_trainer_cap_as: str,
) -> ClientReply:
    """The client's view of `record`, the turn sampled for `request` with max_tokens set by `limited_by`
    ("client", "trainer" or "context") and stop strings `trainer_stop` + `request.stop`."""
    text = chat_format.reply_text(record.output_ids)
    stop_sequence = None
    if record.finish_reason == "stop":
        text, stop_sequence = cut_at_client_stop(text, request.stop, trainer_stop)
    token_logprobs = None
    if request.logprobs:
        token_logprobs = list(zip(chat_format.token_texts(record.output_ids), record.output_logprobs))
    finish = reported_finish(record.finish_reason, limited_by, report_trainer_cap_as)
    return ClientReply(parse_assistant_text(text), finish, stop_sequence, token_logprobs)


def cut_at_client_stop(text: str, client_stop: list[str], trainer_stop: list[str]) -> tuple[str, str | None]:
    """`text` before the stop string that ended it, and that string, when it is one of the client's.

    The string that ended sampling is the one whose first occurrence ends first (the engine checks
    after every token); a trainer-only string leaves the text whole and names nothing.
    """
    found = []
    for stop in {*client_stop, *trainer_stop}:
        start = text.find(stop)
        if start >= 0:
            found.append((start + len(stop), start, stop))
    if not found:
        return text, None
    _, start, matched = min(found)
    if matched not in client_stop:
        return text, None
    return text[:start], matched


def reported_finish(finish_reason: str, limited_by: str, report_trainer_cap_as: str) -> str:
    """"length" for a reply cut at a limit the client set (or when cuts are reported as they are), else "stop"."""
    if finish_reason != "length":
        return "stop"
    if limited_by == "client" or report_trainer_cap_as == "max_tokens":
        return "length"
    return "stop"


@dataclass(frozen=True)
class WireReply:
    """A reply encoded by one wire format, and what its client will send back for it."""

    response_id: str
    body: dict
    """The JSON response."""
    echo: dict
    """The assistant chat message the client sends back for this reply, which later requests are matched on."""
    events: list[bytes] | None
    """The stream events when the request asked to stream, else None; the last two only close the stream."""
