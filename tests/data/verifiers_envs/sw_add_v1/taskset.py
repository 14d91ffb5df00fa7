import re

import verifiers.v1 as vf

from sw_add_v1.tools import AddToolset


class AddData(vf.TaskData):
    a: int = 0
    b: int = 0


class AddTaskConfig(vf.TaskConfig):
    # What the rewards return: "number" (the default); "text" or "nan" make a broken environment for the tests,
    # "exit" a reward that ends its process (os._exit(1)), "block" one that blocks its event loop (time.sleep).
    reward_kind: str = "number"
    # Seconds the task's setup sleeps: a hanging environment for the tests.
    setup_sleep_s: float = 0.0
    # Raise in the task's setup: an environment that fails mid-episode.
    setup_raises: bool = False


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    async def setup(self, trace, runtime) -> None:
        if self.config.setup_raises:
            raise RuntimeError("the environment's setup failed on purpose")
        if self.config.setup_sleep_s:
            import asyncio

            await asyncio.sleep(self.config.setup_sleep_s)

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.config.reward_kind == "text":
            return "not a number"  # type: ignore[return-value]
        if self.config.reward_kind == "nan":
            return float("nan")
        if self.config.reward_kind == "exit":
            import os

            os._exit(1)
        if self.config.reward_kind == "block":
            import time

            time.sleep(3600)
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return 1.0 if numbers and int(numbers[-1]) == self.data.a + self.data.b else 0.0

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return 1.0 if trace.tool_messages else 0.0

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 8
    task: AddTaskConfig = AddTaskConfig()
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    @classmethod
    def toolsets(cls, config: AddConfig) -> list[vf.Toolset]:
        return [AddToolset(config.tools)]

    def load(self) -> list[AddTask]:
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = 3 + i, 4 + 2 * i
            prompt = f"What is {a} + {b}? You may use the add tool. Answer with the number."
            tasks.append(AddTask(AddData(prompt=prompt, a=a, b=b, id=f"add-{i}"), self.config.task))
        return tasks
