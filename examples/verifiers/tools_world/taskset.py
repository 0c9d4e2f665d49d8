"""The tasks, their state and their rewards."""

from __future__ import annotations

import json

import verifiers.v1 as vf

from rlhf.demo.rewards import names_the_subject, uses_liked_adjectives
from tools_world.toolset import Preferences, WorldState


class WorldTask(vf.TaskData):
    liked: str = ""
    """The adjectives the prompt's user likes, space-separated: what `preferences` tells."""


class WorldTaskConfig(vf.TaskConfig):
    pass


class Prompt(vf.Task[WorldTask, WorldState, WorldTaskConfig]):
    async def setup(self, trace: vf.Trace, runtime) -> None:
        trace.state.liked = self.data.liked  # what the shared tool server reads for this rollout

    @vf.reward(weight=1.0)
    async def liked(self, task: WorldTask, trace: vf.Trace) -> float:
        return uses_liked_adjectives([self.messages(task)], [trace.last_reply or ""], [task.liked])[0]

    @vf.reward(weight=1.0)
    async def subject(self, task: WorldTask, trace: vf.Trace) -> float:
        value = names_the_subject([self.messages(task)], [trace.last_reply or ""])[0]
        return 0.0 if value is None else value  # no subject to name: no reward, as in process

    @staticmethod
    def messages(task: WorldTask) -> list[dict]:
        prompt = task.prompt if isinstance(task.prompt, list) else [{"role": "user", "content": task.prompt or ""}]
        return [m if isinstance(m, dict) else m.model_dump() for m in prompt]


class ToolsWorldConfig(vf.TasksetConfig):
    task: WorldTaskConfig = WorldTaskConfig()
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    prompts: str | None = None
    """A JSON-lines file of the world's prompt records (`prompt` or `messages`, `liked`): the taskset's tasks,
    what `prompts: {path: "env:"}` trains on; unset, it has none and the trainer's prompts are its tasks."""


class ToolsWorld(vf.Taskset[Prompt, ToolsWorldConfig]):
    def load(self) -> list[Prompt]:
        if self.config.prompts is None:
            return []  # each reset brings its record
        with open(self.config.prompts) as lines:
            records = [json.loads(line) for line in lines if line.strip()]
        return [Prompt(WorldTask(prompt=r.get("messages") or r["prompt"], liked=r["liked"]), self.config.task)
                for r in records]

    @classmethod
    def toolsets(cls, config: ToolsWorldConfig) -> list[vf.Toolset]:
        return [Preferences(config.tools)]  # one server for every rollout: state says whose user it is
