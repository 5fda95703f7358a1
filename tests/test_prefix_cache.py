"""The engine's prefix cache on a tiny random Llama (float32, CPU): what it matches, keeps and evicts, and that
the tokens and logprobs served with it are those served without it (to 1e-5), across the G draws of a row, the
turns of a session, evictions, weight updates and decode-step modes."""

from __future__ import annotations

import asyncio
import copy
import time

import numpy as np
import pytest
import torch

from engine_support import deployed, reads
from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import Engine, prefix_cache
from training.utils.deploy.decode import KVBatch, usable_prefix_lengths
from training.utils.deploy.handle import DeploymentHandle
from training.utils.deploy.prefix_cache import BLOCK_TOKENS, CachedKV, PrefixCache, block_hashes, common_prefix
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.rl.telemetry import EngineCounters
from training.utils.runtime.memory import kv_bytes_per_token

EXACT = 1e-5  # float32: the same logits up to the order of reductions


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = tiny_config(260)
    config.initializer_range = 0.3  # peaked logits: varied outputs
    model, tokenizer = load_model_and_tokenizer(config, device="cpu")
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0  # EOS rarely sampled: predictable lengths
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def tiny_other(tiny):
    model = copy.deepcopy(tiny[0])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


KV_BYTES = 2 * 2 * 1 * 4 * 4
"""Bytes of one token's keys/values in `fake_kv`."""


def fake_kv(n: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((2, 2, 1, n, 4), fill)


def whole(kv: torch.Tensor) -> CachedKV:
    return CachedKV((kv,), kv.shape[3])


# ---------------------------------------------------------------------------- the cache on its own


def test_match_is_the_longest_common_prefix_and_leaves_the_last_prompt_token():
    cache = PrefixCache(1000 * KV_BYTES)
    a, b = tokens(40, 0), tokens(40, 1)
    cache.add(a, reads(torch.arange(40.0).expand(2, 2, 1, 40)[..., None]))
    cache.add(b, reads(fake_kv(40)))
    kv, m = cache.match(a[:35] + tokens(10, 2))  # shares 35 tokens with `a`
    assert m == kv.length == 35 and torch.cat(kv.pieces, dim=3)[0, 0, 0, :, 0].tolist() == list(range(35))
    assert cache.match(a)[1] == 39, "a whole-prompt hit leaves one token to compute the first logits from"
    assert cache.match(a[:20])[1] == 19
    assert cache.match(a[:BLOCK_TOKENS])[1] == 0, "shorter than a hashed block + 1 token: no hit"
    assert cache.match(tokens(40, 3)) == (None, 0)


def test_an_entry_that_extends_others_replaces_them_and_a_covered_one_is_not_copied():
    cache = PrefixCache(1000 * KV_BYTES)
    turn1 = tokens(30, 0)
    cache.add(turn1, reads(fake_kv(30)))
    turn2 = turn1 + tokens(20, 1)
    cache.add(turn2, reads(fake_kv(50)))
    assert len(cache) == 1 and cache.num_tokens == 50, "the next turn's entry holds the first turn's tokens"

    def not_read(start, end):
        raise AssertionError("keys/values of tokens already held were copied again")

    cache.add(turn1 + turn2[30:45], not_read)
    assert len(cache) == 1


def test_the_draws_of_one_prompt_hold_its_full_blocks_once_and_each_serves_its_own_keys():
    """A prompt of 40 tokens (two full blocks and 8 more) and four finished draws of 10 tokens each: the draws
    share the prompt's two blocks; each keeps its third block (the prompt's last 8 tokens and its first 8) and its
    last 2 tokens. Each draw's next turn is served its own keys/values, and evicting draws keeps the blocks the
    others still hold."""
    prompt = tokens(40, 0)
    draws = [prompt + tokens(10, 1 + g) for g in range(4)]

    def keys_of(g: int) -> torch.Tensor:  # a key's value: its position, plus 1000 x (draw + 1) after the prompt
        values = torch.arange(50.0) + torch.where(torch.arange(50) < 40, 0.0, 1000.0 * (g + 1))
        return values[:, None].expand(2, 2, 1, 50, 4).clone()  # 64 bytes a token, as fake_kv's

    cache = PrefixCache(4 * 50 * KV_BYTES)
    cache.add(prompt, reads(keys_of(0)[:, :, :, :40]))
    copied = []
    for g, draw in enumerate(draws):
        cache.add(draw, lambda start, end, g=g: copied.append(start) or keys_of(g)[:, :, :, start:end].clone())
    assert copied == [32, 32, 32, 32], "the prompt's two full blocks were copied once, by the prompt itself"
    assert len(cache) == 4 and cache.num_tokens == 32 + 4 * (16 + 2), "the prompt's entry is extended by the draws"
    assert cache.num_bytes == cache.num_tokens * 64
    for g, draw in enumerate(draws):
        kv, m = cache.match(draw + tokens(5, 9))
        assert m == 50 and torch.cat(kv.pieces, dim=3)[0, 0, 0, :, 0].tolist() == keys_of(g)[0, 0, 0, :, 0].tolist()
    cache.max_bytes = 100 * KV_BYTES
    cache.add(tokens(40, 20), reads(fake_kv(40, 7.0)))  # 140 tokens: the three oldest draws go, 90 remain
    assert len(cache) == 2 and cache.num_tokens == 32 + 18 + 40 and cache.num_bytes == cache.num_tokens * 64
    kv, m = cache.match(draws[3] + [1])
    assert m == 50 and torch.cat(kv.pieces, dim=3)[0, 0, 0, :, 0].tolist() == keys_of(3)[0, 0, 0, :, 0].tolist()
    assert cache.match(draws[0] + [1])[1] == 40, "draw 0's own tokens went with it; the prompt stays in draw 3's"
    cache.max_bytes = 50 * KV_BYTES
    cache.add(tokens(50, 21), reads(fake_kv(50)))
    assert (len(cache), cache.num_tokens, cache.match(prompt + [1])) == (1, 50, (None, 0)), "the last user frees them"


def test_a_block_key_that_stands_for_other_tokens_is_never_shared(monkeypatch):
    """Block keys are hashes: should two prefixes' keys collide, the later sequence is not kept rather than
    served another prefix's keys/values."""
    monkeypatch.setattr(prefix_cache, "block_hashes", lambda t: [7 + b for b in range(len(t) // BLOCK_TOKENS)])
    cache = PrefixCache(1000 * KV_BYTES)
    a, b = tokens(40, 0), tokens(40, 1)
    cache.add(a, reads(fake_kv(40, 1.0)))
    cache.add(a[:16] + b[16:], reads(fake_kv(40, 2.0)))  # the first block equal, the second's key taken
    cache.add(b, reads(fake_kv(40, 3.0)))
    assert len(cache) == 1 and cache.num_tokens == 40
    assert cache.match(b + [1]) == (None, 0) and cache.match(a[:16] + b[16:] + [1])[1] == 16


def test_least_recently_used_entries_go_first_within_the_token_budget():
    cache = PrefixCache(100 * KV_BYTES)
    a, b, c = tokens(40, 0), tokens(40, 1), tokens(40, 2)
    cache.add(a, reads(fake_kv(40)))
    cache.add(b, reads(fake_kv(40)))
    assert cache.match(a + [1])[1] == 40  # a is now the most recently used
    cache.add(c, reads(fake_kv(40)))
    assert cache.num_tokens == 80 and cache.match(b + [1])[1] == 0 and cache.match(a + [1])[1] == 40
    cache.add(tokens(101, 3), reads(fake_kv(101)))  # over the whole budget: not kept, nothing evicted
    assert cache.num_tokens == 80
    cache.clear()
    assert (len(cache), cache.num_tokens, cache.match(a + [1])) == (0, 0, (None, 0))


def test_block_hashes_and_common_prefix():
    t = tokens(40, 0)
    assert len(block_hashes(t)) == 40 // BLOCK_TOKENS
    assert block_hashes(t[:32]) == block_hashes(t)[:2] and block_hashes(t[:1] + t)[0] != block_hashes(t)[0]
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 4])) == 2


# ---------------------------------------------------------------------------- prefill after cached keys


def test_usable_prefix_lengths_keep_cached_and_new_tokens_adjacent():
    # Prompts of 50, 30 and 10 tokens with 45, 20 and 0 cached: the fresh one needs 10 new tokens, so
    # every row with a match is fed 10 (the first recomputes 5 cached tokens), and the fresh one is fed whole.
    assert usable_prefix_lengths([50, 30, 10], [45, 20, 0]) == [40, 20, 0]
    assert usable_prefix_lengths([50, 30], [45, 0]) == [20, 0]


def test_prefill_after_cached_prefixes_gives_the_full_prefill_logits(tiny):
    model, _ = tiny
    prompts = [tokens(50, 0), tokens(30, 1), tokens(8, 2)]
    with torch.inference_mode():
        full, want = KVBatch.prefill(model, prompts)
        used = usable_prefix_lengths([50, 30, 8], [45, 25, 0])
        cached = [whole(full.row_kv(0, 50, end=used[0])), whole(full.row_kv(1, 30, end=used[1])), None]
        part, got = KVBatch.prefill(model, prompts, cached)
        assert (part.next_pos[:3].tolist(), part.length) == ([50, 30, 8], max(used) + 8)
        assert (got - want).abs().max() < EXACT
        step = torch.tensor([5, 6, 7])
        assert (part.decode(model, step) - full.decode(model, step)).abs().max() < EXACT
        with pytest.raises(ValueError, match="rows with cached tokens need the most"):
            KVBatch.prefill(model, prompts, [whole(full.row_kv(0, 50, end=45)), None, None])


# ---------------------------------------------------------------------------- the engine


def kv_bytes(model) -> int:
    """Bytes of one token's keys/values in an engine serving `model` as it is."""
    return kv_bytes_per_token(model.config, next(model.parameters()).dtype)


def engine_for(model, tok, **cfg) -> Engine:
    return Engine(copy.deepcopy(model), tok, DeploymentConfig(**cfg))


async def sample(engine, prompt, seed, max_tokens=6):
    (c,) = await engine.generate(prompt, max_tokens=max_tokens, temperature=1.0, seed=seed)
    return c


async def session(engine, prompt, turns: int, seed: int):
    """A chat session: each turn's prompt is the last prompt + its reply + a new user message."""
    out = []
    for turn in range(turns):
        c = await sample(engine, prompt, seed + turn)
        out.append(c)
        prompt = prompt + c.output_ids + tokens(12, 100 + seed + turn)
    return out


def served_with_and_without_cache(model, tok, scenario, **cfg):
    """Run `scenario(engine)` on an engine with the cache and one without; returns both results and stats."""

    async def on(engine):
        try:
            return await scenario(engine), dict(engine.stats)
        finally:
            engine.close()

    cached = asyncio.run(on(engine_for(model, tok, **cfg)))
    plain = asyncio.run(on(engine_for(model, tok, **{**cfg, "prefix_cache_bytes": 0})))
    return cached, plain


def assert_same_samples(got, want):
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
    assert diff < EXACT


def assert_counts_add_up(stats):
    assert stats["prompt_tokens"] == stats["prefill_tokens"] + stats["prefix_cache_hit_tokens"]
    assert stats["prefill_time_s"] > 0 and stats["decode_time_s"] > 0


def test_the_draws_of_one_row_sent_together_prefill_the_prompt_once(tiny):
    model, tok = tiny
    prompt = tokens(40, 0)

    async def draws(engine):
        return await asyncio.gather(*[sample(engine, prompt, seed) for seed in range(4)])

    (got, stats), (want, plain) = served_with_and_without_cache(model, tok, draws)
    assert_same_samples(got, want)
    assert (stats["prompt_tokens"], stats["prefill_tokens"], stats["prefix_cache_hit_tokens"]) == (160, 40, 120)
    assert (plain["prefill_tokens"], plain["prefix_cache_hit_tokens"]) == (160, 0)
    assert_counts_add_up(stats)


def test_a_draw_sent_later_reuses_all_but_the_last_prompt_token(tiny):
    model, tok = tiny
    prompt = tokens(40, 0)

    async def one_by_one(engine):
        return [await sample(engine, prompt, seed) for seed in range(3)]

    (got, stats), (want, _) = served_with_and_without_cache(model, tok, one_by_one)
    assert_same_samples(got, want)
    assert (stats["prefill_tokens"], stats["prefix_cache_hit_tokens"]) == (40 + 1 + 1, 39 + 39)


@pytest.mark.parametrize("decode_steps", ["eager", "static"])
def test_each_turn_of_a_session_prefills_only_the_new_message(tiny, decode_steps):
    model, tok = tiny

    async def sessions(engine):  # two sessions at once: the rows of both share the batch
        runs = await asyncio.gather(session(engine, tokens(30, 0), 3, 0), session(engine, tokens(20, 1), 3, 10))
        return [c for run in runs for c in run]

    (got, stats), (want, plain) = served_with_and_without_cache(model, tok, sessions, decode_steps=decode_steps)
    assert_same_samples(got, want)
    # Turns 2 and 3 reuse the previous prompt and all its reply but the last token (never fed): they prefill
    # that token and the 12-token message.
    later_turns = [c for i, c in enumerate(got) if i % 3]
    assert stats["prefix_cache_hit_tokens"] == sum(len(c.prompt_ids) - 13 for c in later_turns)
    assert stats["prefill_tokens"] == 30 + 20 + 13 * len(later_turns)
    assert plain["prefill_tokens"] == stats["prompt_tokens"]
    assert_counts_add_up(stats)


def test_an_evicted_prefix_is_prefilled_again_and_a_kept_one_still_hits(tiny):
    model, tok = tiny
    a, b, c = tokens(40, 0), tokens(40, 1), tokens(40, 2)
    # 100 tokens hold two finished sequences of 40 + 4 - 1 tokens: c's evicts a, the least recently used.

    async def evict(engine):
        out = [await sample(engine, p, 0, max_tokens=4) for p in (a, b, c)]
        before = engine.stats["prefill_tokens"]
        out.append(await sample(engine, c, 1, max_tokens=4))  # kept: prefills its last token
        out.append(await sample(engine, a, 1, max_tokens=4))  # evicted: prefilled whole
        return out, engine.stats["prefill_tokens"] - before

    ((got, fresh), stats), ((want, _), _) = served_with_and_without_cache(model, tok, evict,
                                                                              prefix_cache_bytes=100 * kv_bytes(model))
    assert_same_samples(got, want)
    assert fresh == 1 + 40 and stats["prefix_cache_hit_tokens"] == 39


def test_no_prefix_computed_on_old_weights_is_reused_after_a_weight_update(tiny, tiny_other):
    model, tok = tiny
    prompt = tokens(40, 0)

    async def update_between(engine):
        first = await session(engine, prompt, 1, 0)
        await asyncio.to_thread(engine.update_weights, tiny_other.state_dict(), 1)
        hits = engine.stats["prefix_cache_hit_tokens"]
        second = await session(engine, prompt, 2, 0)  # turn 1 again, then a turn extending it
        return first + second, engine.stats["prefix_cache_hit_tokens"] - hits

    ((got, hits), stats), ((want, _), _) = served_with_and_without_cache(model, tok, update_between)
    assert_same_samples(got, want)
    assert got[1].versions == [1] * len(got[1].output_ids)
    assert hits == len(got[2].prompt_ids) - 13, "after the update only the new weights' first turn is reused"
    # What the new weights sample with a cold engine: the same tokens and logprobs.
    cold = engine_for(tiny_other, tok, prefix_cache_bytes=0)
    try:
        fresh = asyncio.run(session(cold, prompt, 2, 0))
    finally:
        cold.close()
    assert_same_samples(got[1:], fresh)


def test_a_sequence_that_spans_a_weight_update_is_not_cached(tiny, tiny_other):
    """With `continue_new` a running sequence finishes on the new weights over keys the old ones computed:
    a next turn must not start from them."""
    model, tok = tiny
    prompt = tokens(40, 0)

    async def main():
        engine = engine_for(model, tok)
        forward = engine.model.forward

        def slow_forward(*args, **kwargs):  # >= 2 ms a step, so the update lands mid-sequence
            time.sleep(0.002)
            return forward(*args, **kwargs)

        engine.model.forward = slow_forward
        try:
            long = asyncio.create_task(engine.generate(prompt, max_tokens=60, temperature=0))
            while engine.stats["output_tokens"] < 5:
                await asyncio.sleep(0.002)
            await asyncio.to_thread(engine.update_weights, tiny_other.state_dict(), 1)
            (c,) = await long
            hits = engine.stats["prefix_cache_hit_tokens"]
            await sample(engine, prompt + c.output_ids + tokens(12, 5), 0)
            return c, engine.stats["prefix_cache_hit_tokens"] - hits
        finally:
            engine.close()

    c, hits = asyncio.run(main())
    assert c.versions[0] == 0 and c.versions[-1] == 1
    assert hits == 0


def test_a_zero_bound_turns_the_cache_off_and_the_old_token_bound_names_its_successor(tiny):
    model, tok = tiny
    engine = engine_for(model, tok, prefix_cache_bytes=0)
    try:
        assert engine._prefix_cache is None
    finally:
        engine.close()
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        DeploymentConfig(prefix_cache_bytes=-1)
    with pytest.raises(ValueError, match="prefix_cache_tokens is now deployment.prefix_cache_bytes"):
        DeploymentConfig(prefix_cache_tokens=100)


def test_the_default_budget_keeps_a_prompt_longer_than_the_old_fixed_one(tiny):
    """An agent's prompt (a CLI's system prompt and tools) outgrows a fixed budget of 8192 tokens, which then keeps
    nothing. Unset, the budget is four prompts of the context served: a 9000-token prompt is kept, and a second
    draw of it prefills only its last token."""
    model, tok = tiny
    prompt = tokens(9000, 0)

    async def two_draws(engine):
        return [await sample(engine, prompt, seed, max_tokens=2) for seed in range(2)]

    engine = engine_for(model, tok, max_context_tokens=12_000)
    try:
        asyncio.run(two_draws(engine))
        assert engine._prefix_cache.max_bytes == 4 * 12_000 * kv_bytes(model)
        assert (engine.stats["prefill_tokens"], engine.stats["prefix_cache_hit_tokens"]) == (9000 + 1, 8999)
    finally:
        engine.close()


# ---------------------------------------------------------------------------- per-step metrics


def test_engine_counters_report_each_steps_increase_for_the_embedded_deployment_only(tiny):
    model, tok = tiny
    prompt = tokens(40, 0)

    async def main():
        counters = EngineCounters()
        async with deployed(model, tok) as dep:
            await dep.sampler.sample(prompt, n=1, max_tokens=3)
            first = counters.step_metrics(dep)
            await dep.sampler.sample(prompt, n=1, max_tokens=3)
            second = counters.step_metrics(dep)
            external = counters.step_metrics(DeploymentHandle(base_url="http://external", model_name="m",
                                                              sampler=dep.sampler, weight_sync=dep.weight_sync))
        return first, second, external

    first, second, external = asyncio.run(main())
    assert (first["perf/prompt_tokens"], first["perf/engine_prefill_tokens"]) == (40, 40)
    assert first["perf/prefix_cache_hit_tokens"] == 0 and first["perf/engine_decode_time"] > 0
    # The second draw prefills the prompt's last token; the rest comes from the cache.
    assert (second["perf/prompt_tokens"], second["perf/engine_prefill_tokens"]) == (40, 1)
    assert second["perf/prefix_cache_hit_tokens"] == 39 and second["perf/engine_prefill_time"] > 0
    assert external == {}
