"""Stress the multi-process launches: run each 2-process job the test suite runs N times and count
how each one ended.

    python -m bench.launch_stress --runs 20            (or: make stress-launch)
    python -m bench.launch_stress --runs 5 --jobs ppo-fsdp ppo-ddp --tag smoke

The jobs are the suite's own (tests/test_distributed.py, tests/test_sharding.py,
tests/test_lora_stages.py) with their settings, on the tiny config's world and the SFT and reward
checkpoints its fixtures train: SFT, reward and PPO on two DDP processes; SFT, reward, DPO, PPO
(reward critic, reward-lora critic, shared critic) sharded with FSDP2 over two processes; the
kill-and-resume pair (a run killed after its first checkpoint, then resumed); a LoRA SFT sharded.

Each run ends as one of:
- `clean`: every process exited 0 and the stage returned its result;
- `abort after done`: every rank had recorded its work done (`stages.launch.local.done_marker`) and one
  then died in teardown: the stage returned its result with a warning naming the rank and the log;
- `abort in teardown`: the job was reported failed although rank 0 had written its result, and a
  process aborted with "terminate called ..." (what `stages.launch.local` did before ranks recorded
  "done": the failure issue #38 is about);
- `failed in the work`: any other failure (the error is kept).
The killed leg of the kill-and-resume pair counts as `clean` when it ends by the kill after its
first checkpoint, as the test expects.

Writes `bench/results/launch-stress-<date>[-<tag>].json` after every run (so a stopped run keeps
what it measured) and prints a table. A benchmark, not a test: it takes about a minute a run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KINDS = ("clean", "abort after done", "abort in teardown", "failed in the work")

Job = Callable[[Path], str]
"""Runs a 2-process stage call, as a test makes it, in a fresh folder; returns how it ended (a KIND first)."""


def _upstream(root: Path):
    """The tiny world, its datasets, and SFT and reward checkpoints trained as the tests' `trained` fixture
    trains them."""
    from rlhf.config import load_config
    from rlhf.demo.world import build_world
    from stages.runtime.models import load_tokenizer
    from tests.helpers import train_upstream, world_frames

    cfg = load_config(REPO / "configs/tiny.yaml")
    world = build_world(root / "worlds", cfg.demo)
    frames = world_frames(world, load_tokenizer(str(world / "model")))
    return (cfg, world, frames, *train_upstream(cfg, world, frames, root))


def _outcome(call: Callable[[list[str]], object], folder: Path) -> str:
    from stages.launch.job import LaunchError

    warnings: list[str] = []
    try:
        call(warnings)
    except LaunchError as e:
        log = folder / "launch" / "launch.log"
        if (folder / "launch" / "result.pkl").exists() and "terminate called" in log.read_text(errors="replace"):
            return "abort in teardown"
        return f"failed in the work: {str(e)[:2000]}"
    except Exception as e:  # noqa: BLE001 - a benchmark counts every way a job fails
        return f"failed in the work: {type(e).__name__}: {e}"[:2000]
    return "abort after done" if any("finished its work" in w for w in warnings) else "clean"


def jobs(root: Path) -> dict[str, Job]:
    from rlhf.config import with_overrides
    from rlhf.sections.base import LaunchConfig
    from stages.common.reporting import Reporting
    from stages.dpo import DPOInputs, train_dpo
    from stages.launch.call import Determinism, call_stage
    from stages.launch.job import LaunchError
    from stages.ppo import PPOInputs, train_ppo
    from stages.reward import RewardInputs, train_reward
    from stages.sft import SFTInputs, train_sft
    from tests.stand_in_stages import KilledAfterFirstCheckpoint, ppo_killed_after_first_checkpoint

    cfg, world, frames, sft, reward = _upstream(root)
    ddp = LaunchConfig(num_processes=2)
    fsdp = LaunchConfig(num_processes=2, accelerate_config="configs/accelerate/fsdp.yaml")
    sft_inputs = SFTInputs(str(world / "model"), frames["sft"], frames["sft_eval"])
    reward_inputs = RewardInputs(model_location=sft, policy_location=sft, train=frames["preferences"],
                                 evaluation=frames["preferences_eval"], normalization_prompts=frames["prompts_eval"])
    dpo_inputs = DPOInputs(sft, frames["preferences"], frames["preferences_eval"], frames["prompts_eval"])
    ppo_inputs = PPOInputs(sft_location=sft, reward_location=reward,
                           prompts=frames["prompts"], eval_prompts=frames["prompts_eval"])

    def stage(train, section, inputs):
        def run(folder: Path) -> str:
            def call(warnings):
                reporting = Reporting(warning=warnings.append)
                return call_stage(train, section, inputs, folder, reporting, Determinism(num_threads=2))
            return _outcome(call, folder)
        return run

    def ppo(launch, **settings):
        return with_overrides(cfg.ppo, settings | {"launch": launch})

    def killed_then_resumed(folder: Path) -> str:
        section = ppo(fsdp, num_iterations=4, checkpoint_every=2)
        try:
            call_stage(ppo_killed_after_first_checkpoint, section, KilledAfterFirstCheckpoint(ppo_inputs), folder,
                       Reporting(), Determinism(num_threads=2))
            return "failed in the work: the killed leg was not killed"
        except LaunchError as e:
            if json.loads((folder / "state" / "loop.json").read_text())["iteration"] != 2:
                return f"failed in the work: the killed leg left no checkpoint at iteration 2: {e}"[:2000]
        return stage(train_ppo, section, ppo_inputs)(folder)

    sft_small = cfg.sft.model_copy(update={"max_steps": 12, "batch_size": 8})
    reward_small = cfg.reward.model_copy(update={"max_steps": 12, "batch_size": 8})
    return {
        "sft-ddp": stage(train_sft, sft_small.model_copy(update={"launch": ddp}), sft_inputs),
        "reward-ddp": stage(train_reward, reward_small.model_copy(update={"launch": ddp}), reward_inputs),
        "ppo-ddp": stage(train_ppo, ppo(ddp, num_iterations=6, rollout_batch_size=16, learning_rate=1e-3,
                                        evaluation={"samples_per_prompt": 4}), ppo_inputs),
        "sft-fsdp": stage(train_sft, sft_small.model_copy(update={"launch": fsdp}), sft_inputs),
        "reward-fsdp": stage(train_reward, reward_small.model_copy(update={"launch": fsdp}), reward_inputs),
        "dpo-fsdp": stage(train_dpo, cfg.dpo.model_copy(update={"max_steps": 8, "batch_size": 8, "launch": fsdp}),
                          dpo_inputs),
        "ppo-fsdp": stage(train_ppo, ppo(fsdp, num_iterations=4, checkpoint_every=2), ppo_inputs),
        "ppo-fsdp-reward-lora": stage(train_ppo, ppo(fsdp, num_iterations=4, checkpoint_every=2,
                                                     critic={"kind": "reward-lora"}, frozen_dtype="bfloat16"),
                                      ppo_inputs),
        "ppo-fsdp-shared": stage(train_ppo, ppo(fsdp, critic={"kind": "shared"}, ref_refresh_every=2,
                                                sharded_sampling="per_layer"), ppo_inputs),
        "ppo-fsdp-killed-resumed": killed_then_resumed,
        "sft-lora-fsdp": stage(train_sft, sft_small.model_validate(sft_small.model_dump()
                                                                   | {"lora": {"r": 4}, "launch": fsdp.model_dump()}),
                               sft_inputs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each job")
    parser.add_argument("--jobs", nargs="*", help="only these jobs (default: all)")
    parser.add_argument("--tag", default="", help="suffix of the results file")
    parser.add_argument("--cores", type=Path, help="keep the core dump of a process that aborted here (run under "
                        "`ulimit -c unlimited`; the kernel writes `core` into the launch's working folder, the "
                        "repository)")
    args = parser.parse_args()

    out = REPO / "bench" / "results" / f"launch-stress-{datetime.date.today()}{'-' + args.tag if args.tag else ''}.json"
    with tempfile.TemporaryDirectory(prefix="launch-stress-") as tmp:
        root = Path(tmp)
        every = jobs(root)
        chosen = args.jobs or list(every)
        results: dict[str, dict] = {name: {"runs": 0, "seconds": [], **{k: 0 for k in KINDS}, "failures": []}
                                    for name in chosen}
        for attempt in range(args.runs):  # round-robin: a slow stretch of the machine hits every job alike
            for name in chosen:
                started = time.perf_counter()
                ended = every[name](root / "runs" / name / str(attempt))
                kind = next(k for k in KINDS if ended.startswith(k))
                record = results[name]
                record["runs"] += 1
                record[kind] += 1
                record["seconds"].append(round(time.perf_counter() - started, 1))
                if kind in ("abort in teardown", "failed in the work", "abort after done"):
                    record["failures"].append({"run": attempt, "kind": kind, "detail": ended,
                                               "log_tail": _log_tail(root / "runs" / name / str(attempt))})
                if args.cores and (REPO / "core").exists():
                    args.cores.mkdir(parents=True, exist_ok=True)
                    (REPO / "core").rename(args.cores / f"{name}-{attempt}.core")
                print(f"{name} run {attempt}: {ended[:300]} ({record['seconds'][-1]} s)", flush=True)
                out.write_text(json.dumps({"date": str(datetime.date.today()), "runs_each": args.runs,
                                           "results": results}, indent=1))
    print(f"\n| job | runs | {' | '.join(KINDS)} | s/run |\n|---|---|{'---|' * len(KINDS)}---|")
    for name, r in results.items():
        mean = sum(r["seconds"]) / max(1, len(r["seconds"]))
        print(f"| {name} | {r['runs']} | {' | '.join(str(r[k]) for k in KINDS)} | {mean:.0f} |")
    print(f"\nwritten: {out.relative_to(REPO)}")


def _log_tail(folder: Path) -> str:
    log = folder / "launch" / "launch.log"
    if not log.exists():
        return ""
    lines = log.read_text(errors="replace").splitlines()
    keep = [line for line in lines if re.search(r"terminate|Abort|Signal|signal|exit|Error|rank", line)]
    return "\n".join(keep[-20:])


if __name__ == "__main__":
    main()
