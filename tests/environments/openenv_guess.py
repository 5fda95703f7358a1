"""A multi-step OpenEnv environment written as openenv-core's users write one: guess a digit in three tries.

Served by `openenv_server("openenv_guess:app")` in the checks (tests/environments/check_openenv.py).
`GUESS_BEHAVIOUR` makes it a bad environment: `raises` (step raises), `nan` (a NaN reward), `hangs` (step never
returns), `empty` (reset says the episode is already done).
"""

import math
import os
import random
import re
import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

TRIES = 3


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    message: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.behaviour = os.environ.get("GUESS_BEHAVIOUR", "")
        self.secret, self.tries = 0, 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.secret, self.tries = random.Random(seed).randint(0, 9), 0
        return GuessObservation(message="Guess my number (0-9). Reply with one digit.",
                                done=self.behaviour == "empty", reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if self.behaviour == "raises":
            raise RuntimeError("the game's state file is missing")
        if self.behaviour == "hangs":
            time.sleep(3600)
        self.tries += 1
        found = re.search(r"\d", action.message)
        guess = int(found.group()) if found else None
        if guess == self.secret:
            return GuessObservation(message="Right.", done=True, reward=math.nan if self.behaviour == "nan" else 1.0)
        hint = "No digit in your reply." if guess is None else ("Higher." if guess < self.secret else "Lower.")
        return GuessObservation(message=f"{hint} Guess again.", done=self.tries >= TRIES,
                                reward=math.nan if self.behaviour == "nan" else 0.0)

    @property
    def state(self) -> State:
        return State(step_count=self.tries)


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=16)
