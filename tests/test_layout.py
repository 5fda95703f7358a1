"""The tree's guard rails: imports run downwards only, modules stay small, CONTRIBUTING.md's Layout lists them all."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "training"
MAX_MODULE_LINES = 500

FORBIDDEN_IMPORTS = [
    # (importing modules, imported modules it must not reach, why)
    ("training.utils", "training.recipes", "utils hold reusable pieces; recipes use them, not the reverse"),
    ("training.utils", "training.examples", "examples are task code on top of everything"),
    ("training.recipes", "training.examples", "recipes must not depend on one task"),
    ("training.utils", "training.environments", "environment adapters sit on top of the library's pieces"),
    ("training.recipes", "training.environments", "a recipe runs any rollout, not one package's"),
    ("training.environments", "training.recipes", "an adapter hands main() its arguments; it does not call it"),
    ("training.utils.deploy", "training.utils.rl", "a deployment serves any caller, not RL"),
    ("training.utils.deploy", "training.utils.trainer", "the deployment and the trainer meet in the recipes"),
    ("training.utils.trainer", "training.utils.rl", "the trainer computes on datums; RL builds them"),
    ("training.utils.trainer", "training.utils.deploy", "the deployment and the trainer meet in the recipes"),
]
PURE_REGISTRIES = ("training.utils.rl.losses", "training.utils.rl.loss_aggregation",
                   "training.utils.rl.loss_corrections", "training.utils.rl.advantages")
"""The config validates names against these, so they import nothing of the library but its errors and each other."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_imports(source: str, module: str) -> set[str]:
    """Modules of `training` that `source` imports at run time (lazy imports included, `TYPE_CHECKING` blocks not)."""
    tree = ast.parse(source)
    type_checking = {
        id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from ..rl import x` in training.utils.deploy.engine
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return {name for name in found if name == "training" or name.startswith("training.")}


def violations(module: str, imported: set[str]) -> list[str]:
    def within(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    found = [f"{module} imports {name}: {why}" for importer, banned, why in FORBIDDEN_IMPORTS
             if within(module, importer) for name in sorted(imported) if within(name, banned)]
    if module in PURE_REGISTRIES:
        allowed = ("training.utils.errors", *PURE_REGISTRIES)
        found += [f"{module} imports {name}: a registry the config reads imports only training.utils.errors and "
                  "the other registries" for name in sorted(imported) if not any(within(name, a) for a in allowed)]
    return found


def library_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_imports_run_from_higher_layers_to_lower_ones_only():
    found = [v for path in library_modules() for v in violations(module_name(path),
                                                                 library_imports(path.read_text(), module_name(path)))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, module, expected", [
    ("from training.recipes.rl_loop import Config", "training.utils.rl.startup",
     "training.utils.rl.startup imports training.recipes.rl_loop"),
    ("def f():\n    from training.utils.rl.rollout.types import PromptGroup", "training.utils.trainer.core",
     "training.utils.trainer.core imports training.utils.rl.rollout.types"),
    ("from ..rl import losses", "training.utils.deploy.engine",
     "training.utils.deploy.engine imports training.utils.rl"),
    ("import training.utils.config", "training.utils.rl.losses",
     "training.utils.rl.losses imports training.utils.config"),
])
def test_the_import_check_catches_an_upward_import(source, module, expected):
    assert any(v.startswith(expected) for v in violations(module, library_imports(source, module)))


def test_type_checking_imports_are_not_runtime_dependencies():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from training.utils.config import TISConfig\n"
    assert library_imports(source, "training.utils.rl.losses") == set()


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in library_modules() if (n := len(p.read_text().splitlines()))
            > MAX_MODULE_LINES}
    assert not long, f"split these along their seams (limit {MAX_MODULE_LINES} lines): {long}"


def listed_layout() -> set[str]:
    """Paths the Layout block of CONTRIBUTING.md names: a line `dir/` opens a folder, indented lines name its
    files (their leading words that end in `.py`)."""
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    block = contributing.split("\n## Layout\n", 1)[1].split("```", 2)[1]
    listed, folder = set(), ""
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            folder = line.split()[0]
            if not folder.endswith("/"):
                listed.add(folder)
            continue
        for word in line.split():
            if not word.endswith(".py"):
                break
            listed.add(folder + word)
    return listed


def test_contributing_layout_lists_every_module_and_nothing_else():
    modules = {str(p.relative_to(ROOT)) for p in library_modules() if p.name != "__init__.py"}
    listed = {path for path in listed_layout() if path.startswith("training/") and path.endswith(".py")}
    assert not modules - listed, f"add to CONTRIBUTING.md's Layout: {sorted(modules - listed)}"
    assert not listed - modules, f"CONTRIBUTING.md's Layout names modules that do not exist: {sorted(listed - modules)}"


def test_code_does_not_cite_a_document_outside_the_repository():
    cited = {str(p.relative_to(ROOT)) for p in [*library_modules(), *sorted((ROOT / "tests").glob("*.py"))]
             if re.search(r"DESIGN\.md|\bCase \d+", p.read_text()) and p != Path(__file__).resolve()}
    assert not cited, f"cite the README, skills/ or docs/ instead: {sorted(cited)}"


MEASUREMENT = re.compile("|".join([
    r"\b\d+(?:\.\d+)?\s?(?:ms|µs)\b",                                                    # 14 ms
    r"\b\d+(?:\.\d+)?\s?[x×]\s+(?:faster|slower|fewer|more|less)\b",                     # 3.8x faster
    r"(?:\babout |~)\s?\d+(?:\.\d+)?\s?(?:s|ms|min)\b",                                     # ~0.1 s
    r"\b\d+(?:\.\d+)?\s?(?:s|min|minutes|seconds)\s+(?:vs|instead of|against|a step|per step)\b",
    r"\b(?:took|takes|ran in|runs in)\b[^.\n]{0,40}?\b\d+(?:\.\d+)?\s?(?:ms|s|min)\b",  # took 12.3 s
    r"\(\d+(?:\.\d+)?(?:[–-]\d+(?:\.\d+)?)?\s?(?:ms|s|min)\b",                           # (1–2 s of CPU)
    r"\b\d+(?:\.\d+)?\s?(?:tokens/s|tok/s|GFLOP/s|samples/s|GB/s)\b",                    # 858 GFLOP/s
]))
"""A measurement quoted in prose. Code says why, never how fast: numbers live in benchmarks/RESULTS.md."""


def comments_and_docstrings(source: str):
    """(line, text) of every comment and triple-quoted string, with `code spans` blanked (a format example such
    as `step 7.9s 8.1 samples/s` is not a measurement)."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING
                                            and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
            yield tok.start[0], re.sub(r"`[^`\n]*`", "``", tok.string)


def test_the_measurement_scanner_finds_quoted_timings():
    found = [MEASUREMENT.search(text) for text in (
        "# fused: 0.05 s vs 0.25 s a step", '"""Prefill is 3.8x faster with the cache."""', "# ~0.1 s",
        "# each agent imports the SDK (1–2 s of CPU)", '"""the engine decodes at 1,200 tokens/s"""',
        "# 14 ms per step")]
    assert all(found), found
    assert not MEASUREMENT.search("# the timeout is rollout_timeout_s; 30 retries at most; see benchmarks/")


def test_comments_and_docstrings_quote_no_measurements():
    found = [f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}"
             for path in library_modules() for line, text in comments_and_docstrings(path.read_text())
             for match in MEASUREMENT.finditer(text)]
    assert not found, "measurements belong in benchmarks/RESULTS.md:\n" + "\n".join(found)
