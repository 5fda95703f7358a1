"""Environments from the packages users already have, as what `main()` takes.

    from training import from_reasoning_gym
    main(cfg, **from_reasoning_gym(["chain_sum", "leg_counting"]))

(`from_reasoning_gym`, `from_openenv`, `openenv_server`, `from_verifiers` and `BadEnvironmentError` are public names of
`training`; this package is their home.)

Each adapter returns `rollout_fn_factory`, `rows` (the training rows) and `evaluation_fn` (the held-out rows,
through `rollout_evaluation`). Each package is an optional extra (`pip install -e ".[reasoning-gym]"`, ...),
imported only when its adapter is called. docs/environments.md says what each records and what is not supported.
"""

from training.environments.episodes import BadEnvironmentError, EnvironmentDrop
from training.environments.openenv import from_openenv, openenv_server
from training.environments.reasoning_gym import from_reasoning_gym
from training.environments.verifiers import from_verifiers

__all__ = ["BadEnvironmentError", "EnvironmentDrop", "from_openenv", "from_reasoning_gym", "from_verifiers",
           "openenv_server"]
