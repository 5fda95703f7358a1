"""The library's error types.

Each also inherits the standard-library type it stands for, so callers that catch
`ValueError` or `TimeoutError` keep working. Keep them picklable: no required
constructor arguments beyond the message (extra attributes set in `__init__` travel in
the exception's `__dict__`, which the default pickling keeps).
"""


class TrainingError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(TrainingError, ValueError):
    """A configuration value or combination is invalid."""


class RolloutContractError(TrainingError, ValueError):
    """A rollout function returned something that breaks the contract (README: What you write).

    This is a user bug: it stops the run before any optimizer step uses the data.
    """


class RolloutCancellationError(TrainingError, RuntimeError):
    """A rollout call did not honour cancellation (it swallowed `CancelledError`); it is abandoned and the run stops."""


class RecoverableRolloutError(TrainingError):
    """Raise from a rollout function to drop this one draw (counted, feeds the circuit breaker)."""


class DeploymentError(TrainingError, RuntimeError):
    """The inference deployment failed in a way retries cannot fix."""


class RecoverableDeploymentError(RecoverableRolloutError, ConnectionError):
    """The deployment could not be reached or answered 5xx after the retry budget."""


class NoReplicaLeftError(DeploymentError):
    """Every replica of a deployment of several servers was taken out of rotation (the message names each and why)."""


class ModelLoadError(TrainingError, RuntimeError):
    """A model or tokenizer could not be loaded (missing package, bad path)."""


class CircuitBreakerError(TrainingError, RuntimeError):
    """Rollouts keep failing: the run stops instead of training on nothing."""


class NothingTrainedError(TrainingError, RuntimeError):
    """A run ended without training a single group: every row was dropped, rejected or filtered."""


class SkippedStepsError(TrainingError, RuntimeError):
    """Too many optimizer steps were skipped for non-finite gradients or updates: the run is not training."""


class EvaluationTimeoutError(TrainingError, TimeoutError):
    """`evaluation_fn` did not return within `eval_timeout_s`."""


class CheckpointError(TrainingError, RuntimeError):
    """A checkpoint cannot be trusted (a file missing, truncated or changed since it was written), so the run
    stops rather than resume from it; the message names the file."""


class RunDirectoryInUseError(TrainingError, RuntimeError):
    """Another process is running on this `log_path` (the message names it); one run per directory."""


class DiskFullError(TrainingError, OSError):
    """The disk filled up while the run wrote a checkpoint (ENOSPC or EDQUOT); the message names where and which
    step. The half-written checkpoint is never used: the run resumes from the one before."""


class EventLoopBlockedError(TrainingError, RuntimeError):
    """The run's event loop did not turn within `event_loop_stall_s`: something on it blocked (the message names the
    task, e.g. a rollout's row and draw, and its stack)."""


def one_line(error: BaseException, limit: int = 300) -> str:
    """`Type: message` of an exception, its first line only (compiler errors run to pages)."""
    text = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
