"""Calling rollout functions: context kwargs, drops, bug propagation, cancellation; row cursor."""

import asyncio

import pytest

from training.utils.errors import ConfigError, RecoverableRolloutError, RolloutContractError
from training.utils.rl.dataset import RowCursor
from training.utils.rl.rollout.invoke import CONTEXT_KEYS, context_params, gather_or_cancel, is_recoverable, run_draw
from training.utils.rl.rollout.types import RolloutSample, sample_from_completion

CTX = dict(cursor_index=5, row_index=2, epoch=1, sample_index=3, submit_version=7, evaluation=False)


def sample():
    return RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -0.1, -0.2], loss_mask=[0, 1, 1], reward=1.0)


def test_context_params_reads_declared_keys():
    async def only_row(row): ...
    async def some(row, sample_index, submit_version=0): ...
    async def everything(row, **kwargs): ...

    assert context_params(only_row) == ()
    assert context_params(some) == ("sample_index", "submit_version")
    assert context_params(everything) == CONTEXT_KEYS


def test_context_params_rejects_typos_and_sync_functions():
    async def typo(row, epcoh=0): ...

    with pytest.raises(ConfigError, match="declares parameter 'epcoh', which is not a context key"):
        context_params(typo)

    def not_async(row): ...

    with pytest.raises(ConfigError, match="must be `async def"):
        context_params(not_async)


def test_only_declared_context_is_passed():
    seen = {}

    async def rollout(row, sample_index, epoch):
        seen.update(row=row, sample_index=sample_index, epoch=epoch)
        return sample()

    result = asyncio.run(run_draw(rollout, {"q": 1}, CTX, context_params(rollout), row_id="r", draw_index=3,
                                  vocab_size=10, timeout_s=5))
    assert seen == {"row": {"q": 1}, "sample_index": 3, "epoch": 1}
    assert result.run is not None and result.drop_reason is None


class HTTPStatusError(Exception):
    def __init__(self, status_code):
        self.status_code = status_code


@pytest.mark.parametrize(
    "exc, recoverable",
    [
        (RecoverableRolloutError("x"), True),
        (TimeoutError(), True),
        (ConnectionResetError(), True),
        (HTTPStatusError(503), True),
        (HTTPStatusError(429), True),
        (HTTPStatusError(408), True),
        (HTTPStatusError(400), False),
        (KeyError("answer"), False),
        (ValueError("bad"), False),
    ],
)
def test_error_classification(exc, recoverable):
    assert is_recoverable(exc) is recoverable


def test_openai_transport_errors_are_recoverable():
    import httpx
    import openai  # a rollout that speaks openai has imported it; the classifier does not import it for everyone

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    assert is_recoverable(openai.APIConnectionError(request=request))
    assert is_recoverable(openai.APITimeoutError(request=request))
    assert not is_recoverable(openai.BadRequestError("bad", response=httpx.Response(400, request=request), body=None))


def draw(fn, timeout_s=5.0):
    return asyncio.run(run_draw(fn, {}, CTX, (), row_id="q1", draw_index=0, vocab_size=10, timeout_s=timeout_s))


def test_drops_are_counted_with_reasons():
    async def none(row):
        return None

    async def recoverable(row):
        raise RecoverableRolloutError("sandbox down")

    async def hangs(row):
        await asyncio.sleep(30)

    assert draw(none).drop_reason == "returned_none"
    assert draw(recoverable).drop_reason == "recoverable:RecoverableRolloutError"
    result = draw(hangs, timeout_s=0.05)
    assert result.drop_reason == "timeout" and result.run is None


def test_bugs_and_contract_violations_propagate():
    async def bug(row):
        return row["missing"]

    async def malformed(row):
        return RolloutSample(tokens=[1, 2], logprobs=[0.0], loss_mask=[0, 1], reward=0.0)

    with pytest.raises(KeyError, match="missing"):
        draw(bug)
    with pytest.raises(RolloutContractError,
                       match="row 'q1' draw 0 segment 0: tokens has 2 entries but logprobs has 1"):
        draw(malformed)


def test_gather_or_cancel_cancels_siblings_on_failure():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def fails():
        await asyncio.sleep(0.01)
        raise KeyError("boom")

    async def ok(x):
        return x

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(gather_or_cancel([slow(), fails()]))
    assert cancelled == [True]
    assert asyncio.run(gather_or_cancel([ok(1), ok(2)])) == [1, 2]


def test_row_cursor_is_deterministic_resumable_and_wraps_epochs():
    rows = [{"id": f"r{i}"} for i in range(5)]
    cursor = RowCursor(rows, seed=3)
    first = cursor.take(3)
    state = cursor.state_dict()
    rest = cursor.take(4)
    assert sorted(i.row_id for i in first + rest[:2]) == [f"r{i}" for i in range(5)]
    assert [i.epoch for i in rest] == [0, 0, 1, 1] and [i.cursor_index for i in rest] == [3, 4, 5, 6]
    resumed = RowCursor(rows, seed=0)
    resumed.load_state_dict(state)
    assert [i.row_id for i in resumed.take(4)] == [i.row_id for i in rest]
    assert [i.row_id for i in RowCursor(rows, seed=3).take(3)] == [i.row_id for i in first]
    with pytest.raises(ConfigError, match=r"rows\[1\] is str; every dataset row must be a dict"):
        RowCursor([{}, "x"], seed=0)


def test_context_marks_the_last_row_of_each_epoch_in_cursor_order_and_names_the_draw_twice():
    from training.utils.rl.rollout.invoke import draw_context

    rows = [{"id": f"r{i}"} for i in range(3)]
    items = RowCursor(rows, seed=3).take(7)  # two shuffled epochs and the first row of a third
    contexts = [draw_context(item, rows_per_epoch=3, sample_index=2, submit_version=4) for item in items]
    assert [c["end_of_epoch"] for c in contexts] == [False, False, True, False, False, True, False]
    # row_index is the row's place in `rows`, which the shuffle permutes: epoch 0 hands out rows 2, 1, 0,
    # so rows[0] ends it.
    assert [c["row_index"] for c in contexts[:3]] == [2, 1, 0] and contexts[2]["cursor_index"] == 2
    assert all(c["rollout_idx"] == c["sample_index"] == 2 for c in contexts)
    assert set(contexts[0]) == set(CONTEXT_KEYS) and contexts[0]["evaluation"] is False
    assert [c["epoch"] for c in contexts] == [0, 0, 0, 1, 1, 1, 2]


def context_recorder(seen):
    async def rollout(row, rollout_idx, end_of_epoch, cursor_index, evaluation):
        seen.append((row["id"], rollout_idx, end_of_epoch, cursor_index, evaluation))
        return sample()

    return rollout


def test_every_caller_passes_rollout_idx_and_end_of_epoch():
    """The one binder (`bind_draws`, the async producer's and rl_loop's draw) and rollout_evaluation build the
    same context."""
    from training.recipes import rl_loop
    from training.utils.rl.evaluation import rollout_evaluation
    from training.utils.rl.rollout.invoke import bind_draws

    rows = [{"id": f"r{i}"} for i in range(3)]
    items = RowCursor(rows, seed=0, shuffle=False).take(3)
    assert context_params(context_recorder([])) == ("rollout_idx", "end_of_epoch", "cursor_index", "evaluation")

    seen = []
    rollout = context_recorder(seen)
    draw = bind_draws(rollout, rows_per_epoch=3, vocab_size=10, timeout_s=5)
    asyncio.run(draw(items[2], 1, 0))
    assert seen == [("r2", 1, True, 2, False)]

    seen.clear()
    cfg = rl_loop.Config(completions_per_prompt=2, rollout_timeout_s=5)
    settled = asyncio.run(rl_loop.sample_row(items[1], draw, cfg, version=0,
                                                 min_group_size=cfg.effective_min_group_size()))
    assert len(settled.runs_G) == 2 and sorted(seen) == [("r1", 0, False, 1, False), ("r1", 1, False, 1, False)]

    seen.clear()
    evaluation_fn = rollout_evaluation(lambda setup: context_recorder(seen), rows, samples_per_row=2)
    assert asyncio.run(evaluation_fn(None, 3)) == {"reward": 1.0, "dropped": 0.0}
    assert sorted(seen) == [("r0", 0, False, 0, True), ("r0", 1, False, 0, True), ("r1", 0, False, 1, True),
                            ("r1", 1, False, 1, True), ("r2", 0, True, 2, True), ("r2", 1, True, 2, True)]


def test_rollout_evaluation_makes_its_rollout_once_per_run_setup():
    """Reused across runs (or after `serve_policy`), the evaluation samples from the setup it is given."""
    from types import SimpleNamespace

    from training import rollout_evaluation

    made = []

    def factory(setup):
        made.append(setup.name)

        async def rollout_fn(row):
            return sample_from_completion([1, 2], [3], [-0.5], reward=float(setup.name == "second"))

        return rollout_fn

    evaluation_fn = rollout_evaluation(factory, [{"id": "a"}, {"id": "b"}])
    first, second = SimpleNamespace(name="first"), SimpleNamespace(name="second")
    results = [asyncio.run(evaluation_fn(setup, step)) for setup, step in ((first, 0), (first, 1), (second, 0))]
    assert made == ["first", "second"]
    assert [r["reward"] for r in results] == [0.0, 0.0, 1.0]


def one_bad_draw_factory(bad_sample):
    """Row r1's draw 1 returns `bad_sample(row)`; every other draw a short, valid sample."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            if row["id"] == "r1" and sample_index == 1:
                return bad_sample(row)
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                          reward=float(sample_index))

        return rollout_fn

    return make_rollout_fn


def stops_before_training(recipe, tmp_path, bad_sample, error, **fields):
    """Run `recipe` on 4 rows, 2 a step, with one bad draw: it stops with `error`, and no step trained."""
    from training.recipes import async_rl_loop
    from training.utils.config.rl import SamplingConfig
    from training.utils.run_files.logging import read_ledger

    rows = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50]} for i in range(4)]
    extra = {"max_head_offpolicy_versions": 0} if recipe is async_rl_loop else {}
    cfg = recipe.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=4, max_steps=1,
                        log_path=str(tmp_path), sampling=SamplingConfig(max_tokens=4), progress=False,
                        **extra | fields)
    with pytest.raises(RolloutContractError) as raised:
        recipe.main(cfg, rollout_fn_factory=one_bad_draw_factory(bad_sample), rows=rows)
    assert str(raised.value) == error
    ledger = tmp_path / "metrics.jsonl"
    assert not [r for r in (read_ledger(ledger) if ledger.exists() else []) if "train/loss" in r]


def long_sample(tokens):
    return lambda row: sample_from_completion(row["prompt_token_ids"], [70] * (tokens - 3), [-1.0] * (tokens - 3),
                                              reward=1.0)


def test_a_sample_longer_than_the_model_context_stops_the_run_naming_it(tmp_path):
    """tiny-random has a 1,024-token context (`max_position_embeddings`, which the embedded engine serves too)."""
    from training.recipes import rl_loop

    stops_before_training(rl_loop, tmp_path, long_sample(1025), (
        "row 'r1' draw 1 segment 0: tokens has 1025 entries, more than the 1024 the run can train (the policy's "
        "context (its max_position_embeddings)); shorten the rollout (sampling.max_tokens, fewer turns) or drop the "
        "draw by returning None"))


def test_a_sample_longer_than_max_sequence_tokens_stops_the_async_run_naming_it(tmp_path):
    from training.recipes import async_rl_loop

    stops_before_training(async_rl_loop, tmp_path, long_sample(100_000), (
        "row 'r1' draw 1 segment 0: tokens has 100000 entries, more than the 64 the run can train "
        "(max_sequence_tokens); shorten the rollout (sampling.max_tokens, fewer turns) or drop the draw by returning "
        "None"), max_sequence_tokens=64)


def test_an_overflowing_reward_stops_the_run_naming_row_and_draw(tmp_path):
    from training.recipes import rl_loop

    huge_reward = lambda row: sample_from_completion(row["prompt_token_ids"], [70, 80], [-1.0, -2.0],  # noqa: E731
                                                     reward=-1e200)
    stops_before_training(rl_loop, tmp_path, huge_reward, (
        "row 'r1' draw 1 segment 0: reward is -1e+200, outside [-1e+15, 1e+15]: beyond that the advantage "
        "arithmetic overflows; rescale the reward"))


@pytest.mark.parametrize("returns", ["sample", "run"])
def test_a_sample_changed_after_its_return_trains_as_returned(tmp_path, returns):
    """Issue 63: a rollout appends three tokens to what it returned 1 ms later; what trains is what it returned."""
    from training.recipes import async_rl_loop
    from training.utils.config.rl import SamplingConfig
    from training.utils.rl.rollout.types import RolloutRun
    from training.utils.run_files.logging import read_ledger

    rows = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]
    changed = []

    def factory(mutate: bool):
        def make_rollout_fn(setup):
            async def rollout_fn(row, sample_index):
                out = sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 71, 72, 73],
                                             [-1.0] * 4, reward=float(sample_index))

                def grow():
                    for values, extra in ((out.tokens, [74, 75, 76]), (out.logprobs, [-1.0] * 3),
                                          (out.loss_mask, [1, 1, 1])):
                        values.extend(extra)
                    changed.append(len(out.tokens))

                if mutate:
                    asyncio.get_running_loop().call_later(0.001, grow)
                return out if returns == "sample" else RolloutRun(segments=[out])

            return rollout_fn

        return make_rollout_fn

    def trained(name: str, mutate: bool) -> list[tuple[float, float]]:
        cfg = async_rl_loop.Config(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2,
                                   max_steps=2, log_path=str(tmp_path / name), sampling=SamplingConfig(max_tokens=4),
                                   progress=False)
        summary = async_rl_loop.main(cfg, rows=rows, rollout_fn_factory=factory(mutate))
        return [(r["rollout/response_len_mean"], r["perf/train_tokens"]) for r in read_ledger(summary["ledger"])
                if "perf/train_tokens" in r]

    control = trained("control", mutate=False)
    assert control == [(4.0, 2 * 4 * 7.0)] * 2  # 4 sampled tokens; 8 runs of 8 tokens, 7 positions each
    assert trained("mutated", mutate=True) == control
    assert len(changed) == 16 and set(changed) == {11}  # every returned sample did grow, after its return
