"""What a wire format declares to the server: its routes, the codec of its model calls, its error shape and prefix.

Each wire module (`wire_<name>.py`) declares one `WireFormat` named `WIRE`, and
`server.WIRE_FORMATS` lists them: the server builds its app from that registry alone, so a new
wire format is a new module plus one registry entry.

A model call is a route with a `TurnCodec` (`model_call_route`), or with a function that makes one
for the request's session (`session_codec`: the Responses wire seals reasoning to its session): the
server answers it with the flow every wire shares (`model_call.py`) and uses the codec only at the
two ends, to decode the request body into a `ChatRequest` and to encode the reply; the codec never
calls the server. A token-count route (`count_tokens_route`, Anthropic's `count_tokens`) has a
`TokenCount`: the server decodes the body with it, counts the prompt, and has it shape the answer.
Any other route has a handler of its own, `async (server, request) -> response`, calling the
`WireServer` interface.
Whatever the shim refuses (`WireError`, `ContextOverflowError`) is answered in the error shape of
the wire the route belongs to.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from training.utils.rl.agent.chat_request import overflow_message

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
    overflow: Callable[[str], web.StreamResponse | None] | None = None
    """(the wire's overflow message) -> the answer to a request whose prompt leaves no room to generate, or None
    for the wire's 400 (the Responses wire answers a stream with a `response.failed` event, where Codex looks)"""


@dataclass(frozen=True)
class TokenCount:
    """How one wire format's token-count route decodes its body and shows the count."""

    parse: Callable[[Any], ChatRequest]
    """request body -> ChatRequest (a WireError names the bad field)"""
    respond: Callable[[int], dict]
    """the prompt's tokens -> the response body"""


@dataclass(frozen=True)
class Route:
    """One route of a wire format: a model call, decoded and encoded by `codec` (or by the codec `session_codec`
    makes for the request's session key) and answered by the server's shared flow, or a route of the wire's own,
    answered by `handler`."""

    method: str
    path: str
    handler: RouteHandler | None = None
    codec: TurnCodec | None = None
    session_codec: Callable[[str], TurnCodec] | None = None
    count: TokenCount | None = None
    """A token-count route's decoder and answer (`count_tokens_route`)."""

    def __post_init__(self):
        if sum(kind is not None for kind in (self.handler, self.codec, self.session_codec, self.count)) != 1:
            raise ValueError(f"route {self.method} {self.path}: give it a handler or a codec (a model call), not both")


def model_call_route(path: str, codec: TurnCodec) -> Route:
    """A `POST path` route that answers model requests through the server's shared flow, translated by `codec`."""
    return Route("POST", path, codec=codec)


def count_tokens_route(path: str, count: TokenCount) -> Route:
    """A `POST path` route that answers with the prompt tokens of the body `count` decodes."""
    return Route("POST", path, count=count)


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
    overflow_param: str = "messages"
    """The request field that 400 names: where the wire's conversation is."""

    def error_response(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> web.Response:
        return web.json_response(self.error_body(status, message, param=param, code=code), status=status)
