"""Deadlines on the client connections of the library's HTTP servers (the embedded deployment's, the agent shim's).

An agent under training may have a shell on this machine, so a client can be anything, and
aiohttp's server bounds few of the ways one can hold a connection open for nothing: its
keep-alive timer (`keepalive_timeout`, an hour by default) closes an idle connection, and only
recent releases also close one that never sends a complete request; nothing bounds a client
that stops taking a reply. `ClientDeadlines` serves an app with each connection's protocol
wrapped (`serve`) and bounds, version-independently, each state a client can leave it in:

- waiting for a request: a connection must send a complete request's headers within
  `timeout_s` of opening, or of the end of its previous request's handler (idle keep-alive
  connections, headers that never complete);
- taking a reply: a client that takes nothing it was sent for `timeout_s` (the socket's buffers
  full, so asyncio pauses writing) is cut off, and the handler waiting to write wakes with a
  `ConnectionError`;
- sending a body: only the handler knows when it has read enough, so each server reads its
  bodies under a deadline (`read_body`).

A connection past a deadline is aborted: a graceful close would first wait to flush what the
client is not reading. Each listener also caps the connections open on it at once (`max_connections`): one
past the cap is aborted as it opens, so a flood of connections holds a bounded number of file descriptors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from aiohttp import web

logger = logging.getLogger(__name__)

CLIENT_TIMEOUT_S = 60.0
"""The embedded deployment's deadlines (the shim's are `agent_shim.client_timeout_s`): well past the idle time
after which HTTP clients drop their own pooled connections (seconds), so a client never reuses one this closed."""


class ClientDeadlines:
    """The connections of one server and their deadlines; `middleware` must be the app's first middleware."""

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self._connections: dict[asyncio.BaseTransport, _Connection] = {}
        self._listening: asyncio.AbstractServer | None = None

    def __len__(self) -> int:
        return len(self._connections)

    async def serve(self, runner: web.BaseRunner, host: str, port: int, max_connections: int | None = None) -> str:
        """Listen on `host:port` (0: a free port) for `runner`, set up, each connection under the deadlines, at most
        `max_connections` open at once; returns the base URL (`http://host:port`). Call `stop_listening` before
        `runner.cleanup()`."""
        http = _http_factory(runner)
        cap = _Cap(max_connections)
        self._listening = await asyncio.get_running_loop().create_server(
            lambda: _Connection(http(), self, cap), host, port)
        bound_port = self._listening.sockets[0].getsockname()[1]
        return f"http://{f'[{host}]' if ':' in host else host}:{bound_port}"

    async def serve_unix(self, runner: web.BaseRunner, path: str, max_connections: int) -> asyncio.AbstractServer:
        """Also listen on the Unix socket `path` (created 0600), at most `max_connections` open on it at once; the
        returned server stops it (`close()`, then unlink `path`)."""
        http = _http_factory(runner)
        cap = _Cap(max_connections)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # set and restored around the bind alone: processes started meanwhile inherit it
        try:
            sock.bind(path)
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        return await asyncio.get_running_loop().create_unix_server(lambda: _Connection(http(), self, cap), sock=sock)

    def stop_listening(self) -> None:
        """Accept no more connections; those open are the runner's to close (`runner.cleanup()`)."""
        if self._listening is not None:
            self._listening.close()
            self._listening = None

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """While a handler runs, its connection waits for no request; when it ends, the wait starts again."""
        connection = self._connections.get(request.transport)
        if connection is None:
            return await handler(request)
        connection.request_started()
        try:
            return await handler(request)
        finally:
            connection.request_ended()


def _http_factory(runner: web.BaseRunner):
    http = runner.server
    if http is None:
        raise RuntimeError("set the runner up before serving it")
    return http


class _Cap:
    """The connections open on one listener, and how many may be."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.open = 0
        self.refused = 0


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, which every event is forwarded to, with the deadlines around it."""

    def __init__(self, http: asyncio.Protocol, deadlines: ClientDeadlines, cap: _Cap):
        self._http = http
        self._deadlines = deadlines
        self._cap = cap
        self._transport: asyncio.Transport | None = None
        self._awaiting_request: asyncio.TimerHandle | None = None
        self._awaiting_reader: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._cap.limit is not None and self._cap.open >= self._cap.limit:
            self._cap.refused += 1
            if self._cap.refused in (1, 1000):
                logger.warning("refusing connections past %d open on one listener (%d so far)", self._cap.limit,
                               self._cap.refused)
            transport.abort()
            return
        self._cap.open += 1
        self._transport = transport
        self._deadlines._connections[transport] = self
        self._http.connection_made(transport)
        self._awaiting_request = self._deadline("sent no complete request")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is None:
            return  # refused at the cap: aiohttp never saw it
        self._cap.open -= 1
        self._cancel()
        self._deadlines._connections.pop(self._transport, None)
        self._transport = None
        self._http.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._transport is not None:
            self._http.data_received(data)

    def eof_received(self) -> bool | None:
        return self._http.eof_received() if self._transport is not None else None

    def pause_writing(self) -> None:
        self._http.pause_writing()
        self._awaiting_reader = self._deadline("took none of its reply")

    def resume_writing(self) -> None:
        if self._awaiting_reader is not None:
            self._awaiting_reader.cancel()
            self._awaiting_reader = None
        self._http.resume_writing()

    def request_started(self) -> None:
        if self._awaiting_request is not None:
            self._awaiting_request.cancel()
            self._awaiting_request = None

    def request_ended(self) -> None:
        if self._transport is not None and self._awaiting_request is None:
            self._awaiting_request = self._deadline("sent no complete request")

    def _deadline(self, what: str) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(self._deadlines.timeout_s, self._expire, what)

    def _expire(self, what: str) -> None:
        if self._transport is None:
            return
        peer = self._transport.get_extra_info("peername")
        logger.info("closing the connection from %s: it %s within %gs", peer, what, self._deadlines.timeout_s)
        self._transport.abort()

    def _cancel(self) -> None:
        for handle in (self._awaiting_request, self._awaiting_reader):
            if handle is not None:
                handle.cancel()
        self._awaiting_request = self._awaiting_reader = None


class BodyTooLargeError(ValueError):
    """A request body over the server's limit; the message says its size ("the request body is N bytes")."""


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytearray:
    """The request's body: a `BodyTooLargeError` past `limit` bytes (before reading, when its size is announced),
    a `TimeoutError` when it has not all arrived within `timeout_s` (a client sending it slowly, or never, holds
    nothing longer)."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLargeError(f"the request body is {request.content_length} bytes")
    body = bytearray()
    async with asyncio.timeout(timeout_s):
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise BodyTooLargeError(f"the request body exceeds {limit} bytes")
    return body
