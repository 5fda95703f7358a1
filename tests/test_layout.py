"""The tree's guard rails: imports run downwards only, modules stay small, CONTRIBUTING.md's Layout lists them all."""

import ast
import io
import re
import tokenize
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "training"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 100
OVERSIZED = {
    # definition -> the lines it has now, its ceiling: it may not grow; split it and drop its entry
    "training/utils/deploy/engine.py:Engine": 426,
    "training/utils/trainer/core.py:Trainer": 411,
    "training/utils/rl/async_rl/producer.py:RolloutProducer": 311,
    "training/examples/rl/single_turn_token_in/measure_baseline.py:main": 106,
}

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
                   "training.utils.rl.loss_corrections", "training.utils.rl.kl_estimators",
                   "training.utils.rl.advantages")
"""The config validates names against these, so they import nothing of the library but its errors and each other."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_imports(source: str, module: str, *, type_checking: bool = False) -> set[str]:
    """Modules of `training` that `source` imports at run time (lazy imports included; `TYPE_CHECKING` blocks only
    with `type_checking`): for `from x import y` both `x` and `x.y` (which may be a module or a name)."""
    tree = ast.parse(source)
    type_only = set() if type_checking else {
        id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = module if module in PACKAGES else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
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


def loaded_modules(module: str, imported: set[str]) -> set[str]:
    """The modules of the tree that importing `imported` from `module` runs: each name that is a module, and the
    packages above it that `module` is not inside (importing `a.b.c` runs `a/b/__init__.py` first)."""
    loaded = set()
    for name in imported & set(MODULES):
        parts = name.split(".")
        loaded |= {".".join(parts[:n]) for n in range(1, len(parts) + 1)
                   if not within(module, ".".join(parts[:n]))}
    return loaded - {module}


def import_graph(sources: dict[str, str], *, type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the modules of the tree it loads directly (`loaded_modules`), from each module's source."""
    return {module: loaded_modules(module, library_imports(source, module, type_checking=type_checking))
            for module, source in sources.items()}


def reached(graph: dict[str, set[str]], module: str) -> dict[str, list[str]]:
    """Every module importing `module` loads, directly or through others, with the shortest chain of imports."""
    paths, queue = {module: [module]}, deque([module])
    while queue:
        current = queue.popleft()
        for target in sorted(graph.get(current, ())):
            if target not in paths:
                paths[target] = paths[current] + [target]
                queue.append(target)
    del paths[module]
    return paths


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(module: str, imported: set[str]) -> list[str]:
    found = [f"{module} imports {name}: {why}" for importer, banned, why in FORBIDDEN_IMPORTS
             if within(module, importer) for name in sorted(imported) if within(name, banned)]
    if module in PURE_REGISTRIES:
        allowed = ("training.utils.errors", *PURE_REGISTRIES)
        found += [f"{module} imports {name}: a registry the config reads imports only training.utils.errors and "
                  "the other registries" for name in sorted(imported) if not any(within(name, a) for a in allowed)]
    return found


def indirect_violations(graph: dict[str, set[str]]) -> list[str]:
    """A module that loads, through any chain of imports (lazy ones included), a module its layer may not: the
    chain named. The registries sit below the config and the floor, whatever their folder (their own imports are
    held to `PURE_REGISTRIES`' rule), and so does the empty package around them."""
    below_the_config = {*PURE_REGISTRIES, "training.utils.rl"}
    found = []
    for module in sorted(graph):
        for target, path in reached(graph, module).items():
            if target in below_the_config:
                continue
            found += [f"{problem} (through {' -> '.join(path)})" for problem in violations(module, {target})
                      if module not in PURE_REGISTRIES]
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Sets of modules that import one another round a loop (strongly connected, more than one module)."""
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def library_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


MODULES = {module_name(path): path for path in library_modules()}
PACKAGES = {module_name(path) for path in library_modules() if path.name == "__init__.py"}


def sources() -> dict[str, str]:
    return {module: path.read_text() for module, path in MODULES.items()}


def test_imports_run_from_higher_layers_to_lower_ones_only():
    found = [v for module, source in sources().items() for v in violations(module, library_imports(source, module))]
    assert not found, "\n".join(found)


def test_no_module_reaches_a_forbidden_layer_through_other_modules():
    found = indirect_violations(import_graph(sources()))
    assert not found, "\n".join(found)


def test_no_import_circles():
    """Not even through a type annotation: two modules that name each other are one idea split badly, or a lower
    one that knows its caller."""
    circles = import_circles(import_graph(sources(), type_checking=True))
    assert not circles, "modules importing one another in a loop: " + "; ".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("source, module, expected", [
    ("from training.recipes.rl_loop import Config", "training.utils.rl.startup",
     "training.utils.rl.startup imports training.recipes.rl_loop"),
    ("def f():\n    from training.utils.rl.rollout.types import PromptGroup", "training.utils.trainer.core",
     "training.utils.trainer.core imports training.utils.rl.rollout.types"),
    ("from ..rl import losses", "training.utils.deploy.engine",
     "training.utils.deploy.engine imports training.utils.rl"),
    ("import training.utils.config.rl", "training.utils.rl.losses",
     "training.utils.rl.losses imports training.utils.config.rl"),
])
def test_the_import_check_catches_an_upward_import(source, module, expected):
    assert any(v.startswith(expected) for v in violations(module, library_imports(source, module)))


def test_the_import_check_catches_a_lazy_upward_import_made_through_a_lower_module():
    """deploy -> lora is allowed, but a lazy import of the trainer inside lora.py makes every deployment load the
    trainer: the check names the deployment module and the chain."""
    tree = sources()
    tree["training.utils.models.lora"] += "\ndef _head():\n    import training.utils.trainer.logprob_head\n"
    found = indirect_violations(import_graph(tree))
    assert any(v.startswith("training.utils.deploy imports training.utils.trainer") and
               "training.utils.models.lora -> training.utils.trainer" in v for v in found), found
    assert not indirect_violations(import_graph(sources()))


def test_the_circle_check_finds_a_loop_through_a_lazy_or_a_type_only_import():
    tree = sources()
    tree["training.utils.models.peft_names"] += (
        "\n\ndef _f():\n    from training.utils.models.lora_layers import AddedLoraLinear\n")
    circle = ["training.utils.models.lora_layers", "training.utils.models.peft_names"]
    assert circle in import_circles(import_graph(tree))
    tree = sources()
    tree["training.utils.rl.agent.chat_request"] += ("\nif TYPE_CHECKING:\n"
                                                     "    from training.utils.rl.agent.wire_format import TurnCodec\n")
    graph = import_graph(tree, type_checking=True)
    assert any({"training.utils.rl.agent.chat_request", "training.utils.rl.agent.wire_format"} <= set(circle)
               for circle in import_circles(graph))
    assert not import_circles(import_graph(tree))  # at run time there is none


def test_type_checking_imports_are_not_runtime_dependencies():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from training.utils.config.rl import TISConfig\n"
    assert library_imports(source, "training.utils.rl.losses") == set()


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in library_modules() if (n := len(p.read_text().splitlines()))
            > MAX_MODULE_LINES}
    assert not long, f"split these along their seams (limit {MAX_MODULE_LINES} lines): {long}"


def definition_lengths(source: str, path: str) -> dict[str, tuple[str, int]]:
    """`path:Name` -> ("class" or "function", its lines) for every class and function in `source`, nested included."""
    return {f"{path}:{node.name}": ("class" if isinstance(node, ast.ClassDef) else "function",
                                    node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}


def oversized(lengths: dict[str, tuple[str, int]], ceilings: dict[str, int] = OVERSIZED) -> list[str]:
    """Definitions past their limit (`MAX_CLASS_LINES`, `MAX_FUNCTION_LINES`), or past their ceiling in
    `ceilings`; and ceilings that are no longer needed (the definition shrank under the limit, or is gone)."""
    limits = {"class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    found = [f"{name}: a {kind} of {n} lines (limit {ceilings.get(name, limits[kind])})"
             for name, (kind, n) in sorted(lengths.items()) if n > ceilings.get(name, limits[kind])]
    found += [f"{name}: listed in OVERSIZED but {'gone' if name not in lengths else 'within the limit'}; "
              "remove its entry" for name in sorted(ceilings)
              if name not in lengths or lengths[name][1] <= limits[lengths[name][0]]]
    return found


def test_no_class_or_function_is_longer_than_its_limit():
    """A module under its limit can still be one class that does everything: classes and functions have limits of
    their own. The few already past them may not grow; split one along an idea and its ceiling goes."""
    lengths = {}
    for path in library_modules():
        lengths |= definition_lengths(path.read_text(), str(path.relative_to(ROOT)))
    found = oversized(lengths)
    assert not found, "split these along an idea:\n" + "\n".join(found)


def test_the_size_check_catches_a_long_class_a_grown_one_and_a_stale_ceiling():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    assert oversized(definition_lengths(f"class Big:\n{body}", "m.py"), {}) == [
        f"m.py:Big: a class of {MAX_CLASS_LINES + 1} lines (limit {MAX_CLASS_LINES})"]
    listed = dict.fromkeys(OVERSIZED, ("class", 1))
    assert all("remove its entry" in v for v in oversized(listed)) and len(oversized(listed)) == len(OVERSIZED)
    name, ceiling = "training/utils/deploy/engine.py:Engine", OVERSIZED["training/utils/deploy/engine.py:Engine"]
    assert oversized({name: ("class", ceiling)}, {name: ceiling}) == []
    assert oversized({name: ("class", ceiling + 1)}, {name: ceiling}) == [
        f"{name}: a class of {ceiling + 1} lines (limit {ceiling})"]


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


def test_utils_top_level_is_a_few_rooms_each_named_in_contributing():
    entries = sorted(p.name for p in (PACKAGE / "utils").iterdir() if p.name != "__pycache__")
    assert len(entries) <= 10, f"training/utils/ has {len(entries)} entries at its top level: {entries}"
    rooms = [name for name in entries if (PACKAGE / "utils" / name).is_dir()]
    table = (ROOT / "CONTRIBUTING.md").read_text().split("Which room a change belongs in", 1)[1].split("\n\n", 2)[1]
    named = set(re.findall(r"^\| `utils/([a-z_]+)/` \|", table, re.M))
    assert named == set(rooms), f"CONTRIBUTING's room table names {sorted(named)}, training/utils/ has {rooms}"
