"""PPO for language models, one equation per function. Pure tensor code: no models, no I/O.

Shapes: B sequences, T response tokens. `mask` is 1.0 on the tokens that count and 0.0 elsewhere: on a
single response its real tokens (up to and including the first end token); the stage passes the
model's own tokens (`trainable`: an episode's turns, not its tool results), and where an equation
steps through time a token outside the mask is no step. Tests work each function through by hand.

Losses are token means, or the policy loss's `aggregate`. Their `num_tokens` (`denominator`) is
what the mean divides by: left unset, the batch given's; in the update, the whole minibatch's
over every micro-batch and process, so each micro-batch's loss is its share of one minibatch
loss and the accumulated gradient does not depend on how the minibatch is split."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from stages.common.tensors import last_token_index, masked_mean, masked_var, masked_whiten

# --- KL penalty and rewards ------------------------------------------------------------------


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda log_ratio: log_ratio,  # log pi - log pi_ref: unbiased, can be negative
    "k3": lambda log_ratio: torch.expm1(-log_ratio) + log_ratio,  # (r - 1) - log r, r = pi_ref / pi: never negative
}
"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020), by name (`kl.estimator`)."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi: `KL_ESTIMATORS[estimator]`.

    k1 = log pi - log pi_ref                       (unbiased, can be negative)
    k3 = (r - 1) - log r,  r = pi_ref / pi         (unbiased, never negative; Schulman 2020)
    # (B, T), (B, T) -> (B, T)"""
    return _named(KL_ESTIMATORS, estimator, "KL estimator")(logprobs - ref_logprobs)


def _named(table: dict, name: str, what: str):
    """`table[name]`, or an error naming what is known."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; expected one of {', '.join(table)}")
    return table[name]


def apply_eos_penalty(scores: torch.Tensor, has_eos: torch.Tensor, penalty_score: float | None) -> torch.Tensor:
    """Responses that never emitted EOS get `penalty_score` instead of the reward model's score. # (B,) -> (B,)"""
    if penalty_score is None:
        return scores
    return torch.where(has_eos, scores, torch.full_like(scores, penalty_score))


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment of a response of |y| tokens, limit L_max, buffer L_cache:

        0                               |y| <= L_max - L_cache
        (L_max - L_cache - |y|) / L_cache   up to -1 at |y| = L_max

    # (B,) -> (B,)"""
    return ((max_length - buffer - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)


def weighted_reward(terms: dict[str, torch.Tensor], weights: dict[str, float],
                    no_reward: Collection[str] = ()) -> torch.Tensor:
    """The score a response is given: sum over terms of weight x value. In the terms named in
    `no_reward` (the reward functions) NaN means "no reward" and adds nothing; any other NaN stays
    NaN, for the non-finite check to stop on. # {name: (B,)} -> (B,)"""
    return sum(weight * (torch.nan_to_num(terms[name], nan=0.0) if name in no_reward else terms[name])
               for name, weight in weights.items())


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor) -> torch.Tensor:
    """r_t = -beta * KL_t on every response token, plus the sequence score on the last one.
    # (B,), (B, T), (B, T) -> (B, T)"""
    rewards = -beta * kl * mask
    rows = torch.arange(len(scores), device=scores.device)
    rewards[rows, last_token_index(mask)] += scores
    return rewards


# --- advantages ------------------------------------------------------------------------------


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, backwards in time:

        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last real token is 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V

    where t + 1 is the next token the mask counts: in a multi-turn episode the tool's tokens between
    two turns are skipped, not steps.

    # (B, T), (B, T), (B, T) -> (B, T), (B, T)"""
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        # A masked-out token (padding, or a tool's answer inside an episode) is not a step: the next
        # step of the token before it is the model's next own token.
        counted = mask[:, t] > 0
        next_value = torch.where(counted, values[:, t], next_value)
        next_advantage = torch.where(counted, advantages[:, t], next_advantage)
    return advantages, advantages + values


# --- critic-free advantages ------------------------------------------------------------------
# Rows come in groups of `group_size` consecutive responses to the same prompt. Each estimator
# is checked against the formulas of verl's `verl/trainer/ppo/core_algos.py` (tests/test_ppo_math.py).


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """One row per prompt, one column per response to it. # (B,) -> (B / K, K)"""
    if x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} responses do not split into groups of {group_size}")
    return x.view(-1, group_size)


def teacher_rewards(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, weight: float, mask: torch.Tensor,
                    estimator: str = "k1") -> torch.Tensor:
    """On-policy distillation's reward on every sampled token: the negative reverse KL to the teacher,

        d_t = -w * KL_t(pi || pi_teacher)        k1: w * (log pi_teacher(y_t) - log pi(y_t))

    (`kl_estimate` of the policy's log-probs against the teacher's). # (B, T), (B, T), (B, T) -> (B, T)"""
    return -weight * kl_estimate(logprobs, teacher_logprobs, estimator) * mask


def binned_kl(logps_bins: torch.Tensor, teacher_bins: torch.Tensor) -> torch.Tensor:
    """KL(pi || pi_teacher) over the same k + 1 bins of both (`stages.common.tensors.binned`: the teacher's
    top-k tokens, and the rest of the vocabulary as one): the exact reverse KL of the two coarse-grained
    distributions, never negative, differentiable in the policy's logits,

        KL_t = sum_b p_b (log p_b - log q_b)

    # (B, T, k + 1), (B, T, k + 1) -> (B, T)"""
    return (logps_bins.exp() * (logps_bins - teacher_bins)).sum(-1)


def sequence_rewards(scores: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor) -> torch.Tensor:
    """R = score - beta * sum_t KL_t: a whole response's reward, its KL penalty included. # (B,), (B, T) -> (B,)"""
    return scores - beta * (kl * mask).sum(dim=1)


def grpo_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_size: int, std_normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024): each response's reward against its group's,

        A_i = (R_i - mean_g R) / (std_g R + eps)      std unbiased; Dr. GRPO (std_normalize=False): R_i - mean_g R

    the same advantage on every token of the response. # (B,), (B, T) -> (B, T)"""
    group = grouped(rewards, group_size)  # (G, K)
    centred = group - group.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (group.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1, 1) * mask


def groups_with_signal(scores: torch.Tensor, group_size: int, tolerance: float = 1e-6) -> torch.Tensor:
    """Whether each prompt's responses scored differently: a group whose scores are all equal gets
    zero advantage from any group baseline, so it carries no signal (DAPO's dynamic sampling drops
    it). # (B,) -> (B / K,) bool"""
    group = grouped(scores, group_size)  # (G, K)
    return (group.max(dim=1).values - group.min(dim=1).values) > tolerance


def rloo_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each response's reward against the mean of the others in its group,

        A_i = R_i - (sum_g R - R_i) / (K - 1)

    the same advantage on every token of the response. # (B,), (B, T) -> (B, T)"""
    if group_size < 2:
        raise ValueError("RLOO needs at least two responses per prompt")
    group = grouped(rewards, group_size)  # (G, K)
    leave_one_out = (group.sum(dim=1, keepdim=True) - group) / (group_size - 1)
    return (group - leave_one_out).reshape(-1, 1) * mask


def group_baselined(scores: torch.Tensor, group_size: int, totals: torch.Tensor | None = None) -> torch.Tensor:
    """score_i - mean_g total: REINFORCE++-baseline's scores, before the KL reward; `totals`, each
    episode's whole return where it has more than its score (turn rewards), else the scores. # (B,) -> (B,)"""
    means = grouped(scores if totals is None else totals, group_size).mean(dim=1, keepdim=True)  # (G, 1)
    return (grouped(scores, group_size) - means).reshape(-1)


def failed_at_group_mean(scores: torch.Tensor, failed: torch.Tensor, group_size: int,
                         totals: torch.Tensor | None = None) -> torch.Tensor:
    """Failed episodes' scores set to the mean of their group's others' totals (`totals`: each
    episode's score with its turn rewards; a failed one has none), 0 where all failed: a failed episode
    trains no token, and its group's mean baseline stays the others' own. # (B,), (B,) bool -> (B,)"""
    ok = grouped((~failed).float(), group_size)  # (G, K)
    of = grouped(scores if totals is None else totals, group_size)
    mean_ok = (of * ok).sum(dim=1, keepdim=True) / ok.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(failed, mean_ok.expand(-1, group_size).reshape(-1), scores)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE returns, backwards in time: G_t = r_t + gamma * G_{t+1} (0 after the last real token;
    t + 1 the next token the mask counts).
    # (B, T), (B, T) -> (B, T)"""
    returns = torch.zeros_like(rewards)
    next_return = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        returns[:, t] = (rewards[:, t] + gamma * next_return) * mask[:, t]
        next_return = torch.where(mask[:, t] > 0, returns[:, t], next_return)  # masked-out tokens are not steps
    return returns


# --- the estimators, by name -------------------------------------------------------------------


Whiten = Callable[..., torch.Tensor]
"""`masked_whiten(x, mask, shift_mean=True)`, or the stage's collective version over every process's tokens."""


@dataclass(frozen=True, kw_only=True)
class EstimatorInputs:
    """What an advantage estimator reads of one iteration's episodes."""

    scores: torch.Tensor  # (B,) each response's reward
    kl: torch.Tensor  # (B, T) the per-token KL to the reference, masked
    beta: float  # the KL's weight in the reward: 0 where it is a loss term instead (GRPO)
    trainable: torch.Tensor  # (B, T) the tokens that count: the model's own (a rollout's `trainable`)
    values: torch.Tensor | None = None  # (B, T) the critic's (GAE only)
    group_size: int = 1  # consecutive responses to one prompt
    gamma: float = 1.0
    lam: float = 0.95  # GAE's lambda
    whiten_rewards: bool = False  # GAE: whiten the token rewards (not their mean) before the recursion
    std_normalize: bool = True  # GRPO: divide by the group's std (false: Dr. GRPO)
    turn_rewards: torch.Tensor  # (B, T) each turn's reward on its turn's last token (0 for a single response)
    dense: torch.Tensor | None = None  # (B, T) a reward on every token (the teacher's, `teacher_rewards`); None: none

    def token_rewards(self) -> torch.Tensor:
        """r_t = -beta * KL_t + dense_t, the score on the last token and each turn's reward on its own last. # (B, T)"""
        rewards = token_rewards(self.scores, self.kl, self.beta, self.trainable) + self.turn_rewards
        return rewards if self.dense is None else rewards + self.dense * self.trainable

    def episode_scores(self) -> torch.Tensor:
        """Each episode's score with its turn rewards and its dense rewards summed in: what a group
        baseline compares. # (B,)"""
        dense = 0.0 if self.dense is None else (self.dense * self.trainable).sum(dim=1)
        return self.scores + self.turn_rewards.sum(dim=1) + dense


def gae_estimate(e: EstimatorInputs, whiten: Whiten = masked_whiten) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on r_t = -beta * KL_t plus the score on the last token; returns = A + V (A before whitening)."""
    rewards = e.token_rewards()
    if e.whiten_rewards:
        rewards = whiten(rewards, e.trainable, shift_mean=False)
    return gae(rewards, e.values, e.trainable, e.gamma, e.lam)


def grpo_estimate(e: EstimatorInputs, whiten: Whiten = masked_whiten) -> tuple[torch.Tensor, None]:
    """GRPO on the score alone: its KL is a loss term (`kl_weights`)."""
    return grpo_advantages(e.episode_scores(), e.trainable, e.group_size, e.std_normalize), None


def rloo_estimate(e: EstimatorInputs, whiten: Whiten = masked_whiten) -> tuple[torch.Tensor, None]:
    """RLOO on R = score - beta * sum KL."""
    rewards = sequence_rewards(e.episode_scores(), e.kl, e.beta, e.trainable)  # (B,)
    return rloo_advantages(rewards, e.trainable, e.group_size), None


def reinforce_estimate(e: EstimatorInputs, whiten: Whiten = masked_whiten) -> tuple[torch.Tensor, None]:
    """REINFORCE++: discounted returns of r_t = -beta * KL_t plus the score on the last token."""
    return discounted_returns(e.token_rewards(), e.trainable, e.gamma), None


def distill_estimate(e: EstimatorInputs, whiten: Whiten = masked_whiten) -> tuple[torch.Tensor, None]:
    """On-policy distillation (the published recipe): each token's own reward, discount 0, no baseline:
    A_t = r_t, with the teacher's term `dense_t = w * (log p_teacher - log p_policy)` (k1) in it."""
    return discounted_returns(e.token_rewards(), e.trainable, gamma=0.0), None


def reinforce_baseline_estimate(e: EstimatorInputs, whiten: Whiten = masked_whiten) -> tuple[torch.Tensor, None]:
    """REINFORCE++-baseline: REINFORCE++ on the score less its group's mean."""
    baselined = group_baselined(e.scores, e.group_size, e.episode_scores())
    return reinforce_estimate(dataclasses.replace(e, scores=baselined), whiten)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: its advantages (and returns, for a critic), and how they are whitened."""

    estimate: Callable[[EstimatorInputs, Whiten], tuple[torch.Tensor, torch.Tensor | None]]
    """(advantages, returns or None) before the batch whitening. # -> (B, T), (B, T) | None"""
    whitened: bool
    """True: the advantages are whitened over the whole batch; False: only with `group_batch_normalize`
    (the group estimators' baselines are already on the scores' scale)."""


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(gae_estimate, whitened=True),
    "grpo": Estimator(grpo_estimate, whitened=False),
    "rloo": Estimator(rloo_estimate, whitened=False),
    "reinforce++": Estimator(reinforce_estimate, whitened=True),
    "reinforce++-baseline": Estimator(reinforce_baseline_estimate, whitened=True),
    "distill": Estimator(distill_estimate, whitened=False),
}
"""`advantage_estimator`'s choices (docs/methods.md); the config's choices are tested to be these keys."""


def estimator_named(name: str) -> Estimator:
    """`ESTIMATORS[name]`; an unknown name is refused."""
    return _named(ESTIMATORS, name, "advantage estimator")


# --- losses ----------------------------------------------------------------------------------


def _sequences(mask: torch.Tensor) -> torch.Tensor:
    """Sequences with a token in the mask. # (B, T) -> ()"""
    return (mask.sum(dim=1) > 0).float().sum()


def _per_length(mask: torch.Tensor, length: float | None) -> torch.Tensor:
    if length is None:
        raise ValueError("seq-mean-token-sum-norm divides by a constant length; give `length`")
    return _sequences(mask) * length


AGGREGATIONS: dict[str, Callable[[torch.Tensor, float | None], torch.Tensor]] = {
    "token-mean": lambda mask, length: mask.sum(),  # every token alike (DAPO, TRL's `dapo`)
    "seq-mean-token-mean": lambda mask, length: _sequences(mask),  # every sequence alike (GRPO as published)
    "seq-mean-token-sum": lambda mask, length: _sequences(mask),
    "seq-mean-token-sum-norm": _per_length,  # Dr. GRPO: a constant length, no length bias
}
"""How per-token loss terms become one loss (verl's `loss_agg_mode` names), by name: what `aggregate`
divides a batch's sums by (`loss_denominator`)."""


def loss_denominator(mask: torch.Tensor, aggregation: str, length: float | None = None) -> torch.Tensor:
    """What `aggregate` divides this batch's sums by, counted here: its tokens (`token-mean`), its
    sequences (`seq-mean-*`), or its sequences x the constant `length` (`seq-mean-token-sum-norm`).
    Summed over micro-batches and processes it is the whole minibatch's, so each micro-batch's loss
    is its share of one minibatch loss. A sequence counts where it has a token in the mask.
    # (B, T) -> ()"""
    return _named(AGGREGATIONS, aggregation, "loss aggregation")(mask, length)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token-mean",
              denominator: torch.Tensor | float | None = None, length: float | None = None) -> torch.Tensor:
    """One loss from per-token terms l (B sequences, N tokens, |y_i| tokens in sequence i):

        token-mean               sum_i sum_t l / N                       (DAPO, TRL's `dapo`: every token alike)
        seq-mean-token-mean      sum_i (sum_t l / |y_i|) / B             (GRPO as published: every sequence alike)
        seq-mean-token-sum       sum_i sum_t l / B
        seq-mean-token-sum-norm  sum_i sum_t l / (B * length)            (Dr. GRPO: a constant length, no length bias)

    `denominator` (N, B or B * length) is the whole minibatch's (`loss_denominator` summed over
    its micro-batches and processes); left unset, this batch's. # (B, T), (B, T) -> ()"""
    if denominator is None:
        denominator = loss_denominator(mask, aggregation, length).clamp(min=1.0)
    _named(AGGREGATIONS, aggregation, "loss aggregation")
    if aggregation == "seq-mean-token-mean":
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum() / denominator
    return (per_token * mask).sum() / denominator


def policy_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                 level: str = "token") -> torch.Tensor:
    """The importance ratio the policy loss clips.

        token     rho_t = pi(y_t) / pi_old(y_t)                                       (PPO)
        sequence  s_i = exp(mean_t log rho_t), the geometric mean of sequence i's     (GSPO, Zheng et al. 2025)
                  token ratios, in its per-token form s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]:
                  the value s_i on every token, the gradient s_i * grad log pi(y_t)

    With one advantage per sequence, the per-token form under `seq-mean-token-mean` has GSPO's
    gradient; with per-token advantages (GAE) it is GSPO-token. # (B, T) x 3 -> (B, T)"""
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        sequence = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
        return torch.exp(logprobs - logprobs.detach() + sequence.detach())
    raise ValueError(f"unknown importance sampling level {level!r}; expected token or sequence")


@dataclass(kw_only=True, frozen=True)
class PolicyClip:
    """How the policy loss clips its ratio and averages its terms (`clipped_policy_loss`)."""

    low: float
    """eps_low: the ratio's lower bound is 1 - low."""
    high: float | None = None
    """eps_high: its upper bound is 1 + high; None: `low`, PPO's symmetric clip."""
    level: str = "token"
    """`policy_ratio`'s level: `token`, or `sequence` (GSPO)."""
    aggregation: str = "token-mean"
    """`aggregate`'s mode."""
    length: float | None = None
    """`seq-mean-token-sum-norm`'s constant length."""
    totals: Totals | None = None
    """The whole minibatch's counts its terms and figures divide by; None: this batch's."""


@dataclass(frozen=True)
class Totals:
    """A whole minibatch's counts, over every micro-batch and process, that one micro-batch's loss
    terms divide by, so that they add up to the minibatch's."""

    tokens: torch.Tensor | float
    """Counted tokens: the token means' denominator (the figures, the entropy, the value loss)."""
    denominator: torch.Tensor | float
    """`aggregate`'s denominator (`loss_denominator`): the policy and KL losses'."""


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    """-L_clip: the quantity to minimise."""
    clip_fraction: torch.Tensor
    """Share of tokens where the clipped branch was taken (zero gradient there)."""
    approx_kl: torch.Tensor
    """0.5 * E[(log ratio)^2], the old-to-new policy KL estimate (per token, whatever the ratio's level)."""
    ratio: torch.Tensor
    """The clipped ratio, per token (`policy_ratio`). # (B, T)"""


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip: PolicyClip, weights: torch.Tensor | None = None) -> PolicyLoss:
    """L_clip = agg[w * min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)], rho = `policy_ratio`.

    Where A > 0 and rho > 1 + eps_high, or A < 0 and rho < 1 - eps_low, the min picks the
    constant clipped term and the token contributes no gradient. eps_high above eps_low is DAPO's
    clip-higher (more room for unlikely tokens to rise). `weights` w (constants; 1 when None) are
    `mismatch_weights` when another policy sampled the tokens. agg: `aggregate` over
    `clip.totals.denominator`; the figures are token means over `clip.totals.tokens` (this batch's when unset).
    # (B, T) x 4 -> PolicyLoss"""
    high = clip.low if clip.high is None else clip.high
    ratio = policy_ratio(logprobs, old_logprobs, mask, clip.level)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip.low, 1.0 + high)
    per_token = torch.max(unclipped, clipped)
    loss = aggregate(per_token if weights is None else per_token * weights, mask, clip.aggregation,
                     None if clip.totals is None else clip.totals.denominator, clip.length)
    num_tokens = None if clip.totals is None else clip.totals.tokens
    return PolicyLoss(
        loss=loss,
        clip_fraction=masked_mean((clipped > unclipped).float(), mask, num_tokens=num_tokens),
        approx_kl=0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask, num_tokens=num_tokens),
        ratio=ratio,
    )


@dataclass(frozen=True)
class Correction:
    """The correction for tokens another policy sampled (`rollout.correction`): its kind (tis | mis |
    icepop | none), its level (token | sequence) and the bounds of the ratio."""

    kind: str
    level: str
    low: float
    high: float


def sampler_log_ratio(logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor,
                      level: str) -> torch.Tensor:
    """log rho = log pi_train - log pi_sampled per token (`token`), or per sequence (`sequence`: the sum over
    its tokens, the log of their product, on each of them); 0 on padding. # (B, T) x 3 -> (B, T)"""
    log_ratio = (logprobs - sampled_logprobs) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    return log_ratio


def mismatch_weights(logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor,
                     correction: Correction) -> torch.Tensor:
    """Importance weights for tokens another policy sampled than the trainer's (an inference engine's
    numerics, an older version), with rho = pi_train / pi_sampled (`sampler_log_ratio`):

        tis     w = clip(rho, low, high)              truncated IS
        mis     w = rho * 1[low <= rho <= high]        masked IS: outside the bounds, no gradient at all
        icepop  w = rho * 1[low <= rho <= high]        per token, with IcePop's bounds [0.5, 5]
        none    w = 1

    As the peers write them: TRL's `vllm_importance_sampling_mode` `*_truncate` clamps to [C_min, C_max]
    and `*_mask` sets the ratio to 0 outside them (trl/trainer/grpo_trainer.py, `_generate_and_score_completions`);
    verl's rollout correction truncates its IS weights and its rejection sampling masks what lies outside
    [lower, upper] (verl/trainer/ppo/rollout_corr_helper.py); IcePop (Ling team 2025, the correction
    Ring-1T trained with) is the token-level mask M(k) = k if k in [alpha, beta] else 0, alpha 0.5, beta 5.
    The ratio is bounded in log space, so a sequence's product never overflows. 0 on padding.
    # (B, T) x 3 -> (B, T)"""
    if correction.kind == "none":
        return torch.ones_like(mask)
    log_ratio = sampler_log_ratio(logprobs, sampled_logprobs, mask, correction.level)
    low = math.log(correction.low) if correction.low > 0 else None
    high = math.log(correction.high)
    weights = torch.exp(log_ratio.clamp(min=low, max=high))  # tis's truncation; the mask below for the rest
    if correction.kind in ("mis", "icepop"):
        inside = (log_ratio <= high) if low is None else (log_ratio >= low) & (log_ratio <= high)
        weights = weights * inside
    return weights * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip_range_value: float, num_tokens: torch.Tensor | float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """L_V = 0.5 * E[max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)].
    Returns the loss and the share of tokens where the clipped term was larger. # (B, T) x 4"""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_error, clipped_error), mask, num_tokens=num_tokens)
    return loss, masked_mean((clipped_error > unclipped_error).float(), mask, num_tokens=num_tokens)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R]: 1 is a perfect critic, 0 no better than a constant."""
    var_returns = masked_var(returns, mask)
    return float("nan") if var_returns == 0 else (1 - masked_var(returns - values, mask) / var_returns).item()


# --- KL control ------------------------------------------------------------------------------


@dataclass
class KLController:
    """The KL coefficient beta, fixed, or adapted towards a target as in Ziegler et al. (2019):

        e    = clip(KL / target - 1, -0.2, 0.2)
        beta = beta * (1 + e * n_steps / horizon)
    """

    value: float
    target: float | None = None
    """Target KL per sequence; None keeps beta fixed."""
    horizon: float = 10000.0

    def update(self, kl: float, n_steps: int) -> float:
        if self.target is not None and math.isfinite(kl):
            proportional_error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}
