"""Sampling ahead of the updates (`ppo.rollout.max_staleness` s > 0): the vLLM server samples the
next iterations' rollouts while the trainer scores and updates on this one's. `SampledAhead` is the
one `EpisodeSource` of that path: it runs its source's episodes (single turns, or an environment's
episodes with their tool calls, `EpisodeSource.ahead`) on a thread of its own and hands them back,
in order, read as the source reads them (`received`).

    iteration k, s = 1
      trainer thread   take k | submit k+1 | forward passes, score, advantages, update | settle | sync v_k
      sampler thread                 `-- the server samples k+1 with v_{k-1} ----------'

Versions: v_j is the policy after j updates; the server holds v_j from the sync that ends iteration j.
Rollout k is submitted at iteration k - s (at the first iteration run, for those before), so its
first token is sampled by v_{k-1-s} or later and it is trained from v_{k-1}: staleness at most s,
whatever the episode's length. Every trainable segment keeps the version that sampled it
(`Segment.version`); `rollout/staleness` is the iteration's largest episode staleness (v_{k-1} less
the oldest version among its turns), `rollout/staleness_mean` their mean.

Partial rollouts (`rollout.partial`): `settle` does not wait for the rollouts in flight; the sync
waits only for the requests in flight (the server's gate, `VLLMSampler.sync`), so an episode's next
turns are sampled by the new weights: `rollout/mixed_version_share` is the share of episodes whose
turns span versions. The bound above still holds: it is set by when a rollout is submitted.

Which policy the old log-probs are computed under: v_{k-1}, the weights the update starts from.
The trainer recomputes them in its forward passes after taking the rollout (a vLLM rollout never
reuses the sampling pass), so the clipped ratio pi_theta / pi_{v_{k-1}} keeps each update near
where it starts, as in synchronous PPO, and the importance weights of `rollout.correction` (by
default truncated, min(pi_{v_{k-1}} / pi_vllm, 2)) correct, token by token, for the tokens having
been drawn by older versions on the server, each with its own version's log-prob (and for the
engine's own numerics): decoupled PPO's proximal and behaviour policies (Hilton et al. 2022; AReaL).

The requests' seeds, and the episodes' (`EpisodeRunner.seeds`), are drawn on the trainer's thread
when a rollout is submitted, so sampling repeats with the run's seed; the sampler thread only sends
requests, steps the environments and parses, on a copy of the source with a tokenizer of its own.

Resume: a full-state checkpoint holds the rollouts sampled ahead, complete (`save` waits for them),
so they are not sampled again (that would need the older weights that drew them): single turns as
tensors, episodes as JSON. Each process keeps its own.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlhf.sections.base import SamplingConfig
from stages.common.reporting import timed
from stages.engines.sampler import Generation, Sampling
from stages.engines.vllm_server import VLLMSampler
from stages.envs.episode import Episode, EpisodeGeneration, EpisodeSource, Segment


@dataclass(frozen=True)
class Schedule:
    """Which prompts this process samples at each iteration, known ahead (no dynamic sampling here)."""

    rows: Callable[[int], list[dict]]
    """Iteration k (from 1) -> this process's prompt records of it, each repeated for its group."""
    last: int
    """The run's last iteration: nothing is sampled past it."""


@dataclass(frozen=True)
class Answered:
    """One iteration's rollout as the sampler thread answered it: what the source's `received` reads
    (a `Generation` per chunk, or the episodes in row order) and the seconds it took."""

    sampled: deque
    seconds: float


@dataclass
class Ahead:
    """A rollout submitted to the sampler thread, for iteration `iteration`."""

    iteration: int
    future: Future[Answered]


class SampledAhead(EpisodeSource):
    """A source's episodes sampled on a vLLM server by a thread of their own, the next `max_staleness`
    iterations' ahead of the one training; handed back in order, each chunk read as `source` reads it."""

    def __init__(self, sampler: VLLMSampler, source: EpisodeSource, sampling: SamplingConfig, max_staleness: int,
                 schedule: Schedule, partial: bool = False):
        self.sampler, self.source, self.sampling, self.max_staleness = sampler, source, sampling, max_staleness
        self.schedule, self.partial = schedule, partial
        self.worker = copy.deepcopy(source)
        """The source as the sampler thread runs it: a tokenizer is never shared between threads."""
        self.taken = 0
        """The last iteration whose rollout was taken."""
        self.pending: deque[Ahead] = deque()
        self._taking: Answered | None = None
        self._episodes: list[Episode] = []
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rlhf-sampling-ahead")

    multi_turn = property(lambda self: self.source.multi_turn)
    prompt_is_row = property(lambda self: self.source.prompt_is_row)
    max_failed_share = property(lambda self: self.source.max_failed_share)
    tags = property(lambda self: self.source.tags)

    @property
    def figures(self) -> dict[str, float]:
        """The staleness of the iteration's episodes taken so far (`staleness_figures`)."""
        return staleness_figures(self._episodes, self.taken - 1) if self._episodes else {}

    def now(self) -> EpisodeSource:
        return self.source.now()

    def generation(self, sampler, rows: list[dict], sampling: Sampling, device: torch.device,
                   timings: dict[str, float]) -> EpisodeGeneration:
        """The next chunk of this iteration's rollout, sampled earlier (at an iteration's first chunk,
        the next iterations' are submitted first, so the server samples them while this one trains).
        Timed: `rollout_wait`, this iteration's wait for its rollout; `generate`, the sampler thread's
        seconds on it, spent beside earlier work."""
        if self._taking is None or not self._taking.sampled:
            iteration = self.taken + 1
            self.fill(iteration)
            with timed(timings, "rollout_wait"):
                self._taking = self.take(iteration)
            timings["generate"] = self._taking.seconds
            self._episodes = []
        generation = self.source.received(self._taking.sampled, rows, device)
        self._episodes += generation.episodes
        return generation

    def fill(self, iteration: int) -> None:
        """Submit, in order, the rollouts of iterations `iteration` to `iteration + max_staleness`
        (none past the schedule's last) not yet submitted; their seeds drawn here."""
        start = self.pending[-1].iteration + 1 if self.pending else iteration
        for k in range(start, min(iteration + self.max_staleness, self.schedule.last) + 1):
            sampling = Sampling(self.sampling.response_length, self.sampling.temperature)
            work = self.worker.ahead(self.sampler, self.schedule.rows(k), sampling, self.sampling.micro_batch_size)
            self.pending.append(Ahead(k, self._thread.submit(_timed, work)))

    def take(self, iteration: int) -> Answered:
        """Iteration `iteration`'s rollout (waiting for it if the server is still sampling it)."""
        ahead = self.pending.popleft()
        if ahead.iteration != iteration:
            raise RuntimeError(f"sampled ahead for iteration {ahead.iteration}, but iteration {iteration} asked")
        self.taken = iteration
        return ahead.future.result()

    def settle(self, timings: dict[str, float]) -> None:
        """Wait until nothing is in flight, so the server may take new weights; with partial rollouts,
        nothing: the sync waits only for the requests in flight, and episodes go on after it."""
        if self.partial:
            return
        with timed(timings, "sampling_wait"):
            for ahead in self.pending:
                ahead.future.result()

    def close(self) -> None:
        """Drop what is not yet sent; what is in flight ends with the server (stopped after this); the
        episodes' own source closed."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.source.close()

    # --- full-state checkpoints ------------------------------------------------------------------

    def save(self, folder: Path, rank: int) -> None:
        """This process's rollouts sampled ahead into `folder`, once complete (waiting for them):
        single turns' generations as tensors, episodes as JSON."""
        tensors, index = {}, []
        for ahead in self.pending:
            answered = ahead.future.result()
            entry = {"iteration": ahead.iteration, "seconds": answered.seconds, "chunks": [], "episodes": []}
            for chunk, item in enumerate(answered.sampled):
                if isinstance(item, Episode):
                    entry["episodes"].append(dataclasses.asdict(item))
                    continue
                for name, value in dataclasses.asdict(item).items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"{ahead.iteration}.{chunk}.{name}"] = value.contiguous()
                entry["chunks"].append(item.version)
            index.append(entry)
        metadata = {"pending": json.dumps(index, default=_plain)}
        save_file(tensors, str(folder / _file(rank)), metadata=metadata)

    def resume(self, folder: Path, rank: int, device: torch.device, version: int) -> None:
        """Continue from a full-state checkpoint after iteration `version`, to whose weights the
        server was synced: its rollouts sampled ahead as it holds them (none where it has no file:
        a checkpoint written without sampling ahead)."""
        self.taken = version
        path = folder / _file(rank)
        if not path.exists():
            return
        with safe_open(str(path), "pt") as opened:
            index = json.loads(opened.metadata()["pending"])
        tensors = load_file(str(path), device=str(device))
        fields = [f.name for f in dataclasses.fields(Generation) if f.name != "version"]
        for entry in index:
            k = entry["iteration"]
            sampled = deque(Generation(**{name: tensors.get(f"{k}.{chunk}.{name}") for name in fields}, version=v)
                            for chunk, v in enumerate(entry["chunks"]))
            sampled.extend(_episode(e) for e in entry["episodes"])
            done: Future[Answered] = Future()
            done.set_result(Answered(sampled, entry["seconds"]))
            self.pending.append(Ahead(k, done))


def staleness_figures(episodes: list[Episode], trained: int) -> dict[str, float]:
    """Episodes trained from version `trained`: the largest and the mean staleness (`trained` less the
    oldest version among an episode's trainable segments), and the share whose trainable segments
    more than one version sampled (continued across a sync: `rollout.partial`)."""
    versions = [[s.version for s in e.segments if s.trainable] or [trained] for e in episodes]
    staleness = [trained - min(v) for v in versions]
    return {"rollout/staleness": float(max(staleness)),
            "rollout/staleness_mean": sum(staleness) / len(staleness),
            "rollout/mixed_version_share": sum(len(set(v)) > 1 for v in versions) / len(versions)}


def _timed(work: Callable[[], deque]) -> Answered:
    """On the sampler thread: run a rollout's work, timed."""
    clock = time.perf_counter()
    sampled = work()
    return Answered(sampled, time.perf_counter() - clock)


def _episode(saved: dict) -> Episode:
    """An episode as `save` wrote it."""
    return Episode(**{**saved, "segments": [Segment(**s) for s in saved["segments"]]})


def _plain(value: object) -> object:
    """A record's value JSON does not write itself (a numpy scalar from a prompts table) as plain Python."""
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a sampled-ahead episode holds {type(value).__name__}, which a checkpoint cannot keep")


def _file(rank: int) -> str:
    return f"sampled_ahead_rank{rank}.safetensors"
