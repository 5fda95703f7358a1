"""The docs stay true to the code: the README's length, public imports only, `docs/configuration.md` against the
config models, and `docs/metrics.md` against what the recipes log on a tiny model."""

from __future__ import annotations

import re
import typing
from functools import cache
from pathlib import Path

import pydantic
import pytest

import config_page
import training
from training import (
    OverlongConfig,
    RolloutRun,
    RolloutSample,
    SamplingConfig,
    TISConfig,
    TrainerConfig,
    rollout_evaluation,
)
from training.recipes import async_rl_loop, rl_loop
from training.utils.rl.agent.session import COUNTERS as SHIM_COUNTERS
from training.utils.rl.health import RunHealth
from training.utils.run_files.logging import read_ledger

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_README_LINES = 250
RECIPE_MODULES = ("training.recipes.async_rl_loop", "training.recipes.rl_loop")
METRIC_FAMILIES = ("rollout", "train", "perf", "async", "producer", "batch", "eval")


def user_facing_pages() -> list[Path]:
    """Pages whose code users copy: they may import only public names."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((ROOT / "skills").rglob("*.md")),
            *sorted((ROOT / "training" / "examples").rglob("README.md"))]


def table_rows(section: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown tables in `section` whose first header cell is `header`."""
    rows, inside = [], False
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] if line.startswith("|") else None
        if cells is None:
            inside = False
        elif not inside:
            inside = cells[0] == header
        elif not set(cells[0]) <= set("-: "):
            rows.append(cells)
    return rows


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# ---- the README and imports -------------------------------------------------------------------------------------


def test_the_readme_fits_in_250_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference material to docs/"


def imports_of(text: str) -> list[tuple[str, list[str]]]:
    """(module, names) of every `from training... import` and `import training...` in `text` that starts a line or
    an inline code span, parenthesised name lists included."""
    start = r"(?:^|`)[ \t]*"
    found = [(m[1], [n.strip().split(" as ")[0] for n in m[2].strip("()").split(",") if n.strip()])
             for m in re.finditer(start + r"from[ \t]+(training[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#`;]+)", text,
                                  re.M)]
    found += [(m[1], []) for m in re.finditer(start + r"import[ \t]+(training[\w.]*)", text, re.M)]
    return found


@pytest.mark.parametrize("page", user_facing_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_import_only_the_public_surface(page):
    bad = []
    for module, names in imports_of(page.read_text()):
        if module == "training":
            bad += [f"from training import {n}: not in training.PUBLIC_NAMES" for n in names
                    if n not in training.PUBLIC_NAMES]
        elif module not in RECIPE_MODULES:
            bad.append(f"{module}: import from `training` (public names) or a recipe module instead")
    assert not bad, "\n".join(bad)


def test_the_import_check_catches_deep_and_unknown_imports():
    text = ("x = 1\nfrom training.utils.config.rl import TISConfig\nfrom training import (\n    RolloutSample,\n"
            "    Trainer,\n)\n    import training.utils.rl\nraise `from training import ConfigError`; `x`\n")
    assert imports_of(text) == [("training.utils.config.rl", ["TISConfig"]), ("training", ["RolloutSample", "Trainer"]),
                                ("training", ["ConfigError"]), ("training.utils.rl", [])]


# ---- docs/configuration.md ----------------------------------------------------------------------------------------


def shared_config() -> type[pydantic.BaseModel]:
    """The base both recipes' `Config` derive from: the fields they share."""
    return next(c for c in async_rl_loop.Config.__mro__[1:] if c in rl_loop.Config.__mro__ and c.model_fields)


def nested_models(model: type[pydantic.BaseModel]) -> set[type[pydantic.BaseModel]]:
    """Every config model a field of `model` holds, at any depth (`TrainerConfig`, `TISConfig | None`, ...)."""
    found = set()
    for field in model.model_fields.values():
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel) and arg not in found:
                found |= {arg} | nested_models(arg)
    return found


@cache
def config_sections() -> dict[str, dict[str, pydantic.fields.FieldInfo]]:
    """Section name in docs/configuration.md -> the fields its table must list."""
    shared = shared_config()
    sections = {shared.__name__: dict(shared.model_fields)}
    for name, recipe in (("async_rl_loop.Config", async_rl_loop.Config), ("rl_loop.Config", rl_loop.Config)):
        sections[name] = {k: f for k, f in recipe.model_fields.items() if k not in shared.model_fields}
    for model in nested_models(async_rl_loop.Config) | nested_models(rl_loop.Config):
        sections[model.__name__] = dict(model.model_fields)
    return sections


@cache
def documented_config() -> dict[str, dict[str, str]]:
    """Section (the backticked name in each `## ` heading) -> {field: its default cell}."""
    page = (DOCS / "configuration.md").read_text()
    documented = {}
    for section in page.split("\n## ")[1:]:
        heading = section.splitlines()[0]
        if names := backticked(heading):
            documented[names[-1]] = {backticked(row[0])[0]: row[1] for row in table_rows(section, "field")}
    return documented


def test_the_configuration_page_is_generated_from_the_field_docstrings():
    """Each field's meaning lives in its docstring; the page's tables are rendered from them (`tests/config_page.py`),
    so a docstring, a default or a field that changed without the page fails here."""
    page = (DOCS / "configuration.md").read_text()
    assert config_page.generated_part(page) == config_page.render(), (
        "docs/configuration.md differs from the config models: run `python tests/config_page.py`")


def test_the_configuration_page_opens_with_the_settings_the_examples_set():
    page = (DOCS / "configuration.md").read_text()
    first = page.split("\n## ")[1]
    assert first.startswith("The settings the examples set")
    assert [backticked(row[0])[0] for row in table_rows(first, "setting")] == list(config_page.EXAMPLE_SETTINGS)


def test_the_configuration_page_has_a_section_for_every_config_model():
    assert set(documented_config()) == set(config_sections())


@pytest.mark.parametrize("section", sorted(config_sections()))
def test_the_configuration_page_lists_exactly_the_fields_of(section):
    listed, fields = set(documented_config().get(section, {})), set(config_sections()[section])
    assert not fields - listed, f"docs/configuration.md, {section}: add rows for {sorted(fields - listed)}"
    assert not listed - fields, f"docs/configuration.md, {section}: no such fields {sorted(listed - fields)}"


@pytest.mark.parametrize("section", sorted(config_sections()))
def test_the_configuration_page_gives_the_code_defaults_of(section):
    namespace = {name: getattr(training, name) for name in training.PUBLIC_NAMES}
    wrong = []
    for name, cell in documented_config().get(section, {}).items():
        field = config_sections()[section].get(name)
        if field is None:
            continue
        if field.is_required():
            if cell != "required":
                wrong.append(f"{name}: required, the page says {cell}")
        elif cell == "required" or eval(cell.strip("`"), namespace) != field.get_default(call_default_factory=True):
            wrong.append(f"{name}: default {field.get_default(call_default_factory=True)!r}, the page says {cell}")
    assert not wrong, f"docs/configuration.md, {section}:\n" + "\n".join(wrong)


# ---- docs/metrics.md --------------------------------------------------------------------------------------------

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]


def make_rollout_fn(setup):
    """Real sampling, with every optional part of a sample that adds a key: raw logprobs, versions, a shim
    session's counters; one draw returns None and one raises a recoverable error, so both drop reasons show."""

    async def rollout_fn(row, sample_index, evaluation):
        if not evaluation and sample_index == 3 and row["id"] in ("r1", "r2"):
            if row["id"] == "r1":
                return None
            raise training.RecoverableRolloutError("a flaky tool")
        prompt = row["prompt_token_ids"]
        (c,) = await setup.sampler.sample(prompt, **setup.sample_kwargs)
        n = len(c.output_ids)
        segment = RolloutSample(
            tokens=prompt + c.output_ids, logprobs=[0.0] * len(prompt) + c.logprobs,
            loss_mask=[0] * len(prompt) + [1] * n, reward=float(sum(c.output_ids) % 3),
            finish_reason=c.finish_reason, raw_logprobs=[0.0] * len(prompt) + [lp - 0.01 for lp in c.logprobs],
            versions=[-1] * len(prompt) + list(c.versions),
        )
        return RolloutRun(segments=[segment], metadata={f"shim/{name}": 1 for name in SHIM_COUNTERS})

    return rollout_fn


@pytest.fixture(scope="module")
def logged_keys(tmp_path_factory) -> set[str]:
    """Every key both recipes log in two steps of a tiny model, with the knobs that add keys turned on: KL
    (in the loss for one recipe, in the reward for the other) with the adaptive controller, TIS with IcePop
    and seq-mask, the dual clip, overlong shaping, two PPO epochs, disk weight sync, a checkpoint, an
    evaluation, and for the async recipe O=1 with a concurrency cap."""
    tmp = tmp_path_factory.mktemp("docs_metrics")
    common = dict(
        model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=2,
        sampling=SamplingConfig(max_tokens=4, timeout_s=30), trainer=TrainerConfig(learning_rate=1e-3),
        progress=False, kl_beta=0.05, kl_target=0.01, tis=TISConfig(icepop_beta=2.0, seq_mask_low=0.1,
                                                                    seq_mask_high=10.0),
        overlong_penalty=OverlongConfig(buffer=2), dual_clip_c=3.0,
    )
    sync = rl_loop.Config(**common, log_path=str(tmp / "sync"), kl_placement="reward", ppo_epochs=2,
                          deployment=training.DeploymentConfig(weight_sync="disk"))
    overlapped = async_rl_loop.Config(**common, log_path=str(tmp / "async"), dcp_save_interval=2,
                                      max_head_offpolicy_versions=1, max_concurrency_rollout_sample=8)
    keys = set()
    for recipe, cfg in ((rl_loop, sync), (async_rl_loop, overlapped)):
        summary = recipe.main(cfg, rollout_fn_factory=make_rollout_fn, rows=ROWS,
                              evaluation_fn=rollout_evaluation(make_rollout_fn, ROWS[:2]))
        for record in read_ledger(summary["ledger"]):
            keys |= set(record)
    return keys - {"step", "time"}


@cache
def metrics_page() -> str:
    return (DOCS / "metrics.md").read_text()


@cache
def documented_metrics() -> set[str]:
    """The keys (and `<placeholder>` patterns) of the first column of the page's `metric` tables."""
    return {key for row in table_rows(metrics_page(), "metric") for key in backticked(row[0])}


def pattern(key: str) -> re.Pattern:
    """`rollout/drop_<reason>` -> a regex a logged key matches."""
    return re.compile("".join(".+" if part.startswith("<") else re.escape(part)
                              for part in re.split(r"(<[^>]+>)", key)) + "$")


def is_documented(key: str, documented: set[str]) -> bool:
    return key in documented or any("<" in doc and pattern(doc).match(key) for doc in documented)


@cache
def library_source() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "training").rglob("*.py")))


def code_can_log(key: str, logged: set[str]) -> bool:
    """A documented key is one a run logged, or one the code names: the whole key as a string, its
    `<placeholder>` prefix as an f-string (`f"rollout/drop_{reason}"`), a trainer metric's own name (logged
    as `train/<name>`), or a counter of the agent shim's sessions."""
    if key in logged or any("<" in key and pattern(key).match(k) for k in logged):
        return True
    source = library_source()
    if "<" in key:
        return key.split("<", 1)[0] + "{" in source
    family, _, name = key.partition("/")
    if family == "rollout" and name.startswith("shim/"):
        return name.removeprefix("shim/") in SHIM_COUNTERS
    return f'"{key}"' in source or (family == "train" and f'"{name}"' in source)


def test_every_key_the_recipes_log_is_on_the_metrics_page(logged_keys):
    missing = sorted(k for k in logged_keys if not is_documented(k, documented_metrics()))
    assert not missing, f"add to docs/metrics.md: {missing}"


def test_every_key_on_the_metrics_page_is_one_the_code_can_log(logged_keys):
    unknown = sorted(k for k in documented_metrics() if not code_can_log(k, logged_keys))
    assert not unknown, f"docs/metrics.md names keys no code logs: {unknown}"


def test_the_metrics_page_names_every_shim_counter_and_every_run_health_flag():
    counters = {k.removeprefix("rollout/shim/") for k in documented_metrics() if k.startswith("rollout/shim/")}
    assert counters == set(SHIM_COUNTERS)
    flags = {backticked(row[0])[0] for row in table_rows(metrics_page(), "flag")}
    assert flags == set(RunHealth.LEVERS)


def test_the_key_matching_reads_placeholders_and_catches_strangers():
    documented = {"rollout/drop_<reason>", "train/loss"}
    assert is_documented("rollout/drop_recoverable:TimeoutError", documented)
    assert not is_documented("rollout/dropped", documented) and not is_documented("train/loss_x", documented)
    assert not code_can_log("train/made_up_metric", set()) and code_can_log("perf/step_time", set())


def test_only_the_metrics_page_lists_metric_keys():
    """One home: the skill and the other pages link to docs/metrics.md instead of keeping a second list."""
    others = [p for p in user_facing_pages() if p != DOCS / "metrics.md"]
    copies = [str(p.relative_to(ROOT)) for p in others if table_rows(p.read_text(), "metric")]
    assert not copies, f"these keep a metric table of their own; link docs/metrics.md instead: {copies}"


@pytest.mark.parametrize("page", [*user_facing_pages(), ROOT / "CONTRIBUTING.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_that_exist(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    broken = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"
