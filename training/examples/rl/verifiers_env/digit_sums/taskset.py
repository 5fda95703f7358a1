import random
import re

import verifiers.v1 as vf
from digit_sums.tools import DigitSumsToolset

SYSTEM_PROMPT = "Reply with only the completed equation."


class DigitSumsData(vf.TaskData):
    answer: int


class DigitSumsTask(vf.Task[DigitSumsData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and int(numbers[-1]) == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def concise(self, trace: vf.Trace) -> float:
        return 1.0 if 0 < len(trace.last_reply) <= 16 else 0.0


class DigitSumsConfig(vf.TasksetConfig):
    split: str = "train"
    """"train" or "eval": the eval split holds pairs the train split never asks."""
    seed: int = 0
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class DigitSumsTaskset(vf.Taskset[DigitSumsTask, DigitSumsConfig]):
    @classmethod
    def toolsets(cls, config: DigitSumsConfig) -> list[vf.Toolset]:
        """The calculator, one server for every task of the taskset."""
        return [DigitSumsToolset(config.tools)]

    def load(self) -> list[DigitSumsTask]:
        pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
        random.Random(self.config.seed).shuffle(pairs)
        chosen = pairs[:24] if self.config.split == "eval" else pairs[24:]
        return [DigitSumsTask(DigitSumsData(id=f"{self.config.split}-{a}+{b}", system_prompt=SYSTEM_PROMPT,
                                            prompt=f"What is {a} + {b}?", answer=a + b))
                for a, b in chosen]
