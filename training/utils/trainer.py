"""The local policy/reference trainer: logprobs, forward_backward, optimizer step, export.

One `Trainer` wraps one Hugging Face causal LM on one device:
- `logprobs(datums)`: no-grad per-token logprobs (and optionally entropies) of the targets;
- `forward_backward(datums, loss_fn)`: length-bucketed micro-batches, each a forward, a
  user loss and a `backward()`, so gradients accumulate over the whole call;
- `optim_step()`: AdamW with a non-finite-gradient guard, norm clipping and an LR schedule;
- `state_dict_for_inference()` / `save_hf(path)`: hand the weights to an inference engine.

A reference model is a `Trainer(model, cfg, trainable=False)`: frozen, eval mode, no optimizer;
for a LoRA policy (`cfg.lora_rank > 0`) it is `policy.adapter_disabled_reference()`, no copy.

Under torchrun (`training.utils.distributed`) the model is sharded with FSDP2 and every rank
calls each method with the same datums: each rank trains its share of the micro-batches, the
gradients sum to the single-process gradient, and metrics and logprobs are gathered so every
rank returns what one process would. The export methods gather the full weights onto rank 0.

Logprobs are `log_softmax(lm_head(h) / temperature)` at the target ids. The decoder runs once
per micro-batch; the vocabulary projection runs in chunks of `cfg.logprob_chunk_tokens`
selected positions, so no float32 `(tokens, vocab)` buffer for the whole batch ever exists.
Models that transform logits after `lm_head` (e.g. Gemma-2 soft-capping) are not supported.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint

from training.utils import distributed
from training.utils.config import TrainerConfig
from training.utils.errors import ConfigError
from training.utils.lora import adapters_disabled, merged_state_dict, standalone_copy, wrap_with_lora
from training.utils.rl.rollout.types import Datum

logger = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """What a loss function sees: one micro-batch, right-padded to its longest datum, on the model's device."""

    target_ids: Tensor
    """(b, T) long: the next-token targets."""
    weights: Tensor
    """(b, T) float: 1.0 on trained tokens, 0 on context and padding."""
    behaviour_logprobs: Tensor
    """(b, T) float: the sampler's logprob of each target, 0 at padding."""
    advantages: Tensor
    """(b,) float: one advantage per datum."""
    extras: dict[str, Tensor]
    """Per-datum arrays passed to `forward_backward(extras=...)`, each (b, T) float, 0 at padding."""
    datum_indices: list[int]
    """Positions of this micro-batch's rows in the list given to `forward_backward`."""
    num_tokens_total: float
    """Sum of weights over every datum of the `forward_backward` call: the token-mean denominator."""
    num_seqs_total: int
    """Number of datums in the `forward_backward` call: the sequence-mean denominator."""


LossFn = Callable[[Tensor, MicroBatch], tuple[Tensor, dict[str, Tensor]]]
"""`loss_fn(logprobs (b, T), micro_batch) -> (scalar loss, metrics)`; see `Trainer.forward_backward`."""


@dataclass
class _PaddedBatch:
    """One micro-batch's tensors, right-padded; `positions` index the flattened (b·T) grid.

    The model sees `input_ids` with `attention_mask` and `position_ids`: the padded grid itself,
    or (packed) one row of the datums end to end, without a mask, position ids restarting at each
    datum. `hidden_index` says where each of `positions` is in the model's flattened output.
    """

    input_ids: Tensor
    attention_mask: Tensor | None
    position_ids: Tensor | None
    target_ids: Tensor
    weights: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    extras: dict[str, Tensor]
    positions: Tensor
    """(N,) flat indices of the tokens whose logprob is computed."""
    hidden_index: Tensor
    """(N,) the same tokens' flat indices in the model's input."""

    @property
    def shape(self) -> torch.Size:
        """(b, T) of the padded grid the loss sees."""
        return self.target_ids.shape

    def to(self, device: torch.device) -> _PaddedBatch:
        return _PaddedBatch(**{
            name: (value.to(device) if isinstance(value, Tensor) else
                   {k: v.to(device) for k, v in value.items()} if isinstance(value, dict) else value)
            for name, value in vars(self).items()
        })


def lr_multiplier(step: int, cfg: TrainerConfig) -> float:
    """Fraction of the peak learning rate used by the optimizer step that follows `step` applied steps.

    Warmup: (step + 1) / warmup_steps, so the first step already moves the weights. After it,
    `progress = (step − warmup_steps) / (total_steps − warmup_steps)` (capped at 1) and
    linear: min + (1 − min)·(1 − progress); cosine: min + (1 − min)·½(1 + cos(π·progress)).
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def resolve_precision(cfg: TrainerConfig, device: torch.device) -> str:
    """`cfg.precision` with `auto` decided: bf16-autocast on CUDA, fp32 elsewhere."""
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16-autocast" if device.type == "cuda" else "fp32"


def weight_dtype(cfg: TrainerConfig, device: torch.device) -> torch.dtype:
    """The dtype the trainer keeps its weights (and AdamW state) in: float32 unless `precision` is bf16."""
    return torch.bfloat16 if resolve_precision(cfg, device) == "bf16" else torch.float32


def plan_microbatches(lengths: list[int], max_tokens: int, *, packed: bool = False) -> list[list[int]]:
    """Group datums into micro-batches of at most `max_tokens` computed tokens; returns lists of indices.

    Padded (default): longest first, fill each micro-batch while longest × count ≤ max_tokens.
    Packed: first-fit decreasing on the sum of lengths (a packed row holds no padding).
    A datum longer than the budget goes alone.
    """
    longest_first = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if packed:
        bins: list[list[int]] = []
        filled: list[int] = []
        for index in longest_first:
            fit = next((b for b, used in enumerate(filled) if used + lengths[index] <= max_tokens), None)
            if fit is None:
                bins.append([])
                filled.append(0)
                fit = len(bins) - 1
            bins[fit].append(index)
            filled[fit] += lengths[index]
        return bins
    microbatches: list[list[int]] = []
    current: list[int] = []
    for index in longest_first:
        # current[0] is the longest in `current`, so it sets the padded width.
        if current and lengths[current[0]] * (len(current) + 1) > max_tokens:
            microbatches.append(current)
            current = []
        current.append(index)
    microbatches.append(current)
    return microbatches


def check_datums(datums: list[Datum]) -> None:
    """Raise ValueError, naming the datum, if the list is empty or a datum's arrays differ in length."""
    if not datums:
        raise ValueError("got an empty list of datums; pass at least one")
    for index, datum in enumerate(datums):
        n = len(datum.input_ids)
        if n == 0:
            raise ValueError(f"datum {index} has no input_ids")
        for name, values in (
            ("target_ids", datum.target_ids),
            ("weights", datum.weights),
            ("behaviour_logprobs", datum.behaviour_logprobs),
        ):
            if len(values) != n:
                raise ValueError(f"datum {index}: input_ids has {n} entries but {name} has {len(values)}")


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_extras(extras: dict[str, list], datums: list[Datum]) -> None:
    for name, rows in extras.items():
        if len(rows) != len(datums):
            raise ValueError(f"extras[{name!r}] has {len(rows)} entries for {len(datums)} datums")
        for index, (row, datum) in enumerate(zip(rows, datums)):
            if len(row) != len(datum.target_ids):
                raise ValueError(
                    f"extras[{name!r}][{index}] has {len(row)} entries but datum {index} has "
                    f"{len(datum.target_ids)} targets"
                )


def _pad(rows: list, dtype: torch.dtype) -> Tensor:
    """Right-pad 1-D rows (lists or tensors) with 0 into a (b, T) CPU tensor."""
    return pad_sequence([torch.as_tensor(row, dtype=dtype, device="cpu") for row in rows], batch_first=True)


def _collate(
    datums: list[Datum], indices: list[int], extras: dict[str, list], *, trained_only: bool, packed: bool
) -> _PaddedBatch:
    """Pad (or pack) the selected datums on the CPU; pick the positions whose logprob is needed.

    `trained_only` keeps positions with non-zero weight (the only ones a loss can use), else all
    real tokens. Positions are found on the CPU so the device never syncs to size them.
    """
    chosen = [datums[i] for i in indices]
    input_ids = _pad([d.input_ids for d in chosen], torch.long)
    attention_mask = _pad([[1] * len(d.input_ids) for d in chosen], torch.long)
    weights = _pad([d.weights for d in chosen], torch.float32)
    positions = (weights != 0 if trained_only else attention_mask.bool()).flatten().nonzero().squeeze(1)
    position_ids, hidden_index = None, positions
    if packed:
        lengths = torch.tensor([len(d.input_ids) for d in chosen])
        input_ids = input_ids[attention_mask.bool()][None]
        position_ids = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
        row_starts = lengths.cumsum(0) - lengths
        width = attention_mask.shape[1]
        hidden_index = row_starts[positions // width] + positions % width
        attention_mask = None
    return _PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        target_ids=_pad([d.target_ids for d in chosen], torch.long),
        weights=weights,
        behaviour_logprobs=_pad([d.behaviour_logprobs for d in chosen], torch.float32),
        advantages=torch.tensor([d.advantage for d in chosen], dtype=torch.float32),
        extras={name: _pad([rows[i] for i in indices], torch.float32) for name, rows in extras.items()},
        positions=positions,
        hidden_index=hidden_index,
    )


def _chunk_logprobs(lm_head: torch.nn.Module, hidden_CH: Tensor, targets_C: Tensor, temperature: float) -> Tensor:
    logits_CV = lm_head(hidden_CH).float() / temperature
    return logits_CV.gather(1, targets_C[:, None]).squeeze(1) - logits_CV.logsumexp(dim=1)


def _chunk_logprobs_entropy(
    lm_head: torch.nn.Module, hidden_CH: Tensor, targets_C: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    logits_CV = lm_head(hidden_CH).float() / temperature
    logz_C = logits_CV.logsumexp(dim=1)
    probs_CV = (logits_CV - logz_C[:, None]).exp()
    entropy_C = logz_C - (probs_CV * logits_CV).sum(dim=1)
    return logits_CV.gather(1, targets_C[:, None]).squeeze(1) - logz_C, entropy_C


def _scatter(values_N: Tensor, positions_N: Tensor, shape: torch.Size) -> Tensor:
    """Place per-position values on a zero (b, T) grid; differentiable."""
    flat = values_N.new_zeros(shape.numel()).index_copy(0, positions_N, values_N)
    return flat.view(shape)


class _MetricTotals:
    """Accumulates micro-batch losses and metrics as device tensors; reduced once at the end."""

    def __init__(self) -> None:
        self.loss: Tensor | None = None
        self.weighted_sums: dict[str, Tensor] = {}
        self.extremes: dict[str, Tensor] = {}
        self.weight_total = 0.0

    def add(self, loss: Tensor, metrics: dict[str, Tensor], weight: float) -> None:
        loss = loss.detach().float()
        self.loss = loss if self.loss is None else self.loss + loss
        self.weight_total += weight
        for name, value in metrics.items():
            value = torch.as_tensor(value, device=loss.device).detach().float()
            if name.endswith("_min"):
                previous = self.extremes.get(name)
                self.extremes[name] = value if previous is None else torch.minimum(previous, value)
            elif name.endswith("_max"):
                previous = self.extremes.get(name)
                self.extremes[name] = value if previous is None else torch.maximum(previous, value)
            else:
                self.weighted_sums[name] = self.weighted_sums.get(name, 0.0) + value * weight

    def reduce(self) -> dict[str, float]:
        if distributed.is_distributed():
            return self._reduce_across_ranks()
        # The loss function's own "loss" metric, if any, is overridden by the summed loss.
        means = {name: total / self.weight_total for name, total in self.weighted_sums.items()}
        tensors = {**means, **self.extremes, "loss": self.loss}
        # One host sync for all metrics together.
        values = torch.stack(list(tensors.values())).tolist()
        return dict(zip(tensors.keys(), values))

    def _reduce_across_ranks(self) -> dict[str, float]:
        """The same reduction over every rank's micro-batches (a rank may have run none), identical on all ranks."""
        local = [*self.weighted_sums.values(), *self.extremes.values(), *([self.loss] if self.loss is not None else [])]
        values = iter(torch.stack([torch.as_tensor(v).float().cpu() for v in local]).tolist() if local else [])
        mine = ({name: next(values) for name in self.weighted_sums}, {name: next(values) for name in self.extremes},
                next(values, None), self.weight_total)
        sums: dict[str, float] = {}
        extremes: dict[str, float] = {}
        loss, weight_total = 0.0, 0.0
        for rank_sums, rank_extremes, rank_loss, rank_weight in distributed.all_gather_objects(mine):
            for name, value in rank_sums.items():
                sums[name] = sums.get(name, 0.0) + value
            for name, value in rank_extremes.items():
                pick = min if name.endswith("_min") else max
                extremes[name] = value if name not in extremes else pick(extremes[name], value)
            loss += rank_loss or 0.0
            weight_total += rank_weight
        return {**{name: total / weight_total for name, total in sums.items()}, **extremes, "loss": loss}


class Trainer:
    """A policy (trainable) or reference (frozen) model with logprob, gradient and optimizer steps.

    `step` counts applied optimizer steps only; steps skipped for a non-finite gradient are
    counted in `skipped_steps` and do not advance the LR schedule.

    With `cfg.lora_rank > 0` a trainable model is wrapped with peft LoRA adapters (`self.model`
    is the wrapper, `self.lora` is True): only the adapters are optimized, the base weights stay
    bit-identical, `adapter_disabled_reference()` serves as the KL reference, and the export
    methods merge the adapters in (see `training.utils.lora`).

    Under torchrun the model is sharded with FSDP2 at construction (`distributed.shard_model`),
    before the optimizer is built on the shards; every rank must then make the same calls in the
    same order (the recipes' `TrainerWorker` sees to it).
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, *, trainable: bool = True) -> None:
        self.model = model
        self.cfg = cfg
        self.trainable = trainable
        self.step = 0
        self.skipped_steps = 0
        self.device = next(model.parameters()).device
        self.optimizer: torch.optim.AdamW | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.lora = trainable and cfg.lora_rank > 0
        self.precision = resolve_precision(cfg, self.device)
        self._sharded_root: _ShardedRoot | None = None
        dtype = weight_dtype(cfg, self.device)
        if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
            # Load in this dtype to avoid the conversion (from bf16 it cannot restore lost precision).
            model.to(dtype)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
            self._shard_if_distributed()
            if cfg.compile_layers:
                _compile_layers(model)
            return
        if cfg.lr_schedule != "constant" and cfg.total_steps is None:
            raise ConfigError(f"lr_schedule={cfg.lr_schedule!r} decays over total_steps; set total_steps")
        if self.lora:
            # Freezes the base; the optimizer below then sees only the adapters (requires_grad).
            self.model = model = wrap_with_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                                                dropout=cfg.lora_dropout, target_modules=cfg.lora_target_modules)
        if cfg.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        self._shard_if_distributed()
        if cfg.compile_layers:
            _compile_layers(model)
        self.optimizer = torch.optim.AdamW(
            _param_groups(model, cfg.weight_decay),
            lr=cfg.learning_rate,
            betas=cfg.adam_betas,
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_multiplier(step, cfg))

    def _shard_if_distributed(self) -> None:
        """Under torchrun, FSDP2 over this trainer's model; the optimizer is built afterwards, on the shards."""
        if not distributed.is_distributed():
            return
        self._sharded_root = _ShardedRoot(self.model, self._forward)
        distributed.shard_model(self.model, self._sharded_root, bf16_compute=self.precision == "bf16-autocast")

    # ---- forward passes -------------------------------------------------------------

    def _microbatches(self, lengths: list[int]) -> list[list[int] | None]:
        """This rank's micro-batches, as indices into the call's datums; all of them in one process.

        Under torchrun every rank gets the same datums and keeps its share (`distributed.rank_shares`),
        and pads its plan with `None` fillers to the longest plan of any rank, which it computes
        locally: FSDP2 needs every rank to run as many forwards and backwards.
        """
        budget, packed = self.cfg.max_tokens_per_microbatch, self.cfg.pack_sequences
        if self._sharded_root is None:
            return plan_microbatches(lengths, budget, packed=packed)
        plans = [
            [[share[i] for i in mb] for mb in plan_microbatches([lengths[i] for i in share], budget, packed=packed)]
            if share else []
            for share in distributed.rank_shares(lengths, distributed.world_size())
        ]
        mine = plans[distributed.rank()]
        return mine + [None] * (max(map(len, plans)) - len(mine))

    def _model_forward(
        self, batch: _PaddedBatch, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """`_forward`, through the FSDP2 root when sharded so that its hooks run around it."""
        if self._sharded_root is None:
            return self._forward(batch, temperature, with_entropy)
        return self._sharded_root(batch, temperature, with_entropy)

    def _filler_pass(self, *, backward: bool) -> None:
        """A one-token forward (and a zero backward) that changes nothing, run by a rank with fewer
        micro-batches than another so that every rank makes FSDP2's collectives equally often."""
        logprobs_BT, _ = self._model_forward(_filler_batch().to(self.device), 1.0, with_entropy=False)
        if backward:
            (logprobs_BT.sum() * 0.0).backward()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16-autocast":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, batch: _PaddedBatch, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """(b, T) logprobs (and entropies) at `batch.positions`, 0 elsewhere; differentiable if grad is on."""
        lm_head = self.model.get_output_embeddings()
        with self._autocast():
            hidden_BTH = self.model.get_decoder()(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                use_cache=False,
            ).last_hidden_state
            hidden_NH = hidden_BTH.flatten(0, 1).index_select(0, batch.hidden_index)
            targets_N = batch.target_ids.flatten().index_select(0, batch.positions)
            logprob_chunks, entropy_chunks = [], []
            num_positions = len(batch.positions)
            for start in range(0, num_positions, self.cfg.logprob_chunk_tokens):
                stop = start + self.cfg.logprob_chunk_tokens
                hidden_CH, targets_C = hidden_NH[start:stop], targets_N[start:stop]
                if with_entropy:
                    logprobs_C, entropy_C = _chunk_logprobs_entropy(lm_head, hidden_CH, targets_C, temperature)
                    entropy_chunks.append(entropy_C)
                elif torch.is_grad_enabled() and stop < num_positions:
                    # Without recomputation autograd would keep every chunk's float32 (C, V) logits
                    # alive until backward, i.e. the full-batch buffer chunking exists to avoid.
                    # Recomputing costs one extra lm_head matmul per chunk in backward. The last
                    # chunk is exempt: its backward runs first, so its logits add nothing to the peak.
                    logprobs_C = checkpoint(
                        _chunk_logprobs, lm_head, hidden_CH, targets_C, temperature, use_reentrant=False
                    )
                else:
                    logprobs_C = _chunk_logprobs(lm_head, hidden_CH, targets_C, temperature)
                logprob_chunks.append(logprobs_C)
        logprobs_BT = _scatter(_cat(logprob_chunks, hidden_NH), batch.positions, batch.shape)
        entropy_BT = _scatter(_cat(entropy_chunks, hidden_NH), batch.positions, batch.shape) if with_entropy else None
        return logprobs_BT, entropy_BT

    @torch.no_grad()
    def logprobs(
        self, datums: list[Datum], temperature: float = 1.0, *, with_entropy: bool = False
    ) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
        """Per datum, a float32 CPU tensor of log_softmax(logits / temperature) at each target.

        With `with_entropy`, also returns the per-token entropy of that same distribution.
        """
        check_datums(datums)
        check_temperature(temperature)
        self.model.eval()
        logprobs_D: list[Tensor] = [torch.empty(0)] * len(datums)
        entropy_D: list[Tensor] = [torch.empty(0)] * len(datums)
        computed: list[int] = []
        for indices in self._microbatches([len(d) for d in datums]):
            if indices is None:
                self._filler_pass(backward=False)
                continue
            batch = _collate(datums, indices, {}, trained_only=False, packed=self.cfg.pack_sequences).to(self.device)
            logprobs_BT, entropy_BT = self._model_forward(batch, temperature, with_entropy)
            logprobs_BT = logprobs_BT.cpu()
            entropy_BT = entropy_BT.cpu() if with_entropy else None
            for row, index in enumerate(indices):
                n = len(datums[index].target_ids)
                logprobs_D[index] = logprobs_BT[row, :n].clone()
                if with_entropy:
                    entropy_D[index] = entropy_BT[row, :n].clone()
            computed += indices
        if self._sharded_root is not None:
            # Each rank computed its share; every rank returns all of them.
            mine = {index: (logprobs_D[index], entropy_D[index]) for index in computed}
            for share in distributed.all_gather_objects(mine):
                for index, (logprobs, entropy) in share.items():
                    logprobs_D[index], entropy_D[index] = logprobs, entropy
        return (logprobs_D, entropy_D) if with_entropy else logprobs_D

    # ---- training ---------------------------------------------------------------------

    def forward_backward(
        self,
        datums: list[Datum],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        extras: dict[str, list[Tensor | list[float]]] | None = None,
        with_entropy: bool = False,
    ) -> dict[str, float]:
        """Accumulate the gradient of `loss_fn` summed over length-bucketed micro-batches.

        `loss_fn(logprobs, mb)` gets (b, T) logprobs with grad, at `temperature`, and must
        normalise by `mb.num_tokens_total` or `mb.num_seqs_total` so that the micro-batch
        losses sum to the minibatch loss. Logprobs are computed only where `mb.weights` is
        non-zero and are 0 elsewhere (context and padding): no loss can use the rest.
        Gradients accumulate across calls until `optim_step()`. With `with_entropy`, the
        per-token entropy of the same distribution (detached) is in `mb.extras["entropy"]`.

        Returns "loss" (the summed loss) and each metric of `loss_fn`: names ending in
        "_min"/"_max" take the min/max over micro-batches, others the mean weighted by each
        micro-batch's sum of weights.
        """
        self._require_trainable("forward_backward")
        check_datums(datums)
        check_temperature(temperature)
        extras = extras or {}
        _check_extras(extras, datums)
        self.model.train()
        num_tokens_total = float(sum(sum(d.weights) for d in datums))
        totals = _MetricTotals()
        plan = self._microbatches([len(d) for d in datums])
        for number, indices in enumerate(plan):
            if self._sharded_root is not None:
                # FSDP2 reduces the gradients once, after the last backward, not after each one.
                self._sharded_root.set_requires_gradient_sync(number == len(plan) - 1)
            if indices is None:
                self._filler_pass(backward=True)
                continue
            batch = _collate(datums, indices, extras, trained_only=True, packed=self.cfg.pack_sequences)
            batch = batch.to(self.device)
            if self._sharded_root is not None and batch.positions.numel() == 0:
                # Nothing to train (its loss would have no graph, so this rank alone would skip a
                # backward and FSDP2's gradient reduction); its metrics are left out.
                self._filler_pass(backward=True)
                continue
            logprobs_BT, entropy_BT = self._model_forward(batch, temperature, with_entropy=with_entropy)
            if with_entropy:
                batch.extras["entropy"] = entropy_BT.detach()
            micro = MicroBatch(
                target_ids=batch.target_ids,
                weights=batch.weights,
                behaviour_logprobs=batch.behaviour_logprobs,
                advantages=batch.advantages,
                extras=batch.extras,
                datum_indices=indices,
                num_tokens_total=num_tokens_total,
                num_seqs_total=len(datums),
            )
            loss, metrics = loss_fn(logprobs_BT, micro)
            if self._sharded_root is not None and not loss.requires_grad:
                # Every rank must run this backward: it is where FSDP2 reduces the gradients.
                loss = loss + 0.0 * logprobs_BT.sum()
            # A micro-batch without trained tokens never reaches the model's graph.
            if loss.requires_grad:
                loss.backward()
            micro_weight = float(sum(sum(datums[i].weights) for i in indices))
            # If nothing in the call is weighted, average micro-batches equally instead of 0/0.
            totals.add(loss, metrics, micro_weight if num_tokens_total > 0 else 1.0)
        return totals.reduce()

    def optim_step(self) -> dict[str, float]:
        """Clip and apply the accumulated gradient, or skip it if its norm is not finite; then zero it.

        Returns "grad_norm" (before clipping), "lr" (of this step) and "skipped" (1.0 or 0.0).
        """
        self._require_trainable("optim_step")
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()  # FSDP2: every rank's shards together, the same on all ranks
        # The one host sync of a step: deciding to skip needs the norm on the CPU.
        grad_norm_value = grad_norm.item()
        if not math.isfinite(grad_norm_value):
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            logger.warning(
                "skipped optimizer step %d: gradient norm is %s (%d steps skipped so far)",
                self.step,
                grad_norm_value,
                self.skipped_steps,
            )
            return {"grad_norm": grad_norm_value, "lr": lr, "skipped": 1.0}
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"grad_norm": grad_norm_value, "lr": lr, "skipped": 0.0}

    def _require_trainable(self, method: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"{method}() called on a reference trainer (trainable=False)")

    # ---- export -----------------------------------------------------------------------

    def state_dict_for_inference(self) -> dict[str, Tensor]:
        """The live weights under Hugging Face names, detached and not copied.

        With LoRA: the base model's names, adapters merged in (new tensors for the adapted
        layers, the live ones elsewhere). Adapter-only sync is future work (`training.utils.lora`).
        Under torchrun a collective (every rank calls it): the full weights gathered onto rank 0's
        CPU; the other ranks get {}.
        """
        if self.lora:
            merged = merged_state_dict(self.model)
            return merged if self._sharded_root is None else _gather_to_main(merged)
        if self._sharded_root is not None:
            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.model.state_dict()

    def model_for_inference(self) -> torch.nn.Module | None:
        """A model an inference engine may copy (`start_deployment` does): this trainer's own module.

        Under torchrun a collective: a new unsharded model of the same class holding the gathered
        weights, on rank 0; None on the other ranks.
        """
        if self._sharded_root is None:
            return self.model
        state = self.state_dict_for_inference()
        if not distributed.is_main():
            return None
        return _unsharded_copy(self.model.get_base_model() if self.lora else self.model, state, self.device)

    def save_hf(self, path: str | Path, tokenizer=None) -> None:
        """Write a Hugging Face directory (config + safetensors, and the tokenizer if given).

        With LoRA the directory holds the merged model (loadable without peft), written from a
        temporary merged copy. Under torchrun every rank calls it and rank 0 writes.
        """
        if self._sharded_root is not None:
            exported = self.model_for_inference()  # a collective: every rank gathers, rank 0 writes
            if exported is None:
                return
        else:
            exported = standalone_copy(self.model) if self.lora else self.model
        exported.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    def adapter_disabled_reference(self) -> AdapterDisabledReference:
        """The KL reference of a LoRA policy: this trainer's module with its adapters disabled."""
        if not self.lora:
            raise RuntimeError("adapter_disabled_reference() needs a LoRA trainer (cfg.lora_rank > 0)")
        return AdapterDisabledReference(self)


class AdapterDisabledReference:
    """The reference model of a LoRA policy: the policy's base model, i.e. its own module run
    with the adapters disabled. It answers `logprobs` like a frozen `Trainer` and holds no
    weights of its own, so `kl_beta > 0` costs no second copy of the model.

    Call it on the thread that trains the policy: the adapters are off for the whole call.
    """

    trainable = False

    def __init__(self, policy: Trainer) -> None:
        self.policy = policy

    def logprobs(
        self, datums: list[Datum], temperature: float = 1.0, *, with_entropy: bool = False
    ) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
        """`Trainer.logprobs` of the base model (bit-identical to the model before wrapping)."""
        with adapters_disabled(self.policy.model):
            return self.policy.logprobs(datums, temperature, with_entropy=with_entropy)


Reference = Trainer | AdapterDisabledReference
"""What computes reference logprobs: a frozen `Trainer`, or a LoRA policy's base model."""


class _ShardedRoot(torch.nn.Module):
    """The FSDP2 root: `Trainer._forward` as one module call.

    `_forward` calls the decoder and `lm_head` directly, never the model's own `forward`, so the
    root's hooks (gather the embeddings, final norm and lm_head before, reduce their gradients
    after the backward) must wrap a module whose forward is `_forward`.
    """

    def __init__(self, model: torch.nn.Module, compute: Callable) -> None:
        super().__init__()
        self.model = model
        self.compute = compute

    def forward(self, batch: _PaddedBatch, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        logprobs_BT, entropy_BT = self.compute(batch, temperature, with_entropy)
        # Not views (`_scatter` returns one): an in-place op on a view output would drop the
        # pre-backward hook FSDP2 registers on it. The copies are (b, T), small.
        return logprobs_BT.clone(), entropy_BT.clone() if entropy_BT is not None else None


def _filler_batch() -> _PaddedBatch:
    """One token (id 0) whose logprob is computed and never trained."""
    token = torch.zeros((1, 1), dtype=torch.long)
    zeros = torch.zeros((1, 1))
    position = torch.zeros(1, dtype=torch.long)
    return _PaddedBatch(input_ids=token, attention_mask=torch.ones_like(token), position_ids=None, target_ids=token,
                        weights=zeros, behaviour_logprobs=zeros, advantages=torch.zeros(1), extras={},
                        positions=position, hidden_index=position)


def _gather_to_main(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A collective: each sharded tensor gathered whole, one at a time, kept on rank 0's CPU; {} elsewhere."""
    main = distributed.is_main()
    gathered = {}
    for name, tensor in state.items():  # the same order on every rank
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if main:
            gathered[name] = full.detach().cpu()
    return gathered


def _unsharded_copy(model: torch.nn.Module, state: dict[str, Tensor], device: torch.device) -> torch.nn.Module:
    """A plain module of `model`'s class and config holding `state` (the gathered full weights)."""
    dtype = next(iter(state.values())).dtype
    with torch.device(device):
        copy = type(model)(model.config).to(dtype)
    copy.load_state_dict(state)
    copy.generation_config = model.generation_config
    return copy


def _cat(chunks: list[Tensor], like: Tensor) -> Tensor:
    """Concatenate chunk results; an empty float32 tensor when there were no positions."""
    return torch.cat(chunks) if chunks else like.new_zeros(0, dtype=torch.float32)


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """HF activation checkpointing, non-reentrant (the reentrant form needs inputs that require grad)."""
    # transformers 5.17 (our lowest supported) only has the old name; later releases keep it as a
    # deprecated alias that warns on every call.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _compile_layers(model: torch.nn.Module) -> None:
    """`torch.compile` every decoder layer in place (after FSDP2 sharding, which then stays outside the graph)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"trainer.compile_layers: {type(model).__name__}'s decoder has no `layers` ModuleList")
    for layer in layers:
        layer.compile(dynamic=True)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: decaying norm gains and biases pulls them towards 0 for no benefit."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
