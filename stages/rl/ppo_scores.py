"""PPO's scores for one iteration's episodes: the reward model's (normalised, with the EOS penalty
and clipping), the Python reward functions' (computed on the main process for every process) and
the overlong penalty, as the weighted sum the stage trains on; and the reward normalisation fitted
on the first rollouts."""

from __future__ import annotations

from dataclasses import replace

import torch
from accelerate import Accelerator

from rlhf.config_ppo import PPOConfig
from rlhf.config_reward_terms import OVERLONG_TERM
from stages.common.reporting import timed
from stages.envs.episode import Episode
from stages.math.ppo_math import apply_eos_penalty, overlong_penalty, weighted_reward
from stages.rewards.functions import reward_values
from stages.rewards.remote import remote_values
from stages.rewards.scoring import RewardScorer, Scores, fit_normalization
from stages.rl.batch import Rollout
from stages.rl.evaluation import TermJudge
from stages.rl.ppo_rollout import reference_episodes
from stages.rl.ppo_state import Normalization
from stages.rl.update import Learner
from stages.runtime.collectives import computed_on_main, gathered


@torch.no_grad()
def raw_scores(scorer: RewardScorer, batch: Rollout, prompt_messages: list, timings: dict[str, float],
               single_turn: bool) -> torch.Tensor:
    """The reward model's outputs for the rollout's responses, before normalisation. Where the reward
    model shares the policy's tokenizer and each episode is one response, the prompts are the
    policy's own ids, not rendered and encoded again. The responses are always encoded from their
    texts: a sampled token sequence need not be the one its text encodes to (5 of 8 responses of
    the untrained tiny world), and the reward model learned from encoded texts. # -> (B,)"""
    with timed(timings, "score"):
        prompt_ids = None
        if scorer.policy_tokens and single_turn:
            prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(batch.queries, batch.query_mask, strict=True)]
        sequences = scorer.encode(prompt_messages, batch.texts, batch.has_eos.tolist(), prompt_ids)
        raw = scorer.raw_scores(sequences)
    return raw.to(batch.queries.device)


def scores_of(raw: torch.Tensor | None, batch: Rollout, scorer: RewardScorer | None, cfg: PPOConfig,
              functions: dict[str, torch.Tensor] | None = None, remote: dict[str, torch.Tensor] | None = None
              ) -> Scores:
    """The rollout's scores from the reward model's `raw` outputs (None, with no `scorer`, where the
    reward has no model term), the reward functions' values (`function_terms`; none when the
    reward has no function terms), the servers' (`remote_terms`: NaN where a score never arrived,
    which drops the response) and the overlong penalty (`reward.overlong`, when set)."""
    normalized, terms = None, {}
    if scorer is not None:
        normalized = scorer.normalize(raw)
        terms = {term.name: model_score(normalized, batch, cfg) for term in cfg.reward.terms if term.is_model}
    served = {term.name for term in cfg.reward.remotes if term.remote.kind == "score"}  # a reward model, served
    terms |= (functions or {}) | {name: model_score(v, batch, cfg) if name in served else v
                                  for name, v in (remote or {}).items()}
    if cfg.reward.overlong is not None:
        terms[OVERLONG_TERM] = overlong_penalty(batch.trainable.sum(dim=1), cfg.response_tokens,
                                                cfg.reward.overlong.buffer)
    # a function's NaN is "no reward" (its answers are checked finite); a server's, a dropped response
    reward = weighted_reward(terms, cfg.reward.weights, no_reward=[*(functions or ()), *(remote or ())]) if terms \
        else torch.zeros(len(batch.texts), device=batch.queries.device)  # no terms: a teacher's alone (distillation)
    dropped = torch.stack([v.isnan() for v in remote.values()]).any(dim=0) if remote else None  # (B,)
    return Scores(raw=raw, normalized=normalized, terms=terms, reward=reward, dropped=dropped)


def model_score(scores: torch.Tensor, batch: Rollout, cfg: PPOConfig) -> torch.Tensor:
    """A reward model's normalised scores (in this process or served) as PPO trains on them: a cut-off
    response's is `missing_eos_score`, all clipped to `score_clip`; NaN (no score arrived) stays. # (B,)"""
    term = apply_eos_penalty(scores, batch.has_eos, cfg.missing_eos_score)
    term = term.clamp(-cfg.score_clip, cfg.score_clip) if cfg.score_clip is not None else term
    return torch.where(scores.isnan(), scores, term)


def function_terms(learner: Learner, messages: list[list[dict]], episodes: list[Episode], iteration: int,
                   timings: dict[str, float]) -> dict[str, torch.Tensor]:
    """Each reward function's values for this process's episodes' answers (NaN where it gave none),
    every process's rows computed on the main process (collective). # -> {name: (B,)}"""
    if not learner.reward_functions:
        return {}
    with timed(timings, "reward_functions"):
        rows = [(m, e.answer, e.columns) for m, e in zip(messages, episodes, strict=True)]
        every = _functions_on_main(learner, rows, iteration)
        first = learner.accelerator.process_index * len(rows)
    return {name: _as_tensor(values[first:first + len(rows)], learner.accelerator.device)
            for name, values in every.items()}


def with_sft_references(learner: Learner, batch: Rollout, rows: list[dict], cursor: int,
                        timings: dict[str, float]) -> Rollout:
    """`batch` with each episode's `reference`, what `choice` judges compare it with: the SFT policy's
    answer to its group's prompt (`rows`, the prompts' records, in groups of `samples_per_prompt`), one
    per group, sampled from the run's seed and the round's `cursor` (so a resumed run asks the same).
    As it is without such a judge."""
    cfg = learner.cfg
    if not cfg.reward.pairwise:
        return batch
    size = cfg.samples_per_prompt
    with timed(timings, "sft_reference"):
        sft = reference_episodes(learner.models, learner.episode_source, rows[::size], cfg.sampling,
                                 cfg.seed * 1_000_003 + cursor)
    return replace(batch, episodes=[replace(e, reference=sft[i // size].answer) for i, e in enumerate(batch.episodes)])


def remote_terms(learner: Learner, messages: list[list[dict]], episodes: list[Episode], iteration: int | str,
                 timings: dict[str, float]) -> tuple[dict[str, torch.Tensor], float]:
    """Each remote term's scores for this process's episodes' answers (NaN where none arrived), every
    process's rows sent from the main process (collective), and the requests retried; a failed batch may
    stop the run (`stages.rewards.remote.remote_values`). `choice` judges are asked where the episodes
    carry their `reference` (`with_sft_references`). # -> {name: (B,)}, retries"""
    if not learner.remote_rewards:
        return {}, 0.0
    with timed(timings, "remote_reward"):
        rows = _remote_rows(messages, episodes)
        every, retries = _remote_on_main(learner, rows, iteration, _compared(episodes))
        first = learner.accelerator.process_index * len(rows)
    return {name: _as_tensor(values[first:first + len(rows)], learner.accelerator.device)
            for name, values in every.items()}, float(retries)


def _remote_rows(messages: list[list[dict]], episodes: list[Episode]) -> list[tuple]:
    """What a server scores of each episode: (prompt messages, answer, ended, the SFT answer or None)."""
    return [(m, e.answer, e.status == "ok", e.reference) for m, e in zip(messages, episodes, strict=True)]


def _compared(episodes: list[Episode]) -> bool:
    """Whether `choice` judges are asked: the episodes carry the SFT answers they compare with."""
    return any(e.reference is not None for e in episodes)


def term_judge(learner: Learner) -> TermJudge | None:
    """The reward functions and servers as the evaluations score with them (None without such terms).
    Every process holds the same held-out prompts; the main process's responses are the ones judged
    and reported, so only its rows are sent (collective). A server's failures are NaN, as in training."""
    if not learner.reward_functions and not learner.remote_rewards:
        return None
    accelerator, reward = learner.accelerator, learner.cfg.reward

    def values(messages: list[list[dict]], episodes: list[Episode], judged: str) -> dict[str, torch.Tensor]:
        main, every = accelerator.is_main_process, {}
        if learner.reward_functions:
            rows = [(m, e.answer, e.columns) for m, e in zip(messages, episodes, strict=True)]
            every = _functions_on_main(learner, rows if main else [], judged)
        if learner.remote_rewards:
            rows = _remote_rows(messages, episodes)
            every |= _remote_on_main(learner, rows if main else [], judged, _compared(episodes))[0]
        return {name: _as_tensor(v, accelerator.device) for name, v in every.items()}

    pairwise = {term.name for term in reward.pairwise}
    return TermJudge(values, {term.name: term.weight for term in reward.terms if term.name not in pairwise},
                     reward.uses_model, frozenset(term.name for term in reward.remotes))


def _functions_on_main(learner: Learner, rows: list[tuple], batch: int | str) -> dict[str, list[float | None]]:
    """Every reward function's checked values for every process's (prompt messages, response, columns)
    rows, computed on the main process (collective)."""

    def compute(every: list[tuple]) -> dict[str, list[float | None]]:
        prompts, responses, records = ([row[i] for row in every] for i in range(3))
        return {f.term.name: reward_values(f, prompts, responses, {c: [r[c] for r in records] for c in f.columns},
                                           batch) for f in learner.reward_functions}

    return computed_on_main(learner.accelerator, rows, compute)


def _remote_on_main(learner: Learner, rows: list[tuple], batch: int | str,
                    pairwise: bool) -> tuple[dict[str, list[float | None]], int]:
    """Every remote term's values for every process's (prompt messages, response, ended, SFT response)
    rows, and the retries, requested from the main process (collective); `choice` judges only where
    `pairwise`."""

    def compute(every: list[tuple]) -> tuple[dict[str, list[float | None]], int]:
        prompts, responses, complete, references = ([row[i] for row in every] for i in range(4))
        return remote_values(learner.remote_rewards, prompts, responses, complete, batch,
                             references if pairwise else None)

    return computed_on_main(learner.accelerator, rows, compute)


def _as_tensor(values: list[float | None], device: torch.device) -> torch.Tensor:
    """A function's values, NaN where it gave none. # -> (B,)"""
    return torch.tensor([float("nan") if v is None else v for v in values], device=device)


def fitted_normalization(learner: Learner, raw: torch.Tensor, batch: Rollout) -> tuple[Normalization, Rollout]:
    """The reward normalisation PPO keeps for the whole run, fitted on its first round's `raw`
    scores (`first_normalization`) and adopted: the scorer, and the critic if it takes it, on the
    fitted scale, and the round's values mapped alike (collective)."""
    normalization = first_normalization(learner.accelerator, learner.models.scorer, raw, learner.cfg)
    values = learner.models.adopt_normalization(normalization.gain, normalization.bias, batch.values)
    return normalization, replace(batch, values=values)


def first_normalization(accelerator: Accelerator, scorer: RewardScorer, raw: torch.Tensor,
                        cfg: PPOConfig) -> Normalization:
    """The reward normalisation PPO keeps for the whole run: refitted on the first iteration's raw
    scores over all processes (so scores start at mean 0, std 1 under PPO's own temperature,
    response length and prompts, where the reward stage sampled with its own), or the reward
    checkpoint's own when `refit_normalization` is off (collective). Cut-off responses count too:
    `missing_eos_score` is a score on this same scale."""
    if not cfg.refit_normalization:
        return Normalization(scorer.gain, scorer.bias)
    return Normalization(*fit_normalization(gathered(accelerator, raw.float())))
