"""The OpenAI Responses wire's server-sent events: a finished response told as the stream a Responses client reads.

A reply is sampled whole before anything is sent, so each output item goes out in one piece:
`response.created` and `response.in_progress` (the response with no output yet), then per item

    reasoning       output_item.added, content_part.added, reasoning_text.delta, reasoning_text.done,
                    content_part.done, output_item.done
    message         output_item.added, content_part.added, output_text.delta, output_text.done,
                    content_part.done, output_item.done
    function_call   output_item.added, function_call_arguments.delta, function_call_arguments.done,
                    output_item.done

and last `response.completed` (`response.incomplete` for a reply reported cut). Every event
carries its `sequence_number`. The official SDK accumulates exactly this order (it needs the
content part before its deltas), and Codex takes each item from its `output_item.done` and
ends the turn on `response.completed`. The last two events (the last item's
`output_item.done` and the terminal event) only close a stream whose content is already out.
"""

from __future__ import annotations

import json
from typing import Any

IN_PROGRESS = {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
"""What a response shows before its output (`response.created`, `response.in_progress`)."""


def response_events(response: dict) -> list[bytes]:
    """`response` (a finished Responses object) as the events of its stream."""
    events = _Events()
    opening = {**response, **IN_PROGRESS}
    events.add("response.created", response=opening)
    events.add("response.in_progress", response=opening)
    for index, item in enumerate(response["output"]):
        _item_events(events, index, item)
    terminal = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.add(terminal, response=response)
    return events.encoded


def failed_events(response: dict) -> list[bytes]:
    """A response that failed before any output (`status: "failed"` with its `error`): created, then failed.

    Codex acts on a context overflow only when it arrives this way, as `response.failed` with error
    code `context_length_exceeded` (it then compacts), not as an HTTP error."""
    events = _Events()
    events.add("response.created", response={**response, **IN_PROGRESS, "error": None})
    events.add("response.failed", response=response)
    return events.encoded


def _item_events(events: _Events, index: int, item: dict) -> None:
    kind, item_id = item["type"], item.get("id")
    where = {"item_id": item_id, "output_index": index}
    if kind == "function_call":
        events.add("response.output_item.added", output_index=index,
                   item={**item, "arguments": "", "status": "in_progress"})
        events.add("response.function_call_arguments.delta", **where, delta=item["arguments"])
        events.add("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
    else:
        events.add("response.output_item.added", output_index=index,
                   item={**item, "content": [], "status": "in_progress"})
        for content_index, part in enumerate(item["content"]):
            _part_events(events, {**where, "content_index": content_index}, part)
    events.add("response.output_item.done", output_index=index, item=item)


def _part_events(events: _Events, where: dict, part: dict) -> None:
    text = part["text"]
    if part["type"] == "reasoning_text":
        events.add("response.content_part.added", **where, part={**part, "text": ""})
        events.add("response.reasoning_text.delta", **where, delta=text)
        events.add("response.reasoning_text.done", **where, text=text)
    else:
        logprobs = part.get("logprobs") or []
        events.add("response.content_part.added", **where, part={**part, "text": "", "logprobs": []})
        events.add("response.output_text.delta", **where, delta=text, logprobs=logprobs)
        events.add("response.output_text.done", **where, text=text, logprobs=logprobs)
    events.add("response.content_part.done", **where, part=part)


class _Events:
    """Encoded SSE events, numbered in order."""

    def __init__(self):
        self.encoded: list[bytes] = []

    def add(self, kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": len(self.encoded), **fields}
        self.encoded.append(f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
