"""Every `auto` of a stage's section resolved in one place, as the stage starts and before any model
loads; each resolved value reported as a run param (`auto.<field>`, beside the section's own, which
keeps `auto`):

    precision                        bf16-mixed on a CUDA GPU with bf16, else fp32 (every stage)
    sharded_sampling, micro-batches  the largest that fit the device (`stages.memory.plan`; ppo, reward, dpo)
    micro_batch_tokens (ppo)         micro_batch_size (or the minibatch) x the longest sequence
    critic.freeze_policy_iterations  a tenth of the run for a value head that starts untrained (ppo)

Resolved as the config is read, so the run's params hold them already: PPO's `samples_per_prompt`,
`critic` and `kl.init_coef` (`rlhf.sections.ppo`). Two are decided by the loaded models themselves and
are reported the same way as they load (`stages.ppo.build_learner`): whether every model takes packed
passes (`padding_free: auto` stays the per-pass choice among those that do) and whether compiling pays
(`compile`). One is decided by the run's first batch: PPO's `old_logprobs` (`stages.rl.old_logprobs`,
reported as the run's `rlhf.old_logprobs` tag)."""

from __future__ import annotations

from typing import Any

from rlhf.config import with_overrides
from rlhf.sections.base import StageName
from stages.common.reporting import Reporting
from stages.memory.phases import Counts
from stages.memory.plan import with_micro_batches
from stages.runtime.models import resolve_precision


def resolved(stage: StageName, section, counts: Counts, locations: tuple[str, str | None],
             reporting: Reporting) -> Any:
    """`section` with every `auto` of `stage` resolved (see the module), the models' shapes read from
    `locations` (the policy's, the reward model's or None); what was resolved to `reporting.params`."""
    policy, reward = locations
    section = with_micro_batches(stage, section, counts, policy, reward, reporting)
    changes = {}
    if section.precision == "auto":
        changes["precision"] = resolve_precision("auto").name
    if stage == "ppo":
        changes |= _ppo_autos(section.model_copy(update=changes))
    if changes:
        reporting.params({f"auto.{name}": value for name, value in changes.items()})
    return with_overrides(section, changes) if changes else section


def _ppo_autos(section) -> dict[str, Any]:
    """PPO's own `auto`s, on a section whose precision and micro-batch sizes are resolved."""
    changes: dict[str, Any] = {}
    if section.micro_batch_tokens == "auto":  # the positions `micro_batch_size` rows of the longest sequences take
        minibatch = section.rollout_batch_size // (section.num_minibatches * section.launch.num_processes)
        changes["micro_batch_tokens"] = (section.micro_batch_size or minibatch) * (
            section.max_prompt_length + section.response_tokens)
    if section.critic is not None and section.critic.freeze_policy_iterations == "auto":
        changes["critic.freeze_policy_iterations"] = section.freeze_policy_iterations
    return changes


def probed(section, models) -> dict[str, Any]:
    """The two `auto`s the loaded models decide, as `resolved` reports the others: whether the passes may
    pack (`padding_free`: the probe refused it, false; else still chosen per pass) and whether they are
    compiled (`compile`)."""
    found = {}
    if section.padding_free == "auto":
        found["auto.padding_free"] = "auto (each pass packed where it saves a tenth)" if models.packs else False
    if section.compile == "auto":
        found["auto.compile"] = models.compiler.enabled
    return found
