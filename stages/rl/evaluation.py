"""Judging a policy on held-out prompts: PPO's evaluations (midway and final) and DPO's final one.

The policy answers the held-out prompts (from `evaluation.seed + 1`) and is compared with the SFT
policy's responses to the same prompts (`HeldOut`, sampled once from `evaluation.seed` before training
starts): KL(policy || SFT) per sequence on the policy's responses, their length and EOS rate, and
with a reward model the scores of both and the win rate with its standard error. PPO's other reward
terms (`TermJudge`: functions and servers) score both too: each term's mean, and without a reward
model the terms' weighted sum and the win rate by it. A `choice` judge compares the policy's
response with the SFT one to the same prompt: its mean is its own win rate.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from rlhf.evaluation import win_rate
from rlhf.sections.base import EvaluationConfig, SamplingConfig
from stages.common.reporting import Reporting
from stages.engines.sampler import Sampler
from stages.envs.episode import Episode, EpisodeSource, episode_figures, transcript
from stages.math.ppo_math import kl_estimate
from stages.rl.ppo_models import Models
from stages.rl.rollout import Rollouts, own_random_stream, reference_episodes, rollout
from stages.rl.scoring import TermJudge


@dataclass(kw_only=True, frozen=True)
class HeldOut:
    """The held-out prompts, each `evaluation.samples_per_prompt` times, and the SFT policy's responses
    to them, which every evaluation judges the policy against."""

    prompts: list[str]
    messages: list[list[dict]]
    columns: list[dict]
    """Each prompt's declared extra columns (PPO's `reward.columns`) by name, for the reward functions."""
    source: EpisodeSource
    """Where both policies' episodes come from: one turn per prompt, or the environment's loop."""
    sft_episodes: list[Episode]
    """The SFT policy's episodes."""

    @property
    def sft_texts(self) -> list[str]:
        """The SFT policy's answers: what the reward terms score."""
        return [e.answer for e in self.sft_episodes]

    @property
    def sft_complete(self) -> list[bool]:
        """False where the SFT episode was cut off (`sampling.response_length`) without ending."""
        return [e.status == "ok" for e in self.sft_episodes]

    @property
    def rows(self) -> list[dict]:
        """The held-out prompts as episodes' records."""
        return [{"prompt": p, "messages": m, **c} for p, m, c in zip(self.prompts, self.messages, self.columns,
                                                                      strict=True)]

    @classmethod
    @torch.no_grad()
    def sample(cls, models: Models, eval_prompts: pd.DataFrame, evaluation: EvaluationConfig, sampling: SamplingConfig,
               source: EpisodeSource, columns: tuple[str, ...] = ()) -> HeldOut:
        """The SFT policy's episodes of `source`, sampled before training starts (so from the SFT
        policy even when the reference is refreshed later, or the run resumes), from
        `evaluation.seed` alone: every run from the same SFT checkpoint and prompts, whatever its
        training seed or settings, is judged against the same responses (common random numbers)."""
        repeat = evaluation.samples_per_prompt
        prompts = [p for p in eval_prompts["prompt"] for _ in range(repeat)]
        messages = [json.loads(m) for m in eval_prompts["prompt_messages"] for _ in range(repeat)]
        records = [r for r in eval_prompts[list(columns)].to_dict("records") for _ in range(repeat)]
        held_out = cls(prompts=prompts, messages=messages, columns=records, source=source, sft_episodes=[])
        models.train(False)
        return dataclasses.replace(held_out, sft_episodes=reference_episodes(models, source, held_out.rows, sampling,
                                                                             evaluation.seed))


@torch.no_grad()
def evaluate(models: Models, sampler: Sampler, held_out: HeldOut, evaluation: EvaluationConfig,
             sampling: SamplingConfig, judge: TermJudge | None = None) -> tuple[dict[str, float], pd.DataFrame]:
    """The policy against the SFT responses on the held-out prompts: KL(policy || SFT) (`eval/kl`:
    k1, the log-ratio, summed over each response) on the policy's responses, sampled from
    `evaluation.seed + 1`, their length and EOS rate; with a distillation teacher, KL(policy ||
    teacher) (`eval/teacher_kl`, k1, summed over each response: column `teacher_kl`); with a reward
    model, the scores of both (on the
    normalisation in force) and the win rate with its standard error; with reward functions
    (`judge`), each one's mean on both (`eval/reward/<name>`, `..._sft`), and without a reward model
    the terms' weighted sum as the score of both and the win rate by it (`eval/win_rate_reward`).
    Training's random stream is the caller's to keep (`own_random_stream`) when training goes on."""
    prompts, messages = held_out.prompts, held_out.messages
    torch.manual_seed(evaluation.seed + 1)
    policy = rollout(models, sampler, held_out.source, held_out.rows, sampling, {})
    kl = (kl_estimate(policy.logprobs, policy.ref_logprobs) * policy.trainable).sum(1)
    table = pd.DataFrame({"prompt": prompts, "prompt_messages": [json.dumps(m) for m in messages],
                          "policy_response": policy.texts, "sft_response": held_out.sft_texts, "kl": kl.cpu().numpy()})
    metrics = {"eval/kl": table["kl"].mean(), "eval/response_length": policy.trainable.sum(1).float().mean().item(),
               "eval/eos_rate": policy.has_eos.float().mean().item()}
    teacher = models.teacher.evaluation(policy.logprobs, policy.teacher, policy.trainable)  # a teacher's view of each
    for name, column in teacher.items():
        table[name] = column
        metrics[f"eval/{name}"] = table[name].mean()
    if held_out.columns and held_out.columns[0]:  # the records' declared columns, which a judge may read
        table = table.assign(**pd.DataFrame(held_out.columns, index=table.index))
    if held_out.source.multi_turn:  # the conversations, and how often each policy called a tool
        table = table.assign(policy_episode=[transcript(e) for e in policy.episodes],
                             sft_episode=[transcript(e) for e in held_out.sft_episodes],
                             policy_tool_calls=[e.tool_calls for e in policy.episodes],
                             sft_tool_calls=[e.tool_calls for e in held_out.sft_episodes])
        metrics |= episode_figures(policy.episodes, "eval")
        sft = episode_figures(held_out.sft_episodes, "eval")
        metrics |= {f"{name}_sft": sft[name] for name in ("eval/tool_call_rate", "eval/environment_reward")}
    if models.scorer is not None:
        table["policy_score"] = models.scorer.score(messages, policy.texts, complete=policy.has_eos.tolist()).numpy()
        table["sft_score"] = models.scorer.score(messages, held_out.sft_texts, complete=held_out.sft_complete).numpy()
        wins, wins_se = win_rate(list(table["policy_score"]), list(table["sft_score"]), prompts)
        metrics |= {"eval/score": table["policy_score"].mean(), "eval/score_sft": table["sft_score"].mean(),
                    "eval/win_rate_rm": wins, "eval/win_rate_rm_se": wins_se}
    if judge is not None:
        metrics |= judged_by_terms(judge, held_out, policy.episodes, table)
    return {k: float(v) for k, v in metrics.items()}, table


def judged_by_terms(judge: TermJudge, held_out: HeldOut, policy: list[Episode], table: pd.DataFrame
                    ) -> dict[str, float]:
    """The reward terms on the policy's and the SFT policy's held-out episodes: their values as
    columns of `table`, each term's means (a `choice` judge's on the policy's answers only, against
    the SFT ones: its win rate), and without a reward model the weighted sum as both answers'
    `score` and the win rate by it, over the pairs whose servers' scores all arrived."""
    metrics: dict[str, float] = {}
    judged = {}
    compared = [dataclasses.replace(e, reference=sft) for e, sft in zip(policy, held_out.sft_texts, strict=True)]
    for who, episodes in (("policy", compared), ("sft", held_out.sft_episodes)):
        judged[who] = judge.values(held_out.messages, episodes, f"evaluation ({who} responses)")
        for name, values in judged[who].items():  # (B,) NaN where the term gave none
            table[f"{who}_reward/{name}"] = values.cpu().numpy()
            given = values[~values.isnan()]
            key = f"eval/reward/{name}" + ("_sft" if who == "sft" else "")
            metrics[key] = given.mean().item() if len(given) else 0.0
    if not judge.with_model and judge.weights:
        # a pair where a server's score never arrived, for either response, has no score: out of the win rate
        served = [judged[who][name] for who in judged for name in judge.served & judge.weights.keys()]  # (B,) each
        unscored = (torch.stack(served).isnan().any(dim=0).cpu().numpy() if served
                    else np.zeros(len(policy), dtype=bool))  # (B,)
        if served:
            metrics["eval/remote_failed_share"] = unscored.mean()
        for who in judged:
            table[f"{who}_score"] = judge.weighted(judged[who]).cpu().numpy()
            table.loc[unscored, f"{who}_score"] = float("nan")
        kept = table[~unscored]
        wins, wins_se = win_rate(list(kept["policy_score"]), list(kept["sft_score"]), list(kept["prompt"]))
        metrics |= {"eval/score": table["policy_score"].mean(), "eval/score_sft": table["sft_score"].mean(),
                    "eval/win_rate_reward": wins, "eval/win_rate_reward_se": wins_se}
    return metrics


def warn_over_kl_budget(metrics: dict[str, float], kl_budget: float, reporting: Reporting) -> None:
    """The final policy's KL to SFT on the held-out prompts against the budget (PPO's and DPO's alike)."""
    if metrics["eval/kl"] > kl_budget:
        reporting.warning(f"the final policy's mean KL per sequence on the held-out prompts, {metrics['eval/kl']:.2f}, "
                          f"is over the budget of {kl_budget}")


def evaluate_midway(rollouts: Rollouts, held_out: HeldOut, iteration: int, reporting: Reporting) -> dict[str, float]:
    """An evaluation between iterations, reported at `iteration`, leaving training's random stream as it was."""
    models, cfg = rollouts.models, rollouts.cfg
    with own_random_stream(models.policy.device):
        metrics, table = evaluate(models, rollouts.sampler, held_out, cfg.evaluation, cfg.sampling,
                                  rollouts.scoring.term_judge())
    reporting.metrics(metrics, iteration)
    reporting.evaluation(table, iteration)
    return metrics
