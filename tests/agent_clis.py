"""Real agent CLIs for the `agent_cli` test tier: each installed once from npm, at a pinned version, into a cache.

A CLI lives in `$TRAINING_CACHE_DIR/agent-clis/<package>@<version>` (default `~/.cache/training`): `npm install
--prefix` with install scripts off, then the package's own postinstall script run explicitly (Claude Code's
`install.cjs` and opencode's `postinstall.mjs` put the platform binary in place; npm 11 skips dependency install
scripts unless allowed, so running them ourselves works on every npm). A lock keeps two pytest processes from
installing at once and a `.complete` file marks a finished install. Only a missing install needs the registry:
when npm is absent or the registry cannot be reached the test skips with one line; an install that fails is an
error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from real_engines import exclusive_lock
from training.examples.rl.cli_agent.clis import CLIS
from training.utils.models.load import cache_dir, load_model_and_tokenizer, load_tokenizer

CONTEXT_TOKENS = 131_072
"""The context of `save_long_context_tiny`'s model: room for a CLI's first prompt and many turns after it."""

VERSIONS = {
    "claude": "2.1.332",
    "codex": "0.171.0",
    "qwen": "0.24.4",
    "opencode": "1.18.33",
}
"""The newest of each on npm when last checked (`npm view <package> version`); bump them together with a run of
the tier."""
INSTALL_TIMEOUT_S = 900.0
_COMPLETE = ".complete"


def installed_cli(name: str) -> Path:
    """The executable of CLI `name` (a key of `clis.CLIS`), installed on first use; skips when npm cannot reach
    its registry."""
    cli = CLIS[name]
    spec = f"{cli.package}@{VERSIONS[name]}"
    prefix = cache_dir() / "agent-clis" / spec.replace("/", "+")
    executable = prefix / "node_modules" / ".bin" / cli.executable
    if (prefix / _COMPLETE).is_file():
        return executable
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(prefix.with_name(prefix.name + ".lock"), INSTALL_TIMEOUT_S):
        if not (prefix / _COMPLETE).is_file():  # another process may have installed it while this one waited
            _require_registry(spec)
            _install(spec, cli.package, prefix)
            if not executable.exists():
                raise RuntimeError(f"npm installed {spec} into {prefix} but {executable} is missing")
            (prefix / _COMPLETE).write_text(spec + "\n")
    return executable


def _require_registry(spec: str) -> None:
    if shutil.which("npm") is None:
        pytest.skip(f"agent_cli: npm is not installed; it is needed once, to install {spec}")
    try:
        probe = subprocess.run(["npm", "view", spec, "version", "--fetch-retries=0", "--fetch-timeout=30000"],
                               capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        probe = None
    if probe is not None and "E404" in probe.stderr:  # the registry answered: the pin is wrong, not the network
        raise RuntimeError(f"npm has no {spec}: {probe.stderr.strip()}")
    if probe is None or probe.returncode != 0:
        reason = "no answer in 60 s" if probe is None else _npm_error(probe.stderr)
        pytest.skip(f"agent_cli: the npm registry is unreachable ({reason}); it is needed once, to install {spec}")


def _npm_error(stderr: str) -> str:
    """npm's one-line reason (its FetchError line, else its error code), not the pointer to its debug log."""
    lines = [line.removeprefix("npm error").strip() for line in stderr.splitlines()]
    return next((line for line in lines if line.startswith("FetchError")), None) or next(
        (line for line in lines if line.startswith("code ")), stderr.strip()[:200] or "no output")


def _install(spec: str, package: str, prefix: Path) -> None:
    if prefix.exists():
        shutil.rmtree(prefix)  # an install that did not finish
    prefix.mkdir()
    log = prefix.with_name(prefix.name + ".install.log")
    package_dir = prefix / "node_modules" / package
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    with open(log, "w") as out:
        _step(["npm", "install", "--prefix", str(prefix), "--ignore-scripts", "--no-audit", "--no-fund", spec],
              prefix, out, log, deadline)
        scripts = json.loads((package_dir / "package.json").read_text()).get("scripts", {})
        if "postinstall" in scripts:
            _step(["npm", "run", "postinstall"], package_dir, out, log, deadline)


def _step(command: list[str], cwd: Path, out, log: Path, deadline: float) -> None:
    out.write(f"$ {' '.join(command)}\n")
    out.flush()
    try:
        code = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              timeout=max(1.0, deadline - time.monotonic())).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    if code != 0:
        lines = log.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"`{' '.join(command)}` failed ({code}); {log} ends:\n" + "\n".join(lines))


def save_long_context_tiny(directory: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template and a `CONTEXT_TOKENS` context, saved to
    `directory` as a model directory: the prompts are a CLI's real ones, the replies random text."""
    from transformers import LlamaConfig

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT_TOKENS,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(config, device="cpu")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
