"""Shared-prefix rows (`TrainerConfig.share_prefixes`): which datums share, the tokens computed, and
logprobs, entropies, gradients and loss inputs equal to the datums computed apart.

Run as a script under torchrun this file is also the multi-process side of the FSDP2 test:
`torchrun --standalone --nproc_per_node=2 tests/test_shared_prefix.py OUT_DIR`.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training.utils.config.rl import RLConfig, TrainerConfig
from training.utils.errors import ConfigError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.rl.rollout.types import RolloutRun, RolloutSample, make_prompt_group
from training.utils.rl.train_step import KLCoefficient, train_batch
from training.utils.trainer import Datum, MicroBatch, Trainer
from training.utils.trainer.batching import computed_tokens, plan_ranks
from training.utils.trainer.shared_prefix import MIN_SHARED_TOKENS, PrefixBundle, PrefixSharing, prefix_bundles

VOCAB = 260
TOLERANCE = 1e-5


def make_model(attention: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    model, _ = load_model_and_tokenizer(tiny_config(VOCAB), device="cpu")
    model.set_attn_implementation(attention)
    return model


def make_datum(tokens: list[int], prompt_len: int, advantage: float, behaviour_seed: int) -> Datum:
    n = len(tokens) - 1
    behaviour = (-torch.rand(n, generator=torch.Generator().manual_seed(behaviour_seed)) * 3).tolist()
    weights = [0.0] * (prompt_len - 1) + [1.0] * (n - prompt_len + 1)
    return Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=weights, behaviour_logprobs=behaviour,
                 advantage=advantage, prompt_len=prompt_len)


def group_datums(prompt_lens: list[int], completion_lens: list[list[int]], seed: int = 1) -> list[Datum]:
    """One group per prompt: its draws are the prompt followed by random completions of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    datums = []
    for prompt_len, lengths in zip(prompt_lens, completion_lens):
        prompt = torch.randint(4, VOCAB, (prompt_len,), generator=generator).tolist()
        for length in lengths:
            completion = torch.randint(4, VOCAB, (length,), generator=generator).tolist()
            datums.append(make_datum(prompt + completion, prompt_len, advantage=len(datums) % 3 - 1.0,
                                     behaviour_seed=len(datums)))
    return datums


def multi_turn_datums(seed: int = 2) -> list[Datum]:
    """Two conversations of three turns: each turn's datum is the whole history so far, so a turn's
    input ids begin with the previous turn's tokens (a longer common history than the prompt)."""
    generator = torch.Generator().manual_seed(seed)
    datums = []
    for conversation in range(2):
        history = torch.randint(4, VOCAB, (12,), generator=generator).tolist()
        for turn in range(3):
            prompt_len = len(history)
            history = history + torch.randint(4, VOCAB, (3 + turn + conversation,), generator=generator).tolist()
            datums.append(make_datum(history, prompt_len, advantage=1.0 - turn, behaviour_seed=len(datums)))
            history = history + torch.randint(4, VOCAB, (4,), generator=generator).tolist()  # the next observation
    return datums


def ragged_groups() -> list[Datum]:
    """Ragged completions, one-token completions, two identical draws, and two lone datums without a group."""
    datums = group_datums([20, 14, 9], [[5, 1, 12, 3], [1, 1, 7], [6, 2]])
    datums.append(make_datum(datums[0].input_ids + [datums[0].target_ids[-1]], 20, -0.5, behaviour_seed=99))
    datums += group_datums([17, 23], [[8], [4]], seed=5)
    return datums


def pg_loss(logprobs, mb: MicroBatch):
    ratio = torch.exp(logprobs - mb.behaviour_logprobs)
    loss = -(mb.advantages[:, None] * ratio * mb.weights).sum() / mb.num_tokens_total
    return loss + 0.1 * (mb.extras["entropy"] * mb.weights).sum() / mb.num_tokens_total, {}


def run(model, datums, *, share: str, temperature: float = 0.7, **cfg):
    """Logprobs and entropies (no grad), then a gradient through the loss; what the loss saw, per datum."""
    trainer = Trainer(model, TrainerConfig(share_prefixes=share, logprob_chunk_tokens=16, **cfg))
    logprobs, entropy = trainer.logprobs(datums, temperature, with_entropy=True)
    seen = {}

    def recording_loss(logprobs_BT, mb):
        for row, index in enumerate(mb.datum_indices):
            n = len(datums[index])
            seen[index] = [mb.target_ids[row, :n], mb.weights[row, :n], mb.behaviour_logprobs[row, :n],
                           mb.advantages[row], mb.extras["entropy"][row, :n].detach(), logprobs_BT[row, :n].detach(),
                           mb.weights[row, n:].sum()]
        return pg_loss(logprobs_BT, mb)

    trainer.model.zero_grad(set_to_none=True)
    metrics = trainer.forward_backward(datums, recording_loss, temperature=temperature, with_entropy=True,
                                       entropy_grad=True)
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return logprobs, entropy, grads, seen, metrics


def assert_same(shared, apart):
    for got, want in zip(shared[0] + shared[1], apart[0] + apart[1], strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= TOLERANCE
    assert shared[2].keys() == apart[2].keys() and shared[2]
    for name, grad in apart[2].items():
        assert (shared[2][name] - grad).abs().max() <= TOLERANCE, name
    assert shared[3].keys() == apart[3].keys()
    for index, want in apart[3].items():
        for got_field, want_field in zip(shared[3][index], want, strict=True):
            assert (got_field - want_field).abs().max() <= TOLERANCE, index
    assert shared[4]["loss"] == pytest.approx(apart[4]["loss"], abs=TOLERANCE)


# ---- which datums share ---------------------------------------------------------------------


def test_a_group_of_one_prompt_shares_it_and_counts_the_prefix_once():
    prompt, other = list(range(10, 30)), list(range(100, 130))
    input_ids_D = [prompt + [1, 2, 3], other + [5], prompt + [4], prompt + [1, 2, 7, 8], other + [6, 6]]
    bundles = prefix_bundles(input_ids_D, max_tokens=1000, pair_cost=0.0)
    # In input-id order; datums 0 and 3 share 22 tokens, but the bundle's prefix is the group's 20.
    assert bundles == [PrefixBundle((0, 3, 2), 20, 20 + 3 + 4 + 1), PrefixBundle((1, 4), 30, 30 + 1 + 2)]


def test_a_shared_chat_header_alone_does_not_shrink_a_group_prefix():
    header = list(range(10, 20))  # a chat template's system block: 10 tokens common to every prompt
    group = [header + list(range(50, 80)) + [i] for i in range(4)]
    stranger = header + list(range(90, 95))
    bundles = prefix_bundles(group + [stranger], max_tokens=1000, pair_cost=0.0)
    # Joining would cost 4 × 30 tokens of the group's prefix to save the stranger's 10.
    assert [b.indices for b in bundles] == [(0, 1, 2, 3), (4,)]
    assert bundles[0].length == 40 + 4 * 1


def test_a_stranger_sorted_first_does_not_pull_a_group_onto_the_shared_header():
    header = list(range(10, 20))
    stranger = header + [5, 6, 7, 8, 9, 10, 11, 12]  # sorts before the group, shares only the header
    group = [header + list(range(50, 80)) + [i] for i in range(4)]
    bundles = prefix_bundles([stranger] + group, max_tokens=1000, pair_cost=0.0)
    # Greedily, each draw would join the stranger's row sharing 10 tokens: 10 + 8 + 4 × 31 = 142 computed.
    assert [b.indices for b in bundles] == [(0,), (1, 2, 3, 4)]
    assert sum(b.length for b in bundles) == 18 + 40 + 4 * 1


def test_short_prefixes_the_budget_and_dense_attention_keep_datums_apart():
    short = list(range(MIN_SHARED_TOKENS - 1))
    assert len(prefix_bundles([short + [1, 2], short + [3, 4]], max_tokens=1000, pair_cost=0.0)) == 2
    at_min = list(range(MIN_SHARED_TOKENS))
    assert len(prefix_bundles([at_min + [1, 2], at_min + [3, 4]], max_tokens=1000, pair_cost=0.0)) == 1
    prompt = list(range(20))
    group = [prompt + [i] * 10 for i in range(6)]
    # The prompt and two completions make 40 tokens; a third would pass the 45-token budget.
    assert [b.indices for b in prefix_bundles(group, max_tokens=45, pair_cost=0.0)] == [(0, 1), (2, 3), (4, 5)]
    # Long completions behind a short prompt: the shared row's dense row² costs more than it saves.
    long_group = [prompt + [i] * 500 for i in range(4)]
    assert len(prefix_bundles(long_group, max_tokens=10_000, pair_cost=1 / 3000)) == 4
    assert len(prefix_bundles(long_group, max_tokens=10_000, pair_cost=0.0)) == 1


def test_share_prefixes_follows_the_attention_implementation():
    model = make_model()
    assert PrefixSharing.for_model("auto", model).attention == "sdpa"
    assert PrefixSharing.for_model("off", model) is None
    model.config._attn_implementation = "flash_attention_2"  # not installed here; only the name is read
    assert PrefixSharing.for_model("auto", model) is None
    with pytest.raises(ConfigError, match="share_prefixes='on'.*flash_attention_2"):
        Trainer(model, TrainerConfig(share_prefixes="on"))


def test_the_trainer_reports_the_tokens_it_computed():
    datums = group_datums([20, 20], [[5, 3, 4], [2, 6]])  # 24 + 22 + 23 and 21 + 25 input tokens
    model = make_model()
    apart = Trainer(model, TrainerConfig(share_prefixes="off", max_tokens_per_microbatch=1000))
    shared = Trainer(model, TrainerConfig(share_prefixes="on", max_tokens_per_microbatch=1000))
    packed = Trainer(model, TrainerConfig(share_prefixes="on", max_tokens_per_microbatch=1000, pack_sequences=True))
    # Apart: five rows padded to 25. Shared: rows of 20 + 4 + 2 + 3 = 29 and 20 + 1 + 5 = 26, padded to 29.
    assert apart.forward_backward(datums, pg_loss_without_entropy)["tokens_computed"] == 5 * 25
    assert shared.forward_backward(datums, pg_loss_without_entropy)["tokens_computed"] == 2 * 29
    assert packed.forward_backward(datums, pg_loss_without_entropy)["tokens_computed"] == 29 + 26


def test_a_training_step_reports_the_tokens_computed_beside_its_metrics():
    datums = group_datums([20, 20], [[5, 3, 4], [2, 6]])
    # The same sequences as the recipes hand them to the trainer: groups of runs, one segment each.
    runs = [RolloutRun([RolloutSample(tokens=d.input_ids + d.target_ids[-1:], logprobs=[0.0] + d.behaviour_logprobs,
                                      loss_mask=[0] + d.weights, reward=float(i % 2))]) for i, d in enumerate(datums)]
    groups = [make_prompt_group("g0", runs[:3]), make_prompt_group("g1", runs[3:])]
    cfg = RLConfig(model="tiny-random", ppo_epochs=2, trainer=TrainerConfig(max_tokens_per_microbatch=1000))
    metrics = train_batch(Trainer(make_model(), cfg.trainer), None, groups, cfg, np.random.default_rng(0),
                          KLCoefficient(0.0))
    # Two epochs over one minibatch, each computing the two shared rows padded to 29 tokens.
    assert metrics["perf/train_tokens_computed"] == 2 * 2 * 29
    assert "train/tokens_computed" not in metrics


def pg_loss_without_entropy(logprobs, mb: MicroBatch):
    return -(mb.advantages[:, None] * logprobs * mb.weights).sum() / mb.num_tokens_total, {}


# ---- the same numbers as apart ----------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True])
def test_ragged_groups_give_the_logprobs_entropies_and_gradient_of_datums_apart(packed):
    datums = ragged_groups()
    model = make_model()
    # A budget that holds a bundle or two per micro-batch, lone datums beside them.
    shared = run(model, datums, share="on", max_tokens_per_microbatch=60, pack_sequences=packed)
    apart = run(model, datums, share="off", max_tokens_per_microbatch=60, pack_sequences=packed)
    assert shared[4]["tokens_computed"] < apart[4]["tokens_computed"]
    assert_same(shared, apart)


def test_multi_turn_histories_share_their_longer_common_prefix():
    datums = multi_turn_datums()
    bundles = prefix_bundles([d.input_ids for d in datums], max_tokens=1000, pair_cost=0.0)
    # Each conversation is one bundle; its prefix is the first turn's whole input.
    assert sorted(sorted(b.indices) for b in bundles) == [[0, 1, 2], [3, 4, 5]]
    assert {b.prefix_len for b in bundles} == {len(datums[0].input_ids), len(datums[3].input_ids)}
    model = make_model()
    assert_same(run(model, datums, share="on"), run(model, datums, share="off"))


def test_eager_attention_takes_the_additive_mask():
    datums = ragged_groups()
    model = make_model("eager")
    assert_same(run(model, datums, share="on", max_tokens_per_microbatch=60),
                run(model, datums, share="off", max_tokens_per_microbatch=60))


def test_lora_adapters_train_alike_shared_and_apart():
    datums = ragged_groups()
    results = []
    for share in ("on", "off"):
        model = make_model()
        results.append(run(model, datums, share=share, lora_rank=4, max_tokens_per_microbatch=60))
        assert all("lora_" in name for name in results[-1][2])
    assert_same(*results)


def test_flex_attention_logprobs_read_a_block_mask():
    """CPU flex attention has no backward, so only the no-grad pass (a block mask, compiled) is checked here."""
    datums = ragged_groups()[:8]
    model = make_model("flex_attention")
    shared = Trainer(model, TrainerConfig(share_prefixes="on"))
    assert shared.prefix_sharing.pair_cost == 0.0
    got = shared.logprobs(datums, with_entropy=True)
    model.set_attn_implementation("sdpa")
    want = Trainer(model, TrainerConfig(share_prefixes="off")).logprobs(datums, with_entropy=True)
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert (a - b).abs().max() <= TOLERANCE


# ---- FSDP2 --------------------------------------------------------------------------------


def fsdp_datums() -> list[Datum]:
    return ragged_groups() + multi_turn_datums()


def fsdp_trainer() -> Trainer:
    return Trainer(make_model(), TrainerConfig(share_prefixes="on", max_tokens_per_microbatch=60,
                                               logprob_chunk_tokens=16))


def child(out: Path) -> None:
    from torch.distributed.tensor import DTensor

    from training.utils.runtime import distributed

    torch.set_num_threads(1)
    with distributed.distributed_session(timeout_s=120):
        trainer, datums = fsdp_trainer(), fsdp_datums()
        logprobs = trainer.logprobs(datums, 0.7)
        metrics = trainer.forward_backward(datums, pg_loss_without_entropy, temperature=0.7)
        grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for name, p in trainer.model.named_parameters()}
        if distributed.is_main():
            torch.save({"logprobs": logprobs, "metrics": metrics, "grads": grads}, out / "rank0.pt")


def test_two_fsdp2_ranks_give_the_logprobs_and_gradient_of_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{Path(__file__).resolve().parents[1]}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    seen = torch.load(tmp_path / "rank0.pt", weights_only=False)
    trainer, datums = fsdp_trainer(), fsdp_datums()
    for got, want in zip(seen["logprobs"], trainer.logprobs(datums, 0.7), strict=True):
        assert (got - want).abs().max() <= TOLERANCE
    metrics = trainer.forward_backward(datums, pg_loss_without_entropy, temperature=0.7)
    # Each rank pads its own micro-batches: the count is what both ranks' plans computed together.
    bundles = prefix_bundles([d.input_ids for d in datums], 60, trainer.prefix_sharing.pair_cost)
    plans = plan_ranks(bundles, 60, packed=False, world=2)
    assert seen["metrics"]["tokens_computed"] == sum(computed_tokens([b.length for b in mb], packed=False)
                                                     for plan in plans for mb in plan)
    assert seen["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=TOLERANCE)
    for name, p in trainer.model.named_parameters():
        assert (seen["grads"][name] - p.grad).abs().max() <= TOLERANCE, name


if __name__ == "__main__":
    child(Path(sys.argv[1]))
