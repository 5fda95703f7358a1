"""The agent CLIs the kit runs, as each ships on npm: how it starts, and what keeps it offline and on its session.

Every CLI gets a scratch HOME of its own per run (its settings, caches, session files and memories land there and
are deleted with it), an environment allowlisted from ours (no credentials of the trainer reach an agent that has
a shell), the task on stdin (no CLI reads a task that starts with "-" as a flag), and settings that turn off what
would reach the network: telemetry, update checks, model catalogues, plugin installs. Its only endpoint is its
shim session. The flags and settings are each CLI's own documented ones, checked against the pinned versions in
`tests/agent_clis.py` (docs/agent-shim.md: Agent CLIs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

_INHERITED_ENV = frozenset({"PATH", "USER", "LANG", "TERM", "TZ", "TMPDIR", "SYSTEMROOT"})
"""What a CLI inherits from this process: enough to find `node` and a shell. Everything else is set per CLI."""

CLAUDE_CODE_COMPACT_WINDOW_FLOOR = 100_000
"""Claude Code's smallest auto-compact window: below it, it still budgets for 100k tokens, so on a smaller
context a long run overflows before it compacts (docs/agent-shim.md: Claude Code)."""


@dataclass(frozen=True)
class Run:
    """What one run of a CLI is pointed at."""

    base_url: str
    """The shim session's URL, without `/v1`."""
    key: str
    """The session key: the CLI's API key."""
    home: str
    """Its scratch HOME, empty."""
    model_name: str
    """The model name it asks for (the shim serves the policy whatever the name)."""
    context_tokens: int
    """The longest prompt + reply the shim serves."""
    max_tokens: int
    """The trainer's cap on one reply."""
    title: str
    """What names the run (opencode's session title)."""


@dataclass(frozen=True)
class Launch:
    """How one run of a CLI starts: its command line, its environment, and the files it reads from its HOME."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    """Path relative to the scratch HOME -> content."""


@dataclass(frozen=True)
class AgentCLI:
    """One agent CLI."""

    name: str
    package: str
    """Its npm package."""
    executable: str
    """The command the package installs."""
    wire: str
    """The shim wire it speaks."""
    launch: Callable[[str, Run], Launch]
    """(the executable's path, the run) -> how to start it."""
    compacts_from: int = 0
    """The least context with which it compacts reliably (0: whatever fits its first prompt)."""


def base_env(home: str) -> dict[str, str]:
    """The part of every CLI's environment that is not its own: our allowlisted variables and its scratch HOME."""
    env = {k: v for k, v in os.environ.items() if k in _INHERITED_ENV or k.startswith("LC_")}
    return env | {"HOME": home}


def claude_code(executable: str, run: Run) -> Launch:
    env = base_env(run.home) | {
        "ANTHROPIC_BASE_URL": run.base_url,
        "ANTHROPIC_API_KEY": run.key,
        # Telemetry, error reports, update checks and every other request that is not a model call: off.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        # Its system prompt names a memory path per working directory: without this, a row's draws (each in its
        # own directory) differ from a few thousand tokens in, and no draw reuses another's prefix cache entry.
        "CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1",
    }
    if run.context_tokens >= CLAUDE_CODE_COMPACT_WINDOW_FLOOR:
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(run.context_tokens)  # it assumes 200k otherwise
    # As root, Claude Code refuses bypassPermissions unless told it is sandboxed; in the kit's sandbox it may be root
    # whoever the trainer runs as (a user namespace maps the user to root), and it is sandboxed.
    env["IS_SANDBOX"] = "1"
    # -p: one task from stdin, then exit; bypassPermissions: no tool call waits for an approval nobody gives.
    return Launch([executable, "-p", "--permission-mode", "bypassPermissions"], env)


def qwen_code(executable: str, run: Run) -> Launch:
    settings = {
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False},
        # Its memory extractor is a side agent that runs after the task: in a scratch HOME its memories are
        # deleted unread, and its model calls would be trained on the task's reward.
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
        # It compresses its history on `context_length_exceeded`, and before, at a share of this window.
        "model": {"generationConfig": {"contextWindowSize": run.context_tokens}},
    }
    env = base_env(run.home) | {"OPENAI_BASE_URL": run.base_url + "/v1", "OPENAI_API_KEY": run.key,
                                "OPENAI_MODEL": run.model_name}
    # No prompt argument: it reads the task from stdin, runs it and exits; yolo: every tool call is approved.
    return Launch([executable, "--auth-type", "openai", "--approval-mode", "yolo"], env,
                  {".qwen/settings.json": json.dumps(settings, indent=1)})


def opencode(executable: str, run: Run) -> Launch:
    config = {
        "provider": {"shim": {
            "npm": "@ai-sdk/openai-compatible",  # bundled in the binary: nothing is installed
            "name": "agent shim",
            "options": {"baseURL": run.base_url + "/v1", "apiKey": run.key},
            "models": {run.model_name: {"name": run.model_name,
                                        "limit": {"context": run.context_tokens, "output": run.max_tokens}}},
        }},
        "model": f"shim/{run.model_name}",
        "small_model": f"shim/{run.model_name}",
        "autoupdate": False,
        "share": "disabled",
    }
    env = base_env(run.home) | {
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # the models.dev catalogue
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        # It installs its plugin package into its config directory on every start; offline, npm answers from
        # its (empty) cache and opencode logs the miss and goes on.
        "npm_config_offline": "true",
    }
    # `run` reads the task from stdin (an argument would reach the model quoted); a given title spares the
    # model call that would name the session; --auto approves what `run` would otherwise reject and stop on
    # (a path outside the working directory, ...).
    return Launch([executable, "run", "--title", run.title, "--auto"], env,
                  {".config/opencode/opencode.json": json.dumps(config, indent=1)})


def codex(executable: str, run: Run) -> Launch:
    config = "\n".join([
        f"model = {json.dumps(run.model_name)}",
        'model_provider = "shim"',
        f"model_context_window = {run.context_tokens}",
        "check_for_update_on_startup = false",
        "",
        "[model_providers.shim]",
        'name = "agent shim"',
        f"base_url = {json.dumps(run.base_url + '/v1')}",
        'env_key = "SHIM_API_KEY"',
        'wire_api = "responses"',  # the only wire Codex speaks
        # A failed request is the shim's verdict, not a network blip: retrying it would only repeat it.
        "request_max_retries = 0",
        "stream_max_retries = 0",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[feedback]",
        "enabled = false",
        "",
        "[features]",
        "plugins = false",  # else it syncs its plugin marketplace from github.com and chatgpt.com at start
        "",
    ])
    codex_home = os.path.join(run.home, ".codex")
    env = base_env(run.home) | {"CODEX_HOME": codex_home, "SHIM_API_KEY": run.key}
    # exec: one task, then exit; "-": the task from stdin; --strict-config: a setting this version does not know
    # is an error, not silently ignored.
    argv = [executable, "exec", "--strict-config", "--skip-git-repo-check", "--color", "never",
            "--dangerously-bypass-approvals-and-sandbox", "-"]
    return Launch(argv, env, {".codex/config.toml": config})


CLIS: dict[str, AgentCLI] = {cli.name: cli for cli in (
    AgentCLI("claude", "@anthropic-ai/claude-code", "claude", "Anthropic Messages", claude_code,
             compacts_from=CLAUDE_CODE_COMPACT_WINDOW_FLOOR),
    AgentCLI("codex", "@openai/codex", "codex", "OpenAI Responses", codex),
    AgentCLI("qwen", "@qwen-code/qwen-code", "qwen", "OpenAI Chat Completions", qwen_code),
    AgentCLI("opencode", "opencode-ai", "opencode", "OpenAI Chat Completions", opencode),
)}
"""The agent CLIs by the name `rollout_extras["agent"]` picks them with."""
