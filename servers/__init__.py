"""The servers the trainer talks to over HTTP, each a process of its own: the reward model's
(`reward_server`, `rlhf serve-reward`), the environments' (`env_server`, `rlhf serve-env`, with the
verifiers bridge), and who may call them (`auth`). They may import `stages` and the config, never
`flows`; `stages` never imports them (docs/architecture.md)."""

import rlhf  # noqa: F401  (the run's CPU numerics, applied before torch loads: rlhf/numerics.py)
