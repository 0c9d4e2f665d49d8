"""Running a stage on several processes with `accelerate launch` (torch.distributed).

`call_stage` runs a stage function in the caller's process when its config asks for one
process. For more, it writes the stage's inputs to a spec folder, starts

    accelerate launch --num_processes N [--config_file F | --multi_gpu] -m stages.distributed SPEC

and forwards what rank 0 reports (metrics, sample tables, warnings) to the caller's own
callbacks while the job runs. Rank 0 writes the stage's result back; the caller gets the same
result object either way. Every rank runs the same stage function: the TRL trainers and our
PPO loop split the work by `PartialState().process_index`, and only rank 0 returns a result.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pandas as pd

from rlhf.config import PPOConfig, RewardConfig, SFTConfig, accelerate_config_path
from stages.models import set_determinism

STAGE_FUNCTIONS = {"sft": "stages.sft:train_sft", "reward": "stages.reward:train_reward", "ppo": "stages.ppo:train_ppo"}
"""The function each stage's processes run."""
SECTION_TYPES = {"sft": SFTConfig, "reward": RewardConfig, "ppo": PPOConfig}
"""Each stage's config section."""
RESULT_TYPES = {"sft": "stages.sft:SFTResult", "reward": "stages.reward:RewardResult", "ppo": "stages.ppo:PPOResult"}
"""What each stage function returns (on rank 0)."""
USER_ERRORS = {"RewardGateError": "stages.errors:RewardGateError", "NonFiniteLossError": "stages.errors:NonFiniteLossError"}
"""Exceptions a stage raises for its user (not bugs): re-raised in the caller with their message."""


class LaunchError(RuntimeError):
    """The multi-process job failed; the message holds the tail of its log."""


def _import(dotted: str) -> Any:
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Reporting:
    """Where a stage reports while it runs; each stage function takes the ones it knows."""

    metrics: Callable[[dict[str, float], int], None] | None = None
    samples: Callable[[pd.DataFrame, int], None] | None = None
    warning: Callable[[str], None] | None = None
    rollouts: Callable[[pd.DataFrame, int], None] | None = None

    def arguments(self, stage: str) -> dict[str, Any]:
        if stage == "ppo":
            from stages.ppo import PPOHooks

            given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
            return {"hooks": PPOHooks(**given)}
        return {"sink": self.metrics}


def call_stage(stage: str, section, output_dir: Path, reporting: Reporting, *, deterministic: bool,
               num_threads: int | None, **inputs: Any):
    """Run `stage`'s function on `section.launch.num_processes` processes and return its result.
    `inputs` are its keyword arguments besides config, output folder and reporting: strings,
    paths and DataFrames."""
    if section.launch.num_processes == 1:
        return _import(STAGE_FUNCTIONS[stage])(section, **inputs, output_dir=output_dir, **reporting.arguments(stage))
    spec = _write_spec(stage, section, output_dir, inputs, deterministic, num_threads)
    _launch(spec, section.launch, reporting)
    return _read_result(stage, spec)


# --- the caller's side ------------------------------------------------------------------------


def _write_spec(stage: str, section, output_dir: Path, inputs: dict[str, Any], deterministic: bool,
                num_threads: int | None) -> Path:
    spec = output_dir / "launch"
    spec.mkdir(parents=True, exist_ok=True)
    for stale in ("events.jsonl", "result.json", "error.json"):
        (spec / stale).unlink(missing_ok=True)
    arguments = {name: _store(value, f"input-{name}", spec) for name, value in inputs.items()}
    # Each process gets its share of the CPU threads the pipeline may use.
    threads = max(1, (num_threads or os.cpu_count() or 1) // section.launch.num_processes)
    (spec / "spec.json").write_text(json.dumps({
        "stage": stage, "section": section.model_dump(mode="json"), "output_dir": str(output_dir),
        "arguments": arguments, "deterministic": deterministic, "num_threads": threads,
    }))
    return spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(spec: Path, launch) -> list[str]:
    """`accelerate launch` for the stage: the given accelerate config, or DDP on this machine's
    GPUs (gloo on CPU). On one machine a free port each time, so two pipelines can launch side by side."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(launch.num_processes)]
    if launch.engine().get("num_machines", 1) == 1:  # several machines must agree on the port in their config
        command += ["--main_process_port", str(_free_port())]
    if launch.accelerate_config:
        command += ["--config_file", str(accelerate_config_path(launch.accelerate_config))]
    else:
        command += ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return command + ["-m", "stages.distributed", str(spec)]


def _launch(spec: Path, launch, reporting: Reporting) -> None:
    import torch

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"  # torch.distributed over gloo between CPU processes
    log = spec / "launch.log"
    events = spec / "events.jsonl"
    with log.open("w") as out:
        process = subprocess.Popen(launch_command(spec, launch), stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
        read = 0
        try:
            while True:
                finished = process.poll() is not None
                read = _forward_events(events, read, reporting)
                if finished:
                    break
                time.sleep(0.5)
        except BaseException:
            process.kill()  # the caller stops (or its reporting failed): so do the processes
            raise
    error = spec / "error.json"
    if error.exists():
        raised = json.loads(error.read_text())
        if raised["type"] in USER_ERRORS:
            exception = _import(USER_ERRORS[raised["type"]])
            raise (exception(raised["message"], raised["metrics"]) if raised.get("metrics") is not None
                   else exception(raised["message"]))
    if process.returncode != 0 or not (spec / "result.json").exists():
        lines = log.read_text(errors="replace").splitlines()
        tail = "\n".join(lines[-30:])
        raise LaunchError(f"the {launch.num_processes}-process job (accelerate launch) exited with code "
                          f"{process.returncode}{_failed_ranks(lines)}; its log is {log}; last lines:\n{tail}")


def _failed_ranks(lines: list[str]) -> str:
    """Each failed process's exception, as torch.distributed prefixes its traceback lines ("[rank1]: RuntimeError: ..."):
    the launcher's own report, which ends the log, leaves the cause out."""
    raised = {}
    for line in lines:
        if found := re.match(r"\[rank(\d+)\]: ((?:\w+\.)*\w*(?:Error|Exception|Exit|Interrupt)\b.*)", line):
            raised[int(found[1])] = found[2]  # the last one: with chained exceptions, the one the process died of
    return "".join(f"; rank {rank}: {message}" for rank, message in sorted(raised.items()))


def _forward_events(events: Path, read: int, reporting: Reporting) -> int:
    """Hand complete new lines of rank 0's event file to the caller's callbacks; returns the new offset."""
    if not events.exists():
        return read
    with events.open() as f:
        f.seek(read)
        chunk = f.read()
    complete = chunk[:chunk.rfind("\n") + 1]
    for line in complete.splitlines():
        event = json.loads(line)
        if event["kind"] == "metrics" and reporting.metrics:
            reporting.metrics(event["metrics"], event["step"])
        elif event["kind"] == "samples" and reporting.samples:
            reporting.samples(pd.DataFrame(event["rows"]), event["step"])
        elif event["kind"] == "rollouts" and reporting.rollouts:
            reporting.rollouts(pd.DataFrame(event["rows"]), event["step"])
        elif event["kind"] == "warning" and reporting.warning:
            reporting.warning(event["message"])
    return read + len(complete)


def _read_result(stage: str, spec: Path):
    stored = json.loads((spec / "result.json").read_text())
    return _import(RESULT_TYPES[stage])(**{name: _restore(value, spec) for name, value in stored.items()})


# --- what crosses between the processes -------------------------------------------------------


def _store(value: Any, name: str, folder: Path) -> dict[str, Any]:
    """A stage argument or result field as JSON: DataFrames go to a parquet file beside it."""
    if isinstance(value, pd.DataFrame):
        value.to_parquet(folder / f"{name}.parquet")
        return {"frame": f"{name}.parquet"}
    if isinstance(value, Path):
        return {"path": str(value)}
    return {"value": value}


def _restore(stored: dict[str, Any], folder: Path) -> Any:
    if "frame" in stored:
        return pd.read_parquet(folder / stored["frame"])
    if "path" in stored:
        return Path(stored["path"])
    return stored["value"]


# --- each process's side ----------------------------------------------------------------------


def _write_result(result, spec: Path) -> None:
    stored = {f.name: _store(getattr(result, f.name), f"result-{f.name}", spec) for f in dataclasses.fields(result)}
    staging = spec / "result.json.tmp"
    staging.write_text(json.dumps(stored))
    staging.rename(spec / "result.json")


def _event_writer(events: Path) -> Reporting:
    def write(event: dict) -> None:
        with events.open("a") as f:
            f.write(json.dumps(event) + "\n")

    return Reporting(
        metrics=lambda metrics, step: write({"kind": "metrics", "metrics": metrics, "step": step}),
        samples=lambda table, step: write({"kind": "samples", "rows": table.to_dict("records"), "step": step}),
        warning=lambda message: write({"kind": "warning", "message": message}),
        rollouts=lambda table, step: write({"kind": "rollouts", "rows": table.to_dict("records"), "step": step}),
    )


def main(spec: Path) -> None:
    from accelerate import PartialState

    described = json.loads((spec / "spec.json").read_text())
    stage = described["stage"]
    section = SECTION_TYPES[stage].model_validate(described["section"])
    set_determinism(described["deterministic"], described["num_threads"])
    # First to set up the process group, so the trainers and our PPO loop find it as is (the
    # trainers' own `ddp_timeout` then goes unused): PartialState reads the CPU switch only from its argument.
    state = PartialState(cpu=os.environ.get("ACCELERATE_USE_CPU") == "true",
                         timeout=timedelta(seconds=section.launch.timeout_seconds))
    inputs = {name: _restore(given, spec) for name, given in described["arguments"].items()}
    reporting = _event_writer(spec / "events.jsonl") if state.is_main_process else Reporting()
    try:
        result = _import(STAGE_FUNCTIONS[stage])(section, **inputs, output_dir=Path(described["output_dir"]),
                                                  **reporting.arguments(stage))
    except Exception as e:
        if state.is_main_process and type(e).__name__ in USER_ERRORS:
            (spec / "error.json").write_text(json.dumps({"type": type(e).__name__, "message": str(e),
                                                         "metrics": getattr(e, "metrics", None)}))
        raise
    if state.is_main_process:
        _write_result(result, spec)
    # The ranks leave together, once rank 0 has saved and written its result (the others wait up to
    # `launch.timeout_seconds`), and the process group is torn down first: a rank that exited while it
    # was alive could abort in gloo's threads ("terminate called without an active exception"), and
    # the launcher then killed rank 0 mid-save.
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
