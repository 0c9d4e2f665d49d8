"""How a round's environments answer (`stages.envs.loop`, the `rounds` schedule): every episode's reset,
then after each sampled round every episode's step.

    OneByOne  each episode's reset and step a call of its own, at most `workers` at once on threads
              (in-process environments one after another; a server's requests side by side)
    Batched   a server of our protocol that takes batches: a round's resets, a round's steps and the
              closes, one request each (`/reset_many`, `/step_many`, `/close_many`), not one per episode

Either way an episode whose environment fails fails alone, with the reason, not the run. `continuous`
episodes step on their own (`reset_one`, `step_one`), each as its environment answers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from stages.envs.environment import Environment, EnvironmentFactory, Step
from stages.envs.parsers import AssistantTurn
from stages.envs.remote.served import EnvironmentServer, EpisodeRequestFailed, ServedEpisode, jsonable

Reset = tuple[Environment | None, list[dict], str | None]
"""An episode's environment, its opening messages, and why it could not start (None: it started)."""
Asked = tuple[Environment, AssistantTurn] | None
"""An episode's environment and the model's turn it answers (None: the episode asks nothing this round)."""


def reset_one(make: EnvironmentFactory, row: dict) -> Reset:
    """An episode's environment, made and reset: its opening messages, or (on the record's own
    messages) why it could not start."""
    environment = None
    try:
        environment = make(row)
        return environment, list(environment.reset(row)), None
    except Exception as e:  # noqa: BLE001 - the user's environment failed: the episode fails, the run goes on
        return environment, list(row["messages"]), f"{type(e).__name__}: {e}"


def step_one(environment: Environment, turn: AssistantTurn) -> Step | Exception:
    """The environment's answer to the turn, or what it raised (the episode fails, not the run)."""
    try:
        return checked_step(environment.step(turn))
    except Exception as e:  # noqa: BLE001 - the user's environment or its server failed: so does the episode
        return e


def checked_step(answer: object) -> Step:
    """An environment's `step` answer as a `Step`: a (messages, reward, done[, restart]) tuple, messages a
    list or None."""
    if not isinstance(answer, tuple) or not 1 <= len(answer) <= len(Step._fields):
        raise TypeError(f"step must return (messages, reward, done), got {type(answer).__name__}")
    step = Step(*answer)
    if step.messages is not None and not isinstance(step.messages, list):
        raise TypeError(f"step's messages must be a list of chat messages or None, got {type(step.messages).__name__}")
    return Step(step.messages, float(step.reward), bool(step.done), bool(step.restart))


class Answering(Protocol):
    """A round's resets and steps, in the episodes' order."""

    def resets(self, make: EnvironmentFactory, rows: list[dict]) -> list[Reset]: ...

    def steps(self, asked: list[Asked]) -> list[Step | Exception | None]: ...

    def close(self, environments: list[Environment | None]) -> None:
        """The episodes' environments let go (a server's episodes closed), the run's end or not."""


@dataclass(frozen=True)
class OneByOne:
    """Each episode's reset and step a call of its own: at most `workers` at once (a server's requests wait
    side by side), one after another for 1 (in-process environments)."""

    workers: int

    def resets(self, make: EnvironmentFactory, rows: list[dict]) -> list[Reset]:
        return self._each(lambda row: reset_one(make, row), rows)

    def steps(self, asked: list[Asked]) -> list[Step | Exception | None]:
        return self._each(lambda one: one and step_one(*one), asked)

    def close(self, environments: list[Environment | None]) -> None:
        for environment in environments:  # a server's episode let go (an in-process environment may hold resources)
            if hasattr(environment, "close"):
                environment.close()

    def _each(self, work, items: list) -> list:
        if self.workers == 1 or len(items) < 2:
            return [work(item) for item in items]
        with ThreadPoolExecutor(min(self.workers, len(items)), "episode") as pool:
            return list(pool.map(work, items))


@dataclass(frozen=True)
class Batched:
    """A round's resets, and its steps, as one request each to a server that takes batches (our protocol's
    `/reset_many` and `/step_many`: one request where there were one per episode). An item the server
    lost or could not take now is sent again alone (`ServedEpisode`'s rules: replayed, retried)."""

    server: EnvironmentServer
    at_once: int
    """Items the server answers at a time (`environment.concurrent_episodes`, or the server's `max_concurrent`)."""

    def __deepcopy__(self, memo: dict) -> Batched:
        """Itself: the copy of the runner that samples ahead shares the run's one client of the server."""
        return self

    def resets(self, make: EnvironmentFactory, rows: list[dict]) -> list[Reset]:
        episodes: list[ServedEpisode] = [make(row) for row in rows]
        answers = self._asked("/reset_many", [jsonable(row) for row in rows])
        started = []
        for episode, row, answer in zip(episodes, rows, answers, strict=True):
            try:
                if isinstance(answer, Exception):
                    raise answer
                started.append((episode, episode.reset(row) if answer is None else episode.begun(row, answer), None))
            except Exception as e:  # noqa: BLE001 - the server refused this episode: it fails, the others go on
                started.append((episode, list(row["messages"]), f"{type(e).__name__}: {e}"))
        return started

    def steps(self, asked: list[Asked]) -> list[Step | Exception | None]:
        turns = [(at, one[0], one[1], one[0].asked(one[1])) for at, one in enumerate(asked) if one is not None]
        answers = self._asked("/step_many", [{"episode": episode.episode, **sent} for _, episode, _, sent in turns])
        out: list[Step | Exception | None] = [None] * len(asked)
        for (at, episode, turn, sent), answer in zip(turns, answers, strict=True):
            if answer is None:  # lost or refused for now: alone, replayed or retried
                out[at] = step_one(episode, turn)
                continue
            try:
                if isinstance(answer, Exception):
                    raise answer
                out[at] = checked_step(episode.answered(sent, answer))
            except Exception as e:  # noqa: BLE001 - the server's answer was refused: the episode fails
                out[at] = e
        return out

    def close(self, environments: list[ServedEpisode | None]) -> None:
        started = [episode for episode in environments if episode is not None and episode.episode is not None]
        self._asked("/close_many", [{"episode": episode.episode} for episode in started])  # else idle ones go
        for episode in started:
            episode.episode = None

    def _asked(self, path: str, items: list[dict]) -> list[dict | Exception | None]:
        """Each item's answer to one batch request; the request's failure as every item's."""
        if not items:
            return []
        try:
            return self.server.batch(path, items, self.at_once)
        except EpisodeRequestFailed as e:
            return [e] * len(items)
