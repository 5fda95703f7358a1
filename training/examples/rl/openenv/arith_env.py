"""A two-step OpenEnv environment, written as openenv-core's users write one: two sums of single digits in a row.

`reset(seed=...)` poses the first sum; each `step` scores the reply and poses the next, until both are answered.
A reply scores 1 when it is the completed equation (`"3 + 4 = 7"`, a trailing period allowed), 0 otherwise; each
step's reward is half of that. Served as `training.examples.rl.openenv.arith_env:app` (`openenv_server` starts it
with uvicorn).
"""

import random
import re

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

QUESTIONS = 2


class ArithAction(Action):
    message: str


class ArithObservation(Observation):
    message: str = ""


def score(reply: str, a: int, b: int) -> float:
    equation = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*=\s*(\d+)\s*\.?\s*", reply)
    return 1.0 if equation and tuple(map(int, equation.groups())) == (a, b, a + b) else 0.0


class ArithEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.rng, self.terms, self.asked = random.Random(0), (0, 0), 0

    def _question(self) -> str:
        a, b = self.rng.randint(1, 9), self.rng.randint(1, 9)
        self.terms, self.asked = (a, b), self.asked + 1
        return f"What is {a} + {b}? Reply with only the completed equation."

    def reset(self, seed=None, episode_id=None, **kwargs) -> ArithObservation:
        self.rng, self.asked = random.Random(seed), 0
        return ArithObservation(message=self._question(), reward=0.0)

    def step(self, action: ArithAction, timeout_s=None, **kwargs) -> ArithObservation:
        a, b = self.terms
        reward = score(action.message, a, b) / QUESTIONS
        verdict = "Right." if reward > 0 else f"It was {a} + {b} = {a + b}."
        if self.asked >= QUESTIONS:
            return ArithObservation(message=verdict, done=True, reward=reward)
        return ArithObservation(message=f"{verdict} {self._question()}", reward=reward)

    @property
    def state(self) -> State:
        return State(step_count=self.asked)


# One session per episode in flight: the async recipe holds up to two batches of P·G draws (P=8, G=8, O=1).
app = create_app(ArithEnvironment, ArithAction, ArithObservation, env_name="arith", max_concurrent_envs=256)
