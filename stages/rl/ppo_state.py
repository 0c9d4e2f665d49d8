"""Full-state checkpoints of a PPO run: everything a resumed run needs to continue exactly
(weights, optimizer, scheduler, loss scaler, every process's random generators, the loop's own state).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from stages.math.ppo_math import KLController
from stages.rl.ppo_models import Models

if TYPE_CHECKING:
    from stages.rl.update import Learner


@dataclass(frozen=True)
class Normalization:
    """The reward normalisation PPO scores with, fixed at iteration 1: normalised = gain * raw + bias."""

    gain: float
    bias: float


@dataclass(kw_only=True)
class LoopState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    iteration: int = 0
    """Iterations completed."""
    cursor: int = 0
    """Prompts consumed so far (the order is a seeded shuffle per pass over the prompts)."""
    kl: KLController | None = None
    """The KL coefficient as the controller left it."""
    normalization: Normalization | None = None
    """Set once, at iteration 1."""
    first_length: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    """Every completed iteration's figures."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoopState:
        stored = json.loads(text)
        return cls(**stored | {"kl": stored["kl"] and KLController(**stored["kl"]),
                               "normalization": stored["normalization"] and Normalization(**stored["normalization"])})


def _rng_key(name: str, rank: int) -> str:
    return name if rank == 0 else f"{name}_rank{rank}"


def rng_states(accelerator: Accelerator) -> dict[str, torch.Tensor]:
    """Every process's random-number generator states, collected on all of them (collective)."""
    own = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        own["cuda"] = torch.cuda.get_rng_state()
    everyone = [own]
    if accelerator.num_processes > 1:
        everyone = [None] * accelerator.num_processes
        torch.distributed.all_gather_object(everyone, own)
    return {_rng_key(name, rank): state for rank, states in enumerate(everyone) for name, state in states.items()}


def _held(models: Models) -> dict[str, torch.nn.Module]:
    """The modules a full-state checkpoint holds the weights of."""
    modules = {"policy": models.policy, "critic": models.critic if models.critic.learns else None,
               "reference": models.reference}
    return {name: module for name, module in modules.items() if module is not None}


COMPLETE = "loop.json"
"""The file a full-state checkpoint is complete with (written last, by the main process)."""


def _aside(folder: Path) -> Path:
    return folder.with_name(folder.name + ".old")


def _fsync(path: Path) -> None:
    """A file's data, or a folder's entries, on disk (not only in the page cache)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(folder: Path) -> None:
    """Every file under `folder`, and the folders themselves, on disk."""
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)) + [folder]:
        _fsync(path)


def write_atomically(folder: Path, write: Callable[[Path], None], accelerator: Accelerator) -> None:
    """`write(staging)` by every process into a staging folder that replaces `folder` once all have
    written (collective). The swap is rename-aside, rename-in, delete, each step on disk before the
    next: a kill at any moment leaves a complete checkpoint in `folder` or beside it (`complete_state`)."""
    staging, aside = folder.with_name(folder.name + ".tmp"), _aside(folder)
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    write(staging)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_tree(staging)
        if (folder / COMPLETE).exists():  # an incomplete `folder` is no fallback: the aside copy stays
            shutil.rmtree(aside, ignore_errors=True)
            folder.rename(aside)
            _fsync(folder.parent)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        _fsync(folder.parent)
        shutil.rmtree(aside, ignore_errors=True)
    accelerator.wait_for_everyone()


def complete_state(folder: Path) -> tuple[Path | None, str | None]:
    """(the newest complete full-state checkpoint `write_atomically` left for `folder`, or None; why an
    incomplete one was passed over, or None): `folder` itself, else its aside copy (a kill between the swap's
    two renames)."""
    if (folder / COMPLETE).exists():
        return folder, None
    passed = f"{folder} has no {COMPLETE} (a kill mid-swap)" if folder.exists() else None
    if (_aside(folder) / COMPLETE).exists():
        return _aside(folder), passed
    return None, passed


def save_state_everywhere(learner: Learner, folder: Path, loop: LoopState,
                          own: Callable[[Path], None] | None = None) -> None:
    """Write a full-state checkpoint atomically (a staging folder, renamed once complete), keeping
    only the newest (collective). Weights and optimizer state as the models are held: written by
    the main process when every process holds them whole, one shard per process when sharded;
    the main process writes the rest, with every process's random generators. `own(staging)`:
    what each process writes of its own besides (its rollouts sampled ahead)."""
    accelerator, models = learner.accelerator, learner.models
    rng = rng_states(accelerator)

    def write(staging: Path) -> None:
        models.holding.save(staging, _held(models), learner.optimizer)
        if own is not None:
            own(staging)
        if accelerator.is_main_process:
            torch.save(learner.scheduler.state_dict(), staging / "scheduler.pt")
            torch.save(learner.scaler.state_dict(), staging / "scaler.pt")
            save_file(rng, str(staging / "rng.safetensors"))
            (staging / COMPLETE).write_text(loop.to_json())

    write_atomically(folder, write, accelerator)


def load_state(folder: Path, models: Models, optimizer, scheduler, scaler, rank: int = 0) -> LoopState:
    """Restore a full-state checkpoint, with process `rank`'s random generators (collective when
    the models are sharded). Tensors come from safetensors (or `torch.distributed.checkpoint`
    shards); optimizer and scheduler state load with `weights_only=True`, which refuses arbitrary
    pickled objects."""
    rng = load_file(str(folder / "rng.safetensors"))
    if _rng_key("torch", rank) not in rng:
        raise ValueError(f"the full-state checkpoint in {folder} was written by fewer processes than this run has; "
                         "resume with the same launch.num_processes")
    models.holding.load(folder, _held(models), optimizer)
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    scaler.load_state_dict(torch.load(folder / "scaler.pt", weights_only=True))
    torch.set_rng_state(rng[_rng_key("torch", rank)])
    if _rng_key("cuda", rank) in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng[_rng_key("cuda", rank)])
    return LoopState.from_json((folder / COMPLETE).read_text())
