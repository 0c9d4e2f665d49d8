"""On-policy distillation's teacher as one component (`ppo.teacher`): a frozen model of the policy's
tokenizer that marks every token the policy samples, and everything that follows from its marks:

    marks          its log-probs of the sampled tokens (with `top_k`, its k most likely tokens and
                   the log-probs of those k and of all the others together), from one pass over
                   each rollout                                                  (`stages.rl.rollout`)
    dense_rewards  w * -KL_t(policy || teacher) on every token, the estimator's reward  (`stages.rl.advantages`)
    with_loss      with `top_k`, instead: w * the KL over the k + 1 bins, through the logits (`stages.rl.update`)
    figures        `rollout/teacher_kl` (per sequence) and `_per_token`; the rollouts table's column
    evaluation     the column of `eval/teacher_kl`: KL(policy || teacher) (k1) per held-out response

`NoTeacher` is the stand-in where none is configured: it marks nothing (`Marks`, a batch without
fields) and adds no reward, loss or figure, so nothing outside this module asks whether a teacher is
there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from rlhf.sections.ppo import PPOConfig
from rlhf.sections.reward_terms import TeacherConfig
from stages.common.batches import Sequences, response_columns
from stages.common.errors import StageUserError
from stages.common.reporting import timed
from stages.common.tensors import binned, log_probs, masked_mean, picked, top_bins
from stages.math.ppo_math import binned_kl, kl_estimate, teacher_rewards
from stages.runtime.forward import forward_response
from stages.runtime.holding import Holding
from stages.runtime.models import disable_dropout, frozen_dtype_of, load_causal_lm, load_tokenizer, resolve_precision
from stages.runtime.packing import Passes


@dataclass(frozen=True)
class Marks:
    """What a teacher marked on a batch's sampled tokens: nothing, without a teacher."""


@dataclass(frozen=True, kw_only=True)
class TeacherMarks(Marks):
    """The teacher's marks on a batch's sampled tokens."""

    logprobs: torch.Tensor = response_columns()
    """(B, T) its log-probs of the sampled tokens, masked to the model's own (`trainable`)."""
    top: torch.Tensor = response_columns(pad=0)
    """(B, T, k) with `top_k`: its k most likely tokens at each position; k = 0 without."""
    bins: torch.Tensor = response_columns()
    """(B, T, k + 1) with `top_k`: its log-probs of those k and of all the others together; k = 0 without."""


Aggregate = Callable[[torch.Tensor], torch.Tensor]
"""A per-token loss term -> the minibatch's loss, as the policy loss aggregates (`ppo_math.aggregate`)."""


class NoTeacher:
    """No distillation: no marks, no reward, no loss, no figures."""

    def marks(self, sequences: Sequences, trainable: torch.Tensor, temperature: float, passes: Passes,
              timings: dict[str, float]) -> Marks:
        return Marks()

    def dense_rewards(self, logprobs: torch.Tensor, marks: Marks, trainable: torch.Tensor) -> None:
        return None

    def with_loss(self, loss: torch.Tensor, logps: torch.Tensor, marks: Marks,
                  aggregate: Aggregate) -> tuple[torch.Tensor, dict[str, float]]:
        return loss, {}

    def figures(self, logprobs: torch.Tensor, marks: Marks, trainable: torch.Tensor) -> dict[str, float]:
        return {}

    def columns(self, logprobs: torch.Tensor, marks: Marks, trainable: torch.Tensor) -> dict:
        return {}

    def evaluation(self, logprobs: torch.Tensor, marks: Marks, trainable: torch.Tensor) -> dict:
        return {}


@dataclass(frozen=True)
class Teacher:
    """A frozen teacher (`ppo.teacher`), held as the reference is, and its settings."""

    model: PreTrainedModel
    settings: TeacherConfig

    def marks(self, sequences: Sequences, trainable: torch.Tensor, temperature: float, passes: Passes,
              timings: dict[str, float]) -> TeacherMarks:
        """One pass over each prompt + response: the teacher's log-probs of the sampled tokens, and with
        `top_k` its k + 1 bins at every position (the loss's)."""
        k = self.settings.top_k or 0
        with timed(timings, "teacher"):
            logits, _ = forward_response(self.model, sequences, passes)
            logps = log_probs(logits, temperature)  # (B, T, V), normalised once for both
            logprobs = picked(logps, sequences.responses) * trainable
            if k:  # the loss's k + 1 bins at every position (B, T, k), (B, T, k + 1)
                top, bins = top_bins(logps, k)
            else:
                top = torch.zeros(*logprobs.shape, 0, dtype=torch.long, device=logprobs.device)
                bins = torch.zeros(*logprobs.shape, 1, device=logprobs.device)
        return TeacherMarks(logprobs=logprobs, top=top, bins=bins)

    def kl(self, logprobs: torch.Tensor, marks: TeacherMarks, trainable: torch.Tensor) -> torch.Tensor:
        """The per-token KL(policy || teacher) estimate (`teacher.kl_estimator`), masked. # (B, T)"""
        return kl_estimate(logprobs, marks.logprobs, self.settings.kl_estimator) * trainable

    def dense_rewards(self, logprobs: torch.Tensor, marks: TeacherMarks, trainable: torch.Tensor
                      ) -> torch.Tensor | None:
        """The teacher's term in every token's reward, w * -KL_t; None with `top_k` (a loss term instead). # (B, T)"""
        if self.settings.top_k:
            return None
        return teacher_rewards(logprobs, marks.logprobs, self.settings.weight, trainable, self.settings.kl_estimator)

    def with_loss(self, loss: torch.Tensor, logps: torch.Tensor, marks: TeacherMarks,
                  aggregate: Aggregate) -> tuple[torch.Tensor, dict[str, float]]:
        """`loss` with, under `top_k`, w * KL(policy || teacher) over the teacher's k + 1 bins at every
        position, through the policy's log-probs `logps` (B, T, V)."""
        if not self.settings.top_k:
            return loss, {}
        teacher_loss = aggregate(binned_kl(binned(logps, marks.top), marks.bins))
        return loss + self.settings.weight * teacher_loss, {"teacher_loss": teacher_loss.item()}

    def figures(self, logprobs: torch.Tensor, marks: TeacherMarks, trainable: torch.Tensor) -> dict[str, float]:
        """How far the policy is from its teacher: the KL per sequence, and per token."""
        kl = self.kl(logprobs, marks, trainable)
        return {"rollout/teacher_kl": kl.sum(1).mean().item(),
                "rollout/teacher_kl_per_token": masked_mean(kl, trainable).item()}

    def columns(self, logprobs: torch.Tensor, marks: TeacherMarks, trainable: torch.Tensor) -> dict:
        """The rollouts table's column: each episode's KL to the teacher."""
        return {"teacher_kl": self.kl(logprobs, marks, trainable).sum(1).cpu().numpy()}

    def evaluation(self, logprobs: torch.Tensor, marks: TeacherMarks, trainable: torch.Tensor) -> dict:
        """The evaluation table's column: the teacher's view of each held-out response, KL(policy ||
        teacher), k1, summed over it (whatever `kl_estimator` trains with; `eval/teacher_kl` is its mean)."""
        return {"teacher_kl": (kl_estimate(logprobs, marks.logprobs) * trainable).sum(1).cpu().numpy()}


def teacher_for(cfg: PPOConfig, location: str | None, tokenizer, holding: Holding) -> Teacher | NoTeacher:
    """The run's teacher: `NoTeacher` without `ppo.teacher`, else the model at `location` (the folder
    the flow resolved `teacher.model` to), frozen in `frozen_dtype`, dropout off, its code trusted only
    with `ppo.trust_remote_code` (as the policy's and the reward model's), placed as the
    reference is (sharded and offloaded where the holding says). It reads the policy's token ids, so
    a teacher whose vocabulary differs is refused with the first ids that differ."""
    settings = cfg.teacher
    if settings is None:
        return NoTeacher()
    own = load_tokenizer(location, trust_remote_code=cfg.trust_remote_code).get_vocab()
    policy_vocab = tokenizer.get_vocab()
    if own != policy_vocab:
        differ = sorted(set(own.items()) ^ set(policy_vocab.items()), key=lambda item: item[1])[:3]
        raise ValueError(f"ppo.teacher: the teacher at {location} has another vocabulary ({len(own)} tokens against "
                         f"the policy's {len(policy_vocab)}; e.g. {differ}): its log-probs would grade other tokens "
                         "than the policy's; distil from a teacher of the policy's tokenizer")
    frozen = frozen_dtype_of(cfg.frozen_dtype, resolve_precision(cfg.precision))
    model = load_causal_lm(location, tokenizer, dtype=frozen,
                           trust_remote_code=cfg.trust_remote_code)
    disable_dropout(model)
    return Teacher(holding.frozen(model.eval().requires_grad_(False)), settings)


def check_teacher_given(cfg: PPOConfig, location: str | None) -> None:
    """Refuse, before any model loads, a config with a teacher whose folder the caller did not give."""
    if cfg.teacher is not None and location is None:
        raise StageUserError(f"ppo: teacher.model is {cfg.teacher.model!r}, but no teacher folder was given "
                             "(PPOInputs.teacher_location: the flow resolves runs:/ and models:/ to one)")
