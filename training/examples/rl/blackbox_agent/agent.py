"""A small question-answering agent that knows nothing about RL: it talks to "Claude" through the official SDK.

    ANTHROPIC_BASE_URL=... ANTHROPIC_API_KEY=... \
        python agent.py --workdir DIR "What is 3 + 5? Reply with only the completed equation."
    echo "task text" | python agent.py --workdir DIR

The client is `anthropic.Anthropic()`, which reads `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY`
from the environment like any agent; the model name comes from `ANTHROPIC_MODEL` (any name will
do for the agent shim). The agent has an output contract: the reply must be one line that ends
in `= <number>` (a completed equation). Its loop, all in one conversation:

1. answer: send the task; on a reply that misses the contract, send a follow-up asking for that
   format, until a reply passes;
2. check: send the passing reply back with a request to check it (`CHECK`); the reply to that,
   once it passes the contract (follow-ups again on a miss), is the checked answer.

Only a checked answer goes to `--output` (default `answer.txt`) in `--workdir`: a run that made
`--max-turns` model calls without one writes nothing (`--no-check` writes the first passing reply
instead). It prints the model's last text (stdout) and a one-line count of model calls (stderr),
and exits 0. An API error prints one line to stderr and exits 1.

Nothing here imports the training library: the training side only sees the HTTP requests.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import anthropic

FOLLOW_UP = "That is not the format I need. Reply with only the completed equation and nothing else."
CHECK = "Check that equation. If it is right, reply with it again; if it is wrong, reply with the corrected equation."
# One line, anything before the last `=`, then a whole number (a trailing period is fine):
# "3 + 5 = 8", "Here is the equation: 3 + 5 = 8." pass; "The answer is 8" and a second line do not.
_COMPLETED_EQUATION = re.compile(r"[^\n=]*=[ \t]*(-?\d+)[ \t]*\.?")


def final_answer(reply: str) -> str | None:
    """The number a reply that meets the output contract ends in; None when it does not meet it."""
    match = _COMPLETED_EQUATION.fullmatch(reply.strip())
    return match.group(1) if match else None


@dataclass
class Transcript:
    """What one run of the agent did."""

    text: str = ""
    """The model's last text."""
    answer: str | None = None
    """The number of the checked reply (of the first passing reply with `check=False`); None if there was none."""
    model_calls: int = 0


def reply_text(client: anthropic.Anthropic, request: dict, stream: bool) -> str:
    if stream:
        with client.messages.stream(**request) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**request)
    return "".join(block.text for block in reply.content if block.type == "text")


def run(client: anthropic.Anthropic, task: str, *, model: str, max_turns: int, max_tokens: int,
        stream: bool = False, check: bool = True) -> Transcript:
    """Ask until a reply meets the contract, then ask the model to check it, in one conversation of at most
    `max_turns` calls; the answer is the checked reply's (with `check=False`, the first passing reply's)."""
    transcript = Transcript()
    messages: list[dict] = [{"role": "user", "content": task}]
    # True once a passing reply went back to be checked (from the start without a check): the next passing reply
    # is the answer.
    checking = not check
    # No system prompt: the model's own chat template supplies its default one.
    while transcript.model_calls < max_turns:
        transcript.text = reply_text(client, dict(model=model, max_tokens=max_tokens, messages=messages), stream)
        transcript.model_calls += 1
        answer = final_answer(transcript.text)
        print(f"turn {transcript.model_calls}: {transcript.text[:80]!r} -> "
              f"{'answer ' + answer if answer else 'format miss'}", file=sys.stderr)
        if answer is not None and checking:
            transcript.answer = answer
            return transcript
        checking = checking or answer is not None
        messages += [{"role": "assistant", "content": transcript.text},
                     {"role": "user", "content": FOLLOW_UP if answer is None else CHECK}]
    print(f"no checked reply met the format in {max_turns} turns", file=sys.stderr)
    return transcript


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="An agent that answers with a completed equation, on the "
                                                 "Anthropic Messages API.")
    parser.add_argument("task", nargs="*", help="the task; read from stdin when absent")
    parser.add_argument("--workdir", required=True, type=Path, help="directory the answer file goes to")
    parser.add_argument("--output", default="answer.txt", help="answer file name inside --workdir")
    parser.add_argument("--max-turns", type=int, default=4, help="most model calls (answer, check, follow-ups)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of each model call")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model call")
    parser.add_argument("--stream", action="store_true", help="stream each reply (server-sent events)")
    parser.add_argument("--no-check", action="store_true", help="answer with the first passing reply, unchecked")
    args = parser.parse_args(argv)
    task = " ".join(args.task) if args.task else sys.stdin.read()
    if not task.strip():
        parser.error("no task given (argv or stdin)")
    if not args.workdir.is_dir():
        parser.error(f"--workdir {args.workdir} is not a directory")
    if args.max_turns < 1:
        parser.error(f"--max-turns {args.max_turns}: it must be at least 1")
    output = (args.workdir / args.output).resolve()
    if not output.is_relative_to(args.workdir.resolve()) or output == args.workdir.resolve():
        parser.error(f"--output {args.output!r} is not a file name inside --workdir")
    client = anthropic.Anthropic(timeout=args.timeout)
    model = os.environ.get("ANTHROPIC_MODEL", "policy")
    try:
        transcript = run(client, task, model=model, max_turns=args.max_turns, max_tokens=args.max_tokens,
                         stream=args.stream, check=not args.no_check)
    except anthropic.APIError as e:
        print(f"agent: model call failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if transcript.answer is not None:
        output.write_text(transcript.answer + "\n")
    print(transcript.text)
    # The rollout reads this line (`rollout.py::AgentResult.summary`); this agent has no tools.
    print(f"agent: {transcript.model_calls} model call(s), 0 tool call(s), 0 failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
