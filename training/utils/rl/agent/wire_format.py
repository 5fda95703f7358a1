"""What a wire format declares to the server: its routes, the codec of its model calls, its error shape and prefix.

Each wire module (`wire_<name>.py`) declares one `WireFormat` named `WIRE`, and
`server.WIRE_FORMATS` lists them: the server builds its app from that registry alone, so a new
wire format is a new module plus one registry entry.

A model call is a route with a `TurnCodec` (`model_call_route`): the server answers it with the
flow every wire shares (`model_call.py`) and uses the codec only at the two ends, to decode the
request body into a `ChatRequest` and to encode the reply. Any other route (`count_tokens`) has a
handler of its own, `async (server, request) -> response`, calling the `WireServer` interface.
Whatever the shim refuses (`WireError`, `ContextOverflowError`) is answered in the error shape of
the wire the route belongs to.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from training.utils.rl.agent.chat_request import overflow_message
from training.utils.rl.agent.reply import ClientReply, WireReply

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
        """The prompt tokens of the request body as `parse` decodes it, counted off the event loop; a WireError
        (400, 408, 413) for a bad body."""

    async def model_call(self, request: web.Request, codec: TurnCodec) -> web.StreamResponse:
        """Answer a model request in the session's queue and record the turn."""


RouteHandler = Callable[[WireServer, web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class TurnCodec:
    """How one wire format's model call translates between its bodies and the shim's chat requests and replies."""

    parse: Callable[[Any], ChatRequest]
    """request body -> ChatRequest (a WireError names the bad field)"""
    respond: Callable[..., dict]
    """(parsed, response_id, *, model, finish_reason, prompt_tokens, output_tokens, stop_sequence, token_logprobs)
    -> response body. `finish_reason` is what the client is told ("stop" or "length", `reply.reported_finish`),
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

    def encode(self, reply: ClientReply, request: ChatRequest, *, model: str, prompt_tokens: int,
               output_tokens: int) -> WireReply:
        """`reply` as this wire sends it: its body, its stream events when `request` streams, and its echo."""
        response_id = self.new_id()
        body = self.respond(
            reply.parsed, response_id, model=model, finish_reason=reply.finish_reason,
            stop_sequence=reply.stop_sequence, token_logprobs=reply.token_logprobs,
            prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        )
        events = self.stream(body, request) if request.stream else None
        return WireReply(response_id, body, self.echo(body), events)


@dataclass(frozen=True)
class Route:
    """One route of a wire format: a model call, decoded and encoded by `codec` and answered by the server's shared
    flow, or a route of the wire's own, answered by `handler`."""

    method: str
    path: str
    handler: RouteHandler | None = None
    codec: TurnCodec | None = None

    def __post_init__(self):
        if (self.handler is None) == (self.codec is None):
            raise ValueError(f"route {self.method} {self.path}: give it a handler or a codec (a model call), not both")


def model_call_route(path: str, codec: TurnCodec) -> Route:
    """A `POST path` route that answers model requests through the server's shared flow, translated by `codec`."""
    return Route("POST", path, codec=codec)


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
    overflow_message: Callable[[int, int], str] = overflow_message
    """(prompt tokens, context limit) -> the message of the 400 for a prompt that leaves no room to generate
    (code "context_length_exceeded"): clients recognise an overflow by the wording their provider uses"""

    def error_response(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> web.Response:
        return web.json_response(self.error_body(status, message, param=param, code=code), status=status)
