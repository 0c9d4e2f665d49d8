"""The memory plan against measurement: SFT, reward and PPO, full and LoRA, on Llama-shaped models
of three sizes built from config, on this machine's CPU.

    python -m bench.memory                  (or: make bench-memory)

1. For each size (`SIZES`: ~10M, ~100M, ~400M parameters) a Llama with random weights and the demo
   world's tokenizer is saved as a checkpoint; it is the base model, the SFT checkpoint and the
   reward model's start alike.
2. Each (size, stage, full or LoRA) runs in a fresh process, as the flow calls a stage
   (`call_stage`, one process, float32), on the tiny demo world's data with `WORK`'s settings.
3. In that process, two measures against the plan (`stages.memory.plan.plan` for the same config):
   - *model-and-optimizer state*: after the first optimizer step, the bytes of every model's
     parameters, the trained parameters' gradients (held from backward to the step) and AdamW's
     state, counted from the tensors; against the plan's `state_bytes`. Goal: within 25%.
   - *overall*: the stage's peak resident memory (Linux's VmHWM, reset when the stage starts) less
     the resident memory before it (libraries, the process's own), against the plan's peak less its
     runtime allowance. On CPU there are no allocator statistics: RSS is what can be seen; it also
     holds freed pages malloc keeps. Goal: within a factor of 2.

Prints a Markdown table and writes `bench/results/memory-<date>.json`. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SIZES = {"10M": (256, 14), "100M": (768, 16), "400M": (1024, 36)}
"""(hidden size, decoder layers) of each Llama: 10.5 h^2 parameters per layer (MLP 8/3 h, 4 KV heads per 16)."""

WORK = {
    "sft": {"max_steps": 2, "batch_size": 4, "eval_steps": 100, "logging_steps": 1, "num_samples": 2,
            "checkpoint_every": 100},
    "reward": {"max_steps": 2, "batch_size": 4, "eval_steps": 100, "logging_steps": 1, "normalization_samples": 1,
               "min_eval_accuracy": 0.0, "checkpoint_every": 100},
    "ppo": {"num_iterations": 1, "rollout_batch_size": 8, "num_ppo_epochs": 1, "num_minibatches": 1,
            "sampling.response_length": 16, "evaluation.every": None, "evaluation.samples_per_prompt": 1,
            "checkpoint_every": 100, "missing_eos_score": None, "critic.kind": "reward"},
}
"""Each stage's settings on top of `configs/tiny.yaml` (float32 on the CPU, one process)."""

LARGE_PPO = {"400M": {"critic.kind": "shared"}}
"""At 400M, full PPO with a critic of its own would hold ~16 GiB of 24: the shared value head instead."""

LORA = {"lora": {"r": 8}}
LORA_PPO = {"lora": {"r": 8}, "critic.kind": "shared"}
"""LoRA runs; PPO's with the shared value head (its critic then loads no model of its own)."""


def state_bytes(modules, optimizer, trained) -> int:
    """Bytes of model-and-optimizer state: every parameter of `modules` (each once), AdamW's state,
    and the float32 gradients of `trained`, held from backward to the step (a shard counts its part)."""
    import torch

    from bench.scale import _bytes

    parameters = {id(p): p for m in modules if m is not None for p in m.parameters()}.values()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return _bytes([*parameters, *state]) + 4 * sum(p.numel() for p in trained)


def _record_state(held: dict) -> None:
    """Patch the stages so the first optimizer step records the state bytes into `held`."""
    import stages.ppo
    import stages.runtime.training

    real_update = stages.ppo.ppo_update

    def ppo_update(trainer, *args, **kwargs):
        figures = real_update(trainer, *args, **kwargs)
        if not held:
            models = trainer.models
            held["state"] = state_bytes([*models.trained_modules(), models.reference, models.scorer.model],
                                         trainer.optimizer, models.trainable())
        return figures

    real_step_end = stages.runtime.training.ForwardLogs.on_step_end

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not held and model is not None and optimizer is not None:
            modules = [model] + ([kwargs["ref_model"]] if kwargs.get("ref_model") is not None else [])
            held["state"] = state_bytes(modules, optimizer, [p for p in model.parameters() if p.requires_grad])
        return real_step_end(self, args, state, control, model=model, optimizer=optimizer, **kwargs)

    stages.ppo.ppo_update = ppo_update
    stages.runtime.training.ForwardLogs.on_step_end = on_step_end


def run_one(size: str, stage: str, lora: bool, checkpoint: str, world: Path, work: Path, processes: int = 1) -> dict:
    """One stage run, measured, beside its plan: the row of the table. On one process, in this one;
    on several, sharded (FSDP2, `FSDP_CONFIG`) at the same global batch, measured on the process whose
    memory peaked highest (the model-and-optimizer state is then not counted: it lives in the launched
    processes)."""
    import ctypes

    import psutil

    from rlhf.config import load_config, with_overrides
    from schemas.validate import LengthBudget, load_validated
    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.memory.phases import Counts, Device, Target
    from stages.memory.plan import FSDP_CONFIG, plan
    from stages.memory.shapes import GIB, RUNTIME_GIB, model_shape
    from stages.ppo import PPOInputs, train_ppo
    from stages.reward import RewardInputs, train_reward
    from stages.runtime.models import load_tokenizer
    from stages.sft import SFTInputs, train_sft

    base = load_config("configs/tiny.yaml")
    section = getattr(base, stage)
    changes = WORK[stage] | (LARGE_PPO.get(size, {}) if stage == "ppo" else {})
    section = with_overrides(section, changes | ((LORA_PPO if stage == "ppo" else LORA) if lora else {})
                             | {"precision": "fp32"})
    if processes > 1:
        sharded = {"launch": {"num_processes": processes, "accelerate_config": FSDP_CONFIG}}
        if stage != "ppo":  # PPO's rollout batch is global already
            sharded["batch_size"] = section.batch_size // processes
        section = with_overrides(section, sharded)
    cfg = base.model_copy(update={stage: section})
    tokenizer = load_tokenizer(checkpoint)
    prompt_length = section.max_prompt_length
    budget = LengthBudget(prompt_length, prompt_length + section.sampling.response_length if stage == "ppo"
                          else section.max_length)

    def data(name: str, kind: str):
        return load_validated(str(world / f"{name}.jsonl"), kind, tokenizer=tokenizer, budget=budget).frame

    if stage == "sft":
        train, inputs = train_sft, SFTInputs(checkpoint, data("sft", "sft"), data("sft_eval", "sft"))
    elif stage == "reward":
        train, inputs = train_reward, RewardInputs(model_location=checkpoint, policy_location=checkpoint,
                                                   train=data("preferences", "preference"),
                                                   evaluation=data("preferences_eval", "preference"),
                                                   normalization_prompts=data("prompts_eval", "prompt"))
    else:
        train, inputs = train_ppo, PPOInputs(sft_location=checkpoint, reward_location=checkpoint,
                                             prompts=data("prompts", "prompt"),
                                             eval_prompts=data("prompts_eval", "prompt"))
    eval_prompts = len(data("prompts_eval", "prompt"))
    machine = Target(Device("cpu", psutil.virtual_memory().total), Counts(eval_prompts, eval_prompts, eval_prompts))
    planned = plan(cfg, [stage], {"policy": model_shape(checkpoint)}, machine).stages[stage]

    held: dict = {}
    _record_state(held)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    result = call_stage(train, section, inputs, work, Reporting(), Determinism())
    before = result.metrics["memory/start_rss_gib"] * GIB
    measured = result.metrics["memory/peak_rss_gib"] * GIB - before
    predicted = planned.peak - RUNTIME_GIB * GIB
    state = held.get("state")
    return {"size": size, "stage": stage, "lora": lora, "processes": processes,
            "parameters": model_shape(checkpoint).parameters,
            "state_measured_gib": state and state / GIB, "state_planned_gib": planned.state_bytes() / GIB,
            "state_error": state and planned.state_bytes() / state - 1,
            "peak_measured_gib": measured / GIB, "peak_planned_gib": predicted / GIB,
            "peak_ratio": predicted / measured, "planned_peak_phase": planned.peak_phase,
            "rss_before_gib": before / GIB, "peak_rss_gib": result.metrics["memory/peak_rss_gib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--stages", nargs="+", default=["sft", "reward", "ppo"], choices=["sft", "reward", "ppo"])
    parser.add_argument("--work", default=str(REPO / ".rlhf" / "bench-memory"))
    parser.add_argument("--lora", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--processes", nargs="+", type=int, default=[1],
                        help="process counts to run each stage on (above 1: sharded, FSDP2 over gloo)")
    parser.add_argument("--one", nargs=4, metavar=("SIZE", "STAGE", "LORA", "PROCESSES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work)
    from rlhf.config import load_config
    from rlhf.demo.world import build_world

    world = build_world(work / "worlds", load_config("configs/tiny.yaml").demo)
    if args.one:
        size, stage, lora, processes = args.one
        checkpoint = str(work / "models" / size)
        folder = work / "runs" / f"{size}-{stage}-{lora}-{processes}"
        shutil.rmtree(folder, ignore_errors=True)  # a finished run's full-state checkpoint would be resumed
        row = run_one(size, stage, lora == "lora", checkpoint, world, folder, int(processes))
        print("ROW " + json.dumps(row), flush=True)
        return

    from bench.scale import build_checkpoint

    rows = []
    for size in args.sizes:
        folder = work / "models" / size
        if not (folder / "config.json").exists():
            build_checkpoint(world, folder, *SIZES[size])
        for stage, lora, processes in itertools.product(args.stages, args.lora, args.processes):
            out = subprocess.run([sys.executable, "-m", "bench.memory", "--work", str(work), "--one", size, stage,
                                  lora, str(processes)], cwd=REPO, capture_output=True, text=True)
            found = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
            if out.returncode != 0 or not found:
                print(f"{size} {stage} {lora} x{processes}: failed\n{out.stderr[-3000:]}", flush=True)
                continue
            rows.append(json.loads(found[0]))
            r = rows[-1]
            print(f"{size} {stage} {lora} x{processes}: state {_gib(r['state_measured_gib'])} GiB measured, "
                  f"{r['state_planned_gib']:.3f} planned; peak {r['peak_measured_gib']:.3f} measured "
                  f"({r['peak_rss_gib']:.3f} RSS), {r['peak_planned_gib']:.3f} planned (x{r['peak_ratio']:.2f})",
                  flush=True)
    print("\n| size | stage | | processes | state measured (GiB) | planned | error | peak measured (GiB) | planned "
          "| planned / measured | peak RSS (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        error = "-" if r["state_error"] is None else f"{r['state_error']:+.1%}"
        print(f"| {r['size']} | {r['stage']} | {'LoRA' if r['lora'] else 'full'} | {r['processes']} | "
              f"{_gib(r['state_measured_gib'])} | {r['state_planned_gib']:.3f} | {error} | "
              f"{r['peak_measured_gib']:.3f} | "
              f"{r['peak_planned_gib']:.3f} | {r['peak_ratio']:.2f} | {r['peak_rss_gib']:.3f} |")
    out = REPO / "bench" / "results" / f"memory-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(REPO)}")


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
