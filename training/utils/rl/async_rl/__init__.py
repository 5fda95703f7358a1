"""The async loop's moving parts (skills/dev/references/rl/async-rl.md): gate, producer, coordinator.

- `gate.OffPolicyGate`: the admission arithmetic of async-rl.md §3 (plain bookkeeping, no clock).
- `producer.RolloutProducer`: the asyncio task that admits rows, runs draws, settles groups.
- `coordinator.BatchCoordinator`: accepted groups → batches → chunks for the trainer.
- `errors`: circuit breaker and stall error.

Rows come from `training.utils.rl.dataset.DurableRowSource` and all model work runs on
`training.utils.rl.worker.TrainerWorker`, both shared with the synchronous recipe.
"""

from training.utils.rl.async_rl.coordinator import AcceptedRow, Batch, BatchCoordinator, Chunk, balanced_chunk_targets
from training.utils.rl.async_rl.errors import CircuitBreaker, RolloutStallError
from training.utils.rl.async_rl.gate import OffPolicyGate
from training.utils.rl.async_rl.producer import RolloutProducer

__all__ = [
    "AcceptedRow",
    "Batch",
    "BatchCoordinator",
    "Chunk",
    "CircuitBreaker",
    "OffPolicyGate",
    "RolloutProducer",
    "RolloutStallError",
    "balanced_chunk_targets",
]
