"""The config's sections, field by field: what every section is built from (`base`), the RL stage's
(`ppo`), its reward and teacher (`reward_terms`) and its environments (`environment`). `rlhf.config` assembles
them into the pipeline's config."""

import rlhf  # noqa: F401  (the run's CPU numerics, applied before torch loads: rlhf/numerics.py)
