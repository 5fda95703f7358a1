"""A second verifiers 0.4.0 environment, in the style of that package's own single-turn examples and unlike
`vf_arith`: a chat-message prompt under a system prompt, no tools, one reward function returning several named
scores (a mapping) and a metric. The adapter has never been told about it."""

import verifiers.v1 as vf

WORDS = ["cat", "lamp", "river", "stone", "cloud", "apple", "tiger", "bread"]


class ReverseData(vf.TaskData):
    word: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=2.0)
    async def spelling(self, trace: vf.Trace) -> dict[str, float]:
        reply = trace.last_reply.lower()
        target = self.data.word[::-1]
        return {"exact": float(reply == target), "starts_right": float(reply[:1] == target[:1])}

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ReverseConfig(vf.TasksetConfig):
    pass


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        for word in WORDS:
            yield ReverseTask(ReverseData(
                id=f"reverse-{word}", system_prompt="Reply with one word only.",
                prompt=[vf.UserMessage(content=f"Spell '{word}' backwards.")], word=word))


__all__ = ["ReverseTaskset"]
