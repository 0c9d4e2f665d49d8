"""Every stage sharded over two CPU processes (FSDP2 over gloo, `configs/accelerate/fsdp.yaml`)."""

from __future__ import annotations

from rlhf.config import LaunchConfig
from stages.distributed import call_stage
from stages.ppo import PPOInputs, train_ppo
from stages.reporting import Reporting

FSDP = LaunchConfig(num_processes=2, accelerate_config="configs/accelerate/fsdp.yaml")
DDP = LaunchConfig(num_processes=2)


def _run(train, section, inputs, folder):
    logged = []
    reporting = Reporting(metrics=lambda metrics, step: logged.append((step, metrics)))
    return call_stage(train, section, inputs, folder, reporting, deterministic=True, num_threads=2), logged


def test_ppo_sharded_runs(tiny_config, trained, tmp_path):
    cfg = tiny_config.ppo.model_copy(update={"launch": FSDP})
    inputs = PPOInputs(trained["sft"], trained["reward"], trained["prompts"], trained["eval_prompts"])
    result, logged = _run(train_ppo, cfg, inputs, tmp_path / "fsdp")
    print(result.metrics)
