"""A verifiers 0.4.0 environment written the way that package's users write one (its `vf-init --add-tool`
layout): a taskset of addition questions, a task with two weighted reward functions, and a tool server.

`behaviour` (the taskset config, `ARITH_BEHAVIOUR` in the environment) turns it into one of the bad environments
the tier checks: "raises" (a reward function raises), "nan" (a reward is NaN), "hangs" (the task's setup never
returns), "silent" (the task opens with an empty conversation the chat loop refuses)."""

import asyncio
import os

import verifiers.v1 as vf

from vf_arith.tools import ArithToolset


class ArithData(vf.TaskData):
    answer: int


class ArithTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ArithTask(vf.Task[ArithData, vf.State, ArithTaskConfig]):
    @classmethod
    def toolsets(cls, config: ArithTaskConfig) -> list[vf.Toolset]:
        return [ArithToolset(config.tools)]

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        if os.environ.get("ARITH_BEHAVIOUR") == "hangs":
            await asyncio.sleep(3600)

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        behaviour = os.environ.get("ARITH_BEHAVIOUR")
        if behaviour == "raises":
            raise RuntimeError("the grader crashed")
        if behaviour == "nan":
            return float("nan")
        return 1.0 if str(self.data.answer) in trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if 0 < len(trace.last_reply) <= 12 else 0.0


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 16
    task: ArithTaskConfig = ArithTaskConfig()


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        empty = os.environ.get("ARITH_BEHAVIOUR") == "silent"
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = i % 7 + 1, i % 5 + 2
            data = ArithData(id=f"add-{i}", prompt=None if empty else f"What is {a} + {b}?", answer=a + b)
            tasks.append(ArithTask(data, self.config.task))
        return tasks


__all__ = ["ArithTaskset"]
