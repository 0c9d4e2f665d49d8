"""The demo's tool world written as a verifiers (0.4) environment: `rlhf serve-env --kind verifiers
--module tools_world --path examples/verifiers` serves it (configs/tools-served.yaml trains on it).

Each task is a prompt record of the demo world (`messages` and `liked`, the adjectives its user
likes); the shared `preferences` tool tells them, read from the rollout's state; the task's rewards
are the world's two rules (`rlhf.demo.rewards`, as `configs/tools.yaml` weighs them in process). By
default it has no dataset of its own: the trainer's prompts are its tasks, sent with each reset; with
`--config '{"taskset": {"prompts": "<world>/prompts.jsonl"}}'` that file's records are its tasks.
"""

from tools_world.taskset import ToolsWorld

__all__ = ["ToolsWorld"]
