"""Stage functions that stand in for real ones in the launch tests: importable by the launched
processes (they run from the repository root), as `call_stage` needs."""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass
from pathlib import Path

from accelerate import PartialState


@dataclass(frozen=True)
class Pause:
    seconds: float


def pause_on_the_main_process(cfg, inputs: Pause, output_dir: Path, reporting) -> dict | None:
    """A stage whose main process evaluates and saves for `inputs.seconds` after training, alone."""
    if not PartialState().is_main_process:
        atexit.register(lambda: (output_dir / "rank-1-left").write_text(repr(time.time())))
        return None
    time.sleep(inputs.seconds)
    return {"paused": inputs.seconds}


def report_then_pause(cfg, inputs: Pause, output_dir: Path, reporting) -> None:
    """A stage whose processes record their pids, then pause; the main process reports a warning first
    (after every process has recorded its pid)."""
    import os

    state = PartialState()
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"pid-{state.process_index}").write_text(str(os.getpid()))
    state.wait_for_everyone()
    if state.is_main_process:
        reporting.warning("paused")
    time.sleep(inputs.seconds)


@dataclass(frozen=True)
class KilledAfterFirstCheckpoint:
    ppo_inputs: object
    """The real stage's `PPOInputs`."""


def ppo_killed_after_first_checkpoint(cfg, inputs: KilledAfterFirstCheckpoint, output_dir: Path, reporting):
    """`train_ppo`, whose main process SIGKILLs every process of the launch (its process group:
    the launcher and all ranks) as the iteration after the first full-state checkpoint starts."""
    import os
    import signal

    import stages.ppo
    import stages.rl.rollout

    saved, real_save, real_rollout = [], stages.ppo.save_state_everywhere, stages.rl.rollout.rollout

    def save_state(*args, **kwargs):
        real_save(*args, **kwargs)
        saved.append(True)

    def rollout(*args, **kwargs):
        if saved and PartialState().is_main_process:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return real_rollout(*args, **kwargs)

    stages.ppo.save_state_everywhere, stages.rl.rollout.rollout = save_state, rollout
    return stages.ppo.train_ppo(cfg, inputs.ppo_inputs, output_dir, reporting)


@dataclass(frozen=True)
class Abort:
    rank: int
    """The rank that dies by SIGABRT."""
    after_done: bool
    """In teardown, after it recorded its work done (an `atexit` handler, as a library's thread did);
    else in its work."""


def abort_on_a_rank(cfg, inputs: Abort, output_dir: Path, reporting) -> dict | None:
    """A stage that has one rank abort (SIGABRT), in its work or in teardown; the main process
    returns a result either way."""
    import os

    if PartialState().process_index == inputs.rank:
        if not inputs.after_done:
            os.abort()
        atexit.register(os.abort)
    return {"aborted": inputs.rank} if PartialState().is_main_process else None


@dataclass(frozen=True)
class RecordingLoads:
    train: object
    """The real stage function."""
    inputs: object
    """Its inputs."""


def record_loads(cfg, inputs: RecordingLoads, output_dir: Path, reporting):
    """`inputs.train`, with every model this process builds through transformers' auto classes
    (`from_pretrained`, `from_config`) recorded in `output_dir/loads-<rank>.json` (how it was built,
    the bytes of all its parameters and of those that are real tensors, not on the meta device), and
    every checkpoint tensor it reads (`stages.runtime.models.read_checkpoint_tensor`) in `reads-<rank>.json`:
    the bytes of each, and the most bytes of read tensors alive at once."""
    import json
    import weakref

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from stages.runtime import models

    loads, reads, alive = [], {"sizes": [], "peak_alive": 0}, [0]
    classes = (AutoModelForCausalLM, AutoModelForSequenceClassification)
    originals = {(c, name): getattr(c, name).__func__ for c in classes for name in ("from_pretrained", "from_config")}
    read = models.read_checkpoint_tensor

    def recording(key):
        def build(cls, *args, **kwargs):
            built = originals[key](cls, *args, **kwargs)
            model = built[0] if isinstance(built, tuple) else built  # with `output_loading_info`
            sizes = [(p.numel() * p.element_size(), p.is_meta) for p in model.parameters()]
            loads.append({"model": type(model).__name__, "how": key[1], "bytes": sum(b for b, _ in sizes),
                          "real_bytes": sum(b for b, meta in sizes if not meta)})
            return built
        return classmethod(build)

    def recorded_read(file: str, key: str):
        tensor = read(file, key)
        size = tensor.numel() * tensor.element_size()
        reads["sizes"].append(size)
        alive[0] += size
        reads["peak_alive"] = max(reads["peak_alive"], alive[0])
        weakref.finalize(tensor, lambda: alive.__setitem__(0, alive[0] - size))
        return tensor

    for key in originals:
        setattr(*key, recording(key))
    models.read_checkpoint_tensor = recorded_read
    try:
        return inputs.train(cfg, inputs.inputs, output_dir, reporting)
    finally:
        for (c, name), original in originals.items():
            setattr(c, name, classmethod(original))
        models.read_checkpoint_tensor = read
        output_dir.mkdir(parents=True, exist_ok=True)
        rank = PartialState().process_index
        (output_dir / f"loads-{rank}.json").write_text(json.dumps(loads))
        (output_dir / f"reads-{rank}.json").write_text(json.dumps(reads))


@dataclass(frozen=True)
class RankKilledOnce:
    ppo_inputs: object
    """The real stage's `PPOInputs`."""
    rank: int
    """The rank whose process is SIGKILLed as the iteration after the first full-state checkpoint starts."""
    marker: Path
    """Written just before the kill: a rank started again (a restarted gang) is not killed twice."""


def ppo_with_a_rank_killed_once(cfg, inputs: RankKilledOnce, output_dir: Path, reporting):
    """`train_ppo`, one of whose processes (only it: on Ray the ranks share a process group with the
    node's own processes) dies by SIGKILL once, after the first full-state checkpoint."""
    import os
    import signal

    import stages.ppo
    import stages.rl.rollout

    saved, real_save, real_rollout = [], stages.ppo.save_state_everywhere, stages.rl.rollout.rollout

    def save_state(*args, **kwargs):
        real_save(*args, **kwargs)
        saved.append(True)

    def rollout(*args, **kwargs):
        if saved and PartialState().process_index == inputs.rank and not inputs.marker.exists():
            inputs.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rollout(*args, **kwargs)

    stages.ppo.save_state_everywhere, stages.rl.rollout.rollout = save_state, rollout
    return stages.ppo.train_ppo(cfg, inputs.ppo_inputs, output_dir, reporting)


@dataclass(frozen=True)
class PausedOnce:
    ppo_inputs: object
    """The real stage's `PPOInputs`."""
    marker: Path
    """Written as every rank pauses, after the first full-state checkpoint; a restarted gang does not pause."""
    seconds: float = 300.0
    """How long the ranks wait there for the test to do its worst."""


def ppo_paused_once_after_a_checkpoint(cfg, inputs: PausedOnce, output_dir: Path, reporting):
    """`train_ppo`, whose ranks all stop for `inputs.seconds` after the first full-state checkpoint (once):
    the moment a test loses a node, and its gang restarts from that checkpoint."""
    import time

    import stages.ppo
    import stages.rl.rollout

    saved, real_save, real_rollout = [], stages.ppo.save_state_everywhere, stages.rl.rollout.rollout

    def save_state(*args, **kwargs):
        real_save(*args, **kwargs)
        saved.append(True)

    def rollout(*args, **kwargs):
        if saved and not inputs.marker.exists():
            if PartialState().process_index == 0:
                inputs.marker.write_text("paused")
            time.sleep(inputs.seconds)
        return real_rollout(*args, **kwargs)

    stages.ppo.save_state_everywhere, stages.rl.rollout.rollout = save_state, rollout
    return stages.ppo.train_ppo(cfg, inputs.ppo_inputs, output_dir, reporting)
