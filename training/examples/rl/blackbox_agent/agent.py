"""A small tool-using agent that knows nothing about RL: it talks to "Claude" through the official SDK.

    ANTHROPIC_BASE_URL=... ANTHROPIC_API_KEY=... \
        python agent.py --workdir DIR "Compute 12 * 34 and write it to answer.txt"
    echo "task text" | python agent.py --workdir DIR

The client is `anthropic.Anthropic()`, which reads `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY`
from the environment like any agent; the model name comes from `ANTHROPIC_MODEL` (any name will
do for the agent shim). The agent offers two tools, a calculator and a file writer confined to
`--workdir`, runs them for the model and loops until the model stops calling tools or
`--max-turns` model calls were made, then prints the model's last text (stdout), a one-line
count of model and tool calls (stderr), and exits 0. An API error prints one line to stderr and
exits 1.

Nothing here imports the training library: the training side only sees the HTTP requests.
"""

from __future__ import annotations

import argparse
import ast
import math
import operator
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import anthropic

SYSTEM_PROMPT = (
    "You are a careful assistant working in a sandbox directory. Use the calculator tool for every "
    "arithmetic step and the write_file tool to save results. When the task is done, reply with a "
    "short summary and no tool call."
)

TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses) "
                       "and return the result.",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
    {
        "name": "write_file",
        "description": "Write text to a file in the working directory, replacing it if it exists.",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "relative path, e.g. answer.txt"},
                "content": {"type": "string"},
            },
            "required": ["path", "content"],
        },
    },
]

# ---------------------------------------------------------------------------- calculator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 10**60
"""Bounds that keep one call cheap: `9 ** 9 ** 9` is refused instead of computed."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds (division by zero, too big)."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression, evaluated over its syntax tree (never `eval`).

    Allowed: int and float literals, unary + and -, binary + - * / // % **, parentheses.
    Anything else (names, calls, attributes, strings, comparisons) raises `CalculatorError`.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"unsupported literal {value!r}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result is too large") from None
    raise CalculatorError(f"unsupported syntax: {ast.unparse(node)!r}")


def _bounded(value) -> int | float:
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise CalculatorError("result is not a real number")
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result is too large")
    return value


def format_number(value: int | float) -> str:
    """Integers (and whole floats) without a decimal point, other floats as Python prints them."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# ---------------------------------------------------------------------------- tools

MAX_FILE_CHARS = 100_000


class ToolError(ValueError):
    """A tool call the agent refuses; the message goes back to the model as an error result."""


def write_file(workdir: Path, path: str, content: str) -> str:
    """Write `content` to `path` inside `workdir`; paths that leave it are refused."""
    if not isinstance(path, str) or not path.strip():
        raise ToolError("path must be a non-empty string")
    if not isinstance(content, str):
        raise ToolError("content must be a string")
    if len(content) > MAX_FILE_CHARS:
        raise ToolError(f"content is longer than {MAX_FILE_CHARS} characters")
    root = workdir.resolve()
    target = (root / path).resolve()
    if target == root or not target.is_relative_to(root):
        raise ToolError(f"path {path!r} is outside the working directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return f"wrote {len(content)} characters to {target.relative_to(root)}"


def run_tool(workdir: Path, name: str, arguments) -> str:
    """One tool call's result text; raises `ToolError` / `CalculatorError` for a call that cannot run."""
    if not isinstance(arguments, dict):
        raise ToolError(f"the input of {name} must be a JSON object")
    if name == "calculator":
        if "expression" not in arguments:
            raise ToolError("calculator needs an 'expression'")
        return format_number(calculate(arguments["expression"]))
    if name == "write_file":
        missing = [k for k in ("path", "content") if k not in arguments]
        if missing:
            raise ToolError(f"write_file needs {' and '.join(repr(k) for k in missing)}")
        return write_file(workdir, arguments["path"], arguments["content"])
    raise ToolError(f"unknown tool {name!r}; the tools are calculator and write_file")


@dataclass
class Transcript:
    """What one run of the agent did."""

    text: str = ""
    """The model's last text."""
    model_calls: int = 0
    tool_calls: int = 0
    tool_errors: int = 0


def run_tools(workdir: Path, content, transcript: Transcript) -> list[dict]:
    """A `tool_result` block for each `tool_use` block of a reply, in order."""
    results = []
    for block in content:
        if block.type != "tool_use":
            continue
        transcript.tool_calls += 1
        try:
            text, is_error = run_tool(workdir, block.name, block.input), False
        except (ToolError, CalculatorError) as e:
            text, is_error = f"error: {e}", True
            transcript.tool_errors += 1
        print(f"  {block.name}({block.input!r}) -> {text}", file=sys.stderr)
        results.append({"type": "tool_result", "tool_use_id": block.id, "content": text, "is_error": is_error})
    return results


# ---------------------------------------------------------------------------- the loop


def run(client: anthropic.Anthropic, task: str, workdir: Path, *, model: str, max_turns: int,
        max_tokens: int, stream: bool = False) -> Transcript:
    """Call the model until it answers without a tool call or `max_turns` calls were made."""
    transcript = Transcript()
    messages: list[dict] = [{"role": "user", "content": task}]
    while transcript.model_calls < max_turns:
        request = dict(model=model, max_tokens=max_tokens, system=SYSTEM_PROMPT, tools=TOOLS, messages=messages)
        if stream:
            with client.messages.stream(**request) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**request)
        transcript.model_calls += 1
        transcript.text = "".join(block.text for block in reply.content if block.type == "text")
        print(f"turn {transcript.model_calls}: stop_reason={reply.stop_reason}, "
              f"{len(reply.content)} block(s)", file=sys.stderr)
        results = run_tools(workdir, reply.content, transcript)
        if not results:
            return transcript
        # The reply goes back verbatim (the SDK serializes its blocks), followed by the tool results.
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": results}]
    print(f"stopped after {max_turns} turns", file=sys.stderr)
    return transcript


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A calculator + file-writing agent on the Anthropic Messages API.")
    parser.add_argument("task", nargs="*", help="the task; read from stdin when absent")
    parser.add_argument("--workdir", required=True, type=Path, help="directory write_file writes into")
    parser.add_argument("--max-turns", type=int, default=4, help="most model calls")
    parser.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of each model call")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model call")
    parser.add_argument("--stream", action="store_true", help="stream each reply (server-sent events)")
    args = parser.parse_args(argv)
    task = " ".join(args.task) if args.task else sys.stdin.read()
    if not task.strip():
        parser.error("no task given (argv or stdin)")
    if not args.workdir.is_dir():
        parser.error(f"--workdir {args.workdir} is not a directory")
    client = anthropic.Anthropic(timeout=args.timeout)
    model = os.environ.get("ANTHROPIC_MODEL", "policy")
    try:
        transcript = run(client, task, args.workdir, model=model, max_turns=args.max_turns,
                         max_tokens=args.max_tokens, stream=args.stream)
    except anthropic.APIError as e:
        print(f"agent: model call failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(transcript.text)
    print(f"agent: {transcript.model_calls} model call(s), {transcript.tool_calls} tool call(s), "
          f"{transcript.tool_errors} failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
