"""What a Ray launch costs: each stage at 2 FSDP2 processes, by `accelerate launch` on this machine
(`launch.engine: local`) and as a Ray gang on a local 2-node cluster (`launch.engine: ray`).

    python -m bench.ray_launch                   (or: make bench-ray)
    python -m bench.ray_launch --repeats 1 --stages ppo

The work is the launch-stress jobs' (`bench.launch_stress`: the tiny world, its SFT and reward
checkpoints; SFT and reward 12 steps, DPO 8, PPO 4 iterations), the same on both engines. Each
engine runs each stage `--repeats` times, alternating which goes first. Reported per stage: the
median wall seconds of `call_stage` on each engine, their difference (the Ray launch's overhead),
and Ray's `time/launch_seconds` (from the driver's start to rank 0's). The cluster's own start
(`scripts/ray_cluster.sh up`, once per session of work) is reported apart.

Writes `bench/results/ray-launch-<date>[-<tag>].json` and prints a Markdown table. A benchmark, not
a test: about 10 minutes on this project's 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGES = ("sft", "reward", "dpo", "ppo")


def _cluster(home: Path, port: int) -> tuple[dict, float]:
    env = dict(os.environ, RLHF_HOME=str(home), RLHF_RAY_PORT=str(port))
    started = time.perf_counter()
    subprocess.run([str(REPO / "scripts" / "ray_cluster.sh"), "up"], env=env, check=True, capture_output=True,
                   timeout=300)
    return env, time.perf_counter() - started


def main() -> None:
    from bench.launch_stress import _upstream
    from rlhf.config import with_overrides
    from rlhf.sections.base import LaunchConfig
    from stages.common.reporting import Reporting
    from stages.dpo import DPOInputs, train_dpo
    from stages.launch.call import Determinism, call_stage
    from stages.ppo import PPOInputs, train_ppo
    from stages.reward import RewardInputs, train_reward
    from stages.sft import SFTInputs, train_sft
    from tests.helpers import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each stage on each engine")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    cfg, world, frames, sft, reward = _upstream(root)
    fsdp = {"num_processes": 2, "accelerate_config": "configs/accelerate/fsdp.yaml"}
    port = free_port()
    env, cluster_seconds = _cluster(root / "home", port)
    # the cluster requires its token (scripts/ray_cluster.sh); the Ray drivers `call_stage` starts inherit it
    os.environ |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(root / "home" / "ray" / "auth_token")}
    engines = {"local": LaunchConfig(**fsdp),
               "ray": LaunchConfig(**fsdp, engine="ray", ray_address=f"127.0.0.1:{port}")}
    work = {
        "sft": (train_sft, cfg.sft.model_copy(update={"max_steps": 12, "batch_size": 8}),
                SFTInputs(str(world / "model"), frames["sft"], frames["sft_eval"])),
        "reward": (train_reward, cfg.reward.model_copy(update={"max_steps": 12, "batch_size": 8}),
                   RewardInputs(model_location=sft, policy_location=sft, train=frames["preferences"],
                                evaluation=frames["preferences_eval"], normalization_prompts=frames["prompts_eval"])),
        "dpo": (train_dpo, cfg.dpo.model_copy(update={"max_steps": 8, "batch_size": 8}),
                DPOInputs(sft, frames["preferences"], frames["preferences_eval"], frames["prompts_eval"])),
        "ppo": (train_ppo, with_overrides(cfg.ppo, {"num_iterations": 4, "checkpoint_every": 2}),
                PPOInputs(sft_location=sft, reward_location=reward,
                          prompts=frames["prompts"], eval_prompts=frames["prompts_eval"])),
    }
    seconds: dict[str, dict[str, list[float]]] = {s: {"local": [], "ray": []} for s in args.stages}
    launch_seconds: dict[str, list[float]] = {s: [] for s in args.stages}
    try:
        for repeat in range(args.repeats):
            for stage in args.stages:
                train, section, inputs = work[stage]
                for engine in (("local", "ray") if repeat % 2 == 0 else ("ray", "local")):
                    folder = root / f"{stage}-{engine}-{repeat}"
                    started = time.perf_counter()
                    result = call_stage(train, section.model_copy(update={"launch": engines[engine]}), inputs, folder,
                                        Reporting(), Determinism(num_threads=2))
                    seconds[stage][engine].append(time.perf_counter() - started)
                    if engine == "ray":
                        launch_seconds[stage].append(result.metrics["time/launch_seconds"])
                    print(f"{stage} {engine} #{repeat}: {seconds[stage][engine][-1]:.1f} s", flush=True)
    finally:
        subprocess.run([str(REPO / "scripts" / "ray_cluster.sh"), "down"], env=env, capture_output=True, timeout=120)

    rows = {stage: {"local_s": statistics.median(t["local"]), "ray_s": statistics.median(t["ray"]),
                    "overhead_s": statistics.median(t["ray"]) - statistics.median(t["local"]),
                    "ray_launch_seconds": statistics.median(launch_seconds[stage]),
                    "runs": t | {"ray_launch_seconds": launch_seconds[stage]}}
            for stage, t in seconds.items()}
    lines = [f"Ray cluster start (2 raylets): {cluster_seconds:.1f} s", "",
             "| stage (2 x FSDP2) | accelerate launch (s) | Ray gang (s) | Ray overhead (s) "
             "| Ray: driver start to rank 0 (s) |",
             "|---|---|---|---|---|"]
    lines += [f"| {stage} | {r['local_s']:.1f} | {r['ray_s']:.1f} | {r['overhead_s']:+.1f} "
              f"| {r['ray_launch_seconds']:.1f} |"
              for stage, r in rows.items()]
    print("\n".join(lines))
    out = REPO / "bench" / "results" / f"ray-launch-{datetime.date.today()}{'-' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({"cluster_start_s": cluster_seconds, "repeats": args.repeats, "stages": rows,
                               "cpus": os.cpu_count()}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
