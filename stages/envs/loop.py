"""The multi-turn loop: a batch of episodes sampled turn by turn, token in and token out.

`environment.schedule` says when a turn is sampled. In `rounds`, every live episode's next assistant
turn at once, then every environment answers; `continuous`, each episode's as soon as its environment
answered, the environments on threads of their own, so a slow tool holds only its episode. Either
way a turn is sampled on the context's token ids as they are (`Sampler.generate_ids`: the model's
sampled ids are never decoded and re-encoded). Each turn
is parsed in the model family's convention (`stages.envs.parsers`: reasoning, answer, tool calls) and
the environment answers; its messages enter the context as a fixed-base delta (`ChatDelta.observation`):
a fixed short conversation rendered with them, less the same without them. The model's sampled turns
are never rendered again, so templates that drop or reformat earlier reasoning (Qwen3, DeepSeek, GLM,
gpt-oss) are exact. A template whose rendering of a new message depends on the history before it is
refused at the probe (`probe_template`), before any episode runs, naming what changed.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedTokenizerBase

from rlhf.sections.environment import EnvironmentConfig
from stages.common.errors import StageUserError
from stages.common.reporting import timed
from stages.common.tensors import response_mask
from stages.common.user_code import imported_function
from stages.engines.sampler import Sampler, Sampling
from stages.envs.answering import Answering, Batched, OneByOne, reset_one, step_one
from stages.envs.environment import Environment, EnvironmentFactory, EnvironmentSetupError, Step, environment_factory
from stages.envs.episode import Episode, EpisodeGeneration, EpisodeSource, Segment, SingleTurn, episode_batch
from stages.envs.parsers import (
    AssistantTurn,
    ToolParser,
    hermes,
    never_raising,
    reasoning_parser,
    tool_parser,
    without_special_tokens,
)
from stages.envs.remote.served import EnvironmentServer, ServedEpisode


class TemplateNotAppendOnly(StageUserError):
    """The chat template cannot give an environment's messages as a delta that holds in any conversation."""


BASE_PROMPT = [{"role": "user", "content": "Hi."}]
"""The fixed conversation an observation is rendered after (with a stand-in of the model's turn)."""


def stand_in_turn(messages: list[dict], reasoning: bool) -> dict:
    """The model's turn in the fixed base: one call per tool message that answers it (named as the
    message is), so a template that pairs answers with calls renders them; plain text otherwise."""
    names = [m.get("name") or "tool" for m in messages if m.get("role") == "tool"]
    turn = {"role": "assistant", "content": "Ok."} if not names else {
        "role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": n, "arguments": {}}} for n in names]}
    return turn | ({"reasoning_content": "Hm."} if reasoning else {})


def fixed_base(messages: list[dict], rounds: int, reasoning: bool) -> list[dict]:
    """The conversation an observation of `messages` is rendered after: `BASE_PROMPT`, `rounds` earlier
    rounds (a reasoning turn's call and its answer: a template may render the first answer of a
    conversation unlike later ones, as DeepSeek-V3's does), then the stand-in of the model's turn."""
    earlier = [stand_in_turn(messages, reasoning=True), *({"role": "tool", "name": m.get("name") or "tool",
                                                          "content": "1"} for m in messages)]
    return [*BASE_PROMPT, *earlier * rounds, stand_in_turn(messages, reasoning)]


@dataclass(frozen=True)
class ChatDelta:
    """The chat template as the loop meets it: the prompt's rendering, and what an environment's
    messages add after one of the model's turns, by a fixed-base delta: the base conversation with
    them, less the same base without them (`observation`). The model's own turns are never rendered
    again, so templates that restructure earlier turns (dropping or reformatting reasoning) are exact."""

    tokenizer: PreTrainedTokenizerBase
    model: str
    """The model's location, for the refusal's message."""
    stop_texts: tuple[str, ...] = ()
    """The stop tokens as text: where the model's turn ends in a rendering."""

    def render(self, messages: list[dict], tools: list[dict] | None, generation: bool = True) -> str:
        """The conversation, with the assistant's turn opened (`add_generation_prompt`) unless `generation` is off."""
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation)
        except Exception:  # noqa: BLE001 - a template that wants a call's arguments as JSON text (DeepSeek-V3's)
            if not any("tool_calls" in m for m in messages):
                raise
            return self.tokenizer.apply_chat_template(_arguments_as_text(messages), tools=tools, tokenize=False,
                                                      add_generation_prompt=generation)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def observation(self, messages: list[dict], tools: list[dict] | None, stop: str, rounds: int) -> str:
        """What follows a model's turn that ended with `stop`: the template's text after that token (the
        turn's closing glue), `messages`, and the next turn's opening, rendered after a fixed base
        (`fixed_base`: `rounds` earlier call-and-answer rounds, then a stand-in of the turn), never after
        the episode's own turns. The stand-in has no reasoning or, where the template renders it
        differently once a message follows (Qwen3's empty block on the last turn), a reasoning block."""
        try:
            return self._observation(messages, tools, stop, rounds, reasoning=False)
        except TemplateNotAppendOnly as first:
            try:
                return self._observation(messages, tools, stop, rounds, reasoning=True)
            except TemplateNotAppendOnly:
                raise first from None

    def _observation(self, messages: list[dict], tools: list[dict] | None, stop: str, rounds: int,
                     reasoning: bool) -> str:
        first = fixed_base(messages, 0, reasoning)  # the turn's closing glue, as the first turn renders it
        before, closed = self.render(first[:-1], tools, generation=False), self.render(first, tools, generation=False)
        self._appends(before, closed, "an assistant's turn")
        turn, base = closed[len(before):], first
        if rounds:  # a later observation: rendered after earlier rounds (the first one's base is `first`)
            base = fixed_base(messages, rounds, reasoning)
            closed = self.render(base, tools, generation=False)
        extended = self.render(base + list(messages), tools)
        self._appends(closed, extended, f"a {messages[0]['role']!r} message" if messages else "a message")
        added = extended[len(closed):]
        ends = [end for end in dict.fromkeys((stop, *self.stop_texts)) if end]
        for end in ends:
            if end in turn:  # the turn's closing as rendered: the glue after its stop token
                return turn[turn.rindex(end) + len(end):] + added
        for end in ends:
            if added.startswith(end):  # the stop token opens what follows (GLM's <|observation|>)
                return added[len(end):]
        return added

    def _appends(self, before: str, after: str, what: str) -> None:
        """Refuse a template whose rendering of a conversation is not a prefix of it with `what` added."""
        if after.startswith(before):
            return
        at = next((i for i, (a, b) in enumerate(zip(after, before, strict=False)) if a != b),
                  min(len(after), len(before)))
        raise TemplateNotAppendOnly(
            f"the chat template of {self.model} renders the conversation before {what} differently once it is "
            f"added (at character {at}: {before[at:at + 40]!r} became {after[at:at + 40]!r}), so that message has "
            "no delta of its own. Set `chat_template` to one that appends")


def _arguments_as_text(messages: list[dict]) -> list[dict]:
    """The messages with each call's arguments as JSON text, for templates that concatenate them."""

    def text_call(call: dict) -> dict:
        function = call["function"]
        arguments = function["arguments"]
        return {**call, "function": {**function,
                                     "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}

    return [{**m, "tool_calls": [text_call(c) for c in m["tool_calls"]]} if "tool_calls" in m else m
            for m in messages]


@dataclass(kw_only=True)
class Running:
    """An episode while it runs: the `Episode` as it grows, its environment and tools, and the context
    the next turn is sampled on (every segment's ids so far)."""

    episode: Episode
    environment: Environment | None
    tools: list[dict] | None
    context: list[int]
    ended: bool = False
    """Whether the episode has its status: it answered, ran out of room, or failed."""
    seed: int | None = None
    """Continuous episodes, or sampled ahead: turn t is drawn from its own stream, seeded `seed + t`; None:
    the round's stream."""
    version: int = 0
    """The policy version that sampled its latest turn."""
    answers_in_context: int = 0
    """Whether the chain's rewritten context already holds a tool's answer (the next observation is then a
    later round's, `ChatDelta.observation`)."""

    @property
    def after_prompt(self) -> int:
        """Tokens after the prompt, every chain's: what the episode's budget counts (the batch row's width)."""
        return sum(len(segment.ids) for segment in self.episode.segments[1:])

    def add(self, segment: Segment) -> None:
        """`segment` appended; the next turn's context is the chain's, from its start (`starts_chain`)."""
        self.episode.segments.append(segment)
        self.context = list(segment.ids) if segment.starts_chain else self.context + segment.ids

    def end(self, status: str, error: str | None = None) -> None:
        self.episode.status, self.ended = status, True
        if error is not None:
            self.episode.error = error


@dataclass(frozen=True, kw_only=True)
class EpisodeRunner(EpisodeSource):
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
    answering: Answering
    """How a round's environments answer (`stages.envs.answering`): one by one, or a server's in batches."""
    parse: ToolParser = never_raising(hermes)
    """A turn's text -> its reasoning, answer and calls (`environment.tool_parser`, never raising)."""
    parser_name: str = "hermes"
    """The convention `parse` reads, for the run's tags."""
    sees_reasoning: bool = False
    """Whether the episode's answer (what the reward terms score) keeps the last turn's reasoning."""

    multi_turn = True

    @property
    def max_failed_share(self) -> float:
        return self.settings.max_failed_share

    @property
    def tags(self) -> dict[str, str]:
        """Which tool-call convention the loop read turns in (none where the user's rollout writes episodes)."""
        return {} if self.rollout is not None else {"rlhf.tool_parser": self.parser_name}

    def close(self) -> None:
        """What the environments share let go (an agent endpoint stopped), however the stage ends."""
        if hasattr(self.make, "close"):
            self.make.close()

    def generation(self, sampler: Sampler, rows: list[dict], sampling: Sampling, device: torch.device,
                   timings: dict[str, float]) -> EpisodeGeneration:
        """Every row's episode, as the rollout's batch (each turn at most `turn_tokens`, whatever
        `sampling.max_new_tokens` says: an episode's budget is `environment.episode_tokens`)."""
        with timed(timings, "generate"):
            episodes = self.episodes(sampler, rows, sampling.temperature, timings)
        return episode_batch(episodes, self.chat.tokenizer.pad_token_id, device)

    def ahead(self, sampler: Sampler, rows: list[dict], sampling: Sampling, chunk: int | None
              ) -> Callable[[], deque]:
        """The episodes' seeds drawn here; the work runs every row's episode at once (the schedule's
        concurrency spans the whole rollout, not a chunk) and answers them in row order. It parses and
        renders on its own thread: call it on a copy of the runner, whose tokenizer is its own."""
        seeds = self.seeds(len(rows))
        return lambda: deque(self.episodes(sampler, rows, sampling.temperature, seeds=seeds))

    def received(self, sampled: deque, rows: list[dict], device: torch.device) -> EpisodeGeneration:
        episodes = [sampled.popleft() for _ in rows]
        return episode_batch(episodes, self.chat.tokenizer.pad_token_id, device)

    def seeds(self, episodes: int) -> list[int]:
        """A seed per episode from this thread's random stream: turn t of an episode is drawn from `seed + t`."""
        return torch.randint(0, 2**31 - 1 - self.settings.max_turns, (episodes,)).tolist()

    def episodes(self, sampler: Sampler, rows: list[dict], temperature: float | None,
                 timings: dict[str, float] | None = None, seeds: list[int] | None = None) -> list[Episode]:
        """The episodes of `rows`, by the user's rollout function or the loop (`environment.schedule`;
        `seeds`, each episode's, where the caller drew them), each with its row's declared columns."""
        if self.rollout is not None:
            episodes = [checked_episode(self.rollout(row, sampler, self.chat.tokenizer), row) for row in rows]
        else:
            episodes = self.run(sampler, rows, temperature, timings, seeds)
        for episode, row in zip(episodes, rows, strict=True):  # what the environment gave beside the record's own
            episode.columns = {name: value for name, value in row.items() if name not in ("prompt", "messages")} \
                | episode.columns
        return episodes

    def run(self, sampler: Sampler, rows: list[dict], temperature: float | None,
            timings: dict[str, float] | None = None, seeds: list[int] | None = None) -> list[Episode]:
        """The loop's episodes of `rows`, in `rounds` or `continuous`ly; each let go of its environment.
        `timings` gains `episode_wait`: the seconds this thread waited on what others compute (the
        environments, and a server's turns), not sampling itself. With `seeds`, each episode's turns
        are drawn from its own streams in either schedule; without, `continuous` draws the seeds here
        and `rounds` samples each round from this thread's stream."""
        run = self.rounds if self.settings.schedule == "rounds" else self.continuous
        live = run(sampler, rows, temperature, {} if timings is None else timings, seeds)
        self.answering.close([running.environment for running in live])
        for running in live:
            running.episode.retries = getattr(running.environment, "retries", 0)
            running.episode.add_turn_rewards(getattr(running.environment, "turn_rewards", ()))
            running.episode.columns = dict(getattr(running.environment, "columns", {}))
            if not running.ended:  # out of turns
                running.end("truncated")
        return [running.episode for running in live]

    def rounds(self, sampler: Sampler, rows: list[dict], temperature: float | None,
               timings: dict[str, float], seeds: list[int] | None) -> list[Running]:
        """The episodes of `rows`, all turns of a round sampled at once, each call asking for no more
        tokens than the turn and the roomiest episode's budget allow; then every environment answers."""
        with timed(timings, "episode_wait"):
            resets = self.answering.resets(self.make, rows)
        live = self._started(resets, seeds)
        for _ in range(self.settings.max_turns):
            active = [running for running in live if not running.ended]
            room = sampler.most(max((self.settings.episode_tokens - e.after_prompt for e in active), default=0))
            if not room:  # no process has an episode left
                break
            if not active:  # a sharded policy samples collectively: step on a placeholder until the others end
                sampler.generate_ids([live[0].context], Sampling(min(self.turn_tokens, room), temperature))
                continue
            with timed(timings, "episode_wait") if sampler.concurrent else nullcontext():
                sampled = self._sampled(sampler, active, temperature, room)
            turns = [self._parsed(*turn) for turn in sampled]
            with timed(timings, "episode_wait"):
                answers = self.answering.steps([turn and (turn[0].environment, turn[1]) for turn in turns])
            for episode, turn, answer in zip(active, turns, answers, strict=True):
                if turn is not None:
                    self._answered(episode, *turn[1:], answer)
        return live

    def continuous(self, sampler: Sampler, rows: list[dict], temperature: float | None,
                   timings: dict[str, float], seeds: list[int] | None) -> list[Running]:
        """The episodes of `rows`, each taking its next turn as soon as its environment answered: the
        environments run on `concurrent_episodes` threads, never this one. On a server (`concurrent`)
        each turn is a request of its own; otherwise a decode call starts once the episodes ready for
        it are at least as many as those still with their environment (so a straggler holds no one,
        and a wave of answers takes a few calls, not one each), and takes every ready episode. Each
        turn is drawn from the episode's own stream (seeded from this thread's stream here), so its
        tokens do not depend on which episodes share its batch. Parsing and rendering stay on this
        thread: the tokenizer is never shared between threads."""
        seeds = self.seeds(len(rows)) if seeds is None else seeds
        workers = self.settings.environments_at_once
        with ThreadPoolExecutor(workers, "episode") as environments, \
                ThreadPoolExecutor(len(rows) if sampler.concurrent else 1, "turn") as requests:
            with timed(timings, "episode_wait"):
                resets = list(environments.map(partial(reset_one, self.make), rows))
            live = self._started(resets, seeds)
            order = {id(running): index for index, running in enumerate(live)}  # what ends together: in row order
            ready, pending = [running for running in live if not running.ended], {}
            while ready or pending:
                if sampler.concurrent:  # the server batches the requests in flight
                    pending |= {requests.submit(self._sampled, sampler, [running], temperature): [running]
                                for running in ready}
                    ready = []
                elif ready and len(ready) >= len(pending):  # a decode call costs about the same for one
                    self._take(self._sampled(sampler, ready, temperature), pending, environments)
                    ready = []  # row as for many: wait until the ready are as many as those still out
                if not pending:
                    continue
                with timed(timings, "episode_wait"):
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: order[id(pending[f][0])]):
                    waited = pending.pop(future)
                    if isinstance(waited, list):  # a server's turn
                        self._take(future.result(), pending, environments)
                        continue
                    running = waited[0]
                    self._answered(*waited, future.result())
                    if not running.ended and running.episode.turns < self.settings.max_turns:
                        ready.append(running)
        return live

    def _take(self, sampled: list[tuple], pending: dict, environments: ThreadPoolExecutor) -> None:
        """Sampled turns parsed; each that the environment must answer is sent to it."""
        for turn in (self._parsed(*one) for one in sampled):
            if turn is not None:
                pending[environments.submit(step_one, turn[0].environment, turn[1])] = turn

    def _sampled(self, sampler: Sampler, active: list[Running], temperature: float | None, room: int | None = None
                 ) -> list[tuple[Running, list[int], list[float] | None]]:
        """The next turn of each of `active` (one `generate_ids` call, no more tokens than the turn and
        the roomiest episode's budget allow, or `room`, the roomiest of every process's): its ids to the
        end token, and the engine's log-probs."""
        room = room or max(self.settings.episode_tokens - e.after_prompt for e in active)
        seeds = None if active[0].seed is None else tuple(e.seed + e.episode.turns for e in active)
        sampled = sampler.generate_ids([e.context for e in active],
                                       Sampling(min(self.turn_tokens, room), temperature, seeds=seeds))
        for running in active:
            running.version = sampled.version
        real = response_mask(sampled.responses, self.stop_ids).bool().tolist()  # (b, T)
        engine = [None] * len(active) if sampled.engine_logprobs is None else sampled.engine_logprobs.tolist()
        return [(episode, ids[:sum(mask)], None if logprobs is None else logprobs[:sum(mask)])
                for episode, ids, mask, logprobs in zip(active, sampled.responses.tolist(), real, engine, strict=True)]

    def _started(self, resets: list[tuple], seeds: list[int] | None) -> list[Running]:
        """Each episode's start, its conversation rendered, its seed given; one whose environment could
        not start fails (not the run)."""
        live = []
        for index, (environment, messages, error) in enumerate(resets):
            tools = environment.schemas() if hasattr(environment, "schemas") else None
            prompt = self.chat.ids(self.chat.render(messages, tools))
            running = Running(episode=Episode(segments=[Segment(ids=prompt, trainable=False)], messages=messages),
                              environment=environment, tools=tools, context=list(prompt),
                              seed=None if seeds is None else seeds[index])
            if error is not None:
                running.end("failed", error)
            live.append(running)
        return live

    def _parsed(self, running: Running, ids: list[int], logprobs: list[float] | None
                ) -> tuple[Running, AssistantTurn, list[int], list[float] | None] | None:
        """One sampled turn (and the engine's log-probs of it, where not the trainer's): kept as sampled
        (cut to the episode's budget) and parsed; None where it ran out of tokens mid-turn (the episode
        is then `truncated`), else what the environment is asked (`step_one`) and its answer applied to."""
        room = self.settings.episode_tokens - running.after_prompt
        ended = bool(ids) and ids[-1] in self.stop_ids and len(ids) <= room
        ids, logprobs = ids[:room], None if logprobs is None else logprobs[:room]
        tokenizer, episode = self.chat.tokenizer, running.episode
        turn = self.parse(tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False))
        episode.answer = tokenizer.decode(ids, skip_special_tokens=True) if self.sees_reasoning else \
            without_special_tokens(tokenizer, turn.content)
        episode.messages = episode.messages + [turn.message()]
        episode.tool_calls += len(turn.calls)
        episode.reasoning_tokens += len(self.chat.ids(turn.reasoning)) if turn.reasoning else 0
        if not ended:  # out of tokens mid-turn: nothing the environment could answer
            running.add(Segment(ids=ids, trainable=True, logprobs=logprobs, version=running.version))
            running.end("truncated")
            return None
        return running, turn, ids, logprobs

    def _answered(self, running: Running, turn: AssistantTurn, ids: list[int], logprobs: list[float] | None,
                  answer: Step | Exception) -> None:
        """The turn kept with the environment's answer: its reward, and its messages as the next context."""
        try:
            if isinstance(answer, Exception):
                raise answer
            step = answer
            delta = [] if step.done or not step.messages else \
                self._rewritten(running, step.messages) if step.restart else \
                self._observed(running, ids[-1], step.messages)
        except Exception as e:  # noqa: BLE001 - the environment (or its messages' rendering) failed: so does the episode
            step, delta = Step(None), []
            running.end("failed", f"{type(e).__name__}: {e}")
        running.add(Segment(ids=ids, trainable=True, reward=step.reward, logprobs=logprobs, version=running.version))
        if running.ended:
            return
        if step.done or not step.messages:
            running.end("ok")
            return
        running.add(Segment(ids=delta[:max(self.settings.episode_tokens - running.after_prompt, 0)], trainable=False,
                            starts_chain=step.restart))
        if running.after_prompt >= self.settings.episode_tokens:
            running.end("truncated")

    def _observed(self, running: Running, stop_id: int, messages: list[dict]) -> list[int]:
        """The environment's messages appended: the ids of the template's fixed-base delta after a turn
        that ended with `stop_id` (its closing glue, the messages, the next turn's opening)."""
        running.episode.messages = running.episode.messages + list(messages)
        stop = self.chat.tokenizer.decode([stop_id], skip_special_tokens=False)
        segments = running.episode.segments
        chain = max((at for at, s in enumerate(segments) if s.starts_chain), default=0)
        # the first observation of the chain (its context holding no answer yet), or a later one
        rounds = min(sum(not s.trainable for s in segments[chain + 1:]) + running.answers_in_context, 1)
        return self.chat.ids(self.chat.observation(list(messages), running.tools, stop, rounds))

    def _rewritten(self, running: Running, messages: list[dict]) -> list[int]:
        """A new chain's context, the environment's rewritten history, rendered whole with the turn opened
        (as the prompt is): the next turns are sampled on these ids alone, and kept as sampled."""
        running.episode.messages = running.episode.messages + [
            {"role": "context", "content": f"(the history rewritten: {len(messages)} messages from here on)"},
            *messages]
        running.answers_in_context = int(any(m.get("role") == "tool" for m in messages))
        return self.chat.ids(self.chat.render(list(messages), running.tools))


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


def probe_template(chat: ChatDelta) -> None:
    """Refuse, before any episode runs, a template that cannot render a tool's answer after a call, or
    whose rendering of an answer still depends on the conversation before it after one earlier round
    (the fixed base would then differ from the template's own rendering), naming what changed."""
    answer = [{"role": "tool", "name": "probe", "content": "43"}]
    stop = chat.stop_texts[0] if chat.stop_texts else ""
    try:
        first, later, later_still = (chat.observation(answer, None, stop, rounds) for rounds in (0, 1, 2))
    except TemplateNotAppendOnly:
        raise
    except Exception as e:  # noqa: BLE001 - a template's own error (jinja's raise_exception, a missing key)
        raise StageUserError(f"the chat template of {chat.model} cannot render a conversation with a tool's answer "
                             f"({type(e).__name__}: {e}); multi-turn episodes need one that can") from None
    if later != later_still:
        raise TemplateNotAppendOnly(
            f"the chat template of {chat.model} renders a tool's answer differently the longer the conversation: "
            f"{first!r} after one call, {later!r} after two, {later_still!r} after three, so an observation's "
            "tokens would depend on the episode's history. Set `chat_template` to one that renders each message "
            "on its own")


def episode_source(settings: EnvironmentConfig | None, tokenizer: PreTrainedTokenizerBase, model: str,
                   stop_ids: list[int], response_length: int, sees_reasoning: bool = False) -> EpisodeSource:
    """A single turn per prompt where no environment is set (`SingleTurn`, reading a thinking model's
    reasoning in its family's convention), else `episode_runner`'s."""
    if settings is None:
        return SingleTurn(tokenizer, stop_ids, reasoning_parser(tokenizer), sees_reasoning)
    return episode_runner(settings, tokenizer, model, stop_ids, response_length, sees_reasoning)


def served_episodes(settings: EnvironmentConfig) -> tuple[EnvironmentFactory, Answering]:
    """A factory of episodes on the server `settings.server` names (one client for all), our protocol's or
    OpenEnv's, and how a round's requests go: in batches where the server takes them, else one by one."""
    server = EnvironmentServer(settings.server)
    if settings.server.kind != "openenv":
        at_once = settings.environments_at_once
        answering = Batched(server, at_once) if server.batches() else OneByOne(at_once)
        return lambda row: ServedEpisode(server), answering
    from stages.envs.remote.openenv_client import OpenEnvEpisode  # websockets: imported where an OpenEnv server is used

    return lambda row: OpenEnvEpisode(server), OneByOne(settings.environments_at_once)


def agent_episodes(settings: EnvironmentConfig) -> EnvironmentFactory:
    """A factory of episodes of the agent program `settings.agent` names, all on one endpoint (`stages.envs.agent`)."""
    from stages.envs.agent import AgentEpisodes  # aiohttp and openai: imported where an agent is used

    program = imported_function(settings.agent, "environment.agent", EnvironmentSetupError, "ppo.paths")
    return AgentEpisodes(program, settings.tool_timeout_s)


def episode_runner(settings: EnvironmentConfig, tokenizer: PreTrainedTokenizerBase, model: str,
                   stop_ids: list[int], response_length: int, sees_reasoning: bool = False) -> EpisodeRunner:
    """The runner of `settings`, its environment imported, its tool parser chosen and its template
    probed (`probe_template`) before any episode runs."""
    answering = OneByOne(settings.environments_at_once)
    if settings.server is not None:
        (make, answering), rollout = served_episodes(settings), None
    elif settings.agent is not None:
        make, rollout = agent_episodes(settings), None
    else:
        make, rollout = environment_factory(settings)
    chat = ChatDelta(tokenizer, model, tuple(tokenizer.decode([i], skip_special_tokens=False) for i in stop_ids))
    parse, parser_name = tool_parser(settings.tool_parser, tokenizer, model, lambda location: imported_function(
        location, "environment.tool_parser", EnvironmentSetupError, "ppo.paths"), settings.max_turn_chars)
    if rollout is None:
        probe_template(chat)
    return EpisodeRunner(settings=settings, make=make, rollout=rollout, chat=chat, stop_ids=stop_ids,
                         turn_tokens=response_length, answering=answering, parse=parse, parser_name=parser_name,
                         sees_reasoning=sees_reasoning)
