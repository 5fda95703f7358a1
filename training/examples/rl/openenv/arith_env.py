"""A two-step OpenEnv environment, written as openenv-core's users write one: two sums of single digits in a row.

`reset(seed=...)` poses the first sum; each `step` scores the reply and poses the next, until both are answered.
A reply scores 1 when it is the number itself (`"7"`, `"7."`); a reply that only contains it scores the number's
length over the reply's, so a shorter reply scores more; each step's reward is half of that. Served as
`training.examples.rl.openenv.arith_env:app` (`openenv_server` starts it with uvicorn).
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


def score(reply: str, answer: int) -> float:
    text = reply.strip().rstrip(".")
    if re.fullmatch(r"[+-]?0*\d+", text) and int(text) == answer:
        return 1.0
    return len(str(answer)) / len(text) if str(answer) in text else 0.0


class ArithEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.rng, self.answer, self.asked = random.Random(0), 0, 0

    def _question(self) -> str:
        a, b = self.rng.randint(1, 9), self.rng.randint(1, 9)
        self.answer, self.asked = a + b, self.asked + 1
        return f"What is {a} + {b}?"

    def reset(self, seed=None, episode_id=None, **kwargs) -> ArithObservation:
        self.rng, self.asked = random.Random(seed), 0
        return ArithObservation(message=self._question(), reward=0.0)

    def step(self, action: ArithAction, timeout_s=None, **kwargs) -> ArithObservation:
        reward = score(action.message, self.answer) / QUESTIONS
        verdict = "Right." if reward * QUESTIONS == 1.0 else f"It was {self.answer}."
        if self.asked >= QUESTIONS:
            return ArithObservation(message=verdict, done=True, reward=reward)
        return ArithObservation(message=f"{verdict} {self._question()}", reward=reward)

    @property
    def state(self) -> State:
        return State(step_count=self.asked)


# One session per episode in flight: the async recipe holds up to two batches of P·G draws (P=8, G=8, O=1).
app = create_app(ArithEnvironment, ArithAction, ArithObservation, env_name="arith", max_concurrent_envs=256)
