"""Agent shim: an HTTP endpoint that unmodified agents use as their model, recording every turn for RL.

A rollout opens a session on `setup.shim`, points its agent at `session.base_url` with
`session.key` as the API key, and turns the session into one `RolloutRun` at the end:

    session = setup.shim.open_session(run_id=row["id"])
    try:
        await run_agent(base_url=session.base_url, api_key=session.key)  # Anthropic or OpenAI client
        return await setup.shim.finish_session(session.key, reward=grade(...))
    finally:
        setup.shim.discard_session(session.key)  # a no-op once finished; frees a cancelled rollout's session

`server.py` is the HTTP server and session API, `session.py` the per-session state machine.
Between the wire and the model: `wire_anthropic.py` / `wire_openai.py` (each declares a
`wire_format.WireFormat`, registered in `server.WIRE_FORMATS`) translate requests into
`chat_request.ChatRequest`s (with the shared field readers of `fields.py`), `chat_format.py`
renders them with the chat template, and `hermes.py` is the text format for tools, tool calls
and reasoning the template does not render. README: "The agent shim".
"""

from training.utils.config import AgentShimConfig
from training.utils.rl.agent.chat_format import ChatFormat
from training.utils.rl.agent.chat_request import ChatRequest, WireError
from training.utils.rl.agent.hermes import ParsedOutput
from training.utils.rl.agent.server import AgentShim
from training.utils.rl.agent.session import (
    ContextOverflowError,
    SessionTimeoutError,
    ShimSession,
)
from training.utils.rl.rollout.stitching import Segment, TraceIntegrityError

__all__ = [
    "AgentShim",
    "AgentShimConfig",
    "ChatFormat",
    "ChatRequest",
    "ContextOverflowError",
    "ParsedOutput",
    "Segment",
    "SessionTimeoutError",
    "ShimSession",
    "TraceIntegrityError",
    "WireError",
]
