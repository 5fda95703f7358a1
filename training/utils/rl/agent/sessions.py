"""The shim's open sessions: which one a request's key names, and each one closed, finished or discarded.

A session key is the agent's API key: it is read from `Authorization: Bearer <key>`, then
`x-api-key`, then `x-multi-turn-session-id`. An unknown or closed session is a 401, and
sessions never merge.
"""

from __future__ import annotations

from collections import OrderedDict

from aiohttp import web

from training.utils.errors import RecoverableRolloutError
from training.utils.rl.agent.chat_request import WireError
from training.utils.rl.agent.session import COUNTERS, ShimSession
from training.utils.rl.rollout.stitching import Segment
from training.utils.rl.rollout.types import RolloutRun

SESSION_HEADERS = ("authorization", "x-api-key", "x-multi-turn-session-id")
"""Where the session key is read from, in this order (`Authorization` as `Bearer <key>`)."""

# Closed keys remembered so a late request hears "session is closed" rather than "unknown".
_CLOSED_KEYS_KEPT = 10_000


class SessionTimeoutError(RecoverableRolloutError, TimeoutError):
    """A session still had a request in flight when `finish_session` gave up waiting for it."""


class Sessions:
    """The open sessions by key, the keys recently closed, and the counters of the sessions finished."""

    def __init__(self) -> None:
        self._open: dict[str, ShimSession] = {}
        self._closed_keys: OrderedDict[str, None] = OrderedDict()
        self._finished_totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._finished = 0

    def __len__(self) -> int:
        return len(self._open)

    def add(self, session: ShimSession) -> ShimSession:
        self._open[session.key] = session
        return session

    def for_request(self, request: web.Request) -> ShimSession:
        """The open session whose key the request presents; a WireError 401 otherwise."""
        keys = _presented_keys(request)
        if not keys:
            raise WireError("no session key: send it as 'Authorization: Bearer <key>', 'x-api-key' or "
                            "'x-multi-turn-session-id'", status=401)
        for key in keys:
            session = self._open.get(key)
            if session is not None and not session.closed:
                return session
        if any(key in self._open or key in self._closed_keys for key in keys):
            raise WireError("session is closed", status=401)
        raise WireError("unknown session key", status=401)

    async def finish(self, key: str, reward: float | None, timeout: float) -> list[Segment] | RolloutRun | None:
        """Close a session, wait for its request in flight, and return what it recorded (`ShimSession.result`)."""
        session = self._open.get(key)
        if session is None:
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
        """Counters summed over every session (open and finished), plus session counts."""
        totals = dict(self._finished_totals)
        for session in self._open.values():
            for name, value in session.counters.items():
                totals[name] += value
        totals["sessions_open"] = len(self._open)
        totals["sessions_finished"] = self._finished
        return totals

    def _close(self, session: ShimSession) -> None:
        session.closed = True
        self._closed_keys[session.key] = None
        while len(self._closed_keys) > _CLOSED_KEYS_KEPT:
            self._closed_keys.popitem(last=False)

    def _retire(self, session: ShimSession) -> None:
        if self._open.pop(session.key, None) is not None:
            for name, value in session.counters.items():
                self._finished_totals[name] += value
            self._finished += 1


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
