"""The reward as one component, `Scoring`: what every episode of a rollout scores.

    the reward model   its score of each answer (`stages.rewards.scoring.RewardScorer`), normalised:
                       on the run's first round the normalisation is fitted (`refit_normalization`)
                       and the critic takes the same scale; a cut-off answer gets `missing_eos_score`,
                       all clipped to `score_clip`
    functions          Python reward terms (`stages.rewards.functions`), computed on the main process
                       for every process's episodes
    servers            remote terms (`stages.rewards.remote`): scoring endpoints and LLM judges; a
                       `choice` judge compares each answer with the SFT policy's (`Episode.reference`)
    overlong           DAPO's soft overlong penalty
    reward             their weighted sum (`ppo_math.weighted_reward`): what the stage trains on

Where a term is not configured it scores nothing; with no term at all the reward is 0 (a teacher's
alone, distillation). `term_judge` is the same terms as the evaluations score with them, and
`figures` what an iteration logs of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from accelerate import Accelerator

from rlhf.sections.ppo import PPOConfig
from rlhf.sections.reward_terms import OVERLONG_TERM
from stages.common.reporting import timed
from stages.envs.episode import Episode
from stages.math.ppo_math import apply_eos_penalty, overlong_penalty, weighted_reward
from stages.rewards.functions import RewardFunction, reward_values
from stages.rewards.remote import RemoteReward, remote_values
from stages.rewards.scoring import RewardScorer, Scores, fit_normalization
from stages.rl.batch import Rollout
from stages.rl.ppo_models import Models
from stages.rl.ppo_state import LoopState, Normalization
from stages.runtime.collectives import computed_on_main, gathered


@dataclass(frozen=True)
class TermJudge:
    """PPO's reward terms besides the reward model (functions, servers) as an evaluation scores
    responses with them (`stages.rl.evaluation`)."""

    values: Callable[[list[list[dict]], list[Episode], str], dict[str, torch.Tensor]]
    """(prompt messages, the episodes judged, what is judged) -> each term's values by name for the
    episodes' answers, NaN where it gave none; a `choice` judge's only where the episodes carry the
    SFT answer it compares with (`Episode.reference`). # -> {name: (B,)}"""
    weights: dict[str, float]
    """The weight by name of every term that scores a response alone (the reward model's too; no `choice` judge)."""
    with_model: bool
    """Whether a reward model is one of the terms (it then scores, and judges the win rate)."""
    served: frozenset[str] = frozenset()
    """The terms a server scores: their NaN is a score that never arrived, not "no reward"."""

    def weighted(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The weighted sum of the terms that score a response alone, "no reward" (NaN) adding nothing. # -> (B,)"""
        return weighted_reward(values, self.weights, no_reward=values)


@dataclass(kw_only=True)
class Scoring:
    """The run's reward terms and what they need: the reward model (held by `models`, whose critic
    takes its scale), the reward functions, the servers, and the processes they are computed over."""

    cfg: PPOConfig
    accelerator: Accelerator
    models: Models
    functions: list[RewardFunction]
    """The `reward` terms that are Python functions, imported and checked."""
    remotes: list[RemoteReward]
    """The `reward` terms a server scores, each with its client."""
    prompts_as_sampled: bool = False
    """Whether each episode's prompt segment is its row's rendered prompt (`EpisodeSource.prompt_is_row`)."""

    def score(self, rollout: Rollout, loop: LoopState, iteration: int,
              timings: dict[str, float]) -> tuple[Rollout, Scores]:
        """Every term's values for this process's episodes and their weighted sum (collective: the
        functions and servers are asked from the main process for every process's rows). On the run's
        first round (`loop.normalization` unset) the reward model's normalisation is fitted and adopted:
        the rollout comes back with its values on the fitted scale too."""
        raw = self.raw_scores(rollout, timings)
        if raw and loop.normalization is None:  # the run's first round: the reward's scale
            loop.normalization, rollout = self.fitted_normalization(next(iter(raw.values())), rollout)
        functions = self.function_terms(rollout.messages, rollout.episodes, iteration, timings)
        remote, retries = self.remote_terms(rollout.messages, rollout.episodes, iteration, timings)
        if self.remotes:
            rollout = replace(rollout, figures=rollout.figures | {"remote/retries": retries})
        return rollout, self.scores_of(raw, rollout, functions, remote)

    @torch.no_grad()
    def raw_scores(self, rollout: Rollout, timings: dict[str, float]) -> dict[str, torch.Tensor]:
        """The reward model's outputs for the rollout's answers, before normalisation, under its term's
        name ({} without a reward model). Where the reward model shares the policy's tokenizer and each
        episode's prompt is its row's rendered prompt (`EpisodeSource.prompt_is_row`), the prompts are
        the policy's own ids, not rendered and encoded again. The answers are always encoded from their
        texts: a sampled token sequence need not be the one its text encodes to (5 of 8 responses of
        the untrained tiny world), and the reward model learned from encoded texts. # -> {name: (B,)}"""
        scorer = self.models.scorer
        if scorer is None:
            return {}
        with timed(timings, "score"):
            prompt_ids = None
            if scorer.policy_tokens and self.prompts_as_sampled:
                prompt_ids = [e.prompt_ids for e in rollout.episodes]
            sequences = scorer.encode(rollout.messages, rollout.texts, rollout.has_eos.tolist(), prompt_ids)
            raw = scorer.raw_scores(sequences)
        name = next(term.name for term in self.cfg.reward.terms if term.is_model)
        return {name: raw.to(rollout.queries.device)}

    def scores_of(self, raw: dict[str, torch.Tensor], rollout: Rollout, functions: dict[str, torch.Tensor],
                  remote: dict[str, torch.Tensor]) -> Scores:
        """The rollout's scores from the reward model's `raw` outputs, the reward functions' values, the
        servers' (NaN where a score never arrived, which drops the response) and the overlong penalty
        (`reward.overlong`, when set)."""
        cfg, terms = self.cfg, {}
        normalized = {name: self.models.scorer.normalize(values) for name, values in raw.items()}
        terms = {name: model_score(values, rollout.has_eos, cfg) for name, values in normalized.items()}
        served = {term.name for term in cfg.reward.remotes if term.remote.kind == "score"}  # a reward model, served
        terms |= functions | {name: model_score(v, rollout.has_eos, cfg) if name in served else v
                              for name, v in remote.items()}
        if cfg.reward.overlong is not None:
            terms[OVERLONG_TERM] = overlong_penalty(rollout.trainable.sum(dim=1), cfg.response_tokens,
                                                    cfg.reward.overlong.buffer)
        # a function's NaN is "no reward" (its answers are checked finite); a server's, a dropped response
        rows = len(rollout.episodes)
        reward = weighted_reward(terms, cfg.reward.weights, no_reward=[*functions, *remote]) if terms \
            else torch.zeros(rows, device=rollout.queries.device)  # no terms: a teacher's alone (distillation)
        dropped = torch.zeros(rows, dtype=torch.bool, device=reward.device)  # (B,)
        for values in remote.values():
            dropped = dropped | values.isnan()
        reported = next(iter(normalized.values())) if normalized else reward
        return Scores(terms=terms, reward=reward, reported=reported, dropped=dropped, raw=raw)

    def function_terms(self, messages: list[list[dict]], episodes: list[Episode], iteration: int,
                       timings: dict[str, float]) -> dict[str, torch.Tensor]:
        """Each reward function's values for this process's episodes' answers (NaN where it gave none),
        every process's rows computed on the main process (collective). # -> {name: (B,)}"""
        if not self.functions:
            return {}
        with timed(timings, "reward_functions"):
            rows = [(m, e.answer, e.columns) for m, e in zip(messages, episodes, strict=True)]
            every = self._functions_on_main(rows, iteration)
            first = self.accelerator.process_index * len(rows)
        return {name: _as_tensor(values[first:first + len(rows)], self.accelerator.device)
                for name, values in every.items()}

    def remote_terms(self, messages: list[list[dict]], episodes: list[Episode], iteration: int | str,
                     timings: dict[str, float]) -> tuple[dict[str, torch.Tensor], float]:
        """Each remote term's scores for this process's episodes' answers (NaN where none arrived), every
        process's rows sent from the main process (collective), and the requests retried; a failed batch
        may stop the run (`stages.rewards.remote.remote_values`). `choice` judges are asked where the
        episodes carry their `reference` (the SFT answer). # -> {name: (B,)}, retries"""
        if not self.remotes:
            return {}, 0.0
        with timed(timings, "remote_reward"):
            rows = _remote_rows(messages, episodes)
            every, retries = self._remote_on_main(rows, iteration, _compared(episodes))
            first = self.accelerator.process_index * len(rows)
        return {name: _as_tensor(values[first:first + len(rows)], self.accelerator.device)
                for name, values in every.items()}, float(retries)

    def term_judge(self) -> TermJudge | None:
        """The reward functions and servers as the evaluations score with them (None without such terms).
        Every process holds the same held-out prompts; the main process's responses are the ones judged
        and reported, so only its rows are sent (collective). A server's failures are NaN, as in training."""
        if not self.functions and not self.remotes:
            return None
        accelerator, reward = self.accelerator, self.cfg.reward

        def values(messages: list[list[dict]], episodes: list[Episode], judged: str) -> dict[str, torch.Tensor]:
            main, every = accelerator.is_main_process, {}
            if self.functions:
                rows = [(m, e.answer, e.columns) for m, e in zip(messages, episodes, strict=True)]
                every = self._functions_on_main(rows if main else [], judged)
            if self.remotes:
                rows = _remote_rows(messages, episodes)
                every |= self._remote_on_main(rows if main else [], judged, _compared(episodes))[0]
            return {name: _as_tensor(v, accelerator.device) for name, v in every.items()}

        pairwise = {term.name for term in reward.pairwise}
        return TermJudge(values, {term.name: term.weight for term in reward.terms if term.name not in pairwise},
                         reward.uses_model, frozenset(term.name for term in reward.remotes))

    def figures(self, scores: Scores) -> dict[str, float]:
        """What an iteration logs of its scores besides `rollout/score`: the reward model's raw mean, the
        share of responses a server never scored, and with terms besides the reward model each term's."""
        figures = {}
        for values in scores.raw.values():  # the reward model's, where one scores
            figures["rollout/score_raw"] = values.mean().item()
        if self.remotes:  # responses a server never scored, left out of the update
            figures["rollout/remote_failed_share"] = scores.dropped.float().mean().item()
        if self.functions or self.remotes or self.cfg.reward.overlong:  # terms besides the reward model's
            figures |= term_figures(scores.terms, {f.term.name for f in self.functions})
        return figures

    def fitted_normalization(self, raw: torch.Tensor, rollout: Rollout) -> tuple[Normalization, Rollout]:
        """The reward normalisation PPO keeps for the whole run, fitted on its first round's `raw`
        scores (`first_normalization`) and adopted: the scorer, and the critic if it takes it, on the
        fitted scale, and the round's values mapped alike (collective)."""
        normalization = first_normalization(self.accelerator, self.models.scorer, raw, self.cfg)
        values = self.models.adopt_normalization(normalization.gain, normalization.bias, rollout.values)
        return normalization, replace(rollout, values=values)

    def _functions_on_main(self, rows: list[tuple], batch: int | str) -> dict[str, list[float | None]]:
        """Every reward function's checked values for every process's (prompt messages, response, columns)
        rows, computed on the main process (collective)."""

        def compute(every: list[tuple]) -> dict[str, list[float | None]]:
            prompts, responses, records = ([row[i] for row in every] for i in range(3))
            return {f.term.name: reward_values(f, prompts, responses, {c: [r[c] for r in records] for c in f.columns},
                                               batch) for f in self.functions}

        return computed_on_main(self.accelerator, rows, compute)

    def _remote_on_main(self, rows: list[tuple], batch: int | str,
                        pairwise: bool) -> tuple[dict[str, list[float | None]], int]:
        """Every remote term's values for every process's (prompt messages, response, ended, SFT response)
        rows, and the retries, requested from the main process (collective); `choice` judges only where
        `pairwise`."""

        def compute(every: list[tuple]) -> tuple[dict[str, list[float | None]], int]:
            prompts, responses, complete, references = ([row[i] for row in every] for i in range(4))
            return remote_values(self.remotes, prompts, responses, complete, batch, references if pairwise else None)

        return computed_on_main(self.accelerator, rows, compute)


def model_score(scores: torch.Tensor, has_eos: torch.Tensor, cfg: PPOConfig) -> torch.Tensor:
    """A reward model's normalised scores (in this process or served) as PPO trains on them: a cut-off
    response's is `missing_eos_score`, all clipped to `score_clip`; NaN (no score arrived) stays. # (B,)"""
    term = apply_eos_penalty(scores, has_eos, cfg.missing_eos_score)
    term = term.clamp(-cfg.score_clip, cfg.score_clip) if cfg.score_clip is not None else term
    return torch.where(scores.isnan(), scores, term)


def term_figures(terms: dict[str, torch.Tensor], functions: set[str]) -> dict[str, float]:
    """Each reward term's mean and std over the responses it scored; for a function, the share of
    responses it gave no reward (`_none`)."""
    figures = {}
    for name, values in terms.items():  # (B,) each, NaN where a function gave none
        given = values[~values.isnan()]
        figures[f"rollout/reward/{name}"] = given.mean().item() if len(given) else 0.0
        figures[f"rollout/reward/{name}_std"] = given.std().item() if len(given) > 1 else 0.0
        if name in functions:
            figures[f"rollout/reward/{name}_none"] = values.isnan().float().mean().item()
    return figures


def _remote_rows(messages: list[list[dict]], episodes: list[Episode]) -> list[tuple]:
    """What a server scores of each episode: (prompt messages, answer, ended, the SFT answer or None)."""
    return [(m, e.answer, e.status == "ok", e.reference) for m, e in zip(messages, episodes, strict=True)]


def _compared(episodes: list[Episode]) -> bool:
    """Whether `choice` judges are asked: the episodes carry the SFT answers they compare with."""
    return any(e.reference is not None for e in episodes)


def _as_tensor(values: list[float | None], device: torch.device) -> torch.Tensor:
    """A function's values, NaN where it gave none. # -> (B,)"""
    return torch.tensor([float("nan") if v is None else v for v in values], device=device)


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
