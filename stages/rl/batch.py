"""PPO's batch types, along the path one iteration's data takes:

    prompts  ->  EpisodeGeneration   the episodes, sampled, as token tensors (`stages.envs.episode`)
             ->  Rollout             with the passes PPO needs besides: old log-probs, values, the
                                     reference's log-probs, the teacher's marks (`stages.rl.rollout`),
                 + Scores            and what the reward said of each episode (`stages.rl.scoring`)
             ->  TrainingBatch       with the KL, the advantages and their targets: what the update
                                     trains on (`stages.rl.advantages`, `stages.rl.update`)

Each field says which axis it runs along (`stages.common.batches`), so taking rows, joining
consecutive batches and trimming a micro-batch are written once. The masks over the response
columns, each (B, T), one meaning each:

    mask        every real token after the prompt: what the forward passes attend to
    trainable   the model's own tokens (a single response: `mask`; an episode: its turns, not the tool
                results or the template's glue; none of a failed episode's or of a response a remote
                term left unscored): what the KL, the advantages and whitening count
    counted     `trainable` less, with `mask_truncated_responses`, the responses cut off without an
                end token: the tokens a loss term sums and divides by
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from stages.common.batches import PAD_ID, Sequences, nested, per_row, prompt_columns, response_columns, rows_of, trimmed
from stages.envs.episode import Episode
from stages.rewards.scoring import Scores
from stages.rl.teacher import Marks


@dataclass(kw_only=True)
class Rollout:
    """One iteration's episodes as sampled, with the passes PPO needs besides sampling."""

    queries: torch.Tensor = prompt_columns(pad=PAD_ID)  # (B, Tq) prompt ids
    query_mask: torch.Tensor = prompt_columns()  # (B, Tq)
    responses: torch.Tensor = response_columns(pad=PAD_ID)  # (B, T) everything after the prompt, then padding
    mask: torch.Tensor = response_columns()  # (B, T) 1.0 on every real token after the prompt
    trainable: torch.Tensor = response_columns()
    """(B, T) 1.0 on the model's own tokens: what the KL, the advantages and the losses count (a single
    response's every real token; an episode's turns, not its tool results or glue, none of a failed one's)."""
    turn_rewards: torch.Tensor = response_columns()
    """(B, T) each turn's reward (`step`'s) on its turn's last token; 0 everywhere for a single response."""
    restarts: torch.Tensor = response_columns()
    """(B, T) 1.0 on the first token of an episode's later chain (a rewritten history): `Sequences.restarts`."""
    logprobs: torch.Tensor = response_columns()  # (B, T) the old policy's, masked
    ref_logprobs: torch.Tensor = response_columns()  # (B, T) the reference's, masked
    values: torch.Tensor = response_columns()  # (B, T) the critic's, masked (0 without one: `NoCritic`)
    entropy: torch.Tensor = response_columns()  # (B, T)
    engine_logprobs: torch.Tensor = response_columns()
    """(B, T) the log-probs of the engine that sampled the tokens, masked: vLLM's own, or where the
    trainer sampled, the trainer's (`logprobs`)."""
    teacher: Marks = nested()
    """The distillation teacher's marks on the sampled tokens (`stages.rl.teacher`); none without a teacher."""
    has_eos: torch.Tensor = per_row()  # (B,) the episode ended: an end token, or the model answered (status `ok`)
    episodes: list[Episode] = per_row()
    """Each row's episode (its turns, tool calls, status, transcript): a single response is an episode of one turn."""
    messages: list[list[dict]] = per_row()
    """Each episode's prompt as chat messages."""
    figures: dict[str, float] = field(default_factory=dict)
    """What sampling counted besides time (dynamic sampling's rounds, a source's staleness)."""

    @property
    def sequences(self) -> Sequences:
        return Sequences(self.queries, self.query_mask, self.responses, self.mask, self.restarts)

    @property
    def texts(self) -> list[str]:
        """What the reward terms score: each episode's answer, decoded."""
        return [e.answer for e in self.episodes]


@dataclass(frozen=True)
class KLWeights:
    """Where the KL controller's coefficient beta goes this iteration (`stages.rl.advantages.kl_weights`)."""

    beta: float
    """The controller's coefficient."""
    in_reward: float
    """The per-token KL penalty's weight in the reward: beta, or 0 where the KL is a loss term (GRPO)."""
    in_loss: float
    """The k3 KL loss term's weight: `kl.loss_coef`, plus beta where the KL is a loss term."""


@dataclass(kw_only=True)
class TrainingBatch(Rollout):
    """A rollout with its scores and what the update trains towards; a micro-batch is some of its rows, `trimmed`."""

    scores: Scores = nested()
    kl: torch.Tensor = response_columns()  # (B, T) the per-token KL estimate (`kl.estimator`) to the reference
    advantages: torch.Tensor = response_columns()  # (B, T)
    returns: torch.Tensor = response_columns()  # (B, T) the critic's targets (its values, 0, without a critic)
    engine_weights: torch.Tensor = response_columns()
    """(B, T) importance weights for the engine mismatch (`rollout.correction`: truncated or masked); 1 where
    the trainer sampled or the correction is off."""
    counted: torch.Tensor = response_columns()  # (B, T) the tokens the loss terms count (module docstring)
    kl_weights: KLWeights
    """Where beta went: the KL's weight in the reward and in the loss (the batch's as a whole, no axis)."""

    @classmethod
    def of(cls, rollout: Rollout, **training: Any) -> TrainingBatch:
        """`rollout`'s fields with the training ones (`scores`, `advantages`, ...) added."""
        return cls(**{f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}, **training)

    @property
    def sequence_kl(self) -> torch.Tensor:
        """Each response's KL to the reference, summed over its tokens. # (B,)"""
        return self.kl.sum(1)


def micro_batch(batch: TrainingBatch, rows: torch.Tensor) -> TrainingBatch:
    """These rows of a training batch, trimmed: what one forward and backward pass takes."""
    return trimmed(rows_of(batch, rows))
