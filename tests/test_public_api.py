"""The public surface: `from training import ...` names the user contract, and what users read imports only it."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import training

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = [
    "AgentShimConfig", "BadEnvironmentError", "ChatAssembler", "ConfigError", "DeploymentConfig", "GeneratedSplits",
    "LossInputs", "OverlongConfig", "PromptGroup", "RecoverableRolloutError", "RolloutRun", "RolloutSample",
    "RolloutSetup", "SamplingConfig", "TISConfig", "TokenLoss", "TrainerConfig", "build_deployment_sampler",
    "build_renderer", "from_openenv", "from_reasoning_gym", "from_verifiers", "get_text_content",
    "load_model_and_tokenizer", "load_tokenizer", "openenv_server", "read_jsonl", "register_policy_loss",
    "restart_with_allocator",
    "rollout_evaluation", "sample_from_completion", "serve_policy", "set_openmp_wait_policy", "write_jsonl",
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


def type_checking_reexports() -> dict[str, str]:
    """Public name -> module, as the `TYPE_CHECKING` block of `training/__init__.py` (what type checkers and IDEs
    read) imports them: `from <module> import X as X`."""
    tree = ast.parse((ROOT / "training" / "__init__.py").read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    return {alias.asname: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names if alias.asname == alias.name}


def test_type_checkers_see_the_public_names_where_they_load_from():
    """The lazy table and the block type checkers read are written apart: they name the same names, each from the
    same module, or an IDE offers a name that fails (or hides one that works)."""
    assert type_checking_reexports() == training.PUBLIC_NAMES


def test_each_public_name_imports_as_users_write_it_and_is_the_librarys_own():
    """`from training import X` in a fresh process gives the library's own `X` (defined under `training`, named `X`:
    not a third-party object passed through, not another of ours under a second name), loaded from its module."""
    code = ("import json, sys\n" + "".join(f"from training import {name}\n" for name in PUBLIC) +
            "print(json.dumps({name: [obj.__module__, obj.__name__, training_module in sys.modules] for name, obj, "
            f"training_module in [{', '.join(f'({n!r}, {n}, {training.PUBLIC_NAMES[n]!r})' for n in PUBLIC)}]}}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    wrong = {name: seen for name, seen in found.items()
             if not (seen[0].startswith("training.") and seen[1] == name and seen[2])}
    assert set(found) == set(PUBLIC) and not wrong, wrong


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
    assert PRIVATE_IMPORT.search("    import training.utils.models.load as m\n")
    assert not PRIVATE_IMPORT.search("from training import read_jsonl\nsee training/utils/config/rl.py\n")
    assert RECIPE_IMPORT.search("from training.recipes.rl_loop import Config, main").group(1) == "rl_loop"


@pytest.mark.parametrize("path", user_facing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_readme_docs_and_skills_import_only_the_public_surface(path):
    text = path.read_text()
    private = [m.group(0).strip() for m in PRIVATE_IMPORT.finditer(text)]
    assert not private, f"{path.relative_to(ROOT)} imports the library's inside: {private}; use `from training import`"
    assert {m.group(1) for m in RECIPE_IMPORT.finditer(text)} <= {"rl_loop", "async_rl_loop"}
