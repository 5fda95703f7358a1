"""The trace rules (#26): a sampled response is trained once, a split run weighs one run in the loss, an SDK retry
of an answered request is answered from the record, and the step reports both (`shim/retries_replayed`, segments
per run). The retry tests use the official SDKs, whose own retry loop re-sends the request."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter

import anthropic
import httpx2
import numpy as np
import openai
import pytest
import torch

from shim_support import make_tiny, outputs, scripted, shim_stack
from training.recipes import rl_loop
from training.utils.config.rl import TrainerConfig
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.rl.agent.session import ANSWERS_KEPT
from training.utils.rl.groups import SettledRow, rollout_metrics, shim_metrics
from training.utils.rl.loss_aggregation import LOSS_AGG_MODES
from training.utils.rl.rollout.stitching import TurnRecord, TurnTree
from training.utils.rl.rollout.types import RolloutRun, make_prompt_group, sample_from_completion
from training.utils.rl.train_step import (
    BatchUpdate,
    KLCoefficient,
    make_loss_fn,
    pack_groups,
    seq_shares,
    sequence_count,
    share_extras,
    train_batch,
)
from training.utils.trainer import MicroBatch, Trainer
from training.utils.trainer.batching import pad_rows

RETRY = "x-stainless-retry-count"


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)


def turn(prompt, output, logprob=-0.5):
    return TurnRecord(list(prompt), list(output), [logprob] * len(output))


def trained(segment) -> list[int]:
    return [t for t, m in zip(segment.response_ids, segment.loss_mask) if m]


# ---- 1. a sampled response is trained once -----------------------------------------------------------------------


def test_a_repeated_response_is_context_on_its_branch_and_trained_where_first_sampled():
    """Node 1 answers node 0's prompt with node 0's output (a regeneration that came out the same) and the chain
    goes on from it: its output is context there, trained only on node 0's path, whichever path comes first."""
    tree = TurnTree()
    first = tree.add(turn([1, 2], [10, 11], -0.1), None)
    repeat = tree.add(turn([1, 2], [10, 11], -0.9), None)
    after = tree.add(turn([1, 2, 10, 11, 5], [20], -0.2), repeat)
    assert tree.first_sampled() == [first, first, after]
    original, branch = tree.materialize([(first, "branch"), (after, "final")])
    assert (trained(original), original.loss_mask, original.logprobs) == ([10, 11], [1, 1], [-0.1, -0.1])
    assert branch.prompt_ids == [1, 2] and branch.response_ids == [10, 11, 5, 20]
    assert (branch.loss_mask, branch.logprobs) == ([0, 0, 0, 1], [0.0, 0.0, 0.0, -0.2])
    assert [original.metadata["repeated_turns"], branch.metadata["repeated_turns"]] == [0, 1]
    # The repeat's path first: the output still trains on node 0's path, where it was first sampled.
    branch, original = tree.materialize([(after, "final"), (first, "branch")])
    assert (branch.loss_mask, original.loss_mask) == ([0, 0, 0, 1], [1, 1])


def test_a_repeat_trains_when_its_first_sampling_is_dropped_and_the_same_output_elsewhere_is_a_new_decision():
    tree = TurnTree()
    long_root = tree.add(turn([1, 2, 3, 4, 5], [10, 11]), None)  # the first sampling: 7 tokens
    tree.add(turn([1, 2, 3, 4, 5], [10, 11]), None)  # its repeat, on a path after it
    other_prompt = tree.add(turn([7], [10, 11]), None)  # the same output after another prompt
    kept = tree.materialize([(long_root, "branch"), (1, "branch"), (other_prompt, "final")], max_context_tokens=7)
    assert [trained(s) for s in kept] == [[10, 11], [10, 11]]
    assert [s.metadata["tree_leaf_id"] for s in kept] == [0, 2]
    # Too long for 6 tokens: the repeat's path keeps it trained instead (it comes after the dropped path).
    tree.add(turn([1], [30]), None)
    short = tree.materialize([(long_root, "branch"), (1, "branch"), (other_prompt, "final")], max_context_tokens=6)
    assert [trained(s) for s in short] == [[10, 11]] and short[0].metadata["tree_leaf_id"] == 2


def test_a_regeneration_that_answers_alike_is_trained_once_through_the_shim(tiny):
    """A client asks the same thing twice as two calls (count 0: a deliberate regeneration, so both are sampled),
    the model answers alike, and the agent carries on from the second answer: its tokens train once."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, "same answer") if i < 2 else c
            session = shim.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url + "/v1", api_key=session.key, max_retries=0)
            messages = [{"role": "user", "content": "task"}]
            first = await client.chat.completions.create(model="m", messages=messages)
            again = await client.chat.completions.create(model="m", messages=messages)
            assert first.choices[0].message.content == again.choices[0].message.content == "same answer"
            messages += [again.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
            await client.chat.completions.create(model="m", messages=messages)
            assert session.kinds == ["new", "branch", "append"]
            return spy.calls, await shim.finish_session(session.key, reward=1.0)

    calls, run = asyncio.run(scenario())
    assert len(calls) == 3 and calls[0]["prompt_ids"] == calls[1]["prompt_ids"]
    assert outputs(calls, 0) == outputs(calls, 1)
    first, chain = run.segments
    assert trained_tokens_of(first) == outputs(calls, 0)
    # The chain goes on from the repeat: its output is context there, only the third answer trains.
    assert trained_tokens_of(chain) == outputs(calls, 2)
    assert chain.metadata["repeated_turns"] == 1
    assert sum(sum(s.loss_mask) for s in run.segments) == len(outputs(calls, 0, 2))


def trained_tokens_of(sample) -> list[int]:
    return [t for t, m in zip(sample.tokens, sample.loss_mask) if m]


# ---- 2. a run split into k segments weighs one run ---------------------------------------------------------------


def split_and_whole_runs():
    """One row's two runs with the same 6 trained tokens: one in 3 segments (1, 2 and 3 tokens), one in 1."""
    split = RolloutRun([sample_from_completion([1, 2], list(range(10, 10 + n)), [-1.0] * n, reward=1.0)
                        for n in (1, 2, 3)])
    whole = RolloutRun([sample_from_completion([1, 2], list(range(10, 16)), [-1.0] * 6, reward=0.0)])
    return make_prompt_group("row", [split, whole])


def run_weights(mode: str, run_weighting: str) -> list[float]:
    """Σ over each run's trained tokens of ∂loss/∂(−A·π): the weight the loss gives the run, through the shares,
    the datums and the loss function the trainer calls (every advantage 1, π = π_old, so the ratio is 1)."""
    cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=2, loss_agg_mode=mode,
                         run_weighting=run_weighting)
    datums_D, run_of_D = pack_groups([split_and_whole_runs()])
    for datum in datums_D:
        datum.advantage = 1.0
    extras = share_extras(datums_D, seq_shares(datums_D, run_of_D, cfg.run_weighting))
    logprobs = torch.zeros(len(datums_D), max(len(d) for d in datums_D), requires_grad=True)
    weights = pad_rows([d.weights for d in datums_D], torch.float32)
    mb = MicroBatch(target_ids=pad_rows([d.target_ids for d in datums_D], torch.long), weights=weights,
                    behaviour_logprobs=torch.zeros_like(weights), advantages=torch.ones(len(datums_D)),
                    extras={k: pad_rows(v, torch.float32) for k, v in extras.items()},
                    datum_indices=list(range(len(datums_D))), num_tokens_total=float(weights.sum()),
                    num_seqs_total=len(datums_D))
    loss, _ = make_loss_fn(cfg, 0.0, num_seqs=sequence_count(extras, len(datums_D)))(logprobs, mb)
    loss.backward()
    per_datum = (-logprobs.grad).sum(-1).tolist()
    return [sum(w for w, run in zip(per_datum, run_of_D) if run == (0, g)) for g in (0, 1)]


@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES))
def test_a_run_in_three_segments_weighs_what_the_same_tokens_weigh_in_one(mode):
    split, whole = run_weights(mode, "run")
    assert split == pytest.approx(whole, rel=1e-6)
    expected = {"token_mean": 0.5, "seq_mean_token_mean": 0.5, "sum": 6.0,
                "seq_mean_token_sum_norm": 6 / rl_loop.Config(model="tiny-random").sampling.max_tokens / 2}
    assert split == pytest.approx(expected[mode], rel=1e-6)


def test_per_segment_weighting_gives_a_split_run_a_sequence_per_segment():
    """`run_weighting="segment"`: the three segments are three of four sequences; the token modes do not change."""
    assert run_weights("seq_mean_token_mean", "segment") == pytest.approx([0.75, 0.25])
    assert run_weights("token_mean", "segment") == pytest.approx([0.5, 0.5])


def test_shares_add_up_to_one_per_run():
    datums_D, run_of_D = pack_groups([split_and_whole_runs()])
    assert seq_shares(datums_D, run_of_D, "run") == pytest.approx([1 / 6, 2 / 6, 3 / 6, 1.0])
    assert seq_shares(datums_D, run_of_D, "segment") == [1.0] * 4
    assert share_extras(datums_D, [1.0] * 4) == {}  # one-segment runs train exactly as without shares


def test_chunked_accumulation_and_one_chunk_agree_with_split_runs():
    """Under `seq_mean_token_mean` the two paths divide by the same run count: the chunks' sums over the batch's
    runs, and the one-chunk minibatch over its shares."""
    groups = [split_and_whole_runs(), split_and_whole_runs()]
    groups[1].runs_G[0].segments[0].tokens[1] = 3  # another prompt, so the rows differ

    def policy():
        torch.manual_seed(0)
        return Trainer(load_model_and_tokenizer(tiny_config(260), device="cpu")[0], TrainerConfig(precision="fp32"))

    # Raw rewards as advantages (1 and 0), so the loss at ratio 1 is −½ under run weighting, not 0.
    cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=2, loss_agg_mode="seq_mean_token_mean",
                         advantage_estimator="reinforce")
    whole = train_batch(policy(), None, copy.deepcopy(groups), cfg, np.random.default_rng(0), KLCoefficient(0.0))
    update = BatchUpdate(policy(), None, cfg, np.random.default_rng(0), KLCoefficient(0.0), planned_chunks=2)
    update.add(copy.deepcopy(groups[:1]))
    update.add(copy.deepcopy(groups[1:]))
    chunked = update.finish()
    assert whole["train/loss"] == pytest.approx(-0.5, rel=1e-6)
    assert chunked["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-5)
    assert chunked["train/grad_norm"] == pytest.approx(whole["train/grad_norm"], rel=1e-5)
    per_segment_cfg = cfg.model_copy(update={"run_weighting": "segment"})
    per_segment = train_batch(policy(), None, copy.deepcopy(groups), per_segment_cfg, np.random.default_rng(0),
                              KLCoefficient(0.0))
    assert per_segment["train/loss"] == pytest.approx(-0.75, rel=1e-6)  # the split run's 3 of 4 sequences


# ---- 3. an SDK retry is answered from the record -----------------------------------------------------------------


class LoseFirstReply(httpx2.AsyncBaseTransport):
    """The client's network: the first model call's reply reaches the client whole and is then lost (a connection
    reset), so the SDK retries the call; everything else passes. Records each attempt's retry count and reply."""

    def __init__(self):
        self.inner = httpx2.AsyncHTTPTransport()
        self.attempts: list[tuple[str | None, bytes]] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        self.attempts.append((request.headers.get(RETRY), body))
        if len(self.attempts) == 1:
            raise httpx2.ReadError("connection reset after the reply", request=request)
        headers = [(k, v) for k, v in response.headers.items() if k.lower() not in ("content-length",
                                                                                       "transfer-encoding")]
        return httpx2.Response(response.status_code, headers=headers, content=body, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_an_openai_sdk_retry_of_an_answered_request_is_replayed_without_sampling(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            network = LoseFirstReply()
            client = openai.AsyncOpenAI(base_url=session.base_url + "/v1", api_key=session.key, max_retries=1,
                                        http_client=httpx2.AsyncClient(transport=network))
            messages = [{"role": "user", "content": "task"}]
            reply = await client.chat.completions.create(model="m", messages=messages)
            assert [count for count, _ in network.attempts] == ["0", "1"]
            assert network.attempts[1][1] == network.attempts[0][1]  # the same bytes: id, content, usage
            assert len(spy.calls) == 1 and session.num_turns == 1
            assert session.counters["retries_replayed"] == 1
            # The agent carries on from the replayed answer: the chain continues, one segment.
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
            await client.chat.completions.create(model="m", messages=messages)
            assert session.kinds == ["new", "append"]
            return spy.calls, await shim.finish_session(session.key, reward=1.0)

    calls, run = asyncio.run(scenario())
    (segment,) = run.segments
    assert trained_tokens_of(segment) == outputs(calls, 0, 1)
    assert run.metadata["shim/retries_replayed"] == 1
    assert shim_metrics([run])["rollout/shim/retries_replayed"] == 1.0


def test_an_anthropic_sdk_retry_of_a_streamed_reply_is_replayed_byte_for_byte(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            network = LoseFirstReply()
            client = anthropic.AsyncAnthropic(base_url=session.base_url, api_key=session.key, max_retries=1,
                                              http_client=httpx2.AsyncClient(transport=network))
            async with client.messages.stream(model="m", max_tokens=64,
                                              messages=[{"role": "user", "content": "task"}]) as stream:
                message = await stream.get_final_message()
            assert [count for count, _ in network.attempts] == ["0", "1"]
            assert network.attempts[1][1] == network.attempts[0][1]  # the same SSE events
            assert network.attempts[0][1].startswith(b"event: message_start")
            assert len(spy.calls) == 1 and session.num_turns == 1 and session.counters["retries_replayed"] == 1
            return message, spy.calls

    message, calls = asyncio.run(scenario())
    assert message.usage.output_tokens == len(calls[0]["completion"].output_ids)


def test_a_new_call_with_an_answered_body_is_sampled_and_only_a_counted_retry_is_replayed(tiny):
    """Count 0 (a deliberate regeneration) samples again; so do a retry count that is no number, a retry of a body
    never answered, and a retry that differs from the answered request in any field the shim reads (here `stream`);
    a retry of a body answered before is replayed."""

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url + "/v1", api_key=session.key, max_retries=0)
            messages = [{"role": "user", "content": "task"}]

            async def ask(count: str | None, body=messages, **kw):
                headers = {} if count is None else {RETRY: count}
                return await client.chat.completions.create(model="m", messages=body, extra_headers=headers, **kw)

            await ask(None)
            await ask("0")  # a new call: sampled (a branch)
            await ask("not-a-count")
            answered = await ask("1", body=[{"role": "user", "content": "never asked"}])
            assert (len(spy.calls), session.counters["retries_replayed"]) == (4, 0)
            streamed = await ask("1", stream=True)  # the same messages, but a streamed reply: another request
            async for _ in streamed:
                pass
            assert (len(spy.calls), session.counters["retries_replayed"]) == (5, 0)
            replayed = await ask("2", body=[{"role": "user", "content": "never asked"}])
            assert (len(spy.calls), session.counters["retries_replayed"]) == (5, 1)
            assert replayed.model_dump() == answered.model_dump()
            return session.kinds

    assert asyncio.run(scenario()) == ["new", "branch", "branch", "compaction", "branch"]


def test_a_session_keeps_its_latest_answers_only(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url + "/v1", api_key=session.key, max_retries=0)
            for i in range(ANSWERS_KEPT + 1):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
            for i in (ANSWERS_KEPT, 0):  # the latest is kept, the oldest was dropped
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}],
                                                     extra_headers={RETRY: "1"})
            return len(spy.calls), session.counters["retries_replayed"]

    assert asyncio.run(scenario()) == (ANSWERS_KEPT + 2, 1)


# ---- 4. what the step reports ------------------------------------------------------------------------------------


def test_rollout_metrics_report_segments_per_run():
    group = split_and_whole_runs()
    settled = [SettledRow("row", {}, group.runs_G)]
    metrics = rollout_metrics(settled, [group], Counter(accepted=1))
    assert (metrics["rollout/segments_per_run_mean"], metrics["rollout/segments_per_run_max"]) == (2.0, 3.0)
