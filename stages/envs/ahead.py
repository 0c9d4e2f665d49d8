"""Sampling ahead of the updates (`ppo.rollout.max_staleness` s > 0): the vLLM server samples the
next iterations' rollouts while the trainer scores and updates on this one's. `SampledAhead` is the
`EpisodeSource` that hands back, in order, the single turns sampled earlier; the rollout takes its
episodes as it takes any source's.

    iteration k, s = 1
      trainer thread   take k | submit k+1 | forward passes, score, advantages, update | settle | sync v_k
      sampler thread                 `-- the server samples k+1 with v_{k-1} ----------'

Versions: v_j is the policy after j updates; the server holds v_j from the sync that ends iteration j.
Rollout k is submitted at iteration k - s (at the first iteration run, for those before), so it is
sampled by v_{k-1-s} and trained from v_{k-1}: staleness s (less in the first s iterations), logged
as `rollout/staleness`.

Which policy the old log-probs are computed under: v_{k-1}, the weights the update starts from.
The trainer recomputes them in its forward passes after taking the rollout (a vLLM rollout never
reuses the sampling pass), so the clipped ratio pi_theta / pi_{v_{k-1}} keeps each update near
where it starts, as in synchronous PPO, and the importance weights of `rollout.correction` (by
default truncated, min(pi_{v_{k-1}} / pi_vllm, 2)) correct for the tokens having been drawn by the
older v_{k-1-s} on the server (and for the engine's own numerics): decoupled PPO's
proximal and behaviour policies (Hilton et al. 2022; AReaL).

The server reloads weights only with nothing in flight: the trainer `settle`s (waits for every
submitted rollout) before each sync, so a rollout is sampled by one version whole. The requests,
and with them the seeds that make sampling repeatable, are made on the trainer's thread when a
rollout is submitted; the sampler thread only sends them and reads the answers.

Resume: at every full-state checkpoint the rollouts sampled ahead are complete (settled before the
sync that precedes it), and they are checkpointed with it (`save`, `load`), not sampled again:
sampling them again would need the older weights that drew them. Each process keeps its own.
"""

from __future__ import annotations

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
from stages.envs.episode import EpisodeGeneration, EpisodeSource, SingleTurn, in_chunks


@dataclass(frozen=True)
class Schedule:
    """Which prompts this process samples at each iteration, known ahead (no dynamic sampling here)."""

    prompts: Callable[[int], list[str]]
    """Iteration k (from 1) -> this process's rendered prompts of it, each repeated for its group."""
    last: int
    """The run's last iteration: nothing is sampled past it."""


@dataclass(frozen=True)
class Answered:
    """One iteration's rollout as the server answered it: its chunks (`in_chunks`), the version of
    the weights that sampled it and the seconds the server took."""

    generations: list[Generation]
    version: int
    seconds: float


@dataclass
class Ahead:
    """A rollout submitted to the server, for iteration `iteration`."""

    iteration: int
    future: Future[Answered]


class SampledAhead(EpisodeSource):
    """Single turns sampled on a vLLM server by a thread of their own, the next `max_staleness`
    iterations' ahead of the one training; each round's chunks handed back in order, read as
    `reading` reads single turns."""

    prompt_is_row = True

    def __init__(self, sampler: VLLMSampler, reading: SingleTurn, sampling: SamplingConfig, max_staleness: int,
                 schedule: Schedule):
        self.sampler, self.reading, self.sampling, self.max_staleness = sampler, reading, sampling, max_staleness
        self.schedule = schedule
        self.version = 0
        """Updates the server's weights hold (the last `synced`)."""
        self.taken = 0
        """The last iteration whose rollout was taken."""
        self.pending: deque[Ahead] = deque()
        self._chunks: deque[Generation] = deque()
        self._figures: dict[str, float] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rlhf-sampling-ahead")

    @property
    def figures(self) -> dict[str, float]:
        return self._figures

    def now(self) -> SingleTurn:
        return self.reading

    def generation(self, sampler, rows: list[dict], sampling: Sampling, device: torch.device,
                   timings: dict[str, float]) -> EpisodeGeneration:
        """The next chunk of this iteration's rollout, sampled earlier (at an iteration's first chunk,
        the next iterations' are submitted first, so the server samples them while this one trains).
        Timed: `rollout_wait`, this iteration's wait for its rollout; `generate`, the server's seconds
        on it, spent beside earlier work."""
        if not self._chunks:
            iteration = self.taken + 1
            self.fill(iteration)
            with timed(timings, "rollout_wait"):
                earlier = self.take(iteration)
            timings["generate"] = earlier.seconds
            self._chunks = deque(earlier.generations)
            self._figures = {"rollout/staleness": float(iteration - 1 - earlier.version)}
        generation = self._chunks.popleft()
        if len(generation.responses) != len(rows):
            raise RuntimeError(f"sampled ahead {len(generation.responses)} responses, but {len(rows)} rows asked")
        return self.reading.batch(generation, rows)

    def fill(self, iteration: int) -> None:
        """Submit, in order, the rollouts of iterations `iteration` to `iteration + max_staleness`
        (none past the schedule's last) not yet submitted."""
        start = self.pending[-1].iteration + 1 if self.pending else iteration
        for k in range(start, min(iteration + self.max_staleness, self.schedule.last) + 1):
            sampling = Sampling(self.sampling.response_length, self.sampling.temperature)
            requests = [self.sampler.requests(chunk, sampling)
                        for chunk in in_chunks(self.schedule.prompts(k), self.sampling.micro_batch_size)]
            self.pending.append(Ahead(k, self._thread.submit(self._sample, requests, self.version)))

    def _sample(self, requests: list, version: int) -> Answered:
        """On the sampler thread: send the requests, wait for the answers."""
        clock = time.perf_counter()
        generations = self.sampler.answer(requests)
        return Answered(generations, version, time.perf_counter() - clock)

    def take(self, iteration: int) -> Answered:
        """Iteration `iteration`'s rollout (waiting for it if the server is still sampling it)."""
        ahead = self.pending.popleft()
        if ahead.iteration != iteration:
            raise RuntimeError(f"sampled ahead for iteration {ahead.iteration}, but iteration {iteration} asked")
        self.taken = iteration
        return ahead.future.result()

    def settle(self, timings: dict[str, float]) -> None:
        """Wait until nothing is in flight: the server may take new weights."""
        with timed(timings, "sampling_wait"):
            for ahead in self.pending:
                ahead.future.result()

    def synced(self, version: int) -> None:
        self.version = version

    def close(self) -> None:
        """Drop what is not yet sent; what is in flight ends with the server (stopped after this)."""
        self._thread.shutdown(wait=False, cancel_futures=True)

    # --- full-state checkpoints ------------------------------------------------------------------

    def save(self, folder: Path, rank: int) -> None:
        """This process's rollouts sampled ahead (complete: call after `settle`) into `folder`."""
        tensors, index = {}, []
        for ahead in self.pending:
            sampled = ahead.future.result()
            for chunk, generation in enumerate(sampled.generations):
                for name, value in dataclasses.asdict(generation).items():
                    if value is not None:
                        tensors[f"{ahead.iteration}.{chunk}.{name}"] = value.contiguous()
            index.append({"iteration": ahead.iteration, "version": sampled.version, "seconds": sampled.seconds,
                          "chunks": len(sampled.generations)})
        save_file(tensors, str(folder / _file(rank)), metadata={"pending": json.dumps(index)})

    def resume(self, folder: Path, rank: int, device: torch.device, version: int) -> None:
        """Continue from a full-state checkpoint after iteration `version`, to whose weights the
        server was synced: its rollouts sampled ahead as it holds them (none where it has no file:
        a checkpoint written without sampling ahead)."""
        self.version = self.taken = version
        path = folder / _file(rank)
        if not path.exists():
            return
        with safe_open(str(path), "pt") as opened:
            index = json.loads(opened.metadata()["pending"])
        tensors = load_file(str(path), device=str(device))
        fields = [f.name for f in dataclasses.fields(Generation)]
        for entry in index:
            k = entry["iteration"]
            generations = [Generation(**{name: tensors.get(f"{k}.{chunk}.{name}") for name in fields})
                           for chunk in range(entry["chunks"])]
            done: Future[Answered] = Future()
            done.set_result(Answered(generations, entry["version"], entry["seconds"]))
            self.pending.append(Ahead(k, done))


def _file(rank: int) -> str:
    return f"sampled_ahead_rank{rank}.safetensors"
