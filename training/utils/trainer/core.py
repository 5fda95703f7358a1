"""The local policy/reference trainer: logprobs, forward_backward, optimizer step, export.

One `Trainer` wraps one Hugging Face causal LM on one device:
- `logprobs(datums)`: no-grad per-token logprobs (and optionally entropies) of the targets;
- `forward_backward(datums, loss_fn)`: length-bucketed micro-batches, each a forward, a
  user loss and a `backward()`, so gradients accumulate over the whole call (and across calls;
  `divide_grads(d)` scales what accumulated);
- with `cfg.share_prefixes`, datums that begin alike are computed as one row, their common prefix
  once (`shared_prefix`), giving the logprobs, entropies and gradients of the datums apart;
- `optim_step()`: AdamW with norm clipping and an LR schedule, skipping a step whose gradient or
  update is not finite;
- `state_dict_for_inference()` / `save_hf(path)`: hand the weights to an inference engine;
- `flops`: the model FLOPs of every micro-batch run so far (`training.utils.models.flops`), what utilisation divides.

A reference model is a `Trainer(model, cfg, trainable=False)`: frozen, eval mode, no optimizer;
for a LoRA policy (`cfg.lora_rank > 0`) it is `policy.adapter_disabled_reference()`, no copy.

Under torchrun (`training.utils.runtime.distributed`) the model is sharded with FSDP2 and every rank
calls each method with the same datums: each rank trains its share of the micro-batches, the
gradients sum to the single-process gradient, and metrics and logprobs are gathered so every
rank returns what one process would. The export methods gather the full weights onto rank 0.

Logprobs are `log_softmax(lm_head(h) / temperature)` at the target ids. The decoder runs once
per micro-batch; the vocabulary projection runs in chunks of `cfg.logprob_chunk_tokens`
selected positions (`logprob_head`), so no float32 `(tokens, vocab)` buffer for the whole batch ever exists.
Models that transform logits after `lm_head` (e.g. Gemma-2 soft-capping) are not supported.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from training.utils.config.rl import TrainerConfig
from training.utils.models.cpu_attention import NAME as CPU_ATTENTION, PIECES, use_cpu_attention
from training.utils.models.flops import decoder_shape, forward_flops, shared_prefix_pairs
from training.utils.models.lora import (
    adapter_state,
    adapters_enabled,
    merged_state_dict,
    standalone_copy,
    wrap_with_lora,
)
from training.utils.models.prefix_attention import plan_pieces
from training.utils.run_files.atomic_dir import replaced_directory
from training.utils.runtime import cpu_share, distributed
from training.utils.trainer.activation_checkpointing import enable_activation_checkpointing
from training.utils.trainer.batching import (
    Datum,
    LossFn,
    MicroBatch,
    PaddedBatch,
    check_datums,
    check_extras,
    check_temperature,
    collate,
    computed_tokens,
    filler_batch,
    plan_ranks,
)
from training.utils.trainer.compiled import CompiledLayers
from training.utils.trainer.logprob_head import scatter_to_grid, token_logprobs
from training.utils.trainer.optim import guarded_step, lr_schedule, max_abs, param_groups
from training.utils.trainer.plan import TrainerPlan
from training.utils.trainer.precision import autocast, keep_frozen_casts, weights_dtype
from training.utils.trainer.reference import AdapterDisabledReference
from training.utils.trainer.sharding import MetricTotals, ShardedRoot, gather_to_main, unsharded_copy
from training.utils.trainer.shared_prefix import PrefixBundle, PrefixSharing, prefix_bundles, shared_prefix_mask

logger = logging.getLogger(__name__)


class Trainer:
    """A policy (trainable) or reference (frozen) model with logprob, gradient and optimizer steps.

    `step` counts applied optimizer steps only; steps skipped for a non-finite gradient or update
    are counted in `skipped_steps` and do not advance the LR schedule.

    With `cfg.compile_layers` the decoder layers are compiled (`self.compiled_layers`); the first
    forward of each grad mode is checked against eager, and on a failure or a mismatch the layers
    run eagerly from then on (`compiled_layers` becomes None).

    With `cfg.lora_rank > 0` a trainable model is wrapped with peft LoRA adapters (`self.model`
    is the wrapper, `self.lora` is True): only the adapters are optimized, the base weights stay
    bit-identical, `adapter_disabled_reference()` serves as the KL reference, and the export
    methods merge the adapters in (see `training.utils.models.lora`).

    Under torchrun the model is sharded with FSDP2 at construction (`distributed.shard_model`),
    before the optimizer is built on the shards; every rank must then make the same calls in the
    same order (the recipes' `TrainerWorker` sees to it).
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, *, trainable: bool = True,
                 plan: TrainerPlan | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.trainable = trainable
        self.step = 0
        self.skipped_steps = 0
        self.last_skip_reason: str | None = None
        """Why the last skipped step was skipped (a non-finite gradient norm, an update that overflowed)."""
        self.device = next(model.parameters()).device
        self.cpu_threads = torch.get_num_threads()  # its CPU work's threads: the count when built (cpu_share)
        self.flop_shape = decoder_shape(model.config)  # None: a model whose FLOPs are not counted
        self.flops = 0.0
        """Model FLOPs of the micro-batches this process ran, forwards and backwards (`_count_flops`)."""
        self.adapter_params = 0
        """LoRA adapter weights a token passes through, r·(in + out) per adapted layer; 0 without adapters."""
        self.optimizer: torch.optim.AdamW | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.lora = trainable and cfg.lora_rank > 0
        self.plan = plan or TrainerPlan.resolve(cfg, self.device)  # the run plan's slice, or its own outside one
        self.precision = self.plan.precision
        self._sharded_root: ShardedRoot | None = None
        self.compiled_layers: CompiledLayers | None = None
        use_cpu_attention(model)  # decode and short rows as batched matmuls on a CPU (cpu_attention.py)
        self.prefix_sharing = PrefixSharing.for_model(cfg.share_prefixes, model)  # None: each datum alone
        self.attention_by_pieces = True
        """Shared-prefix rows' attention a piece at a time (`prefix_attention`) where the model runs `cpu_sdpa` and
        its layers are not compiled; False: the row's dense mask (benchmarks/cpu_attention.py compares the two)."""
        dtype = weights_dtype(self.precision)
        if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
            # Load in this dtype to avoid the conversion (from bf16 it cannot restore lost precision).
            model.to(dtype)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
            self._shard_if_distributed()
            if cfg.compile_layers:
                self.compiled_layers = CompiledLayers(model)
            return
        if self.lora:
            # Freezes the base; the optimizer below then sees only the adapters (requires_grad).
            self.model = model = wrap_with_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                                                dropout=cfg.lora_dropout, target_modules=cfg.lora_target_modules)
            self.adapter_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if self.plan.gradient_checkpointing:
            enable_activation_checkpointing(model, cfg.recompute_attention)
        self._shard_if_distributed()
        if self.lora:
            keep_frozen_casts(model, cfg, self.plan.frozen_weight_casts, sharded=self._sharded_root is not None)
        if cfg.compile_layers:
            self.compiled_layers = CompiledLayers(model)
        self.optimizer = torch.optim.AdamW(
            param_groups(model, cfg.weight_decay),
            lr=cfg.learning_rate,
            betas=cfg.adam_betas,
            # On CPU too: the per-tensor loop is slow there as well (benchmarks/optimizer_step.py measures both).
            fused=self.device.type in ("cuda", "cpu"),
        )
        self.scheduler = lr_schedule(self.optimizer, cfg, self.plan.total_steps)

    def _shard_if_distributed(self) -> None:
        """Under torchrun, FSDP2 over this trainer's model; the optimizer is built afterwards, on the shards."""
        if not distributed.is_distributed():
            return
        self._sharded_root = ShardedRoot(self.model, self._forward)
        distributed.shard_model(self.model, self._sharded_root, bf16_compute=self.precision == "bf16-autocast")

    # ---- forward passes -------------------------------------------------------------

    def _microbatches(self, datums: list[Datum]) -> tuple[list[list[PrefixBundle] | None], int]:
        """This rank's micro-batches, as lists of bundles (`prefix_bundles`, or each datum alone); all of
        them in one process. Also the tokens every rank's micro-batches together run through the model.

        Under torchrun every rank gets the same datums and keeps its share of the bundles (`plan_ranks`),
        and pads its plan with `None` fillers to the longest plan of any rank, which it computes
        locally: FSDP2 needs every rank to run as many forwards and backwards.
        """
        budget, packed, sharing = self.plan.max_tokens_per_microbatch, self.cfg.pack_sequences, self.prefix_sharing
        bundles = prefix_bundles([d.input_ids for d in datums], budget, sharing.pair_cost) if sharing else \
            [PrefixBundle.single(index, len(datum)) for index, datum in enumerate(datums)]
        sharded = self._sharded_root is not None
        plans = plan_ranks(bundles, budget, packed=packed, world=distributed.world_size() if sharded else 1)
        computed = sum(computed_tokens([b.length for b in mb], packed=packed) for plan in plans for mb in plan)
        mine = plans[distributed.rank() if sharded else 0]
        return mine + [None] * (max(map(len, plans)) - len(mine)), computed

    def _model_forward(
        self, batch: PaddedBatch, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """`_root_forward`; with compiled layers, the first one of each grad mode is checked against eager
        (`CompiledLayers.checked_forward`), and on a failure or a mismatch the layers run eagerly from then on."""
        compiled = self.compiled_layers
        if compiled is None or torch.is_grad_enabled() in compiled.checked_grad_modes:
            return self._root_forward(batch, temperature, with_entropy)
        result, kept = compiled.checked_forward(lambda: self._root_forward(batch, temperature, with_entropy),
                                                self.precision)
        if not kept:
            self.compiled_layers = None
        return result

    def _root_forward(
        self, batch: PaddedBatch, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """`_forward`, through the FSDP2 root when sharded so that its hooks run around it."""
        if self._sharded_root is None:
            return self._forward(batch, temperature, with_entropy)
        return self._sharded_root(batch, temperature, with_entropy)

    def _filler_pass(self, *, backward: bool) -> None:
        """A one-token forward (and a zero backward) that changes nothing, run by a rank with fewer
        micro-batches than another so that every rank makes FSDP2's collectives equally often."""
        logprobs_BT, _ = self._model_forward(filler_batch().to(self.device), 1.0, with_entropy=False)
        if backward:
            (logprobs_BT.sum() * 0.0).backward()

    def _count_flops(self, datums: list[Datum], bundles: list[PrefixBundle], batch: PaddedBatch, *,
                     backward: bool) -> None:
        """Add a micro-batch's model FLOPs to `flops`: every token run through the decoder, padding included;
        attention over each row's real tokens, a shared prefix's once; the projection at the positions computed;
        LoRA's enabled adapters, and no gradient of its frozen weights."""
        if self.flop_shape is not None:
            pairs = sum(shared_prefix_pairs(b.prefix_len, [len(datums[i]) for i in b.indices]) for b in bundles)
            self.flops += forward_flops(self.flop_shape, tokens=batch.input_ids.numel(), attention_pairs=pairs,
                                        projected=batch.positions.numel(), backward=backward,
                                        adapter_params=self.adapter_params if adapters_enabled(self.model) else 0,
                                        weights_trained=not self.lora)

    def _forward(self, batch: PaddedBatch, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """(b, T) logprobs (and entropies) at `batch.positions`, 0 elsewhere; differentiable if grad is on."""
        lm_head = self.model.get_output_embeddings()
        attention_mask, pieces = batch.attention_mask, {}
        if batch.sequence_ids is not None:
            attention_mask = shared_prefix_mask(batch.sequence_ids, batch.segment_ids, self.prefix_sharing.attention)
            # Compiled layers would guard on (and recompile for) every plan's shapes: they take the dense mask.
            if (self.attention_by_pieces and self.prefix_sharing.attention == CPU_ATTENTION
                    and self.compiled_layers is None):
                plan = plan_pieces(batch.pieces, batch.input_ids.numel())
                if plan.pay(*batch.input_ids.shape):
                    pieces[PIECES] = plan.to(self.device)
        with autocast(self.precision, self.device):
            hidden_BTH = self.model.get_decoder()(
                input_ids=batch.input_ids,
                attention_mask=attention_mask,
                position_ids=batch.position_ids,
                use_cache=False,
                **pieces,
            ).last_hidden_state
            hidden_NH = hidden_BTH.flatten(0, 1).index_select(0, batch.hidden_index)
            targets_N = batch.target_ids.flatten().index_select(0, batch.positions)
            logprobs_N, entropy_N = token_logprobs(
                lm_head, hidden_NH, targets_N, temperature,
                chunk_tokens=self.cfg.logprob_chunk_tokens, with_entropy=with_entropy,
            )
        logprobs_BT = scatter_to_grid(logprobs_N, batch.positions, batch.shape)
        entropy_BT = scatter_to_grid(entropy_N, batch.positions, batch.shape) if with_entropy else None
        return logprobs_BT, entropy_BT

    @cpu_share.trainer_compute
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
        for bundles in self._microbatches(datums)[0]:
            if bundles is None:
                self._filler_pass(backward=False)
                continue
            indices = [index for bundle in bundles for index in bundle.indices]
            batch = collate(datums, bundles, {}, trained_only=False, packed=self.cfg.pack_sequences).to(self.device)
            logprobs_BT, entropy_BT = self._model_forward(batch, temperature, with_entropy)
            self._count_flops(datums, bundles, batch, backward=False)
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

    @cpu_share.trainer_compute
    def forward_backward(
        self,
        datums: list[Datum],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        extras: dict[str, list[Tensor | list[float]]] | None = None,
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ) -> dict[str, float]:
        """Accumulate the gradient of `loss_fn` summed over length-bucketed micro-batches.

        `loss_fn(logprobs, mb)` gets (b, T) logprobs with grad, at `temperature`, and must
        normalise by `mb.num_tokens_total` or `mb.num_seqs_total` so that the micro-batch
        losses sum to the minibatch loss. Logprobs are computed only where `mb.weights` is
        non-zero and are 0 elsewhere (context and padding): no loss can use the rest.
        Gradients accumulate across calls until `optim_step()`. With `with_entropy`, the
        per-token entropy of the same distribution is in `mb.extras["entropy"]`: detached, or with
        its gradient when `entropy_grad` (an entropy bonus; it keeps the entropy's graph alive until
        the micro-batch's backward, so it costs memory only when asked for).

        Returns "loss" (the summed loss) and each metric of `loss_fn`: names ending in
        "_min"/"_max" take the min/max over micro-batches, others the mean weighted by each
        micro-batch's sum of weights. Also "tokens_computed": the tokens the call ran through the
        model (every rank's), after prefix sharing and with padding, against Σ len(datum).
        """
        self._require_trainable("forward_backward")
        check_datums(datums)
        check_temperature(temperature)
        extras = extras or {}
        check_extras(extras, datums)
        self.model.train()
        num_tokens_total = float(sum(sum(d.weights) for d in datums))
        totals = MetricTotals()
        plan, tokens_computed = self._microbatches(datums)
        for number, bundles in enumerate(plan):
            if self._sharded_root is not None:
                # FSDP2 reduces the gradients once, after the last backward, not after each one.
                self._sharded_root.set_requires_gradient_sync(number == len(plan) - 1)
            if bundles is None:
                self._filler_pass(backward=True)
                continue
            indices = [index for bundle in bundles for index in bundle.indices]
            batch = collate(datums, bundles, extras, trained_only=True, packed=self.cfg.pack_sequences)
            batch = batch.to(self.device)
            if self._sharded_root is not None and batch.positions.numel() == 0:
                # Nothing to train (its loss would have no graph, so this rank alone would skip a
                # backward and FSDP2's gradient reduction); its metrics are left out.
                self._filler_pass(backward=True)
                continue
            logprobs_BT, entropy_BT = self._model_forward(batch, temperature, with_entropy=with_entropy)
            if with_entropy:
                batch.extras["entropy"] = entropy_BT if entropy_grad else entropy_BT.detach()
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
            self._count_flops(datums, bundles, batch, backward=loss.requires_grad)
            micro_weight = float(sum(sum(datums[i].weights) for i in indices))
            # If nothing in the call is weighted, average micro-batches equally instead of 0/0.
            totals.add(loss, metrics, micro_weight if num_tokens_total > 0 else 1.0)
        return totals.reduce() | {"tokens_computed": float(tokens_computed)}

    @torch.no_grad()
    def divide_grads(self, denominator: float) -> None:
        """Divide the gradient accumulated so far on every trainable parameter by `denominator`, in place: a
        sum accumulated over several `forward_backward` calls becomes a mean. Under FSDP2 each rank divides its
        own shards (a DTensor's gradient); with LoRA only the adapters carry gradients."""
        self._require_trainable("divide_grads")
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(denominator)

    @cpu_share.trainer_compute
    def optim_step(self) -> dict[str, float]:
        """Clip and apply the accumulated gradient, or skip the step; then zero the gradient.

        A step is skipped (counted in `skipped_steps`, the LR schedule not advanced, a warning logged)
        when the gradient norm is not finite, or when the update is: when it made a trainable weight
        non-finite, or overflowed so that torch refused it. Then the weights and the AdamW state are put
        back bit for bit (`optim.guarded_step`: when the copy to restore them from is taken, and the two
        reads of the weights' max |w|, the first in the gradient norm's host sync). A step from weights
        that are already non-finite raises: no restore could help.

        Under FSDP2 both reads are max-reduced over every rank's shards, as the gradient norm is made
        global, so every rank skips or applies alike.

        Returns "grad_norm" (before clipping), "lr" (of this step) and "skipped" (1.0 or 0.0).
        """
        self._require_trainable("optim_step")
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()  # FSDP2: every rank's shards together, the same on all ranks
        # One host sync for both: the skip decision and the overflow bound need them on the CPU.
        grad_norm_value, weight_max = torch.stack([grad_norm.float(), max_abs(params).to(grad_norm.device)]).tolist()
        if not math.isfinite(grad_norm_value):
            return self._skip_step(f"gradient norm is {grad_norm_value}", grad_norm_value, lr)
        if not math.isfinite(weight_max):
            raise RuntimeError(f"optimizer step {self.step}: the trainable weights are already non-finite "
                               "(loaded or modified so); no step can make them finite again")
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, grad_norm)
        if (undone := guarded_step(self.optimizer, params, weight_max, self.step)) is not None:
            return self._skip_step(f"{undone}, although the gradient norm {grad_norm_value:g} was finite; "
                                   "weights and AdamW state restored", grad_norm_value, lr)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"grad_norm": grad_norm_value, "lr": lr, "skipped": 0.0}

    def _skip_step(self, reason: str, grad_norm: float, lr: float) -> dict[str, float]:
        self.skipped_steps += 1
        self.last_skip_reason = reason
        self.optimizer.zero_grad(set_to_none=True)
        logger.warning("skipped optimizer step %d: %s (%d steps skipped so far)", self.step, reason, self.skipped_steps)
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0}

    def _require_trainable(self, method: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"{method}() called on a reference trainer (trainable=False)")

    # ---- export -----------------------------------------------------------------------

    def state_dict_for_inference(self, adapter_only: bool = False) -> dict[str, Tensor]:
        """The live weights under Hugging Face names, detached and not copied.

        With LoRA: the base model's names, adapters merged in (new tensors for the adapted
        layers, the live ones elsewhere), the adapter itself as `.adapter`; with `adapter_only` (for a
        deployment whose sync sends only that, `WeightSync.adapter_only`) just the adapter, merging nothing.
        Under torchrun a collective (every rank calls it): the full weights gathered onto rank 0's
        CPU; the other ranks get {}.
        """
        if self.lora and adapter_only and self._sharded_root is None:
            return adapter_state(self.model)
        if self.lora:
            merged = merged_state_dict(self.model)
            return merged if self._sharded_root is None else gather_to_main(merged)
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
        return unsharded_copy(self.model.get_base_model() if self.lora else self.model, state, self.device)

    def save_hf(self, path: str | Path, tokenizer=None) -> None:
        """Write a Hugging Face directory (config + safetensors, and the tokenizer if given).

        With LoRA the directory holds the merged model (loadable without peft), written from a
        temporary merged copy. Under torchrun every rank calls it and rank 0 writes. The directory is
        replaced as a whole (`atomic_dir`): a kill mid-export leaves the earlier export, never a mix.
        """
        if self._sharded_root is not None:
            exported = self.model_for_inference()  # a collective: every rank gathers, rank 0 writes
            if exported is None:
                return
        else:
            exported = standalone_copy(self.model) if self.lora else self.model
        with replaced_directory(path) as staging:
            exported.save_pretrained(staging)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)

    def adapter_disabled_reference(self) -> AdapterDisabledReference:
        """The KL reference of a LoRA policy: this trainer's module with its adapters disabled."""
        if not self.lora:
            raise RuntimeError("adapter_disabled_reference() needs a LoRA trainer (cfg.lora_rank > 0)")
        return AdapterDisabledReference(self)


Reference = Trainer | AdapterDisabledReference
"""What computes reference logprobs: a frozen `Trainer`, or a LoRA policy's base model."""
