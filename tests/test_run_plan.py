"""The run plan (`training/utils/rl/run_plan.py`): every `auto` and None-derived setting decided once at start-up,
the ledger's first record, saved with each checkpoint and compared on resume; and nothing in the library writes a
config once the run has started."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from training import SamplingConfig, TrainerConfig, sample_from_completion
from training.recipes import async_rl_loop, rl_loop
from training.utils.rl import memory_budget, startup
from training.utils.rl.memory_budget import estimate_memory
from training.utils.rl.run_plan import RunPlan, changes
from training.utils.run_files.logging import read_ledger
from training.utils.runtime import cpu_kind

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]
LIBRARY = Path(__file__).resolve().parents[1] / "training"


def sampling_factory(setup):
    async def rollout_fn(row, sample_index):
        (c,) = await setup.sampler.sample(row["prompt_token_ids"], seed=sample_index, **setup.sample_kwargs)
        return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs,
                                      reward=float(sum(c.output_ids) % 3), finish_reason=c.finish_reason)

    return rollout_fn


def tiny_cfg(recipe, tmp_path: Path, **overrides):
    fields = dict(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=1,
                  log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4, timeout_s=30),
                  trainer=TrainerConfig(learning_rate=1e-3), progress=False, dcp_save_interval=0)
    return recipe.Config(**(fields | overrides))


def planned(recipe, cfg) -> tuple[dict, list[dict]]:
    """The plan a run of `cfg` recorded first in its ledger, and the ledger."""
    summary = recipe.main(cfg, rollout_fn_factory=sampling_factory, rows=ROWS)
    records = read_ledger(summary["ledger"])
    return records[0]["plan"], records


def test_the_ledgers_first_record_is_the_plan(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="training")
    plan, records = planned(rl_loop, tiny_cfg(rl_loop, tmp_path, max_steps=2))
    assert set(records[0]) == {"plan"}, "a record of its own, before any step's"
    assert set(plan) == {f.name for f in dataclasses.fields(RunPlan)}
    assert all("plan" not in record for record in records[1:])
    # The suite runs with TRAINING_CPU_BF16=0: float32 throughout; GRPO's defaults; no budget; the tiny model's
    # 1024 positions are the engine's context and the longest segment.
    assert plan | {"threads": None, "machine": None, "choices": None} == dict(
        recipe="rl_loop", device="cpu", machine=None, threads=None, precision="fp32", trainer_weight_dtype="float32",
        trainer_compute_dtype="float32", engine_dtype="float32", decode_steps="eager", lora=False, lora_weights=None,
        frozen_weight_casts=False, compile_layers=False, share_prefixes=True, tis=None, min_group_size=2,
        eps_clip_high=0.2,
        max_tokens_per_microbatch=2048, gradient_checkpointing=False, memory_budget="no budget",
        prefix_cache_bytes=None, total_steps=2, optimizer_steps=2, context_tokens=1024,
        sequence_tokens=1024, sequence_limit="the policy's context (its max_position_embeddings)", eval_interval=0,
        choices=None)
    kind = cpu_kind.cpu_kind()
    assert plan["machine"] == kind.describe() and plan["threads"] == torch.get_num_threads() <= kind.usable_cores
    # Why each machine-decided setting is what it is: the suite's TRAINING_CPU_BF16=0 decided the precision.
    assert plan["choices"] == {
        "precision": "auto: TRAINING_CPU_BF16=0", "threads": plan["choices"]["threads"],
        "decode_steps": "auto: eager, CUDA graphs need CUDA", "max_tokens_per_microbatch": "as set",
        "compile_layers": "as set (on a CPU compiling pays after about 40 steps: benchmarks/RESULTS.md)"}
    assert plan["choices"]["threads"].startswith(f"{plan['threads']}")
    block = next(m for m in caplog.messages if m.startswith("run plan"))
    lines = block.splitlines()
    assert "fp32 on cpu" in block and "micro-batches of 2048 tokens" in block and len(lines) == 8 + 5
    assert lines[1] == f"  machine   {kind.describe()}"
    assert lines[8] == "  why       precision: auto: TRAINING_CPU_BF16=0"
    assert lines[9].startswith("            threads: ")


@pytest.mark.parametrize("bf16", ["0", "1"], ids=["cpu_without_bf16", "cpu_with_bf16"])
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_precision_and_lora_sharing_follow_the_cpu_and_the_adapters(tmp_path, monkeypatch, bf16, lora_rank):
    # The same seam `auto` reads the CPU through (`models.load.native_bf16`).
    monkeypatch.setenv("TRAINING_CPU_BF16", bf16)
    cfg = tiny_cfg(rl_loop, tmp_path, trainer=TrainerConfig(learning_rate=1e-3, lora_rank=lora_rank))
    plan, _ = planned(rl_loop, cfg)
    native = bf16 == "1"
    assert plan["precision"] == ("bf16-autocast" if native else "fp32")
    assert plan["trainer_weight_dtype"] == "float32", "bf16 autocast keeps float32 master weights"
    assert plan["trainer_compute_dtype"] == plan["engine_dtype"] == ("bfloat16" if native else "float32")
    assert plan["lora"] is bool(lora_rank)
    # A CPU engine runs a LoRA policy's adapters over the trainer's own base: in bf16 over the casts it keeps.
    assert plan["lora_weights"] == ("shared" if lora_rank else None)
    assert plan["frozen_weight_casts"] is (native and bool(lora_rank))


def test_the_async_recipe_plans_tis_from_o(tmp_path):
    on_policy, _ = planned(async_rl_loop, tiny_cfg(async_rl_loop, tmp_path / "o0"))
    off_policy, _ = planned(async_rl_loop, tiny_cfg(async_rl_loop, tmp_path / "o1", max_head_offpolicy_versions=1,
                                                    policy_loss="dapo"))
    assert on_policy["tis"] is None and on_policy["recipe"] == "async_rl_loop"
    assert off_policy["tis"] is not None and off_policy["tis"]["level"] == "token" and off_policy["tis"]["cap"] == 2
    assert on_policy["eps_clip_high"] == 0.2 and off_policy["eps_clip_high"] == 0.28, "DAPO clips higher"
    written_off, _ = planned(async_rl_loop, tiny_cfg(async_rl_loop, tmp_path / "off", max_head_offpolicy_versions=1,
                                                     tis=None))
    assert written_off["tis"] is None


@pytest.mark.parametrize("tis", ["auto", None], ids=["auto", "off"])
def test_a_config_rebuilt_from_its_dump_plans_the_same_run(tmp_path, tis):
    """`Config(**cfg.model_dump())` (a config saved as JSON and read back, a sweep's copy) keeps every setting
    the plan decides from: the default TIS of an off-policy run stays on, and one turned off stays off."""
    cfg = tiny_cfg(async_rl_loop, tmp_path / "first", max_head_offpolicy_versions=1, tis=tis)
    rebuilt = async_rl_loop.Config(**cfg.model_dump() | {"log_path": str(tmp_path / "rebuilt" / "run")})
    assert rebuilt.tis == tis and rebuilt.tis_in_effect() == cfg.tis_in_effect()
    first, _ = planned(async_rl_loop, cfg)
    again, _ = planned(async_rl_loop, rebuilt)
    assert (first["tis"] is None) == (tis is None) and again | {"threads": None} == first | {"threads": None}


def test_a_tight_memory_budget_is_in_the_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_budget, "current_rss_bytes", lambda: 1 << 30)  # the estimate stays put
    cfg = tiny_cfg(rl_loop, tmp_path)
    policy, reference, _, _ = startup.setup_trainers(cfg, total_steps=1)
    estimate = estimate_memory(cfg, policy, reference)
    working = estimate.working_set(estimate.microbatch_tokens, False)
    # Room for one context of prefix cache and a quarter less than the configured micro-batch.
    budget = sum(estimate.fixed.values()) + estimate.prefix_cache_floor + working * 3 // 4
    plan, _ = planned(rl_loop, cfg.model_copy(update={"memory_budget_gib": budget / memory_budget.GIB}))
    assert plan["prefix_cache_bytes"] == estimate.prefix_cache_floor < estimate.prefix_cache
    assert memory_budget.MIN_MICROBATCH_TOKENS <= plan["max_tokens_per_microbatch"] < 2048
    assert plan["memory_budget"].startswith("lowered to fit: deployment.prefix_cache_bytes ")
    assert "trainer.max_tokens_per_microbatch 2048 -> " in plan["memory_budget"]


def test_a_resume_under_another_plan_names_what_changed(tmp_path, caplog):
    first = tiny_cfg(rl_loop, tmp_path, max_steps=2, dcp_save_interval=1)
    planned(rl_loop, first)
    caplog.set_level(logging.WARNING, logger="training")
    resumed = tiny_cfg(rl_loop, tmp_path, max_steps=3, dcp_save_interval=1,
                       trainer=TrainerConfig(learning_rate=1e-3, max_tokens_per_microbatch=1024))
    summary = rl_loop.main(resumed, rollout_fn_factory=sampling_factory, rows=ROWS)
    assert summary["start_step"] == 2 and summary["steps"] == 3
    (warning,) = [m for m in caplog.messages if "another plan" in m]
    assert "max_tokens_per_microbatch: 2048 -> 1024" in warning
    assert "total_steps: 2 -> 3" in warning and "optimizer_steps: 2 -> 3" in warning
    assert "precision" not in warning, "only what changed"
    plans = [r["plan"] for r in read_ledger(summary["ledger"]) if "plan" in r]
    assert len(plans) == 2 and plans[1]["total_steps"] == 3, "the resumed run's plan follows the first run's steps"


def test_changes_names_each_value_and_skips_a_checkpoint_without_a_plan(tmp_path):
    plan, _ = planned(rl_loop, tiny_cfg(rl_loop, tmp_path))
    current = RunPlan(**plan)
    assert changes(None, current) == [] and changes(plan, current) == []
    assert changes(plan | {"precision": "bf16-autocast", "tis": {"level": "token"}}, current) == [
        "precision: 'bf16-autocast' -> 'fp32'", "tis: {'level': 'token'} -> None"]
    assert changes(plan | {"choices": {"precision": "as set"}}, current) == [], "a reason is no setting"
    assert changes(plan | {"machine": "another CPU"}, current) == [f"machine: 'another CPU' -> {plan['machine']!r}"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        current.precision = "bf16"


# ---- nothing writes a config after start-up --------------------------------------------------------------------

ALLOWED = {
    ("training/utils/config/deployment.py", "_cookbook_names"):
        "a validator: the config being built keeps the cookbook names that resolve elsewhere",
    ("training/utils/models/cpu_attention.py", "use_cpu_attention"):
        "loading the model: Hugging Face's module configs, copied so the engine's attention is its own",
    ("training/utils/models/load.py", "load_model_and_tokenizer"):
        "loading the model: Hugging Face's generation config gets the tokenizer's pad token",
    ("training/utils/rl/losses.py", "__post_init__"):
        "LossSpec freezing its own fields (a frozen dataclass of the loss, not a config)",
    ("training/utils/deploy/replica_deployment.py", "connect_replicated_deployment"):
        "connecting: each replica's DeploymentConfig made from the user's, before the run starts",
}
"""(module, function) -> why a config is copied or written there: start-up only."""


def config_writes(source: str, path: str) -> list[tuple[str, str, int]]:
    """(path, enclosing function, line) of each `model_copy` call, `object.__setattr__`, `setattr` on a config,
    assignment to a config's attribute (`cfg.x = ...`, `self.cfg.x = ...`) or rebinding of another object's
    config (`trainer.cfg = ...`) outside `__init__`."""
    found = []

    def configish(node) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name == "cfg" or name.endswith("_cfg") or name.endswith("config")

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            hit = False
            if isinstance(child, ast.Call):
                func = child.func
                hit = (isinstance(func, ast.Attribute) and func.attr == "model_copy") or (
                    isinstance(func, ast.Attribute) and func.attr == "__setattr__"
                    and isinstance(func.value, ast.Name) and func.value.id == "object") or (
                    isinstance(func, ast.Name) and func.id == "setattr" and child.args and configish(child.args[0]))
            elif isinstance(child, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for target in targets:
                    if not isinstance(target, ast.Attribute):
                        continue
                    writes_field = configish(target.value)
                    rebinds = target.attr in ("cfg", "config") and not (
                        function == "__init__" and isinstance(target.value, ast.Name) and target.value.id == "self")
                    hit = hit or writes_field or rebinds
            if hit:
                found.append((path, function, child.lineno))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_the_scan_finds_each_way_of_writing_a_config():
    source = '''
class Component:
    def __init__(self, cfg):
        self.cfg = cfg                                              # storing it: fine

    def step(self, trainer):
        self.cfg.max_tokens = 3                                     # 1
        trainer.cfg = trainer.cfg.model_copy(update={"x": 1})       # 2, 3
        object.__setattr__(self.cfg, "tis", None)                   # 4
        setattr(trainer_cfg, "x", 2)                                # 5
        deployment_config.port += 1                                 # 6
        run.value = 1                                               # not a config
'''
    assert [line for _, _, line in config_writes(source, "x.py")] == [7, 8, 8, 9, 10, 11]


def test_nothing_in_the_library_writes_or_copies_a_config_after_start_up():
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        relative = str(path.relative_to(LIBRARY.parent))
        if relative.startswith("training/examples/"):  # user code: what it writes before main() is its config
            continue
        found += [hit for hit in config_writes(path.read_text(), relative) if hit[:2] not in ALLOWED]
    assert not found, f"config copied or written outside start-up: {found}"
    assert all(key[0] in {str(p.relative_to(LIBRARY.parent)) for p in LIBRARY.rglob("*.py")} for key in ALLOWED)
