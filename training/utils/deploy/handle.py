"""What every deployment hands the recipes, embedded or external: `base_url`, `api_key`, `model_name`,
`sampler`, `weight_sync`, `version`, `context_tokens`, `syncs_at_start`, `engine_stats()`, `memory_stats()`,
`step_metrics()`, `run_summary()` and `close()`, and the temporary weight directory it may own."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from training.utils.deploy.sampler import Sampler
from training.utils.deploy.weight_dir import OwnedWeightDir
from training.utils.deploy.weight_sync import WeightSync


@dataclass(kw_only=True)
class DeploymentHandle:
    base_url: str
    model_name: str
    sampler: Sampler
    weight_sync: WeightSync
    api_key: str | None = field(default=None, repr=False)
    """The bearer token the server requires (the embedded server's per-run secret unless
    `deployment.api_key` is set); for clients of the library's own making, never an agent's."""
    owned_weight_dir: OwnedWeightDir | None = field(default=None, repr=False)
    """A directory for disk-synced weights that the deployment created, removed at `close` (`weight_dir.py`)."""
    context_tokens: int | None = None
    """The longest context (prompt + completion tokens) the deployment serves; None when it does not say."""
    syncs_at_start: bool = False
    """Whether a fresh run pushes the trainer's step-0 weights (as version 0) before its first rollout or
    evaluation: an external server with a weight sync may hold any weights, e.g. what an earlier run left in
    it; the embedded engine starts from the trainer's."""

    @property
    def version(self) -> int:
        """Weight version served now (the last successful sync)."""
        return self.weight_sync.version

    def engine_stats(self) -> dict[str, float]:
        """The engine's cumulative counters (`Engine.stats`: `prompt_tokens`, `prefill_tokens`,
        `prefix_cache_hit_tokens`, `prefill_time_s`, `decode_time_s`, ...); {} where the deployment reports none."""
        return {}

    def memory_stats(self) -> dict[str, int]:
        """Bytes the embedded engine holds (`Engine.memory_stats`: `weights`, `kv_cache_reserved` and
        `kv_cache_used` at their most since the previous call, `prefix_cache`); {} where the deployment reports
        none (an external server's memory is its own)."""
        return {}

    async def step_metrics(self) -> dict[str, float]:
        """Metrics of the deployment itself at the end of a step (several replicas: `deploy/replica/<name>/*`); {}
        where it reports none."""
        return {}

    def run_summary(self) -> dict:
        """What the run's summary says of the deployment (several replicas: which were taken out, for how long and
        why); {} where there is nothing to say."""
        return {}

    async def close(self, timeout: float = 30.0) -> None:
        """Shut down in dependency order, each step even if an earlier one failed: the clients
        first, so nothing new reaches the server; then the server, if we run it; then the weight
        files the deployment created itself."""
        try:
            await self.sampler.close()
            await self.weight_sync.close()
        finally:
            try:
                await self._stop_server(timeout)
            finally:
                if self.owned_weight_dir is not None:
                    self.owned_weight_dir.remove()

    async def _stop_server(self, timeout: float) -> None:
        """Nothing by default: an external server keeps running."""


def weight_dir_for(weight_sync: str,
                   directory: str | Path | None) -> tuple[str | Path | None, OwnedWeightDir | None]:
    """(where disk syncs write, the private directory created for them when none was given)."""
    if weight_sync == "disk" and directory is None:
        own_dir = OwnedWeightDir()
        return own_dir.path, own_dir
    return directory, None
