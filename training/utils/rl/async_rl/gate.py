"""The off-policy gate (skills/dev/references/rl/async-rl.md §3): how many rows the producer may have outstanding.

Symbols: G draws per row, P rows per batch, B = P·G sample slots per batch,
O = `max_head_offpolicy_versions`, C = `max_concurrency_rollout_sample` (None: no cap),
v = the published version (batches published, resumed ones included).

    staleness_capacity   = (v + O + 1)·B − (accepted_samples + reserved_samples)
    concurrency_capacity = C − in_flight_calls
    admit the next row  iff  min(staleness_capacity, concurrency_capacity) ≥ G

Admission is row-atomic: a row reserves G slots and starts G calls at once. An accepted
row moves its G slots from reserved to accepted (whatever number of its runs survived);
a rejected row just releases them, so it costs no staleness budget. A retry re-runs all
G calls on the row's existing reservation.

`max_batches` caps the window at the end of a run (`max_steps`): no row is admitted
that could only ever land in a batch after the last one.

The gate is plain bookkeeping with no clock and no event loop, so it is tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.utils.errors import ConfigError


@dataclass
class GateSnapshot:
    """The gate's numbers at one moment (producer gauges)."""

    published_version: int
    accepted_samples: int
    reserved_samples: int
    in_flight_calls: int
    staleness_capacity: int
    concurrency_capacity: int | None
    admission_capacity: int


class OffPolicyGate:
    @staticmethod
    def check_concurrency(max_concurrency: int | None, group_size: int) -> None:
        """C ≥ G, the one home of the rule (the config checks it too, so it fails at construction)."""
        if max_concurrency is not None and max_concurrency < group_size:
            raise ConfigError(
                f"max_concurrency_rollout_sample={max_concurrency} is below completions_per_prompt={group_size}: "
                "admission is row-atomic, so no row could ever start"
            )

    def __init__(
        self,
        *,
        group_size: int,
        groups_per_batch: int,
        max_offpolicy_versions: int,
        max_concurrency: int | None = None,
        published_version: int = 0,
        accepted_samples: int = 0,
        max_batches: int | None = None,
    ):
        self.check_concurrency(max_concurrency, group_size)
        self.G = group_size
        self.B = group_size * groups_per_batch
        self.O = max_offpolicy_versions
        self.C = max_concurrency
        self.published_version = published_version
        self.accepted_samples = accepted_samples
        """Samples of accepted rows, counted from the start of the run (resumed batches included)."""
        self.reserved_samples = 0
        self.in_flight_calls = 0
        self.max_batches = max_batches

    # ---- capacities -----------------------------------------------------------------

    @property
    def staleness_capacity(self) -> int:
        window = self.published_version + self.O + 1
        if self.max_batches is not None:
            window = min(window, self.max_batches)
        return window * self.B - (self.accepted_samples + self.reserved_samples)

    @property
    def concurrency_capacity(self) -> int | None:
        return None if self.C is None else self.C - self.in_flight_calls

    @property
    def admission_capacity(self) -> int:
        concurrency = self.concurrency_capacity
        staleness = self.staleness_capacity
        return max(0, staleness if concurrency is None else min(staleness, concurrency))

    def can_admit(self) -> bool:
        return self.admission_capacity >= self.G

    @property
    def window_full(self) -> bool:
        """Every slot up to `max_batches` is accepted: the run needs no more rows."""
        return self.max_batches is not None and self.accepted_samples >= self.max_batches * self.B

    # ---- transitions ------------------------------------------------------------------

    def admit_row(self) -> None:
        """Reserve G slots and count G calls in flight; the caller checked `can_admit()`."""
        if not self.can_admit():
            raise RuntimeError(f"gate: admitting a row without capacity ({self.snapshot()})")
        self.reserved_samples += self.G
        self.in_flight_calls += self.G

    def retry_row(self) -> None:
        """Re-run all G calls of a row on its existing reservation."""
        self.in_flight_calls += self.G

    def call_finished(self) -> None:
        self.in_flight_calls -= 1

    def accept_row(self) -> None:
        self.reserved_samples -= self.G
        self.accepted_samples += self.G

    def reject_row(self) -> None:
        self.reserved_samples -= self.G

    def publish(self, version: int) -> None:
        if version < self.published_version:
            raise RuntimeError(f"gate: version {version} published after {self.published_version}")
        self.published_version = version

    def snapshot(self) -> GateSnapshot:
        return GateSnapshot(
            published_version=self.published_version,
            accepted_samples=self.accepted_samples,
            reserved_samples=self.reserved_samples,
            in_flight_calls=self.in_flight_calls,
            staleness_capacity=self.staleness_capacity,
            concurrency_capacity=self.concurrency_capacity,
            admission_capacity=self.admission_capacity,
        )
