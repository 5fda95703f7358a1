"""Agent shim: an HTTP endpoint that unmodified agents use as their model, recording every turn for RL.

A rollout opens a session on `setup.shim`, points its agent at `session.base_url` with
`session.key` as the API key, and turns the session into one `RolloutRun` at the end:

    session = setup.shim.open_session(run_id=row["id"])
    try:
        await run_agent(base_url=session.base_url, api_key=session.key)  # Anthropic or OpenAI client
        return await setup.shim.finish_session(session.key, reward=grade(...))
    finally:
        setup.shim.discard_session(session.key)  # a no-op once finished; frees a cancelled rollout's session

A model request's path, top to bottom (docs/agent-shim.md, "A request, top to bottom"): each
phase is one call that returns what the next takes, and no module calls back into one that called
it (`tests/test_agent_request_path.py` traces it).

1. `server.py` routes it (the app is built from `WIRE_FORMATS`, one `wire_format.WireFormat`
   per `wire_<name>.py`) and finds the session its key names (`sessions.py`); anything refused
   on the way is answered in that wire's error shape.
2. parse: `request_body.py` reads the body and, in a worker thread, the wire's codec decodes it
   (`wire_<name>.py`, with the field readers of `chat_request.py`) into a wire-neutral
   `chat_request.ChatRequest`.
3. `model_call.py` answers it in the session's queue (`turn_queue.py`), phase after phase:
   a. match and render (`session.py`'s `prepare`, in a render thread): the request matched to a
      recorded turn (`rollout/turn_matching.py`: NEW, APPEND, or WIPE, which is a branch or a
      compaction), then its prompt ids built (`prompt.py`, with `chat_format.py`'s chat template
      and Hermes text for what the template cannot show, and `rollout/messages.py`'s token assembly);
   b. sample: the deployment samples it, and the answer is checked against the prompt
      (`rollout/stitching.py`'s `check_turn`);
   c. reply: what the client is told (`model_call.client_reply`), encoded by the wire's codec;
   d. commit: `session.py` stages the record, the reply is sent, and once the client has it the
      turn is committed to the session's tree (`rollout/stitching.py`'s `TurnTree`).
4. `finish_session` (`sessions.py`) closes the session, and `session.py` stitches its tree into
   segments and one `RolloutRun` (`rollout/stitching.py`).
"""

from training.utils.config.rl import AgentShimConfig
from training.utils.rl.agent.chat_format import ChatFormat, ParsedOutput
from training.utils.rl.agent.chat_request import ChatRequest, ContextOverflowError, WireError
from training.utils.rl.agent.server import AgentShim
from training.utils.rl.agent.session import ShimSession
from training.utils.rl.agent.sessions import SessionExpiredError, SessionLimitError, SessionTimeoutError
from training.utils.rl.rollout.stitching import Segment, TraceIntegrityError

__all__ = [
    "AgentShim",
    "AgentShimConfig",
    "ChatFormat",
    "ChatRequest",
    "ContextOverflowError",
    "ParsedOutput",
    "Segment",
    "SessionExpiredError",
    "SessionLimitError",
    "SessionTimeoutError",
    "ShimSession",
    "TraceIntegrityError",
    "WireError",
]
