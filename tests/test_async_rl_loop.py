"""The async recipe end to end on a tiny model: equivalence with rl_loop, versions, telemetry."""

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from numerics_support import ADAM_WEIGHTS_ATOL
from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.run_files.logging import read_ledger

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(8)]

COMMON = dict(
    model="tiny-random",
    completions_per_prompt=4,
    prompt_groups_per_step=2,
    max_steps=3,
    sampling=SamplingConfig(max_tokens=4, timeout_s=30),
    trainer=TrainerConfig(learning_rate=1e-3),
    progress=False,
    kl_beta=0.05,
)


def deterministic_factory(calls):
    """No sampler: the sample depends only on (row, draw), with lengths and rewards that vary."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index, submit_version):
            calls.append((row["id"], sample_index, submit_version))
            await asyncio.sleep(0)
            n_out = 1 + (sample_index + int(row["id"][1:])) % 3
            out = [70 + sample_index + k for k in range(n_out)]
            reward = float((sample_index * 7 + int(row["id"][1:])) % 4)
            return sample_from_completion(row["prompt_token_ids"], out, [-1.0 - 0.1 * k for k in range(n_out)], reward)

        return rollout_fn

    return make_rollout_fn


def sampling_factory(calls):
    """Real sampling from the deployment, seeded per (row, draw): the same weights give the same sample, so two
    recipes sample alike exactly when they sample from the same policy version."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, row_index, sample_index, submit_version):
            calls.append((row["id"], sample_index, submit_version))
            (c,) = await setup.sampler.sample(row["prompt_token_ids"], seed=100 * row_index + sample_index,
                                              **setup.sample_kwargs)
            return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs,
                                          reward=float(sum(c.output_ids) % 3), finish_reason=c.finish_reason)

        return rollout_fn

    return make_rollout_fn


def trained(summary):
    return [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]


def run_rl_loop(tmp_path, factory=deterministic_factory, **overrides):
    calls = []
    cfg = rl_loop.Config(**(COMMON | overrides), log_path=str(tmp_path / "sync"), output_dir=str(tmp_path / "sync_out"))
    summary = rl_loop.main(cfg, rollout_fn_factory=factory(calls), rows=ROWS)
    batches = [sorted({c[0] for c in calls[i:i + 8]}) for i in range(0, len(calls), 8)]
    return summary, batches


def run_async(tmp_path, name, factory=deterministic_factory, **overrides):
    calls = []
    cfg = async_rl_loop.Config(**(COMMON | overrides), log_path=str(tmp_path / name),
                               output_dir=str(tmp_path / f"{name}_out"))
    summary = async_rl_loop.main(cfg, rollout_fn_factory=factory(calls), rows=ROWS)
    return summary, calls


def weights(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("factory", [deterministic_factory, sampling_factory], ids=["scripted", "sampled"])
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("synchronous", dict(synchronous_training=True)),
        ("o0_one_chunk", dict(max_head_offpolicy_versions=0, pipeline_chunks_per_step=1)),
    ],
)
def test_matches_rl_loop_step_for_step(tmp_path, name, overrides, factory):
    # Two minibatches per batch: the PPO loop's shuffling must match too. With sampled rollouts the samples
    # match only if every draw samples from the version rl_loop samples from (on-policy).
    reference, batches = run_rl_loop(tmp_path, factory, ppo_minibatches=2)
    summary, calls = run_async(tmp_path, name, factory, ppo_minibatches=2, **overrides)
    ours, theirs = trained(summary), trained(reference)
    assert [r["step"] for r in ours] == [1, 2, 3]
    assert [sorted(r["batch/row_ids"]) for r in ours] == batches
    for mine, ref in zip(ours, theirs):
        for key in ("train/loss", "train/ref_kl", "train/grad_norm", "train/entropy"):
            assert mine[key] == pytest.approx(ref[key], abs=1e-6), key
    assert theirs[-1]["train/ref_kl"] > 0
    final, expected = weights(tmp_path / f"{name}_out"), weights(tmp_path / "sync_out")
    assert all(torch.allclose(final[k], expected[k], atol=1e-6) for k in expected)
    # On-policy at submission: every draw of batch k was submitted on version k − 1.
    assert sorted(v for _, _, v in calls) == [0] * 8 + [1] * 8 + [2] * 8


def test_chunked_gradient_accumulation_matches_one_big_step(tmp_path):
    """K=2 chunks, one epoch and minibatch: the per-chunk token sums, normalised once at the
    end, give rl_loop's token-mean gradient (up to float summation order)."""
    reference, batches = run_rl_loop(tmp_path)
    summary, _ = run_async(tmp_path, "chunked", max_head_offpolicy_versions=0, pipeline_chunks_per_step=2)
    ours, theirs = trained(summary), trained(reference)
    assert [r["async/realized_chunks"] for r in ours] == [2.0, 2.0, 2.0]
    assert [sorted(r["batch/row_ids"]) for r in ours] == batches
    for mine, ref in zip(ours, theirs):
        for key in ("train/loss", "train/grad_norm", "train/ref_kl"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    final, expected = weights(tmp_path / "chunked_out"), weights(tmp_path / "sync_out")
    assert all(torch.allclose(final[k], expected[k], atol=ADAM_WEIGHTS_ATOL) for k in expected)


def test_real_sampling_off_policy_carries_versions_and_reports_telemetry(tmp_path):
    seen_versions = []

    def factory(setup):
        async def rollout_fn(row, submit_version):
            (c,) = await setup.sampler.sample(row["prompt_token_ids"], **setup.sample_kwargs)
            seen_versions.append((submit_version, c.versions))
            return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs,
                                          reward=float(sum(c.output_ids) % 3), finish_reason=c.finish_reason,
                                          output_versions=c.versions)

        return rollout_fn

    cfg = async_rl_loop.Config(**(COMMON | dict(max_steps=5, kl_beta=0.0)), log_path=str(tmp_path / "run"),
                               max_head_offpolicy_versions=1, pipeline_chunks_per_step=2,
                               max_concurrency_rollout_sample=12)
    summary = async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert summary["steps"] == 5 and summary["version"] == 5
    records = read_ledger(summary["ledger"])
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    # The sampler's per-token versions travel with the samples; tokens never come from the future.
    assert all(v >= s for s, versions in seen_versions for v in versions)
    assert all(0 <= r["async/version_offset_max"] <= 2 for r in steps)
    assert all(r["async/token_version_offset_mean"] <= r["async/version_offset_max"] for r in steps)
    assert max(r["async/version_offset_max"] for r in steps) >= 1, "O=1 lets rows run one version ahead"
    for key in ("perf/step_time", "perf/train_time", "perf/rollout_wait_time", "perf/weight_sync_time",
                "perf/trainer_idle_frac", "perf/samples_per_s", "perf/train_tokens_per_s",
                "rollout/raw_reward", "train/entropy", "async/in_flight_calls_mean"):
        assert all(key in r for r in steps), key
    producer = [r for r in records if "producer/event" in r]
    assert [r["producer/event"] for r in producer] == list(range(len(producer)))
    assert producer[-1]["producer/rows_accepted_total"] >= 10
    assert all(r["producer/in_flight_calls"] <= 12 for r in producer)
    assert summary["plots"] and (tmp_path / "run" / "metrics.png").is_file()


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="max_concurrency_rollout_sample=3 is below completions_per_prompt=4"):
        async_rl_loop.Config(completions_per_prompt=4, max_concurrency_rollout_sample=3)
    with pytest.raises(ValueError, match="stall_timeout_s=10 must exceed rollout_timeout_s=600"):
        async_rl_loop.Config(stall_timeout_s=10)
    with pytest.raises(ValueError, match="max_head_offpolicy_versions"):
        async_rl_loop.Config(max_head_offpolicy_versions=-1)


def test_synchronous_training_is_on_policy_whatever_the_default_o():
    assert async_rl_loop.Config(synchronous_training=True).max_head_offpolicy_versions == 0
    with pytest.raises(ValueError, match="trains on-policy, but max_head_offpolicy_versions=2"):
        async_rl_loop.Config(synchronous_training=True, max_head_offpolicy_versions=2)
    assert "max_head_offpolicy_versions" not in rl_loop.Config.model_fields


def test_tis_is_on_by_default_off_policy_and_off_when_written_off():
    from training.utils.config.rl import TISConfig

    assert async_rl_loop.Config(max_head_offpolicy_versions=1).tis_in_effect() == TISConfig()
    assert async_rl_loop.Config(max_head_offpolicy_versions=1).tis_in_effect().level == "token"
    assert async_rl_loop.Config(max_head_offpolicy_versions=1, tis=None).tis_in_effect() is None
    assert async_rl_loop.Config(max_head_offpolicy_versions=2, tis=TISConfig(cap=3.0)).tis_in_effect() == \
        TISConfig(cap=3.0)
    assert async_rl_loop.Config().tis_in_effect() is None
    assert async_rl_loop.Config(synchronous_training=True).tis_in_effect() is None
    assert rl_loop.Config().tis_in_effect() is None
    # The config keeps what the user wrote: `auto` is decided where the run plan reads it, nothing is set.
    cfg = async_rl_loop.Config(max_head_offpolicy_versions=1)
    assert cfg.tis == "auto" and cfg.model_dump()["tis"] == "auto"
    # ... and a config rebuilt from its dump, or from what was written, decides the same.
    assert async_rl_loop.Config(**cfg.model_dump()).tis_in_effect() == TISConfig()
    assert async_rl_loop.Config(**cfg.model_dump(exclude_unset=True)).tis_in_effect() == TISConfig()
    assert async_rl_loop.Config(**async_rl_loop.Config(tis=None).model_dump()).tis_in_effect() is None


@pytest.mark.parametrize("written", [{}, {"tis": None}], ids=["unset", "written_off"])
def test_an_off_policy_run_trains_with_tis_unless_written_off(tmp_path, written):
    cfg = async_rl_loop.Config(**COMMON, **written, max_head_offpolicy_versions=1, log_path=str(tmp_path / "run"))
    as_written = cfg.model_dump()
    summary = async_rl_loop.main(cfg, rollout_fn_factory=deterministic_factory([]), rows=ROWS)
    steps = trained(summary)
    assert len(steps) == 3
    if written:
        assert not any("train/tis_weight_mean" in r for r in steps)
    else:  # the weights clip(exp(π_old − μ), 0, cap=2) of the scripted logprobs
        assert all(0 < r["train/tis_weight_mean"] <= 2.0 for r in steps)
    assert cfg.model_dump() == as_written
