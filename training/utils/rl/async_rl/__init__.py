"""The async loop's moving parts (DESIGN.md §4): gate, producer, coordinator, trainer thread.

- `gate.OffPolicyGate`: the admission arithmetic of §4.2 (plain bookkeeping, no clock).
- `source.DurableRowSource`: dataset rows in cursor order; rows durable only when safe.
- `producer.RolloutProducer`: the asyncio task that admits rows, runs draws, settles groups.
- `coordinator.BatchCoordinator`: accepted groups → batches → chunks for the trainer.
- `worker.TrainerWorker`: the one thread all model work runs on; under torchrun it also
  announces each call to the other ranks, which make it too.
- `errors`: circuit breaker and stall error; `telemetry`: version offsets and `perf/*`.
"""

from training.utils.rl.async_rl.coordinator import AcceptedRow, Batch, BatchCoordinator, Chunk, balanced_chunk_targets
from training.utils.rl.async_rl.errors import CircuitBreaker, RolloutStallError
from training.utils.rl.async_rl.gate import OffPolicyGate
from training.utils.rl.async_rl.producer import RolloutProducer, make_draw_fn
from training.utils.rl.async_rl.source import DurableRowSource
from training.utils.rl.async_rl.worker import TrainerWorker

__all__ = [
    "AcceptedRow",
    "Batch",
    "BatchCoordinator",
    "Chunk",
    "CircuitBreaker",
    "DurableRowSource",
    "OffPolicyGate",
    "RolloutProducer",
    "RolloutStallError",
    "TrainerWorker",
    "balanced_chunk_targets",
    "make_draw_fn",
]
