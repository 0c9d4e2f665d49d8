"""The episode, the one unit of rollout, as token ids: what the environment loop (`stages.envs.loop`),
a user's own rollout function or a single turn (`SingleTurn`) gives, and how a batch of them becomes
the rollout's tensors (`episode_batch`, `single_turn_batch`). Every source of episodes is an
`EpisodeSource`; the rollout (`stages.rl.ppo_rollout`) takes `list[Episode]` and knows no other.

An episode is a list of segments. The first is the prompt; then the model's turns (trainable: the
ids it sampled, never re-tokenised) alternate with what the environment said back (not trainable:
tool results, other roles and the chat template's glue). Each trainable segment has its turn's
reward; the episode has a status: `ok` (it ended), `truncated` (a turn or the episode ran out of
tokens, or of turns) or `failed` (the environment raised, or too many malformed calls).

A chain is a run of segments the model saw as one context: an episode is one chain, unless its
environment rewrote the history (an agent program that summarises, or hands a sub-agent a fresh
context: `Step.restart`). Then a segment that `starts_chain` holds the new context, rendered whole,
and the turns after it were sampled on it alone. The batch keeps the chains of an episode on its one
row, each attending to itself only (`EpisodeGeneration.restarts`, packed passes), so the episode's
reward, group and advantage stay one.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from stages.common.errors import StageUserError
from stages.common.reporting import timed
from stages.common.tensors import is_end, response_mask
from stages.engines.sampler import Generation, Sampler, Sampling
from stages.envs.parsers import AssistantTurn, ToolParser, split_turn, without_special_tokens

Status = Literal["ok", "truncated", "failed"]


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A run of an episode's token ids, the model's own (`trainable`) or not."""

    ids: list[int]
    trainable: bool
    reward: float = 0.0
    """A trainable segment's turn reward (the environment's `step` reward): it lands on the turn's last token."""
    logprobs: list[float] | None = None
    """A trainable segment's log-probs by the engine that sampled it, where that engine is not the trainer
    (vLLM): the rollout weighs the mismatch as for single responses (`engine_logprobs`)."""
    version: int = 0
    """The policy version that sampled a trainable segment (updates its weights had had): its episode's
    staleness when sampled ahead, and more than one per episode where `rollout.partial` continued it."""
    starts_chain: bool = False
    """A context the environment rewrote, rendered whole (not trainable): the turns after it saw it alone."""


@dataclass(kw_only=True)
class Episode:
    """One prompt's episode: its segments (the first the prompt), its status and transcript."""

    segments: list[Segment]
    status: Status = "ok"
    messages: list[dict] = field(default_factory=list)
    """The conversation as chat messages, the model's turns included (for the samples table)."""
    answer: str = ""
    """The model's last turn, decoded without special tokens: what the reward functions score."""
    tool_calls: int = 0
    """Tool calls the model made (well-formed or not)."""
    reasoning_tokens: int = 0
    """Tokens of the model's reasoning blocks, over its turns (they train as its own)."""
    error: str | None = None
    """Why a `failed` episode failed."""
    retries: int = 0
    """Requests to an environment server tried again in this episode, a replay after a restart counting once."""
    columns: dict = field(default_factory=dict)
    """The prompt record's declared columns (`reward.columns`): the reward functions' inputs, and the tables'."""
    reference: str | None = None
    """The SFT policy's answer to the same prompt (its episode's last turn), which a `compare` judge
    compares this one with; set only where such a judge scores."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.segments[0].ids

    def add_turn_rewards(self, rewards: tuple[float, ...] | list[float]) -> None:
        """`rewards` added to the model's turns in order (the first ones, where fewer)."""
        turns = iter(at for at, segment in enumerate(self.segments) if segment.trainable)
        for at, reward in zip(turns, rewards, strict=False):
            self.segments[at] = dataclasses.replace(self.segments[at], reward=self.segments[at].reward + reward)

    @property
    def turns(self) -> int:
        """The model's turns."""
        return sum(s.trainable for s in self.segments)

    @property
    def rewritten_contexts(self) -> int:
        """The chains after the first: the times its environment rewrote the history."""
        return sum(s.starts_chain for s in self.segments)


@dataclass(kw_only=True)
class EpisodeGeneration(Generation):
    """A batch of episodes as the rollout takes them: the prompt as queries, everything after it as
    the response (B, T), the model's own tokens marked. Failed episodes are kept as rows with no
    trainable token, so every process holds the same number of rows; their score is set aside."""

    mask: torch.Tensor  # (B, T) 1.0 on every real token after the prompt: what the forward passes attend to
    trainable: torch.Tensor  # (B, T) 1.0 on the model's own tokens of an episode that did not fail
    turn_rewards: torch.Tensor  # (B, T) each turn's reward on its last token, 0 elsewhere
    restarts: torch.Tensor  # (B, T) 1.0 on the first token of an episode's later chain (`Sequences.restarts`)
    episodes: list[Episode]


def episode_batch(episodes: list[Episode], pad_id: int, device: torch.device) -> EpisodeGeneration:
    """Episodes as one left-padded prompt batch and one right-padded batch of what follows."""
    prompts = [e.prompt_ids for e in episodes]
    rests = [[i for s in e.segments[1:] for i in s.ids] for e in episodes]
    width, steps = max(len(p) for p in prompts), max(1, max(len(r) for r in rests))
    queries = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # (B, Tq)
    query_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    responses = torch.tensor([r + [pad_id] * (steps - len(r)) for r in rests])  # (B, T)
    mask = torch.zeros(len(episodes), steps)
    trainable, turn_rewards = torch.zeros(len(episodes), steps), torch.zeros(len(episodes), steps)
    engine, restarts = torch.zeros(len(episodes), steps), torch.zeros(len(episodes), steps)
    for row, episode in enumerate(episodes):
        start = 0
        for segment in episode.segments[1:]:
            end = start + len(segment.ids)
            mask[row, start:end] = 1.0
            if segment.starts_chain and end > start:
                restarts[row, start] = 1.0
            if segment.trainable and episode.status != "failed" and end > start:
                trainable[row, start:end] = 1.0
                turn_rewards[row, end - 1] += segment.reward
            if segment.logprobs is not None:
                engine[row, start:end] = torch.tensor(segment.logprobs[:end - start])
            start = end
    sampled_elsewhere = any(s.logprobs is not None for e in episodes for s in e.segments)
    return EpisodeGeneration(queries=queries.to(device), query_mask=query_mask.to(device),
                             responses=responses.to(device), mask=mask.to(device), trainable=trainable.to(device),
                             turn_rewards=turn_rewards.to(device), restarts=restarts.to(device), episodes=episodes,
                             engine_logprobs=engine.to(device) if sampled_elsewhere else None)


def in_chunks(items: list, size: int | None) -> list[list]:
    """`items` in runs of `size` (one run when unset): what a process samples at once."""
    size = size or max(len(items), 1)
    return [items[start:start + size] for start in range(0, len(items), size)]


class EpisodeSource:
    """Where a rollout's episodes come from: one turn per prompt (`SingleTurn`), an environment's loop
    (`stages.envs.loop.EpisodeRunner`), or either of them sampled ahead on a vLLM server
    (`stages.envs.ahead.SampledAhead`, through their `ahead` and `received`). The hooks after `now`
    are for work a source holds in flight between iterations: only a source that samples ahead has
    any; here they do nothing."""

    multi_turn: bool = False
    """Whether episodes have turns and tools worth reporting (transcripts, tool-call figures); reporting only."""
    prompt_is_row: bool = False
    """Whether every episode's prompt segment is its row's rendered `prompt`, token for token (a single
    turn's): then a reward model of the policy's tokenizer reads those ids instead of rendering them again."""
    max_failed_share: float = 1.0
    """The share of an iteration's episodes that may fail before the run stops (`check_failed_share`)."""

    @property
    def tags(self) -> dict[str, str]:
        """The run's tags of how its episodes were read (`rlhf.tool_parser`)."""
        return {}

    @property
    def figures(self) -> dict[str, float]:
        """What the source measured of its latest round besides time (a rollout's staleness)."""
        return {}

    def generation(self, sampler: Sampler, rows: list[dict], sampling: Sampling, device: torch.device,
                   timings: dict[str, float]) -> EpisodeGeneration:
        """Every row's episode (`rows`: each prompt's record: `prompt`, `messages`, declared columns), as a
        batch; the sampling timed into `timings` (`generate`)."""
        raise NotImplementedError

    def ahead(self, sampler: Sampler, rows: list[dict], sampling: Sampling, chunk: int | None
              ) -> Callable[[], deque]:
        """`rows`' episodes as work another thread runs while the trainer updates (`stages.envs.ahead`):
        what draws from the random stream is drawn here, on the caller's thread, so the episodes repeat
        with the run's seed whichever thread samples them; the work's answer is what `received` reads.
        Only a source whose sampler is a server (vLLM) is sampled ahead."""
        raise NotImplementedError(f"{type(self).__name__} is not sampled ahead")

    def received(self, sampled: deque, rows: list[dict], device: torch.device) -> EpisodeGeneration:
        """The batch of the next `rows` from the front of what `ahead`'s work answered."""
        raise NotImplementedError(f"{type(self).__name__} is not sampled ahead")

    def now(self) -> EpisodeSource:
        """The source that samples on the sampler as it is, now: itself, or the single turn a source
        that samples ahead reads its episodes with (the evaluations' and the SFT references')."""
        return self

    def settle(self, timings: dict[str, float]) -> None:
        """Wait until nothing is in flight, so the sampler may take new weights."""

    def save(self, folder: Path, rank: int) -> None:
        """What this process holds in flight, into a full-state checkpoint's `folder`."""

    def resume(self, folder: Path, rank: int, device: torch.device, version: int) -> None:
        """Continue from a full-state checkpoint written after iteration `version`."""

    def close(self) -> None:
        """Drop what is in flight; the stage calls it however it ends."""


@dataclass(frozen=True)
class SingleTurn(EpisodeSource):
    """Single-turn rollout: each prompt's episode is one response, against an environment that says
    nothing back. The rendered prompt is sampled in one `generate` call, so the sampling pass's
    log-probs and hidden states serve the update (`models.old_logprobs`). A thinking model's
    reasoning is read in its family's convention (`parse`: `stages.envs.parsers.reasoning_parser`) and
    kept out of the answer the reward terms score, unless `sees_reasoning`."""

    tokenizer: PreTrainedTokenizerBase
    stop_ids: list[int]
    parse: ToolParser = split_turn
    """A response's text -> its reasoning and answer."""
    sees_reasoning: bool = False
    """Whether the answer keeps the reasoning block (`reward.sees_reasoning`)."""
    prompt_is_row = True

    def generation(self, sampler: Sampler, rows: list[dict], sampling: Sampling, device: torch.device,
                   timings: dict[str, float]) -> EpisodeGeneration:
        with timed(timings, "generate"):
            generated = sampler.generate([row["prompt"] for row in rows], sampling)
        return self.batch(generated, rows)

    def ahead(self, sampler: Sampler, rows: list[dict], sampling: Sampling, chunk: int | None
              ) -> Callable[[], deque]:
        """The server's requests made here (tokenised, seeded), `chunk` rows each; the work sends them
        all at once and answers a `Generation` per chunk."""
        requests = [sampler.requests([row["prompt"] for row in part], sampling) for part in in_chunks(rows, chunk)]
        return lambda: deque(sampler.answer(requests))

    def received(self, sampled: deque, rows: list[dict], device: torch.device) -> EpisodeGeneration:
        generation = sampled.popleft()
        if len(generation.responses) != len(rows):
            raise RuntimeError(f"sampled ahead {len(generation.responses)} responses, but {len(rows)} rows asked")
        return self.batch(generation, rows)

    def batch(self, generation: Generation, rows: list[dict]) -> EpisodeGeneration:
        """Sampled single responses (cut at the first end token) as episodes of one trainable turn, the
        sampling pass's figures (log-probs, entropy, hidden states, computed tokens) kept."""
        mask = response_mask(generation.responses, self.stop_ids)  # (B, T) up to and including the first end token
        ended = is_end(generation.responses, self.stop_ids).any(dim=1).tolist()  # (B,)
        decoded = self.tokenizer.batch_decode(generation.responses, skip_special_tokens=True)
        episodes = []
        for row, query, query_mask, response, kept, end, text in zip(
                rows, generation.queries.tolist(), generation.query_mask.tolist(), generation.responses.tolist(),
                mask.tolist(), ended, decoded, strict=True):
            prompt = [i for i, real in zip(query, query_mask, strict=True) if real]
            turn = [i for i, real in zip(response, kept, strict=True) if real]
            read = self._read(turn, end, text)
            reasoning = len(self.tokenizer(read.reasoning, add_special_tokens=False)["input_ids"]) \
                if read.reasoning else 0
            episodes.append(Episode(segments=[Segment(ids=prompt, trainable=False),
                                              Segment(ids=turn, trainable=True, version=generation.version)],
                                    status="ok" if end else "truncated", answer=read.content,
                                    messages=[*row["messages"], read.message()], reasoning_tokens=reasoning,
                                    columns={k: v for k, v in row.items() if k not in ("prompt", "messages")}))
        sampled = {f.name: getattr(generation, f.name) for f in dataclasses.fields(Generation)}
        return EpisodeGeneration(**sampled, mask=mask, trainable=mask, turn_rewards=torch.zeros_like(mask),
                                 restarts=torch.zeros_like(mask),
                                 episodes=episodes)

    def _read(self, ids: list[int], ended: bool, decoded: str) -> AssistantTurn:
        """The response as its family writes it: its reasoning (where it has a block) apart from the
        answer, which is otherwise the text as decoded without special tokens; with `sees_reasoning`,
        the answer is all of it."""
        turn = self.parse(self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False))
        if turn.reasoning is None:
            return AssistantTurn(decoded, decoded)
        answer = decoded if self.sees_reasoning else without_special_tokens(self.tokenizer, turn.content)
        return AssistantTurn(turn.text, answer, turn.reasoning)


def transcript(episode: Episode) -> str:
    """The conversation as one readable text, each message on its own line under its role; an
    assistant turn's reasoning as `(thinking) ...` and each call as `-> name({...})`; tool results
    marked `[tool <name>]` so they stand apart from the model's turns."""
    lines = []
    for message in episode.messages:
        role = message["role"]
        label = f"[tool {message.get('name', '')}]".replace(" ]", "]") if role == "tool" else f"[{role}]"
        parts = [f"(thinking) {message['reasoning_content']}"] if message.get("reasoning_content") else []
        parts += [message["content"]] if message.get("content") or not message.get("tool_calls") else []
        parts += [f"-> {c['function']['name']}({json.dumps(c['function']['arguments'])})"
                  for c in message.get("tool_calls", [])]
        lines.append(f"{label} {' '.join(parts)}")
    return "\n".join(lines) + (f"\n[{episode.status}]" if episode.status != "ok" else "")


class TooManyFailedEpisodes(StageUserError):
    """More of an iteration's episodes failed than `environment.max_failed_share` allows."""


def check_failed_share(episodes: list[Episode], max_share: float) -> None:
    """Stop the run where more than `max_share` of `episodes` failed, naming the first failures' reasons."""
    failed = [e for e in episodes if e.status == "failed"]
    if episodes and len(failed) / len(episodes) > max_share:
        reasons = "; ".join(dict.fromkeys(str(e.error)[:300] for e in failed[:20]))
        raise TooManyFailedEpisodes(
            f"{len(failed)} of {len(episodes)} episodes failed, over environment.max_failed_share "
            f"({max_share:.0%}); the first reasons: {reasons}")


def episode_figures(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """A batch of episodes' figures: the model's turns and tool calls per episode, the share that
    called a tool, failed or were truncated, the tokens per episode in no loss term (`masked_tokens`:
    tool results and the template's glue, and all of a failed episode's), and the environment's
    rewards per episode (`environment_reward`: its turns' summed; an environment server's whole score)
    and its requests tried again per episode (`environment_retries`: a server's hiccups, 0 in process);
    and the contexts its environment rewrote per episode (`rewritten_contexts`: its later chains)."""
    n = max(len(episodes), 1)

    def masked(e: Episode) -> int:
        return sum(len(s.ids) for s in e.segments[1:] if not s.trainable or e.status == "failed")

    return {f"{prefix}/turns": sum(e.turns for e in episodes) / n,
            f"{prefix}/tool_calls": sum(e.tool_calls for e in episodes) / n,
            f"{prefix}/tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / n,
            f"{prefix}/failed_share": sum(e.status == "failed" for e in episodes) / n,
            f"{prefix}/reasoning_tokens": sum(e.reasoning_tokens for e in episodes) / n,
            f"{prefix}/truncated_share": sum(e.status == "truncated" for e in episodes) / n,
            f"{prefix}/masked_tokens": sum(masked(e) for e in episodes) / n,
            f"{prefix}/environment_reward": sum(s.reward for e in episodes for s in e.segments) / n,
            f"{prefix}/environment_retries": sum(e.retries for e in episodes) / n,
            f"{prefix}/rewritten_contexts": sum(e.rewritten_contexts for e in episodes) / n}
