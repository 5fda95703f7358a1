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


class RecoverableRolloutError(TrainingError):
    """Raise from a rollout function to drop this one draw (counted, feeds the circuit breaker)."""


class DeploymentError(TrainingError, RuntimeError):
    """The inference deployment failed in a way retries cannot fix."""


class RecoverableDeploymentError(RecoverableRolloutError, ConnectionError):
    """The deployment could not be reached or answered 5xx after the retry budget."""


class ModelLoadError(TrainingError, RuntimeError):
    """A model or tokenizer could not be loaded (missing package, bad path)."""


class CircuitBreakerError(TrainingError, RuntimeError):
    """Rollouts keep failing: the run stops instead of training on nothing."""


class EvaluationTimeoutError(TrainingError, TimeoutError):
    """`evaluation_fn` did not return within `eval_timeout_s`."""
