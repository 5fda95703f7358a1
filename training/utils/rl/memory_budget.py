"""`memory_budget_gib`: what a run's settings need, estimated at start-up once the trainers are built; what is free
to shrink, shrunk to fit; or a `ConfigError` before any training, naming the budget, the estimate and what to change.

The estimate adds up:
- the process as it stands, measured (its RSS once the trainers are built: Python, torch, the tokenizer, the
  policy's weights and a reference copy), shown as the weights it counts and the rest;
- what the first step adds to the trainer: the gradients of the trainable parameters and their AdamW state (two
  tensors like each parameter, and a float32 step count);
- the embedded engine: its weights (the policy's, adapters merged, in the engine's dtype; only the adapters where it
  runs them over a LoRA trainer's own base, `deploy.shares_lora_base`), a KV cache of
  `deployment.max_batch_requests` rows of the longest context it serves (`deployment.max_context_tokens`, else the
  model's positions: the engine refuses a longer prompt + completion), and the prefix cache's byte bound;
- one training micro-batch's working set: the activations autograd keeps for `trainer.max_tokens_per_microbatch`
  tokens (`activation_bytes_per_token`) and the vocabulary projection's float32 logits (`projection_bytes`: a block of
  them for a plain linear head, a chunk's whole rows for any other).

To fit, the prefix cache's bound is lowered first (down to one context's keys/values, or the bound set if lower:
the longest prompt still fits, so a row's later draws and a session's next turn still find theirs), then
`trainer.max_tokens_per_microbatch` (down to `MIN_MICROBATCH_TOKENS`: smaller micro-batches only cost more
forwards), then activation checkpointing is turned on (`trainer.gradient_checkpointing`: each layer's input and
attention output kept instead of all its activations, for one more forward of the rest of each micro-batch) with
the micro-batch budget as set, lowered again only if it must. Not counted: memory malloc holds freed
(`mem/malloc_free` under glibc), an engine forward's transient buffers, and a datum longer than the micro-batch
budget, which trains alone at its own length (bound it with `max_sequence_tokens`). Each step's `mem/rss_peak` shows
what the estimate missed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from training.utils.config.rl import RLConfig
from training.utils.deploy import engine_dtype, shares_lora_base
from training.utils.deploy.prefix_cache import prefix_cache_budget
from training.utils.errors import ConfigError
from training.utils.models.frozen_casts import cast_of, kept_casts
from training.utils.runtime import distributed
from training.utils.runtime.memory import GIB, current_rss_bytes, kv_bytes_per_token, peak_rss_bytes, storage_bytes
from training.utils.trainer import Reference, Trainer
from training.utils.trainer.logprob_head import projection_bytes
from training.utils.trainer.plan import fit_memory

log = logging.getLogger("training")

MIN_MICROBATCH_TOKENS = 256
"""The least `trainer.max_tokens_per_microbatch` the budget lowers it to (a lower setting is kept): below it a
micro-batch is mostly the per-forward cost, and the model's own sequences seldom fit in fewer tokens."""

def activation_bytes_per_token(model_config, element_bytes: int, row_tokens: int, checkpointing: bool,
                                recompute_attention: bool = False) -> int:
    """What autograd keeps per token of a decoder-only transformer's forward, for its backward.

    Per layer: the two norms' inputs and outputs and the residual (about 4 H), the query, its rotated copy and the
    attention output (3 H), the keys and values with their rotated and head-repeated copies (3 x kv heads x head dim
    and 2 H), the MLP's gate, up, activation and product (4 x intermediate); and the float attention mask each layer
    builds for a padded or shared-prefix row: one value per token of the row (`row_tokens`). With activation
    checkpointing, each layer's input, its attention output and float32 logsumexp (kept unless
    `recompute_attention`: `trainer/activation_checkpointing.py`), and one layer recomputed at a time.
    `tests/test_memory_telemetry.py` holds both to what autograd saves on a tiny model.
    """
    text = model_config.get_text_config()
    hidden, layers, heads = text.hidden_size, text.num_hidden_layers, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    per_layer = 9 * hidden + 3 * kv_heads * head_dim + 4 * intermediate + row_tokens
    if checkpointing:
        attention = 0 if recompute_attention else heads * head_dim * element_bytes + heads * 4
        return (layers * hidden + per_layer) * element_bytes + layers * attention
    return layers * per_layer * element_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run needs: `fixed` parts the budget cannot change, the prefix cache's bound and the least it is
    lowered to, and a micro-batch's working set as a function of its token budget."""

    fixed: dict[str, int]
    prefix_cache: int
    prefix_cache_floor: int
    microbatch_tokens: int
    checkpointing: bool
    working_set: Callable[[int, bool], int]
    """Bytes of a micro-batch of so many tokens, with activation checkpointing or without."""

    def parts(self, prefix_cache: int | None = None, microbatch_tokens: int | None = None,
              checkpointing: bool | None = None) -> dict[str, int]:
        tokens = self.microbatch_tokens if microbatch_tokens is None else microbatch_tokens
        checkpointing = self.checkpointing if checkpointing is None else checkpointing
        name = f"a micro-batch of {tokens} tokens" + (" (activations checkpointed)" if checkpointing else "")
        return self.fixed | {"prefix cache": self.prefix_cache if prefix_cache is None else prefix_cache,
                             name: self.working_set(tokens, checkpointing)}

    def fit(self, budget: int) -> tuple[int, int, bool] | None:
        """(prefix cache bound, micro-batch tokens, checkpointing) that fit `budget`: as configured if they do, else
        the prefix cache lowered, then the micro-batch, then checkpointing on (the micro-batch as set, lowered
        again if it must); None if nothing down to the floors fits."""
        room = budget - sum(self.fixed.values())
        left = room - self.working_set(self.microbatch_tokens, self.checkpointing)
        if left >= self.prefix_cache_floor:
            return min(self.prefix_cache, left), self.microbatch_tokens, self.checkpointing
        room -= self.prefix_cache_floor
        floor = min(self.microbatch_tokens, MIN_MICROBATCH_TOKENS)
        for checkpointing in dict.fromkeys((self.checkpointing, True)):  # as set first: checkpointing costs time
            if self.working_set(floor, checkpointing) > room:
                continue
            low, high = floor, self.microbatch_tokens  # the most tokens that fit: working_set grows with them
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if self.working_set(mid, checkpointing) <= room else (low, mid - 1)
            return self.prefix_cache_floor, low, checkpointing
        return None


def estimate_memory(cfg: RLConfig, policy: Trainer, reference: Reference | None) -> MemoryEstimate:
    """What the run needs, from the built trainers and the process's RSS now."""
    model = policy.model
    text = model.config.get_text_config()
    counted = {"policy weights": storage_bytes(model.parameters())}
    if casts := kept_casts(model.parameters()):
        counted["bf16 copies of frozen weights (trainer.frozen_weight_casts)"] = storage_bytes(casts)
    if isinstance(reference, Trainer):
        counted["reference weights (kl_beta > 0)"] = storage_bytes(reference.model.parameters())
    on_host = sum(counted.values()) if policy.device.type == "cpu" else 0
    process = current_rss_bytes() or peak_rss_bytes()
    trainable = [p for group in policy.optimizer.param_groups for p in group["params"]]
    trainable_bytes = storage_bytes(trainable)
    fixed = {"the process's other memory": max(0, process - on_host), **counted,
             "gradients": trainable_bytes, "AdamW state": 2 * trainable_bytes + 4 * len(trainable)}
    prefix_cache = prefix_cache_floor = 0
    context = cfg.deployment.max_context_tokens or text.max_position_embeddings
    if cfg.deployment.kind == "embedded":
        dtype = engine_dtype(cfg.deployment, policy.device)
        if shares_lora_base(model, cfg.deployment):  # the trainer's base tensors (or their kept casts): the engine
            # owns the adapters, and copies what it serves in another dtype with no kept cast (norms)
            served = [p for p in model.parameters()
                      if p.requires_grad or (p.dtype != dtype and cast_of(p, dtype) is None)]
        else:
            served = [p for p in model.parameters() if not (policy.lora and p.requires_grad)]  # adapters merge in
        fixed["engine weights"] = sum(t.numel() * dtype.itemsize for t in itertools.chain(served, model.buffers()))
        token_bytes = kv_bytes_per_token(model.config, dtype)
        rows = cfg.deployment.max_batch_requests
        fixed[f"KV cache ({rows} rows x {context} tokens)"] = rows * context * token_bytes
        prefix_cache = prefix_cache_budget(cfg.deployment.prefix_cache_bytes, context, token_bytes)
        prefix_cache_floor = min(prefix_cache, context * token_bytes)
    return MemoryEstimate(fixed, prefix_cache, prefix_cache_floor, policy.plan.max_tokens_per_microbatch,
                          policy.plan.gradient_checkpointing, working_set=_working_set(cfg, policy, text.vocab_size,
                                                                                       context))


def _working_set(cfg: RLConfig, policy: Trainer, vocab_size: int, context: int) -> Callable[[int, bool], int]:
    """Bytes of a training micro-batch of `tokens` tokens: activations (a row at most `context` long, the longest
    sequence served; all of them or, with `checkpointing`, each layer's input and one layer's) and float32 logits."""
    element_bytes = 2 if policy.precision == "bf16" else 4  # bf16-autocast keeps float32 norms and residuals
    lm_head = policy.model.get_output_embeddings()

    def working_set(tokens: int, checkpointing: bool) -> int:
        activations = tokens * activation_bytes_per_token(policy.model.config, element_bytes, min(tokens, context),
                                                          checkpointing, policy.cfg.recompute_attention)
        return activations + projection_bytes(lm_head, tokens, policy.cfg.logprob_chunk_tokens, vocab_size,
                                              policy.device, with_entropy_grad=cfg.entropy_coef > 0)

    return working_set


@dataclass(frozen=True)
class MemoryFit:
    """The memory budget's outcome, part of the run plan: the deployment's prefix cache bound and the trainers'
    micro-batch budget and checkpointing it decided (the settings as written where they fit, or without a budget)."""

    prefix_cache_bytes: int | None
    """The prefix cache's byte bound the deployment starts with (None: `deployment.prefix_cache_bytes`' default)."""
    max_tokens_per_microbatch: int
    gradient_checkpointing: bool
    outcome: str
    """"no budget", "fits as configured" or what was lowered to fit."""


def fit_memory_budget(cfg: RLConfig, policy: Trainer, reference: Reference | None) -> MemoryFit:
    """What fits `memory_budget_gib`: the prefix cache's bound lowered where it must be, the trainers' micro-batch
    budget lowered and the policy's activations checkpointed where they must be (applied to their plans,
    `trainer.plan.fit_memory`); the settings as written without a budget.
    A `ConfigError` when the settings cannot fit. Under torchrun rank 0 decides (it holds the engine) and every rank
    applies its decision or raises its error."""
    plan = policy.plan
    if cfg.memory_budget_gib is None:
        return MemoryFit(cfg.deployment.prefix_cache_bytes, plan.max_tokens_per_microbatch,
                         plan.gradient_checkpointing, "no budget")
    decision = distributed.broadcast_object(_decide(cfg, policy, reference) if distributed.is_main() else None)
    if isinstance(decision, str):
        raise ConfigError(decision)
    prefix_cache, microbatch_tokens, checkpointing, outcome = decision
    for trainer in (policy, reference):
        if isinstance(trainer, Trainer):  # the reference computes without grad: it checkpoints no activations
            fit_memory(trainer, trainer.plan.fitted(
                max_tokens_per_microbatch=microbatch_tokens,
                gradient_checkpointing=checkpointing if trainer is policy else trainer.plan.gradient_checkpointing))
    return MemoryFit(cfg.deployment.prefix_cache_bytes if prefix_cache is None else prefix_cache, microbatch_tokens,
                     checkpointing, outcome)


def _decide(cfg: RLConfig, policy: Trainer, reference: Reference | None) -> tuple[int | None, int, bool, str] | str:
    """(the prefix cache's byte bound, None to keep it; the micro-batch tokens; checkpointing; what changed), or the
    refusal's message."""
    estimate = estimate_memory(cfg, policy, reference)
    budget = int(cfg.memory_budget_gib * GIB)
    needed = sum(estimate.parts().values())
    fitted = estimate.fit(budget)
    if fitted is None:
        floor = min(estimate.microbatch_tokens, MIN_MICROBATCH_TOKENS)
        least = sum(estimate.parts(estimate.prefix_cache_floor, floor, checkpointing=True).values())
        return (f"memory_budget_gib={cfg.memory_budget_gib:g} is too small for this model and these settings: the "
                f"run needs about {needed / GIB:.2f} GiB as configured ({_biggest(estimate.parts())}), and still "
                f"{least / GIB:.2f} GiB with the prefix cache at one context, trainer.max_tokens_per_microbatch at "
                f"{floor} and activations checkpointed, the least the budget lowers them to. Lower "
                "deployment.max_batch_requests or deployment.max_context_tokens (the KV cache holds that many rows of "
                "that context), lower trainer.max_tokens_per_microbatch, "
                + ("" if policy.cfg.recompute_attention else
                   "set trainer.recompute_attention=True (checkpointing keeps only each layer's input), ")
                + "train LoRA adapters (trainer.lora_rank > 0: gradients and AdamW state for the adapters only, no "
                "reference copy), or raise memory_budget_gib")
    prefix_cache, microbatch_tokens, checkpointing = fitted
    changes = []
    if prefix_cache != estimate.prefix_cache:
        changes.append(f"deployment.prefix_cache_bytes {estimate.prefix_cache} -> {prefix_cache}")
    if microbatch_tokens != estimate.microbatch_tokens:
        changes.append(f"trainer.max_tokens_per_microbatch {estimate.microbatch_tokens} -> {microbatch_tokens}")
    if checkpointing != estimate.checkpointing:
        changes.append("trainer.gradient_checkpointing False -> True")
    planned = sum(estimate.parts(prefix_cache, microbatch_tokens, checkpointing).values())
    log.info("memory_budget_gib=%g: the run needs about %.2f GiB as configured (%s)%s", cfg.memory_budget_gib,
             needed / GIB, _biggest(estimate.parts()),
             f"; to fit, {', '.join(changes)} (about {planned / GIB:.2f} GiB)" if changes else "")
    outcome = f"lowered to fit: {', '.join(changes)}" if changes else "fits as configured"
    return (prefix_cache if prefix_cache != estimate.prefix_cache else None), microbatch_tokens, checkpointing, outcome


def _biggest(parts: dict[str, int], count: int = 4) -> str:
    largest = sorted(parts.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{name} {size / GIB:.2f} GiB" for name, size in largest)
