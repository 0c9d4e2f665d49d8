"""PPO for language models, one equation per function. Pure tensor code: no models, no I/O.

Shapes: B sequences, T response tokens. `mask` is 1.0 on real response tokens (up to and
including the first end token) and 0.0 after them. Tests work each function through by hand.

Losses are token means. Their `num_tokens` is the denominator of that mean: left unset, the
tokens of the batch given; in the update, the tokens of the whole minibatch over every
micro-batch and process, so each micro-batch's loss is its share of one minibatch mean and the
accumulated gradient does not depend on how the minibatch is split."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from stages.common.tensors import last_token_index, masked_mean, masked_var

# --- KL penalty and rewards ------------------------------------------------------------------


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    k1 = log pi - log pi_ref                       (unbiased, can be negative)
    k3 = (r - 1) - log r,  r = pi_ref / pi         (unbiased, never negative; Schulman 2020)
    # (B, T), (B, T) -> (B, T)"""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1 or k3")


def apply_eos_penalty(scores: torch.Tensor, has_eos: torch.Tensor, penalty_score: float | None) -> torch.Tensor:
    """Responses that never emitted EOS get `penalty_score` instead of the reward model's score. # (B,) -> (B,)"""
    if penalty_score is None:
        return scores
    return torch.where(has_eos, scores, torch.full_like(scores, penalty_score))


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


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, backwards in time:

        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last real token is 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V

    # (B, T), (B, T), (B, T) -> (B, T), (B, T)"""
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value, next_advantage = values[:, t], advantages[:, t]
    return advantages, advantages + values


# --- critic-free advantages ------------------------------------------------------------------
# Rows come in groups of `group_size` consecutive responses to the same prompt. Each estimator
# is checked against the formulas of verl's `verl/trainer/ppo/core_algos.py` (tests/test_ppo_math.py).


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """One row per prompt, one column per response to it. # (B,) -> (B / K, K)"""
    if x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} responses do not split into groups of {group_size}")
    return x.view(-1, group_size)


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


def rloo_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each response's reward against the mean of the others in its group,

        A_i = R_i - (sum_g R - R_i) / (K - 1)

    the same advantage on every token of the response. # (B,), (B, T) -> (B, T)"""
    if group_size < 2:
        raise ValueError("RLOO needs at least two responses per prompt")
    group = grouped(rewards, group_size)  # (G, K)
    leave_one_out = (group.sum(dim=1, keepdim=True) - group) / (group_size - 1)
    return (group - leave_one_out).reshape(-1, 1) * mask


def group_baselined(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """score_i - mean_g score: REINFORCE++-baseline's scores, before the KL reward. # (B,) -> (B,)"""
    group = grouped(scores, group_size)
    return (group - group.mean(dim=1, keepdim=True)).reshape(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE returns, backwards in time: G_t = r_t + gamma * G_{t+1} (0 after the last real token).
    # (B, T), (B, T) -> (B, T)"""
    returns = torch.zeros_like(rewards)
    next_return = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        returns[:, t] = (rewards[:, t] + gamma * next_return) * mask[:, t]
        next_return = returns[:, t]
    return returns


# --- losses ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    """-L_clip: the quantity to minimise."""
    clip_fraction: torch.Tensor
    """Share of tokens where the clipped branch was taken (zero gradient there)."""
    approx_kl: torch.Tensor
    """0.5 * E[(log ratio)^2], the old-to-new policy KL estimate."""
    ratio: torch.Tensor
    """pi_new / pi_old per token. # (B, T)"""


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_range: float, num_tokens: torch.Tensor | float | None = None,
                        weights: torch.Tensor | None = None) -> PolicyLoss:
    """L_clip = E[w * min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)], rho = pi / pi_old.

    Where A > 0 and rho > 1 + eps, or A < 0 and rho < 1 - eps, the min picks the constant
    clipped term and the token contributes no gradient. `weights` w (constants; 1 when None) are
    `engine_importance_weights` when another engine sampled the tokens.
    # (B, T) x 4 -> PolicyLoss"""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_token = torch.max(unclipped, clipped)
    loss = masked_mean(per_token if weights is None else per_token * weights, mask, num_tokens=num_tokens)
    return PolicyLoss(
        loss=loss,
        clip_fraction=masked_mean((clipped > unclipped).float(), mask, num_tokens=num_tokens),
        approx_kl=0.5 * masked_mean(log_ratio**2, mask, num_tokens=num_tokens),
        ratio=ratio,
    )


def engine_importance_weights(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                              level: str, cap: float) -> torch.Tensor:
    """Truncated importance weights for tokens an inference engine sampled: w = min(pi_train / pi_engine, cap),
    per token (`token`) or per sequence (`sequence`: the product over its tokens, on each of them);
    0 on padding. They correct the policy gradient for the engine computing a slightly different
    policy than the trainer (TRL's `vllm_importance_sampling_correction`, verl's rollout correction).
    # (B, T) x 3 -> (B, T)"""
    log_ratio = (logprobs - engine_logprobs) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    return torch.exp(log_ratio.clamp(max=math.log(cap))) * mask


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
