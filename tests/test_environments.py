"""The `environments` tier: each adapter of `training.environments` against its real package from PyPI.

Each package is installed once into a cached venv (tests/environment_packages.py) and its checks
(tests/environments/check_*.py) run in a pytest process of that venv. `-m environments` runs the tier; the default
`-m "not slow"` run leaves it out (docs/environments.md says why CI does not run it).
"""

import pytest

from environment_packages import run_checks

pytestmark = [pytest.mark.environments, pytest.mark.slow]


def test_reasoning_gym():
    run_checks("reasoning-gym", "check_reasoning_gym.py")


def test_openenv():
    run_checks("openenv-core", "check_openenv.py")


def test_verifiers():
    run_checks("verifiers", "check_verifiers.py")
