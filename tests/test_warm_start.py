"""Warm starts (`warm_start_from_checkpoint`, `warm_start_from_adapter`): a fresh run that begins from saved
weights only — fresh optimizer, step 0, data from the first row — and yields to a resumable checkpoint."""

import warnings

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from pydantic import ValidationError

from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.errors import CheckpointError, ConfigError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.rl import startup, training_run
from training.utils.rl.dataset import DurableRowSource
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.run_files.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from training.utils.run_files.logging import read_ledger
from training.utils.trainer import Trainer

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(6)]
LORA = dict(lora_rank=4, lora_alpha=8.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model():
    torch.manual_seed(0)  # what the recipes do before loading `model`: the same initial weights
    return load_model_and_tokenizer("tiny-random", device="cpu")[0]


def clone(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def train_one_step(trainer):
    torch.manual_seed(1)
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    trainer.optim_step()


@pytest.fixture(scope="module")
def source_checkpoint(tmp_path_factory):
    """A full-weight checkpoint at step 4 with the cursor 5 rows in, and the weights it holds."""
    root = tmp_path_factory.mktemp("source")
    trainer = Trainer(tiny_model(), TrainerConfig(learning_rate=1e-2))
    train_one_step(trainer)
    progress = {"step": 4, "accepted_samples": 16, "cursor": {"cursor_index": 5, "done": [], "seed": 0}}
    path = save_checkpoint(root, 4, policy=trainer, progress=progress, np_rng=np.random.default_rng(0))
    return path, clone(trainer.model)


def config(recipe, log_path, **fields):
    return recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2,
                         log_path=str(log_path), sampling=SamplingConfig(max_tokens=4, timeout_s=30), progress=False,
                         **fields)


def recording_factory(cursor_indices):
    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index, cursor_index):
            cursor_indices.append(cursor_index)
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                          reward=float(sample_index % 2))

        return rollout_fn

    return make_rollout_fn


def run_capturing(recipe, cfg, monkeypatch):
    """Run `cfg`; return the summary, the cursor indices the rollouts saw, and the trainers' state when the
    run's first evaluation ran (after start-up, before any step)."""
    built, at_start, cursor_indices = {}, {}, []

    def capture(*args, **kwargs):
        built["policy"], built["reference"], tokenizer, model = startup.setup_trainers(*args, **kwargs)
        return built["policy"], built["reference"], tokenizer, model

    monkeypatch.setattr(training_run, "setup_trainers", capture)

    def evaluation_fn(setup, step):
        if not at_start:
            policy = built["policy"]
            at_start.update(step=step, weights=clone(policy.model), optimizer_state=dict(policy.optimizer.state),
                            optimizer_steps=policy.step, schedule_steps=policy.scheduler.last_epoch)
            if built["reference"] is not None and not policy.lora:
                at_start["reference"] = clone(built["reference"].model)
        return {}

    summary = recipe.main(cfg, rollout_fn_factory=recording_factory(cursor_indices), rows=ROWS,
                          evaluation_fn=evaluation_fn)
    return summary, cursor_indices, at_start


def test_checkpoint_warm_start_loads_the_weights_only_and_trains_from_row_0(tmp_path, monkeypatch, source_checkpoint):
    path, saved_weights = source_checkpoint
    cfg = config(async_rl_loop, tmp_path / "run", max_steps=1, kl_beta=0.1, warm_start_from_checkpoint=str(path),
                 trainer=TrainerConfig(learning_rate=1e-2))
    summary, cursor_indices, at_start = run_capturing(async_rl_loop, cfg, monkeypatch)
    assert_same(at_start["weights"], saved_weights)
    # Fresh optimizer and schedule: no Adam moments, no steps (the checkpoint's trainer had taken one).
    assert at_start["optimizer_state"] == {} and at_start["optimizer_steps"] == at_start["schedule_steps"] == 0
    # The KL reference is `model`, not the warm-start weights.
    initial = clone(tiny_model())
    assert_same(at_start["reference"], initial)
    assert any(not torch.equal(initial[k], saved_weights[k]) for k in initial)
    # Step 0 and the data from the first row (O = 0: only batch 1's rows ran), not the checkpoint's cursor 5.
    assert (summary["start_step"], summary["steps"], at_start["step"]) == (0, 1, 0)
    assert sorted(set(cursor_indices)) == [0, 1]
    first = DurableRowSource(ROWS, seed=0, total_rows=None)
    (step,) = [r for r in read_ledger(summary["ledger"]) if "batch/row_ids" in r]
    assert sorted(step["batch/row_ids"]) == sorted([first.next().row_id, first.next().row_id])


def test_a_checkpoint_in_log_path_wins_over_the_warm_start(tmp_path, monkeypatch, source_checkpoint):
    path, saved_weights = source_checkpoint
    log_path = tmp_path / "run"
    rl_loop.main(config(rl_loop, log_path, max_steps=1, dcp_save_interval=1, trainer=TrainerConfig(learning_rate=1e-2)),
                 rollout_fn_factory=recording_factory([]), rows=ROWS)
    own = latest_checkpoint(log_path)
    resumed_weights = Trainer(tiny_model(), TrainerConfig(learning_rate=1e-2))
    load_checkpoint(own, policy=resumed_weights, np_rng=np.random.default_rng(0))

    cfg = config(rl_loop, log_path, max_steps=2, dcp_save_interval=1, warm_start_from_checkpoint=str(path),
                 trainer=TrainerConfig(learning_rate=1e-2))
    summary, cursor_indices, at_start = run_capturing(rl_loop, cfg, monkeypatch)
    assert (summary["start_step"], summary["steps"], at_start["step"]) == (1, 2, 1)
    assert_same(at_start["weights"], clone(resumed_weights.model))
    assert at_start["optimizer_steps"] == 1 and at_start["optimizer_state"] != {}
    assert sorted(set(cursor_indices)) == [2, 3]  # the cursor continued


def peft_adapter(directory, *, rank=4, alpha=8.0, targets=TARGETS):
    """An adapter written by peft itself, with random A and B (peft starts B at 0), and its tensors by name."""
    with warnings.catch_warnings():
        # peft probes the deprecated `is_gradient_checkpointing` property of transformers.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(tiny_model(), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                        task_type="CAUSAL_LM"))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" in name}


def adapters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" in name}


def test_peft_adapter_warm_starts_a_lora_policy(tmp_path, monkeypatch):
    saved = peft_adapter(tmp_path / "adapter")
    cfg = config(rl_loop, tmp_path / "run", max_steps=1, kl_beta=0.1, warm_start_from_adapter=str(tmp_path / "adapter"),
                 trainer=TrainerConfig(learning_rate=1e-2, **LORA))
    summary, cursor_indices, at_start = run_capturing(rl_loop, cfg, monkeypatch)
    warm = {name: t for name, t in at_start["weights"].items() if ".lora_" in name}
    assert_same(warm, saved)
    assert at_start["optimizer_state"] == {} and at_start["optimizer_steps"] == 0
    assert (summary["start_step"], summary["steps"]) == (0, 1) and sorted(set(cursor_indices)) == [0, 1]
    # The base weights are `model`'s, untouched.
    base = {name.replace(".base_layer.", ".").removeprefix("base_model.model."): t
            for name, t in at_start["weights"].items() if ".lora_" not in name}
    assert_same(base, clone(tiny_model()))


def test_warm_start_combinations_are_refused_at_construction():
    with pytest.raises(ValidationError, match="init_from_checkpoint and warm_start_from_checkpoint are set together"):
        rl_loop.Config(init_from_checkpoint="a", warm_start_from_checkpoint="b")
    with pytest.raises(ValidationError, match="init_from_checkpoint and warm_start_from_adapter are set together"):
        async_rl_loop.Config(init_from_checkpoint="a", warm_start_from_adapter="b", trainer=TrainerConfig(**LORA))
    with pytest.raises(ValidationError,
                       match="warm_start_from_checkpoint and warm_start_from_adapter are set together"):
        rl_loop.Config(warm_start_from_checkpoint="a", warm_start_from_adapter="b", trainer=TrainerConfig(**LORA))
    with pytest.raises(ValidationError, match="warm_start_from_adapter loads LoRA adapters, but trainer.lora_rank is"):
        rl_loop.Config(warm_start_from_adapter="b")
    assert rl_loop.Config(warm_start_from_adapter="b", trainer=TrainerConfig(**LORA)).warm_start_from_adapter == "b"


def lora_policy(**trainer_fields):
    return Trainer(tiny_model(), TrainerConfig(**(LORA | trainer_fields)))


def test_adapters_that_do_not_fit_are_refused_naming_the_difference(tmp_path):
    peft_adapter(tmp_path / "r8", rank=8, alpha=16.0)
    with pytest.raises(ConfigError, match=r"has r=8, lora_alpha=16.0, but trainer.lora_rank=4, trainer.lora_alpha=8"):
        startup.warm_start(rl_loop.Config(warm_start_from_adapter=str(tmp_path / "r8"), trainer=TrainerConfig(**LORA)),
                          lora_policy(), {})
    peft_adapter(tmp_path / "attention", targets=["q_proj", "v_proj"])
    policy = lora_policy()
    before = adapters(policy.model)
    with pytest.raises(ConfigError, match=r"does not fit the policy: 20 of the policy's 28 adapter tensors are not in "
                                          r"it and 0 of its 8 are not in the policy .*set trainer.lora_target_modules"):
        startup.warm_start(rl_loop.Config(warm_start_from_adapter=str(tmp_path / "attention"),
                                         trainer=TrainerConfig(**LORA)), policy, {})
    assert_same(adapters(policy.model), before)  # nothing was loaded
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a PEFT adapter directory: it needs adapter_config.json"):
        startup.warm_start(rl_loop.Config(warm_start_from_adapter=str(tmp_path / "empty"),
                                         trainer=TrainerConfig(**LORA)), lora_policy(), {})


def test_a_checkpoint_of_another_lora_setting_is_refused(source_checkpoint):
    path, _ = source_checkpoint
    cfg = rl_loop.Config(warm_start_from_checkpoint=str(path), trainer=TrainerConfig(**LORA))
    with pytest.raises(CheckpointError, match=r"cannot be loaded: it has no values for 28 of the policy's 28 LoRA "
                                              r"adapter tensors \(first: base_model\.model\.model\.layers\.0\."):
        startup.warm_start(cfg, lora_policy(), {})


def test_a_lora_checkpoint_warm_starts_the_adapters(tmp_path):
    trained = lora_policy(learning_rate=1e-2)
    train_one_step(trained)
    path = save_checkpoint(tmp_path, 3, policy=trained, progress={"step": 3}, np_rng=np.random.default_rng(0))
    policy = lora_policy()
    startup.warm_start(rl_loop.Config(warm_start_from_checkpoint=str(path), trainer=TrainerConfig(**LORA)), policy, {})
    assert_same(adapters(policy.model), adapters(trained.model))
    assert policy.step == 0 and policy.optimizer.state_dict()["state"] == {}
