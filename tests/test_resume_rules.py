"""Resuming under changed settings: refused with the field named, or (O, epochs) continued without loss."""

import logging
import shutil
from collections import Counter

import pytest
import torch

from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.errors import ConfigError
from training.utils.rl.resume import check_resumable
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.run_files.logging import read_ledger


def rows(n):
    return [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(n)]


def factory(crash_at_call=None):
    calls = [0]

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            calls[0] += 1
            if calls[0] == crash_at_call:
                raise RuntimeError("the process died here")
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                          reward=float((int(row["id"][1:]) + sample_index) % 2))

        return rollout_fn

    return make_rollout_fn


def config(recipe, log_path, **overrides):
    fields = dict(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, epochs=2,
                  dcp_save_interval=1, log_path=str(log_path), sampling=SamplingConfig(max_tokens=4),
                  trainer=TrainerConfig(learning_rate=1e-3), progress=False) | overrides
    return recipe.Config(**fields)


@pytest.mark.parametrize("change, expected", [
    (dict(completions_per_prompt=4), "completions_per_prompt was 2, now 4"),
    (dict(prompt_groups_per_step=1), "prompt_groups_per_step was 2, now 1"),
    (dict(seed=7), "seed was 0, now 7"),
    (dict(rows=12), "dataset_rows was 8, now 12"),
])
def test_a_resume_that_would_lose_or_repeat_rows_is_refused_naming_the_field(tmp_path, change, expected):
    # The first process dies in its 3rd step (4 calls a step), after the checkpoint of step 2.
    with pytest.raises(RuntimeError, match="the process died here"):
        rl_loop.main(config(rl_loop, tmp_path), rollout_fn_factory=factory(crash_at_call=9), rows=rows(8))
    n_rows = change.pop("rows", 8)
    with pytest.raises(ConfigError, match=f"cannot resume the checkpoint at step 2: {expected}"):
        rl_loop.main(config(rl_loop, tmp_path, **change), rollout_fn_factory=factory(), rows=rows(n_rows))


def test_the_same_rows_with_other_ids_are_another_dataset(tmp_path):
    rl_loop.main(config(rl_loop, tmp_path, max_steps=1), rollout_fn_factory=factory(), rows=rows(4))
    renamed = [row | {"id": f"q{i}"} for i, row in enumerate(rows(4))]
    with pytest.raises(ConfigError, match="dataset_row_ids was"):
        rl_loop.main(config(rl_loop, tmp_path), rollout_fn_factory=factory(), rows=renamed)


def test_a_resume_with_another_recipe_is_refused(tmp_path):
    rl_loop.main(config(rl_loop, tmp_path, max_steps=1), rollout_fn_factory=factory(), rows=rows(4))
    with pytest.raises(ConfigError, match="recipe was 'rl_loop', now 'async_rl_loop'"):
        async_rl_loop.main(config(async_rl_loop, tmp_path), rollout_fn_factory=factory(), rows=rows(4))


def test_changing_o_on_resume_loses_no_row(tmp_path, caplog):
    """The async recipe dies at its 13th rollout call with O=1, resumes with O=0: every row still trains
    exactly once per epoch."""
    caplog.set_level(logging.INFO, logger="training")
    data = rows(8)
    with pytest.raises(RuntimeError, match="the process died here"):
        async_rl_loop.main(config(async_rl_loop, tmp_path, max_head_offpolicy_versions=1),
                           rollout_fn_factory=factory(crash_at_call=13), rows=data)
    summary = async_rl_loop.main(config(async_rl_loop, tmp_path, max_head_offpolicy_versions=0),
                                 rollout_fn_factory=factory(), rows=data)
    assert summary["start_step"] > 0 and summary["steps"] == 8
    assert "resuming with max_head_offpolicy_versions=0" in caplog.text
    by_step = {r["step"]: r["batch/row_ids"] for r in read_ledger(summary["ledger"]) if "train/loss" in r}
    assert sorted(by_step) == list(range(1, 9))
    assert Counter(row_id for ids in by_step.values() for row_id in ids) == Counter({r["id"]: 2 for r in data})


def unnamed_rows(n, offset=0):
    return [{"prompt_token_ids": [1, 40 + i + offset, 50, 60]} for i in range(n)]


def unnamed_factory(setup):
    async def rollout_fn(row, sample_index):
        return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                      reward=float(sample_index))

    return rollout_fn


def test_rows_without_ids_are_told_apart_by_their_content(tmp_path, caplog):
    """Without ids a row's id is its place, so the same number of other rows had the same ids: the checkpoint
    also records a hash of those rows' content. The same rows resume."""
    caplog.set_level(logging.INFO, logger="training")
    rl_loop.main(config(rl_loop, tmp_path, max_steps=1), rollout_fn_factory=unnamed_factory, rows=unnamed_rows(4))
    with pytest.raises(ConfigError, match=r"cannot resume the checkpoint at step 1: dataset_content was "
                                          r"'[0-9a-f]{16}', now '[0-9a-f]{16}'\. Its data cursor"):
        rl_loop.main(config(rl_loop, tmp_path), rollout_fn_factory=unnamed_factory, rows=unnamed_rows(4, offset=10))
    summary = rl_loop.main(config(rl_loop, tmp_path, max_steps=2), rollout_fn_factory=unnamed_factory,
                           rows=unnamed_rows(4))
    assert summary["start_step"] == 1 and summary["steps"] == 2
    assert "does not record" not in caplog.text


def save_tiny_model(directory, *, seed=0, hidden_size=64):
    from training.utils.models.load import load_model_and_tokenizer
    from training.utils.models.tiny import make_test_tokenizer, tiny_config

    torch.manual_seed(seed)
    model, _ = load_model_and_tokenizer(tiny_config(hidden_size=hidden_size), device="cpu")
    model.save_pretrained(directory)
    make_test_tokenizer().save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Three models: `a`; `a_copy`, the same weights in another directory; `b`, the same shapes with other weights;
    `wide`, another architecture (hidden size 32, not 64)."""
    root = tmp_path_factory.mktemp("models")
    a = save_tiny_model(root / "a")
    shutil.copytree(a, root / "a_copy")
    return {"a": a, "a_copy": str(root / "a_copy"), "b": save_tiny_model(root / "b", seed=1),
            "wide": save_tiny_model(root / "wide", hidden_size=32)}


@pytest.mark.parametrize("other, changed", [
    ("b", r"model_weights was '[0-9a-f]{16}', now '[0-9a-f]{16}'"),
    ("wide", r"model_architecture was 'llama, [\d,]+ parameters \(shapes [0-9a-f]{12}\)', now 'llama, [\d,]+ "
             r"parameters \(shapes [0-9a-f]{12}\)'; model_weights was"),
])
def test_a_resume_with_another_model_is_refused_naming_it(tmp_path, tiny_models, other, changed):
    """Another architecture used to fail deep in the load with a raw size mismatch, and the same shapes from
    another directory trained on: both are refused before anything is loaded, naming the model it trained."""
    rl_loop.main(config(rl_loop, tmp_path, model=tiny_models["a"], max_steps=1), rollout_fn_factory=factory(),
                 rows=rows(4))
    with pytest.raises(ConfigError, match=rf"cannot resume the checkpoint at step 1: {changed}.*Its weights and "
                                          rf"optimizer state belong to the model it trained \(model="
                                          rf"'{tiny_models['a']}'\), not this one"):
        rl_loop.main(config(rl_loop, tmp_path, model=tiny_models[other]), rollout_fn_factory=factory(), rows=rows(4))


def test_the_same_weights_from_another_directory_resume(tmp_path, tiny_models, caplog):
    caplog.set_level(logging.INFO, logger="training")
    rl_loop.main(config(rl_loop, tmp_path, model=tiny_models["a"], max_steps=1), rollout_fn_factory=factory(),
                 rows=rows(4))
    summary = rl_loop.main(config(rl_loop, tmp_path, model=tiny_models["a_copy"], max_steps=2),
                           rollout_fn_factory=factory(), rows=rows(4))
    assert summary["start_step"] == 1 and summary["steps"] == 2
    assert f"resuming with model={tiny_models['a_copy']!r}" in caplog.text


def test_a_warm_start_from_another_models_checkpoint_stays_possible(tmp_path, tiny_models):
    """Weights only, into a new run: the checkpoint of `a` warm-starts a run of `b` (same shapes)."""
    rl_loop.main(config(rl_loop, tmp_path / "first", model=tiny_models["a"], max_steps=1),
                 rollout_fn_factory=factory(), rows=rows(4))
    checkpoint = tmp_path / "first" / "checkpoints" / "step-00000001"
    summary = rl_loop.main(config(rl_loop, tmp_path / "second", model=tiny_models["b"], max_steps=1,
                                  warm_start_from_checkpoint=str(checkpoint)),
                           rollout_fn_factory=factory(), rows=rows(4))
    assert summary["start_step"] == 0 and summary["steps"] == 1


def test_a_checkpoint_from_before_the_model_and_content_checks_resumes_with_a_warning(caplog):
    current = {"recipe": "rl_loop", "completions_per_prompt": 2, "prompt_groups_per_step": 2, "seed": 0,
               "dataset_rows": 4, "dataset_row_ids": "ids", "dataset_content": "content",
               "dataset_digest": "digest", "epochs": 1,
               "max_head_offpolicy_versions": None, "model": "m", "model_architecture": "llama",
               "model_weights": "w"}
    older = {name: value for name, value in current.items()
             if name not in ("dataset_content", "dataset_digest", "model", "model_architecture", "model_weights")}
    with caplog.at_level(logging.WARNING, logger="training"):
        check_resumable({"step": 3, "settings": older}, current)
    assert caplog.messages == ["the checkpoint at step 3 does not record dataset_content, dataset_digest, "
                               "model_architecture, "
                               "model_weights (written by an older version): not checked"]
    with pytest.raises(ConfigError, match="dataset_row_ids was 'ids', now 'other'"):
        check_resumable({"step": 3, "settings": older}, current | {"dataset_row_ids": "other"})
