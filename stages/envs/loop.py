"""The multi-turn loop: a batch of episodes sampled turn by turn, token in and token out.

Each turn samples every live episode's next assistant turn at once (`Sampler.generate_ids`, on the
context's token ids as they are: the model's sampled ids are never decoded and re-encoded). The
environment answers; its messages enter the context as the chat template's delta: the conversation
rendered with them, less what the context already stands for (`ChatDelta`). A template that renders
an earlier turn differently once a later one is added (not prefix-preserving) is refused, naming the
model and the template, since no delta would then be exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from rlhf.config_ppo import EnvironmentConfig
from stages.common.errors import StageUserError
from stages.common.tensors import response_mask
from stages.engines.sampler import Sampler, Sampling
from stages.envs.environment import (
    Environment,
    EnvironmentFactory,
    Step,
    environment_factory,
    parse_tool_calls,
)
from stages.envs.episode import Episode, EpisodeGeneration, Segment, episode_batch


class TemplateNotPrefixPreserving(StageUserError):
    """The chat template renders a conversation's earlier turns differently once a message is added."""


@dataclass(frozen=True)
class ChatDelta:
    """The chat template as the loop meets it: a conversation's rendering and the ids of what a new
    message adds to it."""

    tokenizer: PreTrainedTokenizerBase
    model: str
    """The model's location, for the refusal's message."""

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The conversation with the assistant's turn opened (`add_generation_prompt`)."""
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def delta(self, rendered: str, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
        """`messages` rendered, and the ids of what that rendering adds to `rendered`, the text the
        context's ids stand for; refused where `rendered` is not its prefix."""
        full = self.render(messages, tools)
        if not full.startswith(rendered):
            at = next((i for i, (a, b) in enumerate(zip(full, rendered, strict=False)) if a != b),
                      min(len(full), len(rendered)))
            raise TemplateNotPrefixPreserving(
                f"the chat template of {self.model} is not prefix-preserving: after a {messages[-1]['role']!r} "
                f"message it renders the conversation so far differently (at character {at}: "
                f"{rendered[at:at + 40]!r} became {full[at:at + 40]!r}), so the episode's sampled tokens would not "
                "be what the model sees next. Multi-turn episodes need a template that only appends "
                "(set `chat_template` to one that does)")
        return full, self.ids(full[len(rendered):])


@dataclass(kw_only=True)
class _Live:
    """An episode while it runs."""

    environment: Environment | None
    messages: list[dict]
    tools: list[dict] | None
    rendered: str
    """The text the context's ids stand for."""
    segments: list[Segment]
    status: str | None = None
    answer: str = ""
    tool_calls: int = 0
    error: str | None = None
    context: list[int] = field(default_factory=list)

    @property
    def after_prompt(self) -> int:
        return len(self.context) - len(self.segments[0].ids)

    def add(self, segment: Segment) -> None:
        self.segments.append(segment)
        self.context = self.context + segment.ids

    def episode(self) -> Episode:
        return Episode(segments=self.segments, status=self.status or "truncated", messages=self.messages,
                       answer=self.answer, tool_calls=self.tool_calls, error=self.error)


@dataclass(frozen=True, kw_only=True)
class EpisodeRunner:
    """Runs episodes against the configured environment on a sampler: what the rollout calls."""

    settings: EnvironmentConfig
    make: EnvironmentFactory | None
    """A prompt record -> its environment; None where `rollout` writes whole episodes."""
    rollout: Callable | None
    """The user's `(row, engine, tokenizer) -> Episode`; None for the loop."""
    chat: ChatDelta
    stop_ids: list[int]
    turn_tokens: int
    """New tokens per turn at most."""

    def generation(self, sampler: Sampler, rows: list[dict], temperature: float | None,
                   device: torch.device) -> EpisodeGeneration:
        """Every row's episode, as the rollout's batch."""
        episodes = self.episodes(sampler, rows, temperature)
        for episode, row in zip(episodes, rows, strict=True):
            episode.columns = {name: value for name, value in row.items() if name != "messages"}
        return episode_batch(episodes, self.chat.tokenizer.pad_token_id, device)

    def episodes(self, sampler: Sampler, rows: list[dict], temperature: float | None) -> list[Episode]:
        """The episodes of `rows`: by the user's rollout function, or the loop."""
        if self.rollout is not None:
            return [checked_episode(self.rollout(row, sampler, self.chat.tokenizer), row) for row in rows]
        return self.run(sampler, rows, temperature)

    def run(self, sampler: Sampler, rows: list[dict], temperature: float | None) -> list[Episode]:
        """The episodes of `rows`, all turns of a round sampled at once, each call asking for no more
        tokens than the turn and the roomiest episode's budget allow."""
        live = [self._start(row) for row in rows]
        for _ in range(self.settings.max_turns):
            active = [episode for episode in live if episode.status is None]
            if not active:
                break
            room = max(self.settings.episode_tokens - e.after_prompt for e in active)
            sampled = sampler.generate_ids([e.context for e in active],
                                           Sampling(min(self.turn_tokens, room), temperature))
            real = response_mask(sampled.responses, self.stop_ids).bool().tolist()  # (b, T)
            engine = [None] * len(active) if sampled.engine_logprobs is None else sampled.engine_logprobs.tolist()
            for episode, ids, mask, logprobs in zip(active, sampled.responses.tolist(), real, engine, strict=True):
                kept = sum(mask)
                self._turn(episode, ids[:kept], None if logprobs is None else logprobs[:kept])
        return [episode.episode() for episode in live]

    def _start(self, row: dict) -> _Live:
        """An episode's start: its environment reset, the conversation rendered. An environment that
        cannot start fails its episode (on the record's own messages), not the run."""
        environment, status, error = None, None, None
        try:
            environment = self.make(row)
            messages = list(environment.reset(row))
        except Exception as e:  # noqa: BLE001 - the user's environment failed: the episode fails, the run goes on
            messages, status, error = list(row["messages"]), "failed", f"{type(e).__name__}: {e}"
        tools = environment.schemas() if hasattr(environment, "schemas") else None
        rendered = self.chat.render(messages, tools)
        prompt = self.chat.ids(rendered)
        return _Live(environment=environment, messages=messages, tools=tools, rendered=rendered,
                     segments=[Segment(prompt, trainable=False)], context=list(prompt), status=status, error=error)

    def _turn(self, episode: _Live, ids: list[int], logprobs: list[float] | None) -> None:
        """One sampled turn (and the engine's log-probs of it, where not the trainer's): kept as sampled
        (cut to the episode's budget), then the environment's answer."""
        room = self.settings.episode_tokens - episode.after_prompt
        ended = bool(ids) and ids[-1] in self.stop_ids and len(ids) <= room
        ids, logprobs = ids[:room], None if logprobs is None else logprobs[:room]
        tokenizer = self.chat.tokenizer
        text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        episode.answer = tokenizer.decode(ids, skip_special_tokens=True)
        calls = parse_tool_calls(text)
        episode.tool_calls += len(calls or [])
        if not ended:  # out of tokens mid-turn: nothing the environment could answer
            episode.add(Segment(ids, trainable=True, logprobs=logprobs))
            episode.status = "truncated"
            return
        episode.messages = episode.messages + [{"role": "assistant", "content": text}]
        try:
            step = checked_step(episode.environment.step(text))
            delta = [] if step.done or not step.messages else self._observed(episode, ids, step.messages)
        except Exception as e:  # noqa: BLE001 - the environment (or its messages' rendering) failed: so does the episode
            step, delta, episode.status, episode.error = Step(None), [], "failed", f"{type(e).__name__}: {e}"
        episode.add(Segment(ids, trainable=True, reward=step.reward, logprobs=logprobs))
        if episode.status is not None:
            return
        if step.done or not step.messages:
            episode.status = "ok"
            return
        episode.add(Segment(delta[:max(self.settings.episode_tokens - episode.after_prompt, 0)], trainable=False))
        if episode.after_prompt >= self.settings.episode_tokens:
            episode.status = "truncated"

    def _observed(self, episode: _Live, ids: list[int], messages: list[dict]) -> list[int]:
        """The environment's messages appended: the ids of the template's delta after the model's turn
        (refused, failing the episode, where the turn does not render as it was sampled)."""
        rendered = episode.rendered + self.chat.tokenizer.decode(ids, skip_special_tokens=False)
        episode.messages = episode.messages + list(messages)
        episode.rendered, delta = self.chat.delta(rendered, episode.messages, episode.tools)
        return delta


def checked_step(answer: object) -> Step:
    """An environment's `step` answer as a `Step`: a (messages, reward, done) tuple, messages a list or None."""
    if not isinstance(answer, tuple) or not 1 <= len(answer) <= 3:
        raise TypeError(f"step must return (messages, reward, done), got {type(answer).__name__}")
    step = Step(*answer)
    if step.messages is not None and not isinstance(step.messages, list):
        raise TypeError(f"step's messages must be a list of chat messages or None, got {type(step.messages).__name__}")
    return Step(step.messages, float(step.reward), bool(step.done))


def checked_episode(episode: object, row: dict) -> Episode:
    """A user's rollout function's answer, refused unless it is an `Episode` that starts with its prompt."""
    prompt = row["messages"][-1]["content"][:60] if row.get("messages") else ""
    if not isinstance(episode, Episode):
        raise StageUserError(f"environment.rollout returned {type(episode).__name__} for the prompt {prompt!r}; "
                             "it must return a stages.envs.episode.Episode")
    if not episode.segments or episode.segments[0].trainable or not any(s.trainable for s in episode.segments):
        raise StageUserError(f"environment.rollout's episode for the prompt {prompt!r} must start with the prompt's "
                             "segment (not trainable) and hold at least one trainable segment")
    return episode


def episode_runner(settings: EnvironmentConfig | None, tokenizer: PreTrainedTokenizerBase, model: str,
                   stop_ids: list[int], response_length: int) -> EpisodeRunner | None:
    """The runner of `settings` (None: single-turn), its environment imported and its template checked
    to be prefix-preserving on a probe conversation before any episode runs."""
    if settings is None:
        return None
    make, rollout = environment_factory(settings)
    chat = ChatDelta(tokenizer, model)
    if rollout is None:
        probe = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                 {"role": "tool", "name": "probe", "content": "42"}]
        try:
            chat.delta(tokenizer.apply_chat_template(probe[:2], tokenize=False), probe, None)
        except TemplateNotPrefixPreserving:
            raise
        except Exception as e:  # noqa: BLE001 - a template's own error (jinja's raise_exception, a missing key)
            raise StageUserError(f"the chat template of {model} cannot render a conversation with a tool's answer "
                                 f"({type(e).__name__}: {e}); multi-turn episodes need one that can") from None
    return EpisodeRunner(settings=settings, make=make, rollout=rollout, chat=chat, stop_ids=stop_ids,
                         turn_tokens=settings.turn_tokens or response_length)
