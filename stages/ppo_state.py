"""Full-state checkpoints of a PPO run: everything a resumed run needs to continue exactly
(weights, optimizer, scheduler, loss scaler, every process's random generators, the loop's own state).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, load_model, save_file, save_model

from stages.ppo_math import KLController
from stages.ppo_models import Models


@dataclass(frozen=True)
class Normalization:
    """The reward normalisation PPO scores with, fixed at iteration 1: normalised = gain * raw + bias."""

    gain: float
    bias: float


@dataclass
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


def save_state(folder: Path, models: Models, optimizer, scheduler, scaler, loop: LoopState,
               rng: dict[str, torch.Tensor]) -> Path:
    """Write a full-state checkpoint atomically (staging folder, then rename); keeps only the newest.
    On several processes the main one writes it: weights and optimizer state are the same on all,
    `rng` holds each process's generators."""
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_model(models.policy, str(staging / "policy.safetensors"))
    if models.critic is not None:
        save_model(models.critic, str(staging / "critic.safetensors"))
    if models.reference is not None:
        save_model(models.reference, str(staging / "reference.safetensors"))
    torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    torch.save(scheduler.state_dict(), staging / "scheduler.pt")
    torch.save(scaler.state_dict(), staging / "scaler.pt")
    save_file(rng, str(staging / "rng.safetensors"))
    (staging / "loop.json").write_text(loop.to_json())
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def save_state_everywhere(accelerator: Accelerator, folder: Path, models: Models, optimizer, scheduler, scaler,
                          loop: LoopState) -> None:
    """`save_state` by the main process with every process's generators; no process runs on (or
    stops) before the state is written (collective)."""
    rng = rng_states(accelerator)
    if accelerator.is_main_process:
        save_state(folder, models, optimizer, scheduler, scaler, loop, rng)
    accelerator.wait_for_everyone()


def load_state(folder: Path, models: Models, optimizer, scheduler, scaler, rank: int = 0) -> LoopState:
    """Restore a full-state checkpoint, with process `rank`'s random generators. Tensors come from
    safetensors; optimizer and scheduler state load with `weights_only=True`, which refuses
    arbitrary pickled objects."""
    load_model(models.policy, str(folder / "policy.safetensors"))
    if models.critic is not None:
        load_model(models.critic, str(folder / "critic.safetensors"))
    if models.reference is not None:
        load_model(models.reference, str(folder / "reference.safetensors"))
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    scaler.load_state_dict(torch.load(folder / "scaler.pt", weights_only=True))
    rng = load_file(str(folder / "rng.safetensors"))
    if _rng_key("torch", rank) not in rng:
        raise ValueError(f"the full-state checkpoint in {folder} was written by fewer processes than this run has; "
                         "resume with the same launch.num_processes")
    torch.set_rng_state(rng[_rng_key("torch", rank)])
    if _rng_key("cuda", rank) in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng[_rng_key("cuda", rank)])
    return LoopState.from_json((folder / "loop.json").read_text())
