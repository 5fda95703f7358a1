"""Training under `torchrun --nproc_per_node=2` (gloo, CPU) against the same work in one process.

Run as a script under torchrun, this file is the multi-process side:
`torchrun --standalone --nproc_per_node=2 tests/test_distributed.py SCENARIO OUT_DIR`, where
SCENARIO is `trainer` (logprobs, one gradient, a short run, a checkpoint, the step after it,
an export) or a recipe run: `rl_loop`, `async_rl_loop`, `rl_loop_fail` (a rollout bug on
rank 0), `rl_loop_rank1_fail` (an optimizer failure on rank 1 only). Rank 0 writes what it saw
to OUT_DIR; the tests repeat the work in this process and compare.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
VOCAB = 260
LENGTHS = [5, 30, 17, 9, 2, 12, 25]
"""Seven datums of uneven lengths: the two ranks get different numbers of micro-batches."""
SHORT_RUN_STEPS = 3
CHECKPOINT_STEP = SHORT_RUN_STEPS
ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(6)]


# ---- shared between the torchrun side and the single-process side ----------------------------


def rl_cfg():
    from training.utils.config.rl import RLConfig, TrainerConfig

    # A small token budget and logprob chunk force several micro-batches and chunks per call.
    return RLConfig(model="tiny-random", ppo_minibatches=2, trainer=TrainerConfig(
        learning_rate=1e-3, max_tokens_per_microbatch=48, logprob_chunk_tokens=8))


def make_policy(seed: int = 0):
    from training.utils.models.load import load_model_and_tokenizer
    from training.utils.models.tiny import tiny_config
    from training.utils.trainer import Trainer

    torch.manual_seed(seed)
    model, _ = load_model_and_tokenizer(tiny_config(VOCAB), device="cpu")
    return Trainer(model, rl_cfg().trainer.model_copy(update={"total_steps": 100}))


def make_lora_policy(seed: int = 0):
    """A LoRA policy (rank 4) on the same tiny model, checkpointed (so the frozen base matmul that skips its
    recomputation runs on sharded parameters too); a high learning rate so the adapters move."""
    from training.utils.models.load import load_model_and_tokenizer
    from training.utils.models.tiny import tiny_config
    from training.utils.trainer import Trainer

    torch.manual_seed(seed)
    model, _ = load_model_and_tokenizer(tiny_config(VOCAB), device="cpu")
    cfg = rl_cfg().trainer.model_copy(update={"total_steps": 100, "lora_rank": 4, "learning_rate": 1e-2,
                                                   "gradient_checkpointing": True})
    return Trainer(model, cfg)


def make_datums(seed: int = 1):
    from training.utils.trainer import Datum

    generator = torch.Generator().manual_seed(seed)
    datums = []
    for index, length in enumerate(LENGTHS):
        tokens = torch.randint(4, VOCAB, (length + 1,), generator=generator).tolist()
        prompt_len = max(1, length // 3)
        weights = [0.0] * (prompt_len - 1) + [1.0] * (length - prompt_len + 1)
        behaviour = (-torch.rand(length, generator=generator) * 3).tolist()
        datums.append(Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=weights,
                            behaviour_logprobs=behaviour, advantage=(-1.0) ** index * (index + 1) / 3,
                            prompt_len=prompt_len))
    return datums


def train_step(policy, datums, rng):
    """One PPO batch of the recipes: anchor logprobs, then 2 minibatches (rng-shuffled), 2 optimizer steps."""
    from training.utils.rl.train_step import ppo_update, pre_update_logprobs

    cfg = rl_cfg()
    extras, gap, _ = pre_update_logprobs(policy, None, datums, cfg, cfg.kl_beta)
    return gap | ppo_update(policy, datums, extras, cfg, rng, cfg.kl_beta)


def first_gradient(policy, datums):
    """`forward_backward` of the GRPO loss with an anchor pass; the full gradient and the metrics."""
    from training.utils.rl.train_step import make_loss_fn, pre_update_logprobs

    cfg = rl_cfg()
    extras, _, _ = pre_update_logprobs(policy, None, datums, cfg, cfg.kl_beta)
    metrics = policy.forward_backward(datums, make_loss_fn(cfg, cfg.kl_beta), extras=extras)
    grads = {name: _full(p.grad) for name, p in policy.model.named_parameters()}
    return grads, metrics


def full_optimizer_state(policy):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(policy.model, policy.optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A snapshot: replicated entries (the `step` counters) come back as the live tensors.
    return torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state)


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def recipe_cfg(module, log_path, **overrides):
    from training.utils.config.rl import SamplingConfig, TrainerConfig

    fields = dict(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=3,
                  log_path=str(log_path), sampling=SamplingConfig(max_tokens=4, timeout_s=30),
                  trainer=TrainerConfig(learning_rate=1e-3, max_tokens_per_microbatch=12), progress=False,
                  ppo_minibatches=2, kl_beta=0.05)
    fields.update(overrides)
    return module.Config(**fields)


def async_cfg(log_path, **overrides):
    """O = 0 fixes which rows form each batch; one minibatch keeps the update independent of their order.
    Two chunks per batch (gradients accumulated chunk by chunk) and activation checkpointing."""
    from training.recipes import async_rl_loop
    from training.utils.config.rl import TrainerConfig

    trainer = TrainerConfig(learning_rate=1e-3, max_tokens_per_microbatch=12, gradient_checkpointing=True)
    fields = dict(max_head_offpolicy_versions=0, dcp_save_interval=2, ppo_minibatches=1, pipeline_chunks_per_step=2,
                  trainer=trainer) | overrides
    return recipe_cfg(async_rl_loop, log_path, **fields)


def scripted_rollout_factory(fail_at_call: int | None = None):
    """Fabricated draws (no sampling), so a run's batches are the same in every launch."""

    def make_rollout_fn(setup):
        from training.utils.rl.rollout.types import sample_from_completion

        calls = [0]

        async def rollout_fn(row, sample_index):
            calls[0] += 1
            if calls[0] == fail_at_call:
                raise RuntimeError(f"rollout bug at call {calls[0]}")
            number = int(row["id"][1:])
            out = [70 + sample_index, 80 + number, 90]
            return sample_from_completion(row["prompt_token_ids"], out, [-1.0, -2.0, -0.5],
                                          reward=float((number + sample_index) % 3))

        return rollout_fn

    return make_rollout_fn


# ---- the torchrun side ---------------------------------------------------------------------


def child(scenario: str, out: Path) -> None:
    from training.utils.runtime import distributed

    torch.set_num_threads(1)
    if scenario in ("trainer", "lora", "bf16"):
        with distributed.distributed_session(timeout_s=120):
            {"trainer": child_trainer, "lora": child_lora, "bf16": child_bf16}[scenario](out)
        return
    from training.recipes import async_rl_loop, rl_loop

    if scenario == "rl_loop":
        summary = rl_loop.main(recipe_cfg(rl_loop, out / "run"), rollout_fn_factory=scripted_rollout_factory(),
                               rows=ROWS)
    elif scenario == "rl_loop_fail":
        summary = rl_loop.main(recipe_cfg(rl_loop, out / "run"),
                               rollout_fn_factory=scripted_rollout_factory(fail_at_call=12), rows=ROWS)
    elif scenario == "rl_loop_rank1_fail":
        if os.environ["RANK"] == "1":
            fail_optimizer_step(at_step=2)
        summary = rl_loop.main(recipe_cfg(rl_loop, out / "run"), rollout_fn_factory=scripted_rollout_factory(),
                               rows=ROWS)
    elif scenario == "async_rl_loop":
        summary = async_rl_loop.main(async_cfg(out / "run"), rollout_fn_factory=scripted_rollout_factory(), rows=ROWS)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    (out / f"summary-{os.environ['RANK']}.json").write_text(json.dumps(summary, default=str))


def fail_optimizer_step(at_step: int) -> None:
    """Make this process's optimizer fail, as a rank-local fault (say, out of memory) would."""
    from training.utils.trainer import Trainer

    original = Trainer.optim_step

    def optim_step(self):
        if self.step == at_step:
            raise RuntimeError(f"optimizer failure on rank 1 at step {at_step}")
        return original(self)

    Trainer.optim_step = optim_step


def child_trainer(out: Path) -> None:
    from training.utils.run_files.checkpoint import save_checkpoint
    from training.utils.runtime import distributed

    assert distributed.world_size() == 2
    policy = make_policy()
    datums = make_datums()
    logprobs, entropy = policy.logprobs(datums, with_entropy=True)
    grads, grad_metrics = first_gradient(policy, datums)
    policy.optimizer.zero_grad(set_to_none=True)
    rng = np.random.default_rng(0)
    run_metrics = [train_step(policy, datums, rng) for _ in range(SHORT_RUN_STEPS)]
    save_checkpoint(out / "ckpt", CHECKPOINT_STEP, policy=policy, progress={"step": CHECKPOINT_STEP}, np_rng=rng)
    weights = policy.state_dict_for_inference()
    optimizer = full_optimizer_state(policy)
    after = train_step(policy, datums, rng)
    policy.save_hf(out / "hf")
    if distributed.is_main():
        torch.save({"logprobs": logprobs, "entropy": entropy, "grads": grads, "grad_metrics": grad_metrics,
                    "run_metrics": run_metrics, "weights": weights, "optimizer": optimizer, "after": after,
                    "final": policy.state_dict_for_inference()}, out / "rank0.pt")
    else:
        assert policy.state_dict_for_inference() == {}


def child_lora(out: Path) -> None:
    from training.utils.run_files.checkpoint import save_checkpoint
    from training.utils.runtime import distributed

    policy, datums, rng = make_lora_policy(), make_datums(), np.random.default_rng(0)
    reference = policy.adapter_disabled_reference().logprobs(datums)
    run_metrics = [train_step(policy, datums, rng) for _ in range(SHORT_RUN_STEPS)]
    save_checkpoint(out / "ckpt", CHECKPOINT_STEP, policy=policy, progress={"step": CHECKPOINT_STEP}, np_rng=rng)
    merged = policy.state_dict_for_inference()
    after = train_step(policy, datums, rng)
    policy.save_hf(out / "hf")
    if distributed.is_main():
        torch.save({"reference": reference, "run_metrics": run_metrics, "merged": merged, "after": after},
                   out / "rank0.pt")
    else:
        assert merged == {}


def child_bf16(out: Path) -> None:
    """The policy under `bf16-autocast` (the CUDA default): shards gathered as bf16, gradients reduced in fp32."""
    from training.utils.models.load import load_model_and_tokenizer
    from training.utils.models.tiny import tiny_config
    from training.utils.runtime import distributed
    from training.utils.trainer import Trainer

    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(VOCAB), device="cpu")
    cfg = rl_cfg().trainer.model_copy(update={"total_steps": 100, "precision": "bf16-autocast"})
    policy, datums = Trainer(model, cfg), make_datums()
    gathered_dtypes = set()
    hook = policy.model.model.layers[0].mlp.up_proj.register_forward_pre_hook(
        lambda module, args: gathered_dtypes.add(module.weight.dtype))
    logprobs = policy.logprobs(datums)
    hook.remove()
    grads, _ = first_gradient(policy, datums)
    if distributed.is_main():
        torch.save({"logprobs": logprobs, "grads": grads, "gathered_dtypes": gathered_dtypes,
                    "shard_dtype": policy.model.model.layers[0].mlp.up_proj.weight.dtype}, out / "rank0.pt")


def torchrun(scenario: str, out: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               __file__, scenario, str(out)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


# ---- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One torchrun launch of the `trainer` scenario, shared by the trainer-level tests."""
    out = tmp_path_factory.mktemp("torchrun")
    result = torchrun("trainer", out)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return out, torch.load(out / "rank0.pt", weights_only=False)


def test_logprobs_and_first_gradient_match_one_process(two_ranks):
    _, seen = two_ranks
    policy, datums = make_policy(), make_datums()
    logprobs, entropy = policy.logprobs(datums, with_entropy=True)
    for mine, theirs in zip(logprobs + entropy, seen["logprobs"] + seen["entropy"]):
        torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)
    grads, metrics = first_gradient(policy, datums)
    assert grads.keys() == seen["grads"].keys()
    for name, grad in grads.items():
        assert (seen["grads"][name] - grad).abs().max() <= 1e-5, name
    assert seen["grad_metrics"].keys() == metrics.keys()
    for name, value in metrics.items():
        if name != "tokens_computed":  # each rank pads its own share of the micro-batches
            assert seen["grad_metrics"][name] == pytest.approx(value, abs=1e-5), name


def test_short_run_matches_one_process(two_ranks):
    _, seen = two_ranks
    policy, datums, rng = make_policy(), make_datums(), np.random.default_rng(0)
    for theirs in seen["run_metrics"]:
        mine = train_step(policy, datums, rng)
        assert theirs.keys() == mine.keys()
        for name in ("train/loss", "train/grad_norm", "train/ratio_mean", "train/entropy"):
            assert theirs[name] == pytest.approx(mine[name], abs=1e-5), name
    for name, weight in policy.state_dict_for_inference().items():
        assert (seen["weights"][name] - weight).abs().max() <= 1e-5, name


def test_checkpoint_from_two_ranks_resumes_in_one(two_ranks):
    from training.utils.run_files.checkpoint import latest_checkpoint, load_checkpoint

    out, seen = two_ranks
    path = latest_checkpoint(out / "ckpt")
    assert path is not None and path.name.endswith(f"{CHECKPOINT_STEP:08d}")
    policy, rng = make_policy(seed=123), np.random.default_rng(999)  # different init: the load must overwrite it
    progress = load_checkpoint(path, policy=policy, np_rng=rng)
    assert progress == {"step": CHECKPOINT_STEP}
    assert policy.step == 2 * SHORT_RUN_STEPS
    weights = policy.state_dict_for_inference()
    assert weights.keys() == seen["weights"].keys()
    for name, weight in weights.items():
        assert torch.equal(weight, seen["weights"][name]), name
    optimizer = full_optimizer_state(policy)
    assert optimizer["param_groups"] == seen["optimizer"]["param_groups"]
    for name, state in seen["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(optimizer["state"][name][key], value), (name, key)
    after = train_step(policy, make_datums(), rng)  # the rng came back too: same minibatch split
    for name in ("train/loss", "train/grad_norm", "rollout/sampler_trainer_logprob_diff"):
        assert after[name] == pytest.approx(seen["after"][name], abs=1e-5), name


def test_export_under_torchrun_is_a_plain_model(two_ranks):
    from transformers import AutoModelForCausalLM

    out, seen = two_ranks
    exported = AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    for name, weight in seen["final"].items():
        assert torch.equal(exported[name], weight), name


def test_lora_under_torchrun_matches_one_process_and_resumes_in_one(tmp_path):
    """LoRA sharded over 2 ranks: the adapter-disabled reference, a short run's losses, the merged
    export (weight sync and `save_hf`) and a checkpoint that one process resumes from."""
    from transformers import AutoModelForCausalLM

    from training.utils.run_files.checkpoint import latest_checkpoint, load_checkpoint

    result = torchrun("lora", tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    seen = torch.load(tmp_path / "rank0.pt", weights_only=False)
    policy, datums, rng = make_lora_policy(), make_datums(), np.random.default_rng(0)
    for mine, theirs in zip(policy.adapter_disabled_reference().logprobs(datums), seen["reference"]):
        torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)
    for step, theirs in enumerate(seen["run_metrics"]):
        mine = train_step(policy, datums, rng)
        # Float32 sums in another order: the first step agrees to about 1e-7. Each AdamW step then turns that
        # rounding into weights apart by more (numerics_support.ADAM_WEIGHTS_ATOL), so later steps agree less.
        rel = 1e-5 if step == 0 else 1e-4
        for name in ("train/loss", "train/grad_norm", "train/ratio_mean"):
            assert theirs[name] == pytest.approx(mine[name], rel=rel, abs=1e-5), (step, name)
    merged = policy.state_dict_for_inference()
    assert merged.keys() == seen["merged"].keys() and not any(".lora_" in name for name in merged)
    for name, weight in merged.items():
        assert (seen["merged"][name] - weight).abs().max() <= 1e-5, name

    resumed, resumed_rng = make_lora_policy(), np.random.default_rng(999)
    assert load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), policy=resumed, np_rng=resumed_rng) == {
        "step": CHECKPOINT_STEP}
    for name, weight in resumed.state_dict_for_inference().items():
        assert (seen["merged"][name] - weight).abs().max() <= 1e-5, name
    after = train_step(resumed, datums, resumed_rng)
    assert after["train/loss"] == pytest.approx(seen["after"]["train/loss"], abs=1e-5)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    final = resumed.state_dict_for_inference()
    for name, weight in final.items():
        assert (exported[name] - weight).abs().max() <= 1e-5, name


def test_bf16_autocast_under_torchrun_gathers_bf16_and_keeps_fp32_shards(tmp_path):
    """The CUDA default numerics sharded: layers run on bf16 copies of float32 shards; logprobs and
    the gradient agree with one process under bf16 autocast to bf16 precision (not to fp32's)."""
    from training.utils.models.load import load_model_and_tokenizer
    from training.utils.models.tiny import tiny_config
    from training.utils.trainer import Trainer

    result = torchrun("bf16", tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    seen = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert seen["gathered_dtypes"] == {torch.bfloat16} and seen["shard_dtype"] == torch.float32
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(VOCAB), device="cpu")
    cfg = rl_cfg().trainer.model_copy(update={"total_steps": 100, "precision": "bf16-autocast"})
    policy, datums = Trainer(model, cfg), make_datums()
    gaps = [(mine - theirs).abs().max().item() for mine, theirs in zip(policy.logprobs(datums), seen["logprobs"])]
    assert max(gaps) < 0.05, gaps
    grads, _ = first_gradient(policy, datums)
    for name, grad in grads.items():
        theirs = seen["grads"][name]
        assert theirs.dtype == torch.float32, name
        assert (theirs - grad).norm() <= 0.05 * grad.norm() + 1e-6, name


def test_a_trainer_call_names_each_rank_own_objects():
    """What `TrainerWorker` sends rank 1: registered objects by name, anything else by value."""
    from training.utils.rl.worker import TrainerWorker

    rank0, rank1 = TrainerWorker(policy=["rank 0"], reference=None), TrainerWorker(policy=["rank 1"], reference=None)
    fn, args, kwargs = rank1.decode_call(rank0.encode_call((list.extend, (rank0._objects["policy"], [7]), {})))
    fn(*args, **kwargs)
    assert rank1._objects["policy"] == ["rank 1", 7] and rank0._objects["policy"] == ["rank 0"]
    # `share`: the call that binds a new object sends it by value; from then on it goes by name.
    batch = {"datums": []}
    share = rank0.encode_call((rank0._bind, ("training", batch), {}))
    rank0._bind("training", batch)  # what that call does on rank 0
    fn, args, kwargs = rank1.decode_call(share)
    fn(*args, **kwargs)  # and on rank 1, with its own copy
    fn, args, kwargs = rank1.decode_call(rank0.encode_call((dict.update, (batch, {"n": 1}), {})))
    fn(*args, **kwargs)
    assert rank1._objects["training"] == {"datums": [], "n": 1} and batch == {"datums": []}
    with pytest.raises(TypeError, match="cannot be pickled"):
        rank0.encode_call((print, (lambda: None,), {}))


# ---- the recipes under torchrun (a launch of two recipe processes each, ~10-15 s on 2 cores) -------


def ledger_by_step(summary: dict) -> dict[int, dict]:
    from training.utils.run_files.logging import read_ledger

    return {r["step"]: r for r in read_ledger(summary["ledger"]) if "train/loss" in r}


def test_rl_loop_under_torchrun_matches_one_process(tmp_path):
    from training.recipes import rl_loop

    result = torchrun("rl_loop", tmp_path / "two")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    summaries = [json.loads((tmp_path / "two" / f"summary-{r}.json").read_text()) for r in (0, 1)]
    assert summaries[0] == summaries[1]  # every rank returns rank 0's summary
    mine = rl_loop.main(recipe_cfg(rl_loop, tmp_path / "one" / "run"), rollout_fn_factory=scripted_rollout_factory(),
                        rows=ROWS)
    two, one = ledger_by_step(summaries[0]), ledger_by_step(mine)
    assert sorted(two) == sorted(one) == [1, 2, 3]
    for step in one:
        for name in ("rollout/raw_reward", "train/loss", "train/grad_norm", "train/ratio_mean", "train/entropy",
                     "train/ref_kl", "train/optimizer_steps"):
            assert two[step][name] == pytest.approx(one[step][name], abs=1e-5), (step, name)
    assert summaries[0]["version"] == mine["version"] == 3


@pytest.mark.slow
def test_async_rl_loop_resumes_from_one_process_to_two_and_back(tmp_path):
    from training.recipes import async_rl_loop

    cfg = async_cfg(tmp_path / "run", max_steps=4)
    # Steps 1-2 in one process (checkpoint at 2), step 3 under torchrun with 2 ranks, step 4 in one process.
    first = async_rl_loop.main(cfg.model_copy(update={"max_steps": 2}), rollout_fn_factory=scripted_rollout_factory(),
                               rows=ROWS)
    assert first["checkpoint"].endswith("step-00000002")
    result = torchrun("async_rl_loop", tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    summary = json.loads((tmp_path / "summary-0.json").read_text())
    assert summary["start_step"] == 2 and summary["steps"] == 3 and summary["checkpoint"].endswith("step-00000003")
    resumed = async_rl_loop.main(cfg, rollout_fn_factory=scripted_rollout_factory(), rows=ROWS)
    assert resumed["start_step"] == 3 and resumed["steps"] == 4
    steps = ledger_by_step(resumed)
    assert sorted(steps) == [1, 2, 3, 4] and math.isfinite(steps[4]["train/loss"])
    # A fresh single-process run of 4 steps trains the same batches to the same losses.
    fresh = async_rl_loop.main(cfg.model_copy(update={"log_path": str(tmp_path / "fresh")}),
                               rollout_fn_factory=scripted_rollout_factory(), rows=ROWS)
    for step, record in ledger_by_step(fresh).items():
        assert record["async/realized_chunks"] == 2
        assert sorted(steps[step]["batch/row_ids"]) == sorted(record["batch/row_ids"])
        assert steps[step]["train/loss"] == pytest.approx(record["train/loss"], abs=1e-4), step


@pytest.mark.slow
@pytest.mark.parametrize("scenario, error", [
    ("rl_loop_fail", "rollout bug at call 12"),  # rank 0, outside any trainer call: the others wait for the next one
    ("rl_loop_rank1_fail", "optimizer failure on rank 1 at step 2"),  # rank 1 alone, mid-call: rank 0 in a collective
])
def test_a_failure_on_one_rank_stops_every_rank_with_its_error(tmp_path, scenario, error):
    # Well inside the 1800 s collective timeout: torchrun stops the job when one rank exits with an error.
    result = torchrun(scenario, tmp_path, timeout=120)
    assert result.returncode != 0
    assert error in result.stdout + result.stderr
    assert not list(tmp_path.glob("summary-*.json"))


if __name__ == "__main__":
    child(sys.argv[1], Path(sys.argv[2]))
