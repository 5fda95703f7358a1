"""One model request through the agent shim, traced module by module: it must read top to bottom.

Each request (Anthropic Messages, OpenAI Chat Completions, OpenAI Responses; JSON and SSE; a first
turn and an APPEND that continues it; and Anthropic's count_tokens, which records nothing) is sent
by the official SDK to a real shim on the tiny deployment, with a profiler recording every function
of `training/utils/rl/agent/` and `training/utils/rl/rollout/` the request runs, from the HTTP
handler until the reply is out and its turn committed. What counts:

- A *visit* of module M starts with a new call of one of M's functions from a function of another
  module (its caller), and lasts until that call returns. M's calls to its own functions are part of
  the visit; so is a job M hands to a worker thread (the job's caller is the frame that submitted it).
  A coroutine or generator resuming after an `await` or `yield` is the same call going on, not a new
  one; a return into the caller is a return, not a visit.
- **No callback**: no visit of M starts while another visit of M is open (A -> B -> A, at any depth):
  a module never calls back into a module that called it.
- **Each module entered once, in order**: the modules one visit calls form one run each, in call
  order: once a visit has gone on to another module it never comes back to one it left (a visit may
  ask a helper several things in a row). So the handler reads as a list of phases, each one module.
- **At most 8 path modules**: the modules that pass the request on (the handler's and every module
  that calls another traced module). A module that only computes and returns (reading fields,
  hashing, Hermes text, token assembly) is a helper of the visit that calls it; they are printed too.

The visit tree is printed (`-s` shows it), so a failure shows the path it found.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import training.utils.rl as rl_package
from shim_support import (
    CALL_TEXT,
    anthropic_client,
    make_tiny,
    openai_client,
    scripted,
    shim_stack,
)

RL = Path(rl_package.__file__).resolve().parent
TRACED = (str(RL / "agent") + "/", str(RL / "rollout") + "/")
MAX_PATH_MODULES = 8
ANTHROPIC_TOOLS = [{"name": "read_file", "description": "Read a file",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                  "parameters": ANTHROPIC_TOOLS[0]["input_schema"]}}]
RESPONSES_TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
                    "parameters": ANTHROPIC_TOOLS[0]["input_schema"]}]


@dataclass
class Visit:
    module: str
    function: str
    parent: Visit | None
    children: list[Visit] = field(default_factory=list)

    def ancestors(self):
        visit = self.parent
        while visit is not None:
            yield visit
            visit = visit.parent


def module_of(filename: str) -> str | None:
    if not filename.startswith(TRACED):
        return None
    return str(Path(filename).relative_to(RL).with_suffix("")).replace("/", ".")


class PathTracer:
    """A profile function for every thread: records the visits of traced modules while `active`."""

    def __init__(self):
        self.active = False
        self.lock = threading.Lock()
        self.frames: dict = {}  # frame -> its Visit (strong references: no id is reused while tracing)
        self.handoffs: dict = {}  # id(work item) -> (work item, the traced frame that submitted it)
        self.roots: list[Visit] = []

    def start(self) -> None:
        with self.lock:
            self.frames, self.handoffs, self.roots = {}, {}, []
            self.active = True

    def stop(self) -> list[Visit]:
        with self.lock:
            self.active = False
            return self.roots

    def __call__(self, frame, event, arg):
        if event != "call" or not self.active:
            return
        code = frame.f_code
        if code.co_name == "__init__" and code.co_filename.endswith("concurrent/futures/thread.py"):
            item = frame.f_locals.get("self")
            with self.lock:
                submitter = self._traced_caller(frame.f_back)
                if submitter is not None:
                    self.handoffs[id(item)] = (item, submitter)
            return
        module = module_of(code.co_filename)
        if module is None:
            return
        with self.lock:
            if frame in self.frames:  # a coroutine or generator resuming: the same call going on
                return
            caller = self._traced_caller(frame.f_back)
            if caller is not None and self.frames[caller].module == module:
                self.frames[frame] = self.frames[caller]
                return
            parent = None if caller is None else self.frames[caller]
            visit = Visit(module, code.co_name, parent)
            (self.roots if parent is None else parent.children).append(visit)
            self.frames[frame] = visit

    def _traced_caller(self, frame):
        """The nearest traced frame below `frame`, crossing a worker thread's hand-off to its submitter."""
        while frame is not None:
            if frame in self.frames:
                return frame
            code = frame.f_code
            if code.co_name == "run" and code.co_filename.endswith("concurrent/futures/thread.py"):
                handoff = self.handoffs.get(id(frame.f_locals.get("self")))
                return None if handoff is None else handoff[1]
            frame = frame.f_back
        return None


def render(visit: Visit, depth: int = 0) -> list[str]:
    lines = [f"{'  ' * depth}{visit.module}.{visit.function}"]
    for child in visit.children:
        lines += render(child, depth + 1)
    return lines


def walk(visit: Visit):
    yield visit
    for child in visit.children:
        yield from walk(child)


def path_problems(roots: list[Visit]) -> tuple[list[str], set[str], set[str]]:
    """(what breaks the rules, the path modules, the helper modules) of one request's visits."""
    problems = []
    if len(roots) != 1:
        problems.append(f"{len(roots)} visits with no caller on the path (one, the handler, expected): "
                        + ", ".join(f"{r.module}.{r.function}" for r in roots))
    visits = [v for root in roots for v in walk(root)]
    for visit in visits:
        callers = [a.module for a in visit.ancestors()]
        if visit.module in callers:
            chain = " -> ".join([*reversed(callers), visit.module])
            problems.append(f"callback into {visit.module} ({visit.function}): {chain}")
        runs = [child.module for i, child in enumerate(visit.children)
                if i == 0 or visit.children[i - 1].module != child.module]
        again = sorted({m for m in runs if runs.count(m) > 1})
        if again:
            problems.append(f"{visit.module}.{visit.function} goes back to {', '.join(again)} after leaving it: "
                            + " -> ".join(runs))
    modules = {v.module for v in visits}
    path = {v.module for v in visits if v.children or v.parent is None}
    if len(path) > MAX_PATH_MODULES:
        problems.append(f"{len(path)} path modules (at most {MAX_PATH_MODULES}): {sorted(path)}")
    return problems, path, modules - path


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)


@pytest.fixture
def tracer():
    tracer = PathTracer()
    previous = sys.getprofile(), threading.getprofile()
    sys.setprofile(tracer)
    threading.setprofile(tracer)  # the shim's parse and render threads start after this
    try:
        yield tracer
    finally:
        sys.setprofile(previous[0])
        threading.setprofile(previous[1])


async def traced(tracer: PathTracer, what: str, request) -> tuple[object, list[Visit]]:
    tracer.start()
    try:
        reply = await request
    finally:
        roots = tracer.stop()
    print(f"\n--- {what}\n" + "\n".join(line for root in roots for line in render(root)))
    return reply, roots


def check(results: list[tuple[str, list[Visit]]]) -> None:
    found = []
    for what, roots in results:
        problems, path, helpers = path_problems(roots)
        print(f"{what}: path modules {sorted(path)}; helpers {sorted(helpers)}")
        found += [f"{what}: {p}" for p in problems]
        commits = any(v.function == "commit" for root in roots for v in walk(root))
        assert commits == ("count_tokens" not in what), f"{what}: {'no' if not commits else 'a'} commit on the path"
    assert not found, "\n".join(found)


def test_an_anthropic_request_reads_top_to_bottom(tiny, tracer):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, CALL_TEXT) if i == 0 else c
            session = shim.open_session(run_id="path")
            client = anthropic_client(session)
            kwargs = dict(model="agent", max_tokens=16, system="You are terse.", tools=ANTHROPIC_TOOLS)
            messages = [{"role": "user", "content": "read a.txt"}]
            counted, count = await traced(tracer, "anthropic, count_tokens", client.messages.count_tokens(
                model="agent", system="You are terse.", tools=ANTHROPIC_TOOLS, messages=messages))
            assert counted.input_tokens > 0
            first, new = await traced(tracer, "anthropic, a new turn (JSON)",
                                      client.messages.create(messages=messages, **kwargs))
            (tool_use,) = first.content
            messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                       "content": "hello"}]}]
            stream = client.messages.stream(messages=messages, **kwargs)

            async def streamed():
                async with stream as events:
                    return await events.get_final_message()

            _, append = await traced(tracer, "anthropic, an APPEND (SSE)", streamed())
            assert session.kinds == ["new", "append"]
            return [("anthropic count_tokens", count), ("anthropic new", new), ("anthropic append", append)]

    check(asyncio.run(scenario()))


def test_an_openai_chat_request_reads_top_to_bottom(tiny, tracer):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, CALL_TEXT) if i == 0 else c
            session = shim.open_session(run_id="path")
            client = openai_client(session)
            messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "read a.txt"}]
            first, new = await traced(tracer, "openai chat, a new turn (JSON)", client.chat.completions.create(
                model="agent", messages=messages, tools=OPENAI_TOOLS, max_tokens=16))
            message = first.choices[0].message
            (call,) = message.tool_calls
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "hello"}]

            async def streamed():
                stream = await client.chat.completions.create(model="agent", messages=messages, tools=OPENAI_TOOLS,
                                                              max_tokens=16, stream=True)
                return [chunk async for chunk in stream]

            _, append = await traced(tracer, "openai chat, an APPEND (SSE)", streamed())
            assert session.kinds == ["new", "append"]
            return [("openai chat new", new), ("openai chat append", append)]

    check(asyncio.run(scenario()))


def test_an_openai_responses_request_reads_top_to_bottom(tiny, tracer):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, CALL_TEXT) if i == 0 else c
            session = shim.open_session(run_id="path")
            client = openai_client(session)
            items = [{"role": "user", "content": "read a.txt"}]
            kwargs = dict(model="agent", instructions="You are terse.", tools=RESPONSES_TOOLS, max_output_tokens=16,
                          store=False)
            first, new = await traced(tracer, "openai responses, a new turn (JSON)",
                                      client.responses.create(input=items, **kwargs))
            (call,) = [item for item in first.output if item.type == "function_call"]
            items += [item.model_dump(exclude_none=True) for item in first.output]
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": "hello"})

            async def streamed():
                stream = await client.responses.create(input=items, stream=True, **kwargs)
                return [event async for event in stream]

            _, append = await traced(tracer, "openai responses, an APPEND (SSE)", streamed())
            assert session.kinds == ["new", "append"]
            return [("responses new", new), ("responses append", append)]

    check(asyncio.run(scenario()))


def test_a_responses_request_carrying_sealed_reasoning_reads_top_to_bottom(tiny, tracer):
    """Codex's way: `store: false`, the reasoning item sent back with only its `encrypted_content`, which the
    shim opens to restore what was sampled."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, "<think>\nplan\n</think>\n" + CALL_TEXT) if i == 0 else c
            session = shim.open_session(run_id="path")
            client = openai_client(session)
            items = [{"role": "user", "content": "read a.txt"}]
            kwargs = dict(model="agent", instructions="You are terse.", tools=RESPONSES_TOOLS, max_output_tokens=16,
                          store=False, include=["reasoning.encrypted_content"])
            first, new = await traced(tracer, "openai responses with reasoning, a new turn (JSON)",
                                      client.responses.create(input=items, **kwargs))
            reasoning, *_ = first.output
            (call,) = [item for item in first.output if item.type == "function_call"]
            items += [{"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content},
                      *(item.model_dump(exclude_none=True) for item in first.output if item.type != "reasoning"),
                      {"type": "function_call_output", "call_id": call.call_id, "output": "hello"}]
            _, append = await traced(tracer, "openai responses, an APPEND carrying sealed reasoning (JSON)",
                                     client.responses.create(input=items, **kwargs))
            assert reasoning.type == "reasoning" and session.kinds == ["new", "append"]
            return [("responses reasoning new", new), ("responses sealed reasoning append", append)]

    check(asyncio.run(scenario()))


def test_the_rules_catch_a_callback_and_a_module_left_and_entered_again():
    """The checks can fail: a visit calling back into its caller's module, and a caller alternating between two."""
    root = Visit("agent.server", "serve", None)
    turn = Visit("agent.model_call", "answer", root)
    root.children = [turn]
    session = Visit("agent.session", "prepare", turn)
    back = Visit("agent.model_call", "helper", session)
    session.children = [back]
    turn.children = [session, Visit("agent.reply", "client_reply", turn), Visit("agent.session", "stage", turn)]
    problems, path, helpers = path_problems([root])
    assert any(p.startswith("callback into agent.model_call") for p in problems), problems
    assert any("goes back to agent.session" in p for p in problems), problems
    assert path == {"agent.server", "agent.model_call", "agent.session"}
    assert helpers == {"agent.reply"}
