"""What a wire format declares to the server, and the server interface its route handlers call.

Each wire module (`wire_anthropic.py`, `wire_openai.py`) declares one `WireFormat` named `WIRE`,
and `server.WIRE_FORMATS` lists them: the server builds its app from that registry alone, so a
new wire format is a new module plus one registry entry.

A route handler is `async (server, request) -> response`. It raises `WireError` for anything the
client should hear about; the server answers it in the error shape of the wire the route belongs
to. A model call goes through `server.model_call(request, codec)` (`model_call_route` makes such a
route), which runs the flow shared by every wire (session lookup, queueing, sampling, recording
the turn) and uses the wire's `TurnCodec` only to translate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

if TYPE_CHECKING:
    from training.utils.rl.agent.chat_format import ChatFormat
    from training.utils.rl.agent.chat_request import ChatRequest
    from training.utils.rl.agent.session import ShimSession


class WireServer(Protocol):
    """The part of `AgentShim` that route handlers use."""

    chat_format: ChatFormat

    def session_for(self, request: web.Request) -> ShimSession:
        """The open session whose key the request presents; a WireError 401 otherwise."""

    async def count_tokens(self, request: web.Request, parse: Callable[[Any], ChatRequest]) -> int:
        """The prompt tokens of the request body as `parse` translates it, counted off the event loop; a WireError
        (400, 408, 413) for a bad body."""

    async def model_call(self, request: web.Request, codec: TurnCodec) -> web.StreamResponse:
        """Answer a model request in the session's queue and record the turn."""


RouteHandler = Callable[[WireServer, web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: RouteHandler


@dataclass(frozen=True)
class TurnCodec:
    """How one wire format's model call translates between its bodies and the shim's chat requests and replies."""

    parse: Callable[[Any], ChatRequest]
    """request body -> ChatRequest (a WireError names the bad field)"""
    respond: Callable[..., dict]
    """(parsed, response_id, *, model, finish_reason, prompt_tokens, output_tokens, stop_sequence, token_logprobs)
    -> response body. `finish_reason` is what the client is told ("stop" or "length", `server.reported_finish`),
    `stop_sequence` the client's stop sequence that ended the reply (or None), `token_logprobs` the (text,
    logprob) of each sampled token when the client asked for them (else None)."""
    stream: Callable[[dict, ChatRequest], list[bytes]]
    """(response, the request it answers) -> stream events; the last two close the stream (Anthropic
    message_delta + message_stop, OpenAI finish or usage chunk + [DONE]), everything before them is the reply's
    content"""
    echo: Callable[[dict], dict]
    """response -> the assistant chat message a client sends back for it"""
    new_id: Callable[[], str]
    """a fresh response id"""


def default_overflow_message(prompt_tokens: int, limit: int) -> str:
    """The shim's own wording of a context overflow (OpenAI's `context_length_exceeded` states both numbers)."""
    return (f"the prompt is {prompt_tokens} tokens, which leaves no room to generate within the context limit of "
            f"{limit} tokens (agent_shim.max_context_tokens); shorten or compact the conversation")


@dataclass(frozen=True)
class WireFormat:
    """One wire format: the routes it serves, its error shape, and the paths that answer in that shape."""

    name: str
    prefix: str
    """Paths starting with it answer an unknown route or method, or an internal error, in this wire's shape.
    The longest matching prefix wins; one wire must claim "/" (every other path)."""
    routes: tuple[Route, ...]
    error_body: Callable[..., dict]
    """(status, message, *, param, code) -> the JSON error body"""
    overflow_message: Callable[[int, int], str] = default_overflow_message
    """(prompt tokens, context limit) -> the message of the 400 for a prompt that leaves no room to generate
    (code "context_length_exceeded"): clients recognise an overflow by the wording their provider uses"""

    def error_response(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> web.Response:
        return web.json_response(self.error_body(status, message, param=param, code=code), status=status)


def model_call_route(path: str, codec: TurnCodec) -> Route:
    """A `POST path` route that answers model requests through the server's shared flow, translated by `codec`."""

    async def model_call(server: WireServer, request: web.Request) -> web.StreamResponse:
        return await server.model_call(request, codec)

    return Route("POST", path, model_call)
