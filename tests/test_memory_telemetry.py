"""Memory measured per step (`mem/*`), the prefix cache bounded by bytes, and `memory_budget_gib`: the counted
owners against a tiny model's sizes worked out by hand, the metrics in every step of both recipes, a step's RSS
peak, and a budget that shrinks what it may or stops the run before any training, losing nothing."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine_support import peaked_tiny, reads
from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import DeploymentConfig, SamplingConfig, TrainerConfig
from training.utils.deploy import Engine
from training.utils.deploy.handle import DeploymentHandle
from training.utils.deploy.prefix_cache import DEFAULT_MAX_BYTES, PrefixCache, prefix_cache_budget
from training.utils.errors import ConfigError
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config
from training.utils.rl import memory_budget, startup
from training.utils.rl.memory_budget import MIN_MICROBATCH_TOKENS, activation_bytes_per_token, estimate_memory
from training.utils.rl.memory_telemetry import RSSWindow, memory_summary, owner_bytes
from training.utils.rl.rollout.types import sample_from_completion
from training.utils.run_files.logging import read_ledger
from training.utils.runtime.memory import GIB, current_rss_bytes, malloc_free_bytes, peak_rss_bytes
from training.utils.trainer import Datum, Trainer, enable_activation_checkpointing

# tiny_config(260): vocabulary V, hidden H, intermediate INTER, 2 layers, 4 heads of D = 16, 2 key/value heads.
V, H, INTER, LAYERS, KV_HEADS, D = 260, 64, 128, 2, 2, 16
PER_LAYER = H * H + 2 * H * (KV_HEADS * D) + H * H + 3 * H * INTER + 2 * H  # q, k and v, o, gate/up/down, two norms
TINY_PARAMETERS = V * H + LAYERS * PER_LAYER + H  # the embedding (the output projection is tied to it), final norm
TINY_TENSORS = 1 + LAYERS * 9 + 1
TOKEN_KV_BYTES = 2 * LAYERS * KV_HEADS * D * 4  # keys and values of one token, float32
MEM_KEYS = {"mem/rss", "mem/rss_peak", "mem/trainer_params", "mem/trainer_grads", "mem/optimizer_state",
            "mem/engine_weights", "mem/kv_cache_reserved", "mem/kv_cache_used", "mem/prefix_cache"} | (
    {"mem/malloc_free"} if malloc_free_bytes() is not None else set())  # glibc's allocator only
ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]


def tiny_model():
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(V), device="cpu")
    return model


def buffer_bytes(model) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


# ---------------------------------------------------------------------------- the counted owners


class ReportedDeployment(DeploymentHandle):
    def __init__(self, stats):
        super().__init__(base_url="http://x", model_name="m", sampler=None, weight_sync=None)
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_the_trainer_owners_are_the_tiny_models_sizes_worked_out_by_hand():
    assert sum(p.numel() for p in tiny_model().parameters()) == TINY_PARAMETERS  # the arithmetic above
    policy = Trainer(tiny_model(), TrainerConfig(learning_rate=1e-3))
    reference = Trainer(copy.deepcopy(policy.model), TrainerConfig(), trainable=False)
    engine = {"weights": 11, "kv_cache_reserved": 22, "kv_cache_used": 3, "prefix_cache": 4}
    before = owner_bytes(policy, reference, ReportedDeployment(engine))
    # float32: 4 bytes a parameter; the tied output projection once; the reference a second copy.
    assert before["mem/trainer_params"] == 2 * 4 * TINY_PARAMETERS
    assert before["mem/trainer_grads"] == before["mem/optimizer_state"] == 0
    assert {k: before[k] for k in ("mem/engine_weights", "mem/kv_cache_reserved", "mem/kv_cache_used",
                                   "mem/prefix_cache")} == {"mem/engine_weights": 11, "mem/kv_cache_reserved": 22,
                                                            "mem/kv_cache_used": 3, "mem/prefix_cache": 4}
    datum = Datum(input_ids=[1, 5, 7, 9], target_ids=[5, 7, 9, 11], weights=[0.0, 1.0, 1.0, 1.0],
                  behaviour_logprobs=[0.0] * 4, advantage=1.0, prompt_len=2)
    policy.forward_backward([datum], lambda logprobs, mb: (-(logprobs * mb.weights).sum(), {}))
    assert owner_bytes(policy, None, ReportedDeployment({}))["mem/trainer_grads"] == 4 * TINY_PARAMETERS
    policy.optim_step()
    after = owner_bytes(policy, None, ReportedDeployment({}))
    # AdamW: two float32 moments a parameter, and a float32 step count a tensor; the gradients freed by the step.
    assert after["mem/optimizer_state"] == 2 * 4 * TINY_PARAMETERS + 4 * TINY_TENSORS
    assert after["mem/trainer_grads"] == 0
    assert not any(k.startswith("mem/engine") or k.startswith("mem/kv") for k in after), "an external server: none"


def test_the_engine_reports_its_weights_kv_batch_and_prefix_cache_in_bytes():
    model, tok = peaked_tiny(0)
    prompts = [list(range(10 + i, 30 + i)) for i in range(3)]  # three distinct prompts of 20 tokens

    async def main(engine):
        return await asyncio.gather(*[engine.generate(p, max_tokens=5, temperature=0) for p in prompts])

    engine = Engine(copy.deepcopy(model), tok, DeploymentConfig(decode_steps="eager"))
    engine.eos_token_ids = frozenset()  # no EOS: every row runs to max_tokens
    try:
        outputs = asyncio.run(main(engine))
        stats, again = engine.memory_stats(), engine.memory_stats()
    finally:
        engine.close()
    assert [len(c.output_ids) for (c,) in outputs] == [5, 5, 5]
    assert stats["weights"] == 4 * TINY_PARAMETERS + buffer_bytes(model), "the tied projection once"
    # One prefill of the 3 rows: buffers of 20 columns + 64 spare, per layer keys and values of 2 heads x 16.
    assert stats["kv_cache_reserved"] == LAYERS * 2 * (3 * KV_HEADS * (20 + 64) * D) * 4
    # The most live at once: 3 rows x 23 columns before the last decode step (20 prompt + 3 fed outputs).
    assert stats["kv_cache_used"] == 3 * 23 * TOKEN_KV_BYTES
    # Each finished sequence (prompt + the 4 outputs fed back) replaced its prompt in the cache.
    assert stats["prefix_cache"] == 3 * 24 * TOKEN_KV_BYTES
    assert (again["kv_cache_reserved"], again["kv_cache_used"]) == (0, 0), "the most since the previous call"
    assert again["prefix_cache"] == stats["prefix_cache"], "what the prefix cache still holds"


# ---------------------------------------------------------------------------- the prefix cache's byte bound


def fake_kv(n: int) -> torch.Tensor:
    return torch.zeros(2, 2, 1, n, 4)  # 64 bytes a token


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()



def test_the_prefix_cache_reports_the_most_it_held_since_the_previous_read():
    """A weight sync empties the cache before the step's record is taken: the record shows what it held."""
    cache = PrefixCache(max_bytes=64 * 100)
    assert cache.take_most_bytes() == 0
    cache.add(tokens(40, 0), reads(fake_kv(40)))
    cache.add(tokens(50, 1), reads(fake_kv(50)))
    assert cache.num_bytes == 64 * 90
    cache.add(tokens(30, 2), reads(fake_kv(30)))  # 120 tokens' bytes: over the bound, the first is evicted
    assert cache.num_bytes == 64 * 80
    cache.clear()  # a weight sync
    assert cache.take_most_bytes() == 64 * 90, "the most held, within the bound"
    assert cache.take_most_bytes() == 0, "counted anew"
    cache.add(tokens(20, 3), reads(fake_kv(20)))
    assert cache.take_most_bytes() == cache.take_most_bytes() == 64 * 20, "what it holds now, when that is the most"


def test_the_prefix_cache_evicts_by_bytes_and_keeps_nothing_larger_than_its_byte_bound():
    cache = PrefixCache(max_bytes=100 * 64)
    a, b, c = tokens(40, 0), tokens(40, 1), tokens(40, 2)
    for sequence in (a, b):
        cache.add(sequence, reads(fake_kv(40)))
    assert (cache.num_tokens, cache.num_bytes) == (80, 80 * 64)
    cache.add(c, reads(fake_kv(40)))  # 120 tokens' bytes: the least recently used goes
    assert (cache.num_bytes, cache.match(a + [1])[1], cache.match(c + [1])[1]) == (80 * 64, 0, 40)

    def not_read(start, end):
        raise AssertionError("a sequence larger than the byte bound was copied")

    cache.add(tokens(101, 3), not_read)  # the bytes of a token are known by now: not even copied
    assert cache.num_bytes == 80 * 64 and len(cache) == 2
    fresh = PrefixCache(max_bytes=100 * 64)
    fresh.add(tokens(101, 3), reads(fake_kv(101)))  # the first one is read, found too large, not kept
    assert (fresh.num_bytes, len(fresh)) == (0, 0)
    cache.clear()
    assert cache.num_bytes == 0


def test_the_byte_bound_defaults_to_512_mib_within_one_to_four_contexts():
    assert DEFAULT_MAX_BYTES == 512 << 20
    assert prefix_cache_budget(None, 12_000, 512) == 4 * 12_000 * 512, "four contexts, below 512 MiB"
    smollm2_float32 = 2 * 30 * 3 * 64 * 4  # a token of SmolLM2-135M: 46 KB; a context of 8192 is 360 MiB
    assert prefix_cache_budget(None, 8192, smollm2_float32) == 512 << 20
    assert prefix_cache_budget(None, 32_768, 131_072) == 32_768 * 131_072, "one context fits"
    assert prefix_cache_budget(7, 8192, 512) == 7 and prefix_cache_budget(0, 8192, 512) == 0


# ---------------------------------------------------------------------------- a step's peak


def test_a_steps_peak_sees_its_own_spike_and_the_next_step_does_not():
    """The window never resets the kernel's high-water mark: `getrusage` (and `/usr/bin/time -v`, which reads the
    same mark) still report the run's peak after it."""
    if current_rss_bytes() is None:
        pytest.skip("this platform reports no current RSS (no /proc/self/statm and no psutil)")
    spike = 400 << 20
    window = RSSWindow()
    rss_before, _ = window.take()
    big = torch.ones(spike // 4)  # written, so resident
    time.sleep(0.2)  # twenty samples while it lives
    del big
    _, first_peak = window.take()
    _, second_peak = window.take()
    assert first_peak >= rss_before + 0.9 * spike
    assert second_peak < rss_before + 0.5 * spike
    assert peak_rss_bytes() >= first_peak, "the lifetime peak (getrusage) was not reset"


# ---------------------------------------------------------------------------- both recipes


def sampling_factory(setup):
    async def rollout_fn(row, sample_index, submit_version):
        (c,) = await setup.sampler.sample(row["prompt_token_ids"], seed=sample_index, **setup.sample_kwargs)
        return sample_from_completion(row["prompt_token_ids"], c.output_ids, c.logprobs,
                                      reward=float(sum(c.output_ids) % 3), finish_reason=c.finish_reason)

    return rollout_fn


def tiny_run_cfg(recipe, tmp_path: Path, **overrides):
    fields = dict(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=2,
                  log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4, timeout_s=30),
                  trainer=TrainerConfig(learning_rate=1e-3), progress=False)
    return recipe.Config(**(fields | overrides))


@pytest.mark.parametrize("recipe, overrides", [(rl_loop, dict(kl_beta=0.05)),
                                               (async_rl_loop, dict(max_head_offpolicy_versions=1))],
                         ids=["rl_loop", "async_rl_loop"])
def test_every_step_of_both_recipes_logs_the_memory_owners(tmp_path, caplog, recipe, overrides):
    caplog.set_level(logging.INFO, logger="training")
    summary = recipe.main(tiny_run_cfg(recipe, tmp_path, **overrides), rollout_fn_factory=sampling_factory,
                          rows=ROWS)
    records = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert len(records) == 2
    copies = 2 if recipe is rl_loop else 1  # kl_beta > 0: a reference copy
    engine_weights = 4 * TINY_PARAMETERS + buffer_bytes(tiny_model())
    for record in records:
        assert MEM_KEYS <= set(record)
        assert record["mem/trainer_params"] * GIB == copies * 4 * TINY_PARAMETERS
        assert record["mem/optimizer_state"] * GIB == 2 * 4 * TINY_PARAMETERS + 4 * TINY_TENSORS
        assert record["mem/engine_weights"] * GIB == engine_weights
        assert record["mem/kv_cache_used"] <= record["mem/kv_cache_reserved"]
        assert record["mem/rss_peak"] >= record["mem/rss"] > 0
    # rl_loop samples in every step; the async recipe may have drawn all its rows before its second step's record.
    sampled = [record["mem/kv_cache_used"] > 0 for record in records]
    assert all(sampled) if recipe is rl_loop else sampled[0]
    assert any(m.startswith("memory: peak RSS of the run ") and "trainer_params 0.00" in m for m in caplog.messages)


def test_the_summary_line_names_the_runs_peak_and_the_last_steps_owners():
    line = memory_summary({"mem/rss": 1.0, "mem/rss_peak": 2.0, "mem/trainer_params": 0.5, "train/loss": 3.0})
    assert line.startswith(f"memory: peak RSS of the run {peak_rss_bytes() / GIB:.2f} GiB")
    # pytest's process is never restarted, so its malloc is the system's
    assert "at the last step (GiB): rss 1.00, trainer_params 0.50; malloc: the system's" in line


# ---------------------------------------------------------------------------- the budget


def test_the_activation_estimate_holds_to_what_autograd_saves_on_a_tiny_model():
    """The per-token estimate against one measurement: the bytes of every tensor autograd saves in the decoder's
    forward of a padded micro-batch (the float attention mask included)."""
    model = tiny_model()
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    rows, length = 4, 256
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, length // 2:] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.get_decoder()(input_ids=torch.randint(0, V, (rows, length)), attention_mask=mask, use_cache=False)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(size for ptr, size in saved.items() if ptr not in weights) / (rows * length)
    estimate = activation_bytes_per_token(model.config, 4, length, checkpointing=False)
    assert 0.8 * measured <= estimate <= 1.25 * measured, (estimate, measured)


@pytest.mark.parametrize("recompute_attention", [False, True])
def test_the_checkpointed_estimate_holds_to_what_the_layers_keep_on_a_tiny_model(recompute_attention):
    """With checkpointing autograd's saved tensors hide behind the checkpoint's holders, so this counts the storages
    the decoder layers created that are still alive once the forward returns: what the backward will read. Each
    layer's input (the previous layer's output), and its attention output and logsumexp unless
    `trainer.recompute_attention`: on the tiny model (heads x head dim = hidden size) keeping attention doubles
    what a layer keeps."""
    model = tiny_model()
    enable_activation_checkpointing(model, recompute_attention)
    model.train()
    created, outside, inside = [], {p.untyped_storage().data_ptr() for p in model.parameters()}, []

    class LayerCreated(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            storages = [t.untyped_storage() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if inside:
                created.extend(weakref.ref(storage) for storage in storages)
            else:  # the embedding, the rotary tables and the mask: shared by the layers, not theirs
                outside.update(storage.data_ptr() for storage in storages)
            return out

    for layer in model.get_decoder().layers:
        layer.register_forward_pre_hook(lambda *args: inside.append(1))
        layer.register_forward_hook(lambda *args: inside.clear())
    rows, length = 4, 256
    with LayerCreated():
        hidden = model.get_decoder()(input_ids=torch.randint(0, V, (rows, length)), use_cache=False).last_hidden_state
    alive = {ref().data_ptr(): ref().nbytes() for ref in created if ref() is not None}
    measured = sum(size for ptr, size in alive.items() if ptr not in outside) / (rows * length)
    # The estimate less its one layer being recomputed, which lives only in the backward.
    kept = (activation_bytes_per_token(model.config, 4, length, checkpointing=True,
                                       recompute_attention=recompute_attention)
            - activation_bytes_per_token(model.config, 4, length, checkpointing=False) // LAYERS)
    assert 0.8 * measured <= kept <= 1.25 * measured, (kept, measured)
    hidden.sum().backward()


@pytest.fixture
def fixed_process_memory(monkeypatch):
    """The process measured at 1 GiB: the estimate no longer depends on what else this test process holds."""
    monkeypatch.setattr(memory_budget, "current_rss_bytes", lambda: 1 << 30)


def built(cfg):
    policy, reference, _, _ = startup.setup_trainers(cfg, total_steps=2)
    return policy, reference


def test_a_budget_that_fits_lowers_the_prefix_cache_first_then_the_micro_batch(tmp_path, fixed_process_memory):
    cfg = tiny_run_cfg(rl_loop, tmp_path)
    policy, reference = built(cfg)
    estimate = estimate_memory(cfg, policy, reference)
    parts = estimate.parts()
    total, prefix = sum(parts.values()), estimate.prefix_cache
    assert prefix == 4 * 1024 * TOKEN_KV_BYTES, "the default: four contexts of 1024 tokens (under 512 MiB)"
    assert parts["KV cache (64 rows x 1024 tokens)"] == 64 * 1024 * TOKEN_KV_BYTES

    def fitted(budget_bytes):
        budgeted = cfg.model_copy(update={"memory_budget_gib": budget_bytes / GIB})
        return memory_budget.fit_memory_budget(budgeted, policy, reference), int(budget_bytes / GIB * GIB)

    as_configured = fitted(total)[0]
    assert as_configured.prefix_cache_bytes == cfg.deployment.prefix_cache_bytes, "it fits: nothing changes"
    assert as_configured.outcome == "fits as configured"
    deployment, budget = fitted(total - prefix // 2)
    assert deployment.prefix_cache_bytes == prefix - (total - budget)
    assert policy.plan.max_tokens_per_microbatch == 2048
    one_context = 1024 * TOKEN_KV_BYTES  # the least the bound is lowered to: the longest prompt still fits
    assert estimate.prefix_cache_floor == one_context
    working = estimate.working_set(2048, False)
    deployment, budget = fitted(total - prefix + one_context - working // 4)
    tokens = policy.plan.max_tokens_per_microbatch
    assert deployment.prefix_cache_bytes == one_context and MIN_MICROBATCH_TOKENS <= tokens < 2048
    room = budget - (total - prefix + one_context - working)
    assert estimate.working_set(tokens, False) <= room < estimate.working_set(tokens + 1, False), "the most that fit"
    assert not policy.plan.gradient_checkpointing, "a smaller micro-batch fits: no recomputation"
    assert cfg.trainer.max_tokens_per_microbatch == 2048, "the config stays as the user wrote it"



def layer_forwards_in_one_step(policy: Trainer) -> int:
    """How many times the first decoder layer's MLP starts in one forward_backward: twice with checkpointing. (The
    layer's `forward` is what transformers checkpoints, so the layer's own hooks run once; and the recomputation
    stops once it has rebuilt the last saved tensor, inside the MLP, so the MLP's post-forward hooks run once.)"""
    calls = []
    handle = policy.model.get_decoder().layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
    datum = Datum(input_ids=[1, 5, 7, 9], target_ids=[5, 7, 9, 11], weights=[0.0, 1.0, 1.0, 1.0],
                  behaviour_logprobs=[-1.0] * 4, advantage=1.0, prompt_len=2)
    try:
        policy.forward_backward([datum], lambda logprobs, mb: (-(logprobs * mb.weights).sum(), {}))
    finally:
        handle.remove()
        policy.optimizer.zero_grad(set_to_none=True)
    return len(calls)


def test_a_budget_the_smallest_micro_batch_misses_turns_on_checkpointing(tmp_path, fixed_process_memory):
    cfg = tiny_run_cfg(rl_loop, tmp_path)
    policy, reference = built(cfg)
    assert layer_forwards_in_one_step(policy) == 1
    estimate = estimate_memory(cfg, policy, reference)
    assert not estimate.checkpointing
    plain_floor = estimate.working_set(MIN_MICROBATCH_TOKENS, False)
    assert estimate.working_set(MIN_MICROBATCH_TOKENS, True) < plain_floor
    everything_else = sum(estimate.parts().values()) - estimate.prefix_cache + estimate.prefix_cache_floor \
        - estimate.working_set(2048, False)
    budget_bytes = everything_else + plain_floor - 1  # the plain 256-token micro-batch misses by a byte
    budgeted = cfg.model_copy(update={"memory_budget_gib": budget_bytes / GIB})
    deployment = memory_budget.fit_memory_budget(budgeted, policy, reference)
    assert deployment.prefix_cache_bytes == estimate.prefix_cache_floor
    assert policy.plan.gradient_checkpointing
    tokens, room = policy.plan.max_tokens_per_microbatch, int(budget_bytes / GIB * GIB) - everything_else
    assert MIN_MICROBATCH_TOKENS <= tokens < 2048
    assert estimate.working_set(tokens, True) <= room < estimate.working_set(tokens + 1, True), "the most that fit"
    assert layer_forwards_in_one_step(policy) == 2, "the backward recomputes the layer"
    assert not cfg.trainer.gradient_checkpointing, "the config stays as the user wrote it"
    assert "activations checkpointed" in " ".join(estimate.parts(checkpointing=True))

def test_a_run_logs_what_its_budget_chose(tmp_path, caplog, fixed_process_memory):
    cfg = tiny_run_cfg(rl_loop, tmp_path)
    estimate = estimate_memory(cfg, *built(cfg))
    budget = sum(estimate.parts().values()) - estimate.prefix_cache // 2
    caplog.set_level(logging.INFO, logger="training")
    summary = rl_loop.main(cfg.model_copy(update={"memory_budget_gib": budget / GIB}),
                           rollout_fn_factory=sampling_factory, rows=ROWS)
    assert summary["steps"] == 2
    chose = [m for m in caplog.messages if m.startswith(f"memory_budget_gib={budget / GIB:g}")]
    assert len(chose) == 1 and f"deployment.prefix_cache_bytes {estimate.prefix_cache} -> " in chose[0]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def test_a_budget_too_small_stops_at_start_up_naming_what_to_change_and_loses_nothing(tmp_path):
    """Refused after the run directory's lock and the trainers, before a checkpoint is read or anything written:
    an earlier run's ledger, checkpoints and export are as they were, and a fresh directory holds only the lock (as
    a resume refused for changed settings leaves it)."""
    earlier = tiny_run_cfg(rl_loop, tmp_path, dcp_save_interval=1, output_dir=str(tmp_path / "export"))
    rl_loop.main(earlier, rollout_fn_factory=sampling_factory, rows=ROWS)
    before = snapshot(tmp_path)
    assert any(name.startswith("run/checkpoints/") for name in before) and "run/metrics.jsonl" in before
    calls = []

    def counting_factory(setup):
        calls.append(setup)
        return sampling_factory(setup)

    for cfg in (earlier.model_copy(update={"memory_budget_gib": 0.05, "max_steps": 4}),
                tiny_run_cfg(rl_loop, tmp_path, log_path=str(tmp_path / "fresh"), memory_budget_gib=0.05)):
        with pytest.raises(ConfigError) as refused:
            rl_loop.main(cfg, rollout_fn_factory=counting_factory, rows=ROWS)
        message = str(refused.value)
        assert message.startswith("memory_budget_gib=0.05 is too small for this model and these settings: the run "
                                  "needs about ")
        for named in ("the process's other memory", "deployment.max_batch_requests", "deployment.max_context_tokens",
                      "trainer.max_tokens_per_microbatch", "trainer.lora_rank", "raise memory_budget_gib"):
            assert named in message
    assert calls == [], "no rollout was set up"
    assert snapshot(tmp_path) == before
    assert [p.name for p in (tmp_path / "fresh").iterdir()] == ["run.lock"]
