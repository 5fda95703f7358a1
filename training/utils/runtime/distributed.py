"""Multi-process training under `torchrun`: process groups, FSDP2 sharding, object collectives.

Launched as `torchrun --nproc_per_node=N ...`, every process holds a shard of the policy
(`torch.distributed.fsdp.fully_shard`: each decoder layer, then the rest) and trains its share
of every batch, on its own GPU with NCCL or on the CPU with gloo. Rank 0 also runs the
deployment, the rollouts and the logging, and announces each trainer call to the other ranks
(`TrainerWorker`), which make the same calls in the same order. Without torchrun there is one
process, every helper here is a no-op, and the single-process code path is unchanged.

Two process groups:
- the default group (NCCL on GPUs, gloo on CPUs) carries the training collectives: FSDP2's
  all-gathers and gradient reduce-scatters, gathered state dicts, DCP checkpoints, metrics.
  Its timeout (`TrainerConfig.distributed_timeout_s`) bounds each of them, so a rank that
  died or fell out of step fails the others with an error instead of hanging them;
- a gloo "control" group carries rank 0's announcements. The other ranks wait on it while
  rank 0 rolls out, which may legitimately take long (rank 0 bounds its own waits with the
  rollout, stall and weight-sync timeouts), so it waits up to `CONTROL_TIMEOUT_S`; a rank
  that exits closes its connections, which fails a peer waiting on it at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from training.utils.errors import ConfigError

CONTROL_TIMEOUT_S = 24 * 3600.0
"""Longest a rank other than 0 waits for rank 0's next trainer call."""

_control_group: dist.ProcessGroup | None = None


def launched_by_torchrun() -> bool:
    """Whether this process is one of several started by torchrun (it sets WORLD_SIZE, RANK, ...)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(timeout_s: float = 1800.0) -> None:
    """Join the job torchrun started: NCCL on this process's GPU (LOCAL_RANK) if CUDA is available, else gloo."""
    global _control_group
    timeout = timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        # Sets the current device too, so `torch.device("cuda")` means this process's GPU.
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    _control_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))


@contextlib.contextmanager
def distributed_session(timeout_s: float = 1800.0) -> Iterator[None]:
    """Hold the process group for a run launched by torchrun; a no-op in a single process, or when
    the caller already initialised the group itself.

    The group is destroyed only after a clean run: after an error a peer may still be inside a
    collective, and the process exits anyway (torchrun then stops the other ranks).
    """
    if not launched_by_torchrun() or dist.is_initialized():
        yield
        return
    init_distributed(timeout_s)
    yield
    shutdown()


def shutdown() -> None:
    global _control_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _control_group = None


def is_distributed() -> bool:
    """More than one process trains together."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Rank 0: the process that runs the deployment, the rollouts, the logging and the exports."""
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: Any = None, *, control: bool = False) -> Any:
    """Rank 0's `obj` on every rank (pickled); returns `obj` itself in a single process.

    `control=True` sends it over the control group, whose long timeout suits waiting for rank 0's
    next trainer call; everything else uses the default group and its collective timeout.
    """
    if not is_distributed():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0, group=_control_group if control else None)
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (pickled); `[obj]` in a single process."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def shard_model(model: torch.nn.Module, root: torch.nn.Module, *, bf16_compute: bool = False) -> None:
    """FSDP2 over the default group: each decoder layer of the Hugging Face `model` is its own
    group (gathered just before it runs, freed just after), then `root`, a module that contains
    `model`, takes the rest (embeddings, final norm, lm_head, tied weights included).

    `bf16_compute` (the trainer's `bf16-autocast`): the float32 shards are gathered as bfloat16,
    half the bytes, and gradients are reduced in float32 into float32 shards.

    Gradients are summed across ranks, not averaged: each rank's loss is already normalised by
    the token (or sequence) count of the whole batch, so the per-rank gradients add up to the
    single-process gradient of that batch.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(
            f"cannot shard {type(model).__name__} with FSDP2: its decoder has no `layers` ModuleList "
            "(the transformer blocks); train it in one process"
        )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_compute \
        else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM reductions: gloo has no PREMUL_SUM, which a divide factor would otherwise use.
            module.set_force_sum_reduction_for_comms(True)


def rank_shares(lengths: list[int], world: int) -> list[list[int]]:
    """Split datum indices across `world` ranks with balanced token counts: longest first, dealt
    round-robin. Every rank computes the same split from the same lengths, without communicating."""
    longest_first = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [longest_first[r::world] for r in range(world)]
