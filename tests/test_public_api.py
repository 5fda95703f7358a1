"""The public surface: `from training import ...` names the user contract, and what users read imports only it."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import training

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = [
    "AgentShimConfig", "ChatAssembler", "ConfigError", "DeploymentConfig", "GeneratedSplits", "LossInputs",
    "OverlongConfig", "PromptGroup", "RecoverableRolloutError", "RolloutRun", "RolloutSample", "RolloutSetup",
    "SamplingConfig", "TISConfig", "TokenLoss", "TrainerConfig", "load_model_and_tokenizer", "load_tokenizer",
    "read_jsonl", "register_policy_loss", "restart_with_allocator", "rollout_evaluation", "sample_from_completion",
    "serve_policy", "set_openmp_wait_policy", "write_jsonl",
]
"""Adding or removing a public name is a decision: change this list, the docs and CONTRIBUTING.md with it."""
PRIVATE_IMPORT = re.compile(r"^\s*(?:from\s+training\.(?:utils)\b[\w.]*\s+import|import\s+training\.utils\b)",
                            re.MULTILINE)
"""An import statement of the library's inside (`training.utils...`), in code or in a Markdown code block."""
RECIPE_IMPORT = re.compile(r"^\s*from\s+training\.recipes\.(\w+)\s+import", re.MULTILINE)


def user_facing_files() -> list[Path]:
    """What users copy from: the examples' code, the README, the docs pages and the skills."""
    files = sorted((ROOT / "training" / "examples").rglob("*.py")) + [ROOT / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "skills").rglob("*.md"))
    return [f for f in files if f.is_file()]


def test_the_public_names_are_pinned():
    assert training.__all__ == sorted(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_name_is_the_librarys_own_object(name):
    module = importlib.import_module(training.PUBLIC_NAMES[name])
    assert getattr(training, name) is getattr(module, name)
    namespace: dict = {}
    exec(f"from training import {name}", namespace)
    assert namespace[name] is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error_that_names_it():
    with pytest.raises(AttributeError, match="no attribute 'RolloutSampel'"):
        training.RolloutSampel  # noqa: B018


def test_importing_the_package_is_cheap():
    """`import training` loads no torch: the public names load on first use."""
    code = "import sys, training; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_scanner_finds_private_imports():
    assert PRIVATE_IMPORT.search("x = 1\nfrom training.utils.rl.dataset import read_jsonl\n")
    assert PRIVATE_IMPORT.search("    import training.utils.model as m\n")
    assert not PRIVATE_IMPORT.search("from training import read_jsonl\nsee training/utils/config.py\n")
    assert RECIPE_IMPORT.search("from training.recipes.rl_loop import Config, main").group(1) == "rl_loop"


@pytest.mark.parametrize("path", user_facing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_readme_docs_and_skills_import_only_the_public_surface(path):
    text = path.read_text()
    private = [m.group(0).strip() for m in PRIVATE_IMPORT.finditer(text)]
    assert not private, f"{path.relative_to(ROOT)} imports the library's inside: {private}; use `from training import`"
    assert {m.group(1) for m in RECIPE_IMPORT.finditer(text)} <= {"rl_loop", "async_rl_loop"}
