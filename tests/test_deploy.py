"""The embedded deployment on a tiny random Llama: engine, HTTP server, client, weight sync.

The model's EOS row of the (tied) output projection is zeroed, so EOS has logit 0 while the
other logits spread over several units: greedy never picks it and sampling rarely does, which
keeps lengths predictable. Each test runs its own event loop and deployment.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import threading
import time
import weakref
from unittest.mock import patch

import aiohttp
import pytest
import torch
from aiohttp import web

from engine_support import deployed, greedy_and_sampled
from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import (
    DiskWeightSync,
    Engine,
    Sampler,
    engine_dtype,
    start_deployment,
    start_embedded_deployment,
)
from training.utils.deploy.admission import split_by_length
from training.utils.deploy.completion import InvalidRequestError
from training.utils.deploy.decode import KVBatch, SlotLayer, cache_kwarg
from training.utils.deploy.graphs import DecodeSteps
from training.utils.deploy.next_token import (
    SamplingParams_B,
    _sample_inverse_cdf,
    _truncation_keep,
    _uniforms,
    sample_next,
)
from training.utils.errors import ConfigError, DeploymentError, RecoverableDeploymentError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config

MODEL_NAME = "tiny"


def make_tiny(seed: int):
    torch.manual_seed(seed)
    config = tiny_config(260)
    config.initializer_range = 0.3  # peaked logits: varied greedy outputs, clear argmax gaps
    model, tokenizer = load_model_and_tokenizer(config, device="cpu")
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)


@pytest.fixture(scope="module")
def tiny_other():
    return make_tiny(1)[0]


def authorized(dep) -> aiohttp.ClientSession:
    """An HTTP session that sends the deployment's secret, as every client of the library does."""
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {dep.api_key}"})


def greedy_reference(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def trainer_logprobs(model, prompt_ids: list[int], output_ids: list[int], temperature: float) -> torch.Tensor:
    """What the trainer computes: log_softmax(logits / T) of the full sequence, at the output tokens."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, ids[0, len(prompt_ids) :, None]).squeeze(1)


PROMPTS = ["Hi", "The capital of France is", "x", "Once upon a time, in a land far away, there lived"]


# ---------------------------------------------------------------------------- sampling


def _params(B, temperature=1.0, top_p=1.0, top_k=0):
    return SamplingParams_B(
        temperature=torch.full((B,), float(temperature)),
        top_p=torch.full((B,), float(top_p)),
        top_k=torch.full((B,), top_k, dtype=torch.long),
        generators=[None] * B,
    )


def test_truncation_keeps_top_k_and_nucleus():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    keep = _truncation_keep(logp, torch.tensor([1.0, 0.7]), torch.tensor([2, 0]))
    # Row 0: top-2. Row 1: mass before token 2 is 0.8 >= 0.7, so tokens 0 and 1 stay.
    assert keep.tolist() == [[True, True, False, False], [True, True, False, False]]
    keep = _truncation_keep(logp[:1], torch.tensor([0.01]), torch.tensor([0]))
    assert keep.tolist() == [[True, False, False, False]]  # the most likely token always stays


def test_sample_next_logprob_semantics():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    tokens, logprobs = sample_next(logits, _params(3, temperature=0))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))

    tokens, logprobs = sample_next(logits, _params(3, temperature=0.5))
    expected = torch.log_softmax(logits / 0.5, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)

    # top_k=1 leaves one token: it is the argmax and its renormalized logprob is 0.
    tokens, logprobs = sample_next(logits, _params(3, temperature=1.0, top_k=1))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert logprobs.abs().max().item() < 1e-6


def test_sample_next_matches_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(20000, 1)
    tokens, _ = sample_next(logits, _params(20000))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert (freq - probs).abs().max().item() < 0.02


def test_inverse_cdf_matches_distribution_across_blocks():
    """V spans several 256-token blocks plus a partial one; frequencies match the probabilities."""
    torch.manual_seed(0)
    probs = torch.zeros(700)
    probs[[3, 255, 256, 511, 600, 699]] = torch.tensor([0.1, 0.2, 0.25, 0.05, 0.3, 0.1])
    rows = 40000
    tokens = _sample_inverse_cdf(probs.repeat(rows, 1), torch.rand(rows, dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=700).float() / rows
    assert (freq - probs).abs().max().item() < 0.01
    assert freq[probs == 0].sum().item() == 0  # zero-probability tokens are never drawn


def test_inverse_cdf_never_returns_a_zero_probability_token_at_the_edges():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.5, 1.0 - 2**-53):  # u = 1 - eps can round to the row total
        tokens = _sample_inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64))
        assert (probs.gather(1, tokens[:, None]) > 0).all(), (u, tokens)
    # Unnormalized rows are fine: u picks the same token as after normalizing.
    assert _sample_inverse_cdf(probs[:1] * 7, torch.tensor([0.6], dtype=torch.float64)).item() == 2


def test_sampling_non_finite_logits_raises():
    logits = torch.zeros(2, 300)
    logits[1, 5] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        sample_next(logits, _params(2))


def test_seeded_rows_draw_the_same_tokens_again():
    logits = torch.randn(3, 1000)

    def draw(seeds):
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        params = SamplingParams_B(torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.long), gens)
        return [sample_next(logits, params)[0].tolist() for _ in range(5)]

    first, again = draw([1, 2, None]), draw([1, 2, None])
    assert [t[:2] for t in first] == [t[:2] for t in again]
    assert _uniforms([torch.Generator().manual_seed(5)], "cpu").item() == torch.rand(
        (), dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    ).item()


def test_split_by_length_pays_an_extra_forward_only_when_padding_costs_more():
    lengths = [5, 30, 3, 29, 4, 28]
    # One forward: 6 x 30 + 10 = 190 tokens; two: 3 x 30 + 10 + 3 x 5 + 10 = 125.
    assert split_by_length(lengths, forward_cost=10) == [[1, 3, 5], [0, 4, 2]]
    assert split_by_length(lengths, forward_cost=200) == [[1, 3, 5, 0, 4, 2]]
    assert split_by_length(lengths, forward_cost=None) == [[0, 1, 2, 3, 4, 5]]  # off the CPU: one forward


def test_kv_batch_split_prefill_matches_generate(tiny):
    """What a split prefill does: the longest prompts start the batch, shorter ones join it."""
    model, _ = tiny
    chunks = [[list(range(10, 60)), list(range(70, 110))], [[5, 6, 7, 8, 9, 10]], [[13, 14]], [[7, 8, 9], [11, 12]],
              [list(range(20, 40))] * 2]
    rebuilt, slots = [], []
    with torch.inference_mode():
        batch, logits = KVBatch.prefill(model, chunks[0])
        logits_P = [logits]
        for chunk in chunks[1:]:
            new, logits = KVBatch.prefill(model, chunk)
            joined = batch.insert(new, row_capacity=8)
            rebuilt.append(joined is not batch)
            slots.append(joined.row_capacity)
            batch = joined
            logits_P.append(logits)
        # Rows outgrowing the slots rebuild the batch with slots up to the next power of two of its rows, at most
        # row_capacity; rows that fit the slots and the width are written in place.
        assert rebuilt == [True, False, True, False] and slots == [4, 4, 8, 8]
        outputs = [[int(t)] for t in torch.cat(logits_P).argmax(-1)]
        for _ in range(5):
            logits = batch.decode(model, torch.tensor([o[-1] for o in outputs]))
            for o, t in zip(outputs, logits.argmax(-1).tolist()):
                o.append(t)
    for prompt, output in zip([p for chunk in chunks for p in chunk], outputs):
        assert output == greedy_reference(model, prompt, 6)



def test_kv_batch_rebuild_frees_each_old_layer_as_it_copies(tiny):
    """A rebuild holds one layer twice at most: each old layer's buffers are freed once copied, before the next
    layer is built, and the rebuilt batch still decodes what `generate` does."""
    model, _ = tiny
    short, long_prompt = [[5, 6, 7, 8, 9, 10], [7, 8, 9]], list(range(10, 60))
    with torch.inference_mode():
        batch, logits_a = KVBatch.prefill(model, short)
        new, logits_b = KVBatch.prefill(model, [long_prompt])  # longer than the batch: a rebuild
        old_keys = [weakref.ref(layer.keys_buf) for layer in batch.layers]
        freed_before = []  # at the release of layer i: which old layers' keys are gone
        release = SlotLayer.release

        def recording_release(layer):
            if layer in batch.layers:
                freed_before.append([ref() is None for ref in old_keys])
            release(layer)

        with patch.object(SlotLayer, "release", recording_release):
            joined = batch.insert(new, row_capacity=4)
        n = len(batch.layers)
        assert joined is not batch and n >= 2
        assert freed_before == [[j < i for j in range(n)] for i in range(n)]
        assert all(ref() is None for ref in old_keys) and batch.reserved_bytes() == 0 and new.reserved_bytes() == 0
        assert joined.reserved_bytes() > 0
        outputs = [[int(t)] for t in torch.cat([logits_a, logits_b]).argmax(-1)]
        for _ in range(4):
            logits = joined.decode(model, torch.tensor([o[-1] for o in outputs]))
            for o, t in zip(outputs, logits.argmax(-1).tolist()):
                o.append(t)
    for prompt, output in zip(short + [long_prompt], outputs):
        assert output == greedy_reference(model, prompt, 5)


# ---------------------------------------------------------------------------- engine


def test_greedy_matches_generate_concurrently(tiny):
    model, tok = tiny
    prompts = [tok.encode(p) for p in PROMPTS]

    async def main():
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig(max_batch_requests=3))
        try:
            # Four prompts of different lengths, three slots: rows join and leave mid-flight.
            lengths = [24, 9, 17, 30]
            results = await asyncio.gather(
                *[engine.generate(p, max_tokens=n, temperature=0) for p, n in zip(prompts, lengths)]
            )
        finally:
            engine.close()
        return results

    results = asyncio.run(main())
    for prompt, max_tokens, (c,) in zip(prompts, [24, 9, 17, 30], results):
        assert c.output_ids == greedy_reference(model, prompt, max_tokens)
        assert c.finish_reason == "length"
        assert c.versions == [0] * max_tokens
        assert c.prompt_ids == prompt


def test_greedy_matches_generate_with_rows_joining_and_leaving(tiny):
    """Thirteen requests through four slots: in-place inserts, swap-removals and a rebuild all happen."""
    model, tok = tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 260, (int(n),), generator=g).tolist() for n in torch.randint(1, 41, (12,), generator=g)]
    max_tokens = [int(n) for n in torch.randint(1, 26, (12,), generator=g)]
    prompts.append(list(range(10, 160)))  # joins last and is longer than the batch: a rebuild
    max_tokens.append(5)

    async def main():
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig(max_batch_requests=4))
        try:
            return await asyncio.gather(
                *[engine.generate(p, max_tokens=n, temperature=0) for p, n in zip(prompts, max_tokens)]
            )
        finally:
            engine.close()

    for prompt, n, (c,) in zip(prompts, max_tokens, asyncio.run(main())):
        assert c.output_ids == greedy_reference(model, prompt, n)


def test_kv_batch_trim_after_the_long_row_leaves(tiny):
    model, _ = tiny
    long_prompt, short_prompt = list(range(10, 110)), [7, 8, 9]
    with torch.inference_mode():
        batch, logits = KVBatch.prefill(model, [long_prompt, short_prompt])
        outputs = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(3):
            logits = batch.decode(model, torch.tensor([o[-1] for o in outputs]))
            for o, t in zip(outputs, logits.argmax(-1).tolist()):
                o.append(t)
        assert batch.remove([0]) == [1]
        outputs = outputs[1:]
        trimmed = batch.maybe_trim(row_capacity=4)
        assert trimmed is not batch and trimmed.length == len(short_prompt) + 3 and trimmed.row_capacity == 1
        for _ in range(4):
            logits = trimmed.decode(model, torch.tensor([o[-1] for o in outputs]))
            outputs[0].append(int(logits.argmax(-1)[0]))
    assert outputs[0] == greedy_reference(model, short_prompt, 8)


def test_stop_strings_stop_tokens_and_eos(tiny):
    model, tok = tiny
    prompt = tok.encode("The capital of France is")
    greedy = greedy_reference(model, prompt, 40)
    # A two-character stop string taken from the greedy output (ASCII tokens only).
    k = next(i for i in range(5, 38) if all(tok.decode([t]).isalnum() for t in greedy[i : i + 2]))
    stop = tok.decode(greedy[k : k + 2])
    end = next(j for j in range(len(greedy)) if stop in tok.decode(greedy[: j + 1]))

    async def main():
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig())
        try:
            by_string = await engine.generate(prompt, max_tokens=40, temperature=0, stop=[stop, "@@never@@"])
            by_token = await engine.generate(prompt, max_tokens=40, temperature=0, stop_token_ids=[greedy[3]])
            # Near-uniform sampling reaches EOS now and then; seeds make the draw reproducible.
            sampled = await engine.generate(prompt, n=32, max_tokens=64, temperature=100.0, seed=1234)
        finally:
            engine.close()
        return by_string[0], by_token[0], sampled

    by_string, by_token, sampled = asyncio.run(main())
    assert by_string.output_ids == greedy[: end + 1]
    assert by_string.finish_reason == "stop"
    assert by_string.text == tok.decode(greedy[: end + 1]).split(stop)[0]
    first = greedy.index(greedy[3])
    assert by_token.output_ids == greedy[: first + 1] and by_token.finish_reason == "stop"
    eos = tok.eos_token_id
    ended_by_eos = [c for c in sampled if eos in c.output_ids]
    assert ended_by_eos, "expected some sampled completions to hit EOS"
    for c in sampled:
        assert eos not in c.output_ids[:-1]
        assert c.finish_reason == ("stop" if c.output_ids[-1] == eos else "length")
        assert len(c.output_ids) == len(c.logprobs) == len(c.versions) <= 64
        assert c.finish_reason == "stop" or len(c.output_ids) == 64


def test_timeout_aborts_and_engine_keeps_serving(tiny):
    model, tok = tiny
    prompt = tok.encode("Hi")

    async def main():
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig())
        try:
            with pytest.raises(RecoverableDeploymentError, match="timeout=0.05s"):
                await engine.generate(prompt, max_tokens=1000, timeout=0.05)
            for _ in range(100):  # the slot is freed at the next step
                if engine.num_running == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.num_running == 0
            (c,) = await engine.generate(prompt, max_tokens=5, temperature=0)
            assert len(c.output_ids) == 5
        finally:
            engine.close()
        assert not engine.is_running

    asyncio.run(main())


def test_n_shares_prompt_and_samples_independently(tiny):
    model, tok = tiny
    prompt = tok.encode("Once upon a time")

    async def main():
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig(max_batch_requests=4))
        try:
            return await engine.generate(prompt, n=6, max_tokens=12, temperature=1.0)
        finally:
            engine.close()

    completions = asyncio.run(main())
    assert len(completions) == 6
    assert len({tuple(c.output_ids) for c in completions}) > 1
    for c in completions:
        torch.testing.assert_close(
            torch.tensor(c.logprobs), trainer_logprobs(model, prompt, c.output_ids, 1.0), atol=1e-4, rtol=0
        )


def test_engine_rejects_bad_requests(tiny):
    model, tok = tiny

    async def main():
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig(max_context_tokens=64))
        try:
            cases = {
                "prompt": dict(prompt_ids=[1, 260], max_tokens=4),
                "max_tokens": dict(prompt_ids=[5] * 10, max_tokens=60),
                "n": dict(prompt_ids=[5], max_tokens=4, n=0),
                "temperature": dict(prompt_ids=[5], max_tokens=4, temperature=-0.1),
                "top_p": dict(prompt_ids=[5], max_tokens=4, top_p=0.0),
            }
            for param, kwargs in cases.items():
                with pytest.raises(ValueError) as info:
                    await engine.generate(kwargs.pop("prompt_ids"), **kwargs)
                assert info.value.param == param and param in str(info.value)
        finally:
            engine.close()

    asyncio.run(main())


def test_failed_step_fails_its_requests_and_engine_keeps_serving(tiny):
    model, tok = tiny

    async def main():
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig())
        forward = engine.model.forward
        calls = []

        def broken_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("simulated device error")
            return forward(*args, **kwargs)

        engine.model.forward = broken_once
        try:
            with pytest.raises(DeploymentError, match="simulated device error"):
                await engine.generate([5, 6], max_tokens=4)
            (c,) = await engine.generate([5, 6], max_tokens=4, temperature=0)
        finally:
            engine.close()
        return c

    c = asyncio.run(main())
    assert c.output_ids == greedy_reference(model, [5, 6], 4)


# ---------------------------------------------------------------------------- weight updates


def test_update_weights_validates_names_and_shapes(tiny):
    model, tok = tiny
    engine = Engine(copy.deepcopy(model), tok, DeploymentConfig())
    try:
        with pytest.raises(ValueError, match="not in the engine model's state_dict"):
            engine.update_weights({"nope.weight": torch.zeros(1)}, 1)
        name = "model.norm.weight"
        with pytest.raises(ValueError, match=name):
            engine.update_weights({name: torch.zeros(3)}, 1)
        assert engine.version == 0
    finally:
        engine.close()


def test_repeated_updates_reuse_the_pairing_and_still_check_each_call(tiny, tiny_other):
    model, tok = tiny
    engine = Engine(copy.deepcopy(model), tok, DeploymentConfig())
    try:
        for version, source in enumerate([tiny_other, model, tiny_other], start=1):  # same names: the pairing is reused
            engine.update_weights(source.state_dict(), version)
            for name, tensor in engine.model.state_dict().items():
                assert torch.equal(tensor, source.state_dict()[name]), (version, name)
        norm = {"model.norm.weight": torch.full_like(model.model.norm.weight, 2.0)}
        engine.update_weights(norm, 4)  # a subset: paired anew
        assert torch.equal(engine.model.model.norm.weight, norm["model.norm.weight"])
        with pytest.raises(ValueError, match="model.norm.weight"):
            engine.update_weights({"model.norm.weight": torch.zeros(3)}, 5)
        assert engine.version == 4
    finally:
        engine.close()


def test_in_process_sync_changes_greedy_output_and_version(tiny, tiny_other):
    model, tok = tiny
    prompt = tok.encode("The capital of France is")

    async def main():
        async with deployed(model, tok) as dep:
            (before,) = await dep.sampler.sample(prompt, max_tokens=12, temperature=0)
            metrics = await dep.weight_sync.sync(tiny_other.state_dict(), version=1)
            (after,) = await dep.sampler.sample(prompt, max_tokens=12, temperature=0)
            async with authorized(dep) as s, s.get(dep.base_url + "/weights/version") as r:
                served = await r.json()
            return before, after, metrics, served, dep.version, dep.weight_sync.version

    before, after, metrics, served, version, sync_version = asyncio.run(main())
    assert before.output_ids == greedy_reference(model, prompt, 12)
    assert after.output_ids == greedy_reference(tiny_other, prompt, 12)
    assert before.output_ids != after.output_ids
    assert before.versions == [0] * 12 and after.versions == [1] * 12
    assert served == {"version": 1} and version == 1 and sync_version == 1
    assert metrics["weight_sync_time"] > 0 and metrics["weight_sync_bytes"] > 0


LONG = 120  # tokens of the request in flight during an update: many decode steps after the update lands


def _inflight_update(model, tok, new_model, inflight_on_sync: str):
    """Start a long request, update weights mid-flight and queue a new request behind it."""
    prompt = tok.encode("Hi")

    async def main():
        engine = Engine(copy.deepcopy(model), tok, DeploymentConfig(inflight_on_sync=inflight_on_sync))
        forward = engine.model.forward

        def slow_forward(*args, **kwargs):  # >= 2 ms a step, so the update surely lands mid-request
            time.sleep(0.002)
            return forward(*args, **kwargs)

        engine.model.forward = slow_forward
        try:
            long = asyncio.create_task(engine.generate(prompt, max_tokens=LONG, temperature=0))
            while engine.stats["output_tokens"] < 5:
                await asyncio.sleep(0.002)
            update = asyncio.create_task(asyncio.to_thread(engine.update_weights, new_model.state_dict(), 7))
            await asyncio.sleep(0.05)
            later = asyncio.create_task(engine.generate(prompt, max_tokens=4, temperature=0))
            (long_c,), _, (later_c,) = await asyncio.gather(long, update, later)
        finally:
            engine.close()
        return long_c, later_c

    return asyncio.run(main())


def test_continue_new_inflight_request_switches_version(tiny, tiny_other):
    model, tok = tiny
    long_c, later_c = _inflight_update(model, tok, tiny_other, "continue_new")
    assert long_c.finish_reason == "length" and len(long_c.output_ids) == LONG
    first_new = long_c.versions.index(7)
    assert 0 < first_new < LONG
    assert long_c.versions == [0] * first_new + [7] * (LONG - first_new)
    # Tokens before the switch are the old model's greedy continuation.
    assert long_c.output_ids[:first_new] == greedy_reference(model, tok.encode("Hi"), first_new)
    assert later_c.versions == [7] * 4


def test_finish_old_inflight_request_keeps_old_version(tiny, tiny_other):
    model, tok = tiny
    long_c, later_c = _inflight_update(model, tok, tiny_other, "finish_old")
    assert long_c.versions == [0] * LONG
    assert long_c.output_ids == greedy_reference(model, tok.encode("Hi"), LONG)
    # The request queued during the pending update ran on the new weights only.
    assert later_c.versions == [7] * 4
    assert later_c.output_ids == greedy_reference(tiny_other, tok.encode("Hi"), 4)


def test_finish_old_update_times_out_instead_of_hanging(tiny, tiny_other):
    model, tok = tiny

    async def main():
        cfg = DeploymentConfig(inflight_on_sync="finish_old", weight_sync_timeout_s=0.2)
        engine = Engine(copy.deepcopy(model), tok, cfg)
        forward = engine.model.forward

        def slow_forward(*args, **kwargs):
            time.sleep(0.01)
            return forward(*args, **kwargs)

        engine.model.forward = slow_forward
        try:
            long = asyncio.create_task(engine.generate([5, 6], max_tokens=60, temperature=0))
            while engine.num_running == 0:
                await asyncio.sleep(0.005)
            with pytest.raises(DeploymentError, match="weight_sync_timeout_s=0.2s"):
                await asyncio.to_thread(engine.update_weights, tiny_other.state_dict(), 1)
            (long_c,) = await long
            (after,) = await engine.generate([5, 6], max_tokens=3, temperature=0)
        finally:
            engine.close()
        return long_c, after, engine.version

    long_c, after, version = asyncio.run(main())
    assert long_c.versions == [0] * 60 and after.versions == [0] * 3 and version == 0


def test_disk_sync_round_trip(tiny, tiny_other):
    model, tok = tiny
    prompt = tok.encode("Once upon a time")

    async def main():
        async with deployed(model, tok, weight_sync="disk") as dep:
            sync = dep.weight_sync
            assert isinstance(sync, DiskWeightSync)
            (before,) = await dep.sampler.sample(prompt, max_tokens=10, temperature=0)
            metrics = await sync.sync(tiny_other.state_dict(), version=2)
            written = (sync.directory / "step_2" / "model.safetensors").is_file()
            (after,) = await dep.sampler.sample(prompt, max_tokens=10, temperature=0)
            await sync.sync(tiny_other.state_dict(), version=3)
            pruned = not (sync.directory / "step_2").exists()
            async with authorized(dep) as s:
                async with s.post(dep.base_url + "/update_weights_from_disk", json={"model_path": "/nonexistent"}) as r:
                    bad = (r.status, await r.json())
            return before, after, metrics, written, pruned, sync.version, dep.version, bad

    before, after, metrics, written, pruned, sync_version, version, bad = asyncio.run(main())
    assert before.output_ids == greedy_reference(model, prompt, 10)
    assert after.output_ids == greedy_reference(tiny_other, prompt, 10)
    assert after.versions == [2] * 10
    assert written and pruned and sync_version == 3 and version == 3
    assert metrics["weight_sync_time"] > 0
    assert bad[0] == 400 and bad[1]["success"] is False and "/nonexistent" in bad[1]["message"]


def test_the_handle_reports_the_engine_context_and_its_cumulative_counters(tiny):
    """`context_tokens` is the engine's `max_context_tokens`; `engine_stats()` a float snapshot of its counters."""
    model, tok = tiny
    prompt = tok.encode("Once upon a time")

    async def main():
        async with deployed(model, tok, max_context_tokens=64) as dep:
            before = dep.engine_stats()
            await dep.sampler.sample(prompt, n=2, max_tokens=5, temperature=0)
            return dep.context_tokens, dep.engine.max_context_tokens, before, dep.engine_stats()

    context, engine_context, before, after = asyncio.run(main())
    assert context == engine_context == 64
    counters = {"prompt_tokens", "prefill_tokens", "prefix_cache_hit_tokens", "prefill_time_s", "decode_time_s"}
    assert counters <= before.keys() and all(type(v) is float for v in after.values())
    assert all(before[key] == 0.0 for key in counters)
    assert after["prompt_tokens"] == len(prompt)  # n=2 draws of one request: its prompt counts once
    assert after["prompt_tokens"] == after["prefill_tokens"] + after["prefix_cache_hit_tokens"]
    assert after["prefill_time_s"] > 0 and after["decode_time_s"] > 0


def test_a_bfloat16_engine_copy_takes_float32_weights_on_sync(tiny, tiny_other):
    """`deployment.dtype` sets the engine copy's weights; in-process sync rounds the trainer's float32 tensors."""
    model, tok = tiny
    prompt = tok.encode("The capital of France is")

    async def main():
        dep = await start_deployment(model, tok, DeploymentConfig(dtype="bfloat16"), model_name=MODEL_NAME)
        try:
            dtypes = {p.dtype for p in dep.engine.model.parameters()}
            await dep.weight_sync.sync(tiny_other.state_dict(), version=1)
            (after,) = await dep.sampler.sample(prompt, max_tokens=12, temperature=0)
            served = {name: t.clone() for name, t in dep.engine.model.state_dict().items()}
        finally:
            await dep.close()
        return dtypes, after, served

    dtypes, after, served = asyncio.run(main())
    assert dtypes == {torch.bfloat16}
    assert model.dtype == torch.float32  # the policy itself is untouched
    for name, tensor in tiny_other.state_dict().items():
        assert torch.equal(served[name], tensor.to(torch.bfloat16)), name
    assert after.output_ids == greedy_reference(copy.deepcopy(tiny_other).to(torch.bfloat16), prompt, 12)
    assert engine_dtype(DeploymentConfig(), torch.device("cpu")) == torch.float32
    assert engine_dtype(DeploymentConfig(), torch.device("cuda")) == torch.bfloat16


# ---------------------------------------------------------------------------- HTTP server


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_server_logprobs_match_trainer(tiny, temperature):
    model, tok = tiny
    prompts = [tok.encode(p) for p in PROMPTS]

    async def main():
        async with deployed(model, tok) as dep:
            return await asyncio.gather(
                *[dep.sampler.sample(p, n=2, max_tokens=16, temperature=temperature) for p in prompts]
            )

    for prompt, completions in zip(prompts, asyncio.run(main())):
        for c in completions:
            expected = trainer_logprobs(model, prompt, c.output_ids, temperature)
            assert (torch.tensor(c.logprobs) - expected).abs().max().item() < 1e-4


def test_openai_sdk_64_concurrent_requests(tiny):
    openai = pytest.importorskip("openai")
    model, tok = tiny

    async def main():
        async with deployed(model, tok, max_batch_requests=64) as dep:
            client = openai.AsyncOpenAI(base_url=dep.base_url + "/v1", api_key=dep.api_key, max_retries=0, timeout=60)
            try:
                prompts = [tok.encode(f"request number {i}") for i in range(64)]
                responses = await asyncio.gather(
                    *[
                        client.completions.create(
                            model=MODEL_NAME,
                            prompt=[p],
                            max_tokens=8,
                            logprobs=0,
                            extra_body={"return_token_ids": True},
                        )
                        for p in prompts
                    ]
                )
                models = await client.models.list()
            finally:
                await client.close()
            return prompts, responses, models

    prompts, responses, models = asyncio.run(main())
    assert [m.id for m in models.data] == [MODEL_NAME]
    eos = tok.eos_token_id
    for prompt, r in zip(prompts, responses):
        (choice,) = r.choices
        body = r.model_dump()
        token_ids = body["choices"][0]["token_ids"]
        assert body["prompt_token_ids"] == prompt and body["choices"][0]["prompt_token_ids"] == prompt
        assert 1 <= len(token_ids) <= 8
        assert len(choice.logprobs.token_logprobs) == len(token_ids) == len(body["choices"][0]["token_versions"])
        if choice.finish_reason == "length":
            assert len(token_ids) == 8
        else:
            assert choice.finish_reason == "stop" and token_ids[-1] == eos
        assert r.usage.completion_tokens == len(token_ids)


BAD_REQUESTS = [
    ({"prompt": [5, 6], "max_tokens": "10"}, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"prompt": [5, 6], "max_tokens": 4, "top_p": 0}, "top_p"),
    ({"prompt": [5, 6], "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"prompt": [5, 6], "max_tokens": 4, "n": 0}, "n"),
    ({"prompt": [5, 6], "max_tokens": 4, "n": True}, "n"),
    ({"prompt": [5, 100000], "max_tokens": 4}, "prompt"),
    ({"prompt": [5, -1], "max_tokens": 4}, "prompt"),
    ({"prompt": [], "max_tokens": 4}, "prompt"),
    ({"prompt": [[5], [6]], "max_tokens": 4}, "prompt"),
    ({"prompt": [5, 6], "max_tokens": 5000}, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": 4, "stream": True}, "stream"),
    ({"prompt": [5, 6], "max_tokens": 4, "stop": 5}, "stop"),
    ({"prompt": [5, 6], "max_tokens": 4, "logprobs": "yes"}, "logprobs"),
    ({"prompt": [5, 6], "max_tokens": 4, "top_k": 1.5}, "top_k"),
    ({"prompt": [5, 6], "max_tokens": 4, "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": [5, 6], "max_tokens": 4, "return_token_ids": "yes"}, "return_token_ids"),
]


def test_bad_requests_get_400_naming_the_field(tiny):
    model, tok = tiny

    async def main():
        async with deployed(model, tok) as dep, authorized(dep) as s:
            url = dep.base_url + "/v1/completions"
            answers = []
            async with s.post(url, data="{not json", headers={"Content-Type": "application/json"}) as r:
                answers.append((r.status, await r.json(), None))
            for body, param in BAD_REQUESTS:
                async with s.post(url, json=body) as r:
                    answers.append((r.status, await r.json(), param))
            async with s.post(url, json={"model": "other", "prompt": [5], "max_tokens": 2}) as r:
                wrong_model = (r.status, await r.json())
            assert wrong_model[0] == 404 and wrong_model[1]["error"]["param"] == "model"
            good = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "unknown_vendor_field": {"x": 1}}
            async with s.post(url, json=good) as r:
                ok = (r.status, await r.json())
            return answers, ok

    answers, (status, body) = asyncio.run(main())
    for got_status, got, param in answers:
        assert got_status == 400, (param, got)
        assert got["error"]["type"] == "invalid_request_error"
        assert got["error"]["param"] == param
        if param is not None:
            assert param in got["error"]["message"]
    assert status == 200
    assert body["prompt_token_ids"] == tok.encode("Hello", add_special_tokens=False)
    assert len(body["choices"][0]["token_ids"]) == 3


def test_request_timeout_is_reported_and_server_keeps_serving(tiny):
    model, tok = tiny

    async def main():
        async with deployed(model, tok) as dep, authorized(dep) as s:
            url = dep.base_url + "/v1/completions"
            start = time.perf_counter()
            async with s.post(url, json={"prompt": [5, 6], "max_tokens": 1000, "timeout": 0.05}) as r:
                timed_out = (r.status, await r.json(), time.perf_counter() - start)
            async with s.post(url, json={"prompt": [5, 6], "max_tokens": 3}) as r:
                after = (r.status, await r.json())
            return timed_out, after

    (status, body, elapsed), (after_status, after) = asyncio.run(main())
    assert status == 408 and "timed out" in body["error"]["message"] and elapsed < 5
    assert after_status == 200 and len(after["choices"][0]["token_ids"]) == 3


def test_api_key_is_required_when_set(tiny):
    model, tok = tiny

    async def main():
        async with deployed(model, tok, api_key="secret") as dep, aiohttp.ClientSession() as s:
            url = dep.base_url + "/v1/completions"
            body = {"prompt": [5], "max_tokens": 2}
            async with s.post(url, json=body) as r:
                missing = r.status
            async with s.post(url, json=body, headers={"Authorization": "Bearer wrong"}) as r:
                wrong = r.status
            async with s.get(dep.base_url + "/health") as r:
                health = r.status
            (c,) = await dep.sampler.sample([5], max_tokens=2)  # the deployment's sampler holds the key
            return missing, wrong, health, c

    missing, wrong, health, c = asyncio.run(main())
    assert (missing, wrong, health) == (401, 401, 200)
    assert len(c.output_ids) <= 2


# ---------------------------------------------------------------------------- client retries


def _stub_server(handler):
    """Run a one-route aiohttp app on a free port in a background loop; returns (base_url, stop)."""
    ready = threading.Event()
    state = {}

    def run():
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        state["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        state["loop"] = loop
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)

    def stop():
        state["loop"].call_soon_threadsafe(state["loop"].stop)
        thread.join(10)

    return state["url"], stop


def _ok_body(prompt):
    choice = {
        "index": 0,
        "text": "ab",
        "finish_reason": "length",
        "token_ids": [7, 8],
        "logprobs": {"token_logprobs": [-1.0, -2.0]},
        "token_versions": [3, 3],
    }
    return {"choices": [choice], "prompt_token_ids": prompt}


def test_sampler_retries_503_then_gives_up():
    hits = []

    async def always_503(request):
        hits.append(1)
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    url, stop = _stub_server(always_503)
    try:

        async def main():
            sampler = Sampler(url, "m", max_retries=2, backoff_s=0.01)
            try:
                with pytest.raises(RecoverableDeploymentError, match="after 3 attempts.*HTTP 503: overloaded"):
                    await sampler.sample([1, 2], max_tokens=2, timeout=5)
            finally:
                await sampler.close()

        asyncio.run(main())
    finally:
        stop()
    assert len(hits) == 3


def test_sampler_recovers_after_503_and_does_not_retry_400():
    hits = []

    async def flaky(request):
        hits.append(1)
        body = await request.json()
        if body["max_tokens"] == 99:
            return web.json_response({"error": {"message": "max_tokens too big", "param": "max_tokens"}}, status=400)
        if len(hits) < 3:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return web.json_response(_ok_body(body["prompt"]))

    url, stop = _stub_server(flaky)
    try:

        async def main():
            sampler = Sampler(url, "m", max_retries=3, backoff_s=0.01)
            try:
                (c,) = await sampler.sample([1, 2], max_tokens=2, timeout=5)
                with pytest.raises(DeploymentError, match="HTTP 400: max_tokens too big") as info:
                    await sampler.sample([1, 2], max_tokens=99, timeout=5)
                assert not isinstance(info.value, RecoverableDeploymentError)
            finally:
                await sampler.close()
            return c

        c = asyncio.run(main())
    finally:
        stop()
    assert len(hits) == 4  # two 503s, one success, one 400 (not retried)
    assert (c.output_ids, c.logprobs, c.versions, c.finish_reason) == ([7, 8], [-1.0, -2.0], [3, 3], "length")


def test_sampler_does_not_retry_a_request_that_used_up_its_timeout():
    """The timeout bounds the whole call: a server-side timeout (408) or a client-side one is
    reported at once, not retried into a multiple of the timeout."""
    hits = []

    async def slow_or_408(request):
        hits.append(1)
        body = await request.json()
        if body["max_tokens"] == 3:
            await asyncio.sleep(5)  # longer than the client's whole allowance below
        return web.json_response({"error": {"message": "request timed out after 1s"}}, status=408)

    url, stop = _stub_server(slow_or_408)
    try:

        async def main():
            sampler = Sampler(url, "m", max_retries=3, backoff_s=0.01)
            try:
                timed_out = "HTTP 408: request timed out after 1s.*not retried"
                with pytest.raises(RecoverableDeploymentError, match=timed_out):
                    await sampler.sample([1, 2], max_tokens=2, timeout=1)
                with patch("training.utils.deploy.sampler._TRANSPORT_SLACK_S", 0.2):
                    start = time.monotonic()
                    with pytest.raises(RecoverableDeploymentError, match="no answer within 0.5s.*not retried"):
                        await sampler.sample([1, 2], max_tokens=3, timeout=0.3)
                    return time.monotonic() - start
            finally:
                await sampler.close()

        elapsed = asyncio.run(main())
    finally:
        stop()
    assert len(hits) == 2 and elapsed < 2


def test_sampler_connection_refused_is_recoverable():
    async def main():
        sampler = Sampler("http://127.0.0.1:9", "m", max_retries=1, backoff_s=0.01)
        try:
            with pytest.raises(RecoverableDeploymentError, match="after 2 attempts"):
                await sampler.sample([1], max_tokens=1, timeout=2)
        finally:
            await sampler.close()

    asyncio.run(main())


def test_close_aborts_inflight_requests(tiny):
    model, tok = tiny

    async def main():
        dep = await start_embedded_deployment(
            copy.deepcopy(model), tok, DeploymentConfig(), model_name=MODEL_NAME, sampling_timeout_s=60
        )
        task = asyncio.create_task(dep.engine.generate([5, 6], max_tokens=1000))
        while dep.engine.num_running == 0:
            await asyncio.sleep(0.005)
        await dep.close()
        (c,) = await asyncio.wait_for(task, 5)
        with pytest.raises(DeploymentError, match="closed"):
            await dep.engine.generate([5], max_tokens=1)
        return c

    c = asyncio.run(main())
    assert c.finish_reason == "abort" and 0 < len(c.output_ids) < 1000


def test_response_json_shape(tiny):
    """Every field of a seeded n=2 response holds what the request determines: the engine's own
    seeded completions, the trainer's logprobs of them, their decoded text and token offsets."""
    model, tok = tiny
    prompt = [5, 6, 7]

    async def main():
        async with deployed(model, tok) as dep, authorized(dep) as s:
            body = {"model": MODEL_NAME, "prompt": [prompt], "max_tokens": 3, "logprobs": 1, "n": 2, "seed": 3}
            async with s.post(dep.base_url + "/v1/completions", json=body) as r:
                status, data = r.status, await r.json()
            expected = await dep.engine.generate(prompt, n=2, max_tokens=3, seed=3)
            return status, data, expected

    status, body, expected = asyncio.run(main())
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME and body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int) and body["prompt_token_ids"] == prompt
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert [c["index"] for c in body["choices"]] == [0, 1]
    ids = [choice["token_ids"] for choice in body["choices"]]
    assert ids == [c.output_ids for c in expected]  # seed 3 and seed 4, in index order
    assert ids[0] != ids[1]
    for choice, want in zip(body["choices"], expected, strict=True):
        assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"  # EOS is never likely here
        assert choice["stop_reason"] is None and choice["prompt_token_ids"] == prompt
        assert choice["token_versions"] == [0, 0, 0]
        assert choice["text"] == want.text == tok.decode(choice["token_ids"], skip_special_tokens=True)
        lp = choice["logprobs"]
        assert lp["tokens"] == [tok.decode([t]) for t in choice["token_ids"]]
        assert lp["text_offset"] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
        assert lp["top_logprobs"] is None
        assert lp["token_logprobs"] == pytest.approx(want.logprobs)
        reference = trainer_logprobs(model, prompt, choice["token_ids"], temperature=1.0)
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"]), reference, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- static decode steps


def test_static_steps_give_the_eager_logits_as_rows_join_leave_and_drain(tiny):
    """The step CUDA graphs capture, run eagerly: the same logits as `KVBatch.decode` through an
    in-place rebuild (a longer prompt joins), swap-removals, a trim, a drain and a refill."""
    model, _ = tiny
    steps = DecodeSteps(model, max_rows=8, capture=False)
    g = torch.Generator().manual_seed(3)

    def prompts(*lengths):
        return [torch.randint(4, 260, (n,), generator=g).tolist() for n in lengths]

    with torch.inference_mode():
        first = prompts(9, 4, 6)
        eager, logits = KVBatch.prefill(model, first)
        stable = KVBatch.prefill(model, first)[0].with_stable_buffers(8)
        buffers = stable.layers[0].keys_buf
        tokens = logits.argmax(-1)

        def advance(n):
            nonlocal tokens
            for _ in range(n):
                want = eager.decode(model, tokens)
                got = steps.step(stable, tokens)
                assert got.shape == want.shape
                # Logits here reach ~±10: float32 reductions over more (masked) columns differ by ~1e-5.
                assert (got - want).abs().max() < 5e-5
                assert stable.length == eager.length and torch.equal(stable.next_pos[: stable.rows],
                                                                      eager.next_pos[: eager.rows])
                tokens = want.argmax(-1)

        advance(4)
        joining = prompts(100, 2)  # longer than the batch: a rebuild, in place for the stable batch
        new_eager, new_logits = KVBatch.prefill(model, joining)
        eager = eager.insert(new_eager, row_capacity=8)
        assert stable.insert(KVBatch.prefill(model, joining)[0], row_capacity=8) is stable
        # The 100-token row grew the buffers, doubling (16 -> 128 columns); nothing later reallocates them.
        grown = stable.layers[0].keys_buf
        assert grown is not buffers and stable.column_capacity == 128
        tokens = torch.cat([tokens, new_logits.argmax(-1)])
        advance(3)
        order = eager.remove([3, 0])  # the long row leaves: the rest is mostly left padding
        assert stable.remove([3, 0]) == order
        tokens = tokens[order]
        advance(2)
        order = eager.remove([0, 1])
        stable.remove([0, 1])
        tokens = tokens[order]
        trimmed = eager.maybe_trim(8)
        assert trimmed is not eager and trimmed.length < 64
        eager = trimmed
        assert stable.maybe_trim(8) is stable and stable.length == eager.length
        advance(70)  # from under 64 columns to over: the step's column bucket changes
        eager.remove(list(range(eager.rows)))
        stable.remove(list(range(stable.rows)))
        assert stable.maybe_trim(8) is stable and stable.rows == 0 and stable.length == 0
        refill = prompts(5, 12)
        eager, logits = KVBatch.prefill(model, refill)
        stable.insert(KVBatch.prefill(model, refill)[0], row_capacity=8)
        tokens = logits.argmax(-1)
        advance(3)
    assert stable.layers[0].keys_buf is grown


@pytest.mark.parametrize("decode_steps", ["static", "eager"])
def test_engine_greedy_and_logprobs_with_each_decode_step(tiny, decode_steps):
    """Both step kinds through the whole engine: greedy tokens equal `generate`, sampled logprobs the trainer's."""
    model, tok = tiny
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 260, (int(n),), generator=g).tolist() for n in torch.randint(1, 41, (9,), generator=g)]
    max_tokens = [int(n) for n in torch.randint(1, 26, (9,), generator=g)]

    cfg = DeploymentConfig(max_batch_requests=4, decode_steps=decode_steps)
    greedy, sampled, stats = greedy_and_sampled(model, tok, cfg, prompts, max_tokens, sampled_rows=4, sampled_tokens=12)
    for prompt, n, (c,) in zip(prompts, max_tokens, greedy):
        assert c.output_ids == greedy_reference(model, prompt, n)
    for prompt, (c,) in zip(prompts, sampled):
        want = trainer_logprobs(model, prompt, c.output_ids, 0.7)
        assert (torch.tensor(c.logprobs) - want).abs().max() < 1e-4
    assert ("graph_replays" in stats) == (decode_steps == "static") and stats.get("graph_replays", 0) == 0


def test_graph_decode_steps_need_cuda(tiny):
    model, tok = tiny
    with pytest.raises(ConfigError, match="decode_steps='graphs' needs a CUDA device"):
        Engine(copy.deepcopy(model), tok, DeploymentConfig(decode_steps="graphs"))


def test_the_static_step_traces_as_one_graph_without_host_syncs(tiny):
    """What CUDA-graph capture needs of the step, checked on a CPU: dynamo traces the whole forward
    (model, cache writes, mask) as one graph, so it has no `.item()`-style host syncs and no Python
    branch on tensor values, and the traced step computes the eager logits."""
    model, _ = tiny
    steps = DecodeSteps(model, max_rows=8, capture=False)
    with torch.inference_mode():
        batch = KVBatch.prefill(model, [[5, 6, 7, 8], [9, 10]])[0].with_stable_buffers(8)
        steps.tokens[:2] = torch.tensor([11, 12])
        steps.write_col.fill_(batch.length)
        batch.mask_buf[:2, batch.length] = 1
        eager = steps._forward(batch, 2, 64).clone()
        traced = torch.compile(steps._forward, fullgraph=True, backend="eager")(batch, 2, 64)
    assert (traced - eager).abs().max() < 1e-5


def test_invalid_request_error_pickles_with_its_param():
    import pickle

    error = pickle.loads(pickle.dumps(InvalidRequestError("n must be >= 1", "n")))
    assert (type(error), str(error), error.param) == (InvalidRequestError, "n must be >= 1", "n")


def test_the_kv_cache_goes_under_the_keyword_the_models_forward_takes(tiny):
    class OldForward:  # transformers before the rename
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class NewForward:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    marker = object()
    assert cache_kwarg(OldForward(), marker) == {"past_key_values": marker}
    assert cache_kwarg(NewForward(), marker) == {"cache": marker}
    model, _ = tiny
    # The installed transformers' own Llama: whichever name it has, it is a named parameter, not **kwargs.
    (name,) = cache_kwarg(model, marker)
    assert name in inspect.signature(type(model).forward).parameters
