"""The shim's open sessions: which one a request's key names, and each one closed, finished, discarded or expired.

A session key is the agent's API key: it is read from `Authorization: Bearer <key>`, then
`x-api-key`, then `x-multi-turn-session-id`. An unknown, closed or expired session is a 401, and
sessions never merge. A session bound to a Unix socket (`ShimSession.bind`, how a sandboxed agent
reaches the shim) is found only by requests on that socket, and the socket finds no other session: a key
another agent lifted is a 401 wherever it is presented.

A rollout that never finishes nor discards its sessions would grow the shim without bound, so
sessions are bounded twice: at most `max_open_sessions` are open at once (`open_session` beyond
it raises `SessionLimitError`, the shim's 429), and a session idle for `session_idle_timeout_s`
(no request in flight, none arrived) expires. Expiry is checked whenever a session is opened or
a request arrives (the only times the open sessions can grow or be used) and when stats are
read, oldest idle first.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict

from aiohttp import web

from training.utils.errors import RecoverableRolloutError
from training.utils.rl.agent.chat_request import WireError
from training.utils.rl.agent.session import COUNTERS, ShimSession
from training.utils.rl.rollout.stitching import Segment
from training.utils.rl.rollout.types import RolloutRun

SESSION_HEADERS = ("authorization", "x-api-key", "x-multi-turn-session-id")
"""Where the session key is read from, in this order (`Authorization` as `Bearer <key>`)."""

logger = logging.getLogger(__name__)

# Closed keys remembered so a late request hears "session is closed" (or "expired") rather than "unknown".
_CLOSED_KEYS_KEPT = 10_000
_EXPIRED = "expired"


class SessionTimeoutError(RecoverableRolloutError, TimeoutError):
    """A session still had a request in flight when `finish_session` gave up waiting for it."""


class SessionExpiredError(RecoverableRolloutError):
    """`finish_session` of a session that expired: it was idle longer than `agent_shim.session_idle_timeout_s`."""


class SessionLimitError(RecoverableRolloutError):
    """`open_session` with `agent_shim.max_open_sessions` sessions already open."""


class Sessions:
    """The open sessions by key, the idle ones by when they went idle, the keys recently closed, and the counters
    of the sessions finished or expired."""

    def __init__(self, idle_timeout_s: float, max_open: int) -> None:
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_open = int(max_open)
        self._open: dict[str, ShimSession] = {}
        self._idle_since: OrderedDict[str, float] = OrderedDict()
        """Open sessions with no request in flight, oldest idle first: the ones that may expire."""
        self._in_flight: dict[str, int] = {}
        self._closed_keys: OrderedDict[str, str | None] = OrderedDict()
        self._finished_totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._finished = self._expired = self._refused = 0

    def __len__(self) -> int:
        return len(self._open)

    def add(self, session: ShimSession) -> ShimSession:
        """Open `session`; a `SessionLimitError` when `max_open` sessions are open (after expiring the idle ones)."""
        self.expire_idle()
        if len(self._open) >= self.max_open:
            self._refused += 1
            raise SessionLimitError(
                f"the agent shim already has {len(self._open)} open sessions (agent_shim.max_open_sessions="
                f"{self.max_open}): finish or discard each session in a `finally` (setup.shim.discard_session), "
                f"or raise the limit; idle sessions expire after {self.idle_timeout_s:g}s")
        self._open[session.key] = session
        self._idle_since[session.key] = time.monotonic()
        return session

    def for_request(self, request: web.Request) -> ShimSession:
        """The open session whose key the request presents; a WireError 401 otherwise."""
        keys = _presented_keys(request)
        if not keys:
            raise WireError("no session key: send it as 'Authorization: Bearer <key>', 'x-api-key' or "
                            "'x-multi-turn-session-id'", status=401)
        self.expire_idle()
        listener = _unix_listener(request)
        for key in keys:
            session = self._open.get(key)
            if session is not None and session.socket != listener:
                raise WireError("this session key is not good on this connection: it belongs to another agent",
                                status=401)
            if session is not None and not session.closed:
                if key in self._idle_since:
                    self._idle_since[key] = time.monotonic()
                    self._idle_since.move_to_end(key)
                return session
        if any(self._closed_keys.get(key) == _EXPIRED for key in keys):
            raise WireError(f"session expired: it was idle for more than {self.idle_timeout_s:g}s "
                            "(agent_shim.session_idle_timeout_s)", status=401)
        if any(key in self._open or key in self._closed_keys for key in keys):
            raise WireError("session is closed", status=401)
        raise WireError("unknown session key", status=401)

    @contextlib.contextmanager
    def in_use(self, session: ShimSession):
        """While a request of `session` is in flight, it cannot expire; its idle time starts when the last ends."""
        key = session.key
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        self._idle_since.pop(key, None)
        try:
            yield session
        finally:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                del self._in_flight[key]
                if key in self._open:
                    self._idle_since[key] = time.monotonic()

    def expire_idle(self) -> None:
        """Drop every session idle for longer than `idle_timeout_s`: it records nothing more, its agent hears
        "session expired", and its counters join the finished sessions' totals."""
        now = time.monotonic()
        while self._idle_since:
            key, since = next(iter(self._idle_since.items()))
            if now - since <= self.idle_timeout_s:
                return
            session = self._open[key]
            self._close(session, _EXPIRED)
            session.stop_recording()
            self._retire(session, expired=True)
            logger.warning("agent shim: session %s expired after %.0fs without a request "
                           "(agent_shim.session_idle_timeout_s=%g)", session.label, now - since, self.idle_timeout_s)

    async def finish(self, key: str, reward: float | None, timeout: float) -> list[Segment] | RolloutRun | None:
        """Close a session, wait for its request in flight, and return what it recorded (`ShimSession.result`)."""
        self.expire_idle()
        session = self._open.get(key)
        if session is None:
            if self._closed_keys.get(key) == _EXPIRED:
                raise SessionExpiredError(f"the agent-shim session expired: it had no request for more than "
                                          f"{self.idle_timeout_s:g}s (agent_shim.session_idle_timeout_s)")
            state = "already finished" if key in self._closed_keys else "unknown"
            raise KeyError(f"no open agent-shim session with this key ({state})")
        self._close(session)
        try:
            await session.queue.drained(timeout)
        except TimeoutError:
            session.stop_recording()
            raise SessionTimeoutError(
                f"agent-shim session {session.label!r} still had a request in flight after {timeout:g}s"
            ) from None
        finally:
            self._retire(session)
        return session.result(reward)

    def discard(self, key: str) -> None:
        """Drop a session without materializing it; unknown keys are ignored."""
        session = self._open.get(key)
        if session is None:
            return
        self._close(session)
        session.stop_recording()
        self._retire(session)

    def close_all(self) -> None:
        """Every open session records nothing more (the server is stopping)."""
        for session in self._open.values():
            session.closed = True
            session.stop_recording()

    def stats(self) -> dict[str, int]:
        """Counters summed over every session (open, finished and expired), plus session counts: open, finished
        (or discarded), expired, and refused (`open_session` past `max_open`). Idle sessions expire first."""
        self.expire_idle()
        totals = dict(self._finished_totals)
        for session in self._open.values():
            for name, value in session.counters.items():
                totals[name] += value
        totals["sessions_open"] = len(self._open)
        totals["sessions_finished"] = self._finished
        totals["sessions_expired"] = self._expired
        totals["sessions_refused"] = self._refused
        return totals

    def _close(self, session: ShimSession, state: str | None = None) -> None:
        session.closed = True
        self._closed_keys[session.key] = state
        while len(self._closed_keys) > _CLOSED_KEYS_KEPT:
            self._closed_keys.popitem(last=False)

    def _retire(self, session: ShimSession, *, expired: bool = False) -> None:
        """Out of the open sessions; its counters join the totals (a finished or expired session's alike)."""
        self._idle_since.pop(session.key, None)
        if self._open.pop(session.key, None) is not None:
            for name, value in session.counters.items():
                self._finished_totals[name] += value
            if expired:
                self._expired += 1
            else:
                self._finished += 1


def _unix_listener(request: web.Request) -> str | None:
    """The Unix socket the request arrived on (a bound session's), None for TCP."""
    transport = request.transport
    name = transport.get_extra_info("sockname") if transport is not None else None
    return name if isinstance(name, str) else None


def _presented_keys(request: web.Request) -> list[str]:
    keys = []
    for header in SESSION_HEADERS:
        value = request.headers.get(header, "").strip()
        if header == "authorization":
            scheme, _, value = value.partition(" ")
            value = value.strip() if scheme.lower() == "bearer" else ""
        if value and value not in keys:
            keys.append(value)
    return keys
