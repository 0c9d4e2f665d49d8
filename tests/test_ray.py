"""Stages on a Ray cluster (`launch.engine: ray`): a real two-node cluster on this machine
(`scripts/ray_cluster.sh`: two raylets of one CPU each), PPO sharded over one rank per node.

The Ray gang and `accelerate launch` run the same stage function on the same process group
(gloo, FSDP2), so a seeded run ends at the same checkpoint, to the bit, on either engine.
"""

from __future__ import annotations

import json
import re

import pytest

from rlhf.config import with_overrides
from rlhf.sections.base import LaunchConfig
from stages.common.reporting import Reporting
from stages.launch.call import Determinism, call_stage
from stages.launch.job import LaunchError
from stages.ppo import train_ppo
from stages.runtime.models import folder_digest
from tests.helpers import free_port, ppo_inputs, ray_launch

pytestmark = pytest.mark.multiprocess  # a Ray cluster, its driver and the ranks are processes



def _run(train, section, inputs, folder):
    return call_stage(train, section, inputs, folder, Reporting(), Determinism(num_threads=1))


@pytest.fixture(scope="module")
def uninterrupted(tiny_config, trained, tmp_path_factory):
    """PPO sharded over two local processes (`accelerate launch`): the digest every Ray run must end at."""
    cfg = with_overrides(tiny_config.ppo, {"launch": LaunchConfig(num_processes=2,
                                                                  accelerate_config="configs/accelerate/fsdp.yaml"),
                                           "num_iterations": 4, "checkpoint_every": 2})
    inputs = ppo_inputs(trained)
    return cfg, inputs, folder_digest(_run(train_ppo, cfg, inputs, tmp_path_factory.mktemp("local")).checkpoint)


def test_sharded_ppo_on_two_ray_nodes_ends_where_the_local_launch_does(ray_cluster, uninterrupted, tmp_path):
    cfg, inputs, digest = uninterrupted
    cfg = with_overrides(cfg, {"launch": ray_launch(ray_cluster, ray_placement="SPREAD")})
    reported = []
    result = call_stage(train_ppo, cfg, inputs, tmp_path, Reporting(metrics=lambda m, step: reported.append(step)),
                        Determinism(num_threads=1))
    assert folder_digest(result.checkpoint) == digest
    nodes = json.loads(result.tags["rlhf.launch.nodes"])
    assert [n["rank"] for n in nodes] == [0, 1]
    assert len({n["node"] for n in nodes}) == 2  # one rank on each raylet (both share this machine's IP)
    assert result.tags["rlhf.held_as"] == "fsdp2 x 2" and result.metrics["time/launch_seconds"] > 0
    assert reported and reported == sorted(reported)  # rank 0's metrics reached the caller, through Ray, in order


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_a_trainer_stage_sharded_on_ray_ends_where_the_local_launch_does(ray_cluster, tiny_config, trained, world,
                                                                         tokenizer, tmp_path, stage):
    """SFT, reward and DPO train with TRL, whose `Accelerator` reads FSDP2's switches from the
    environment `accelerate launch` sets from the config file; a Ray gang's ranks get the same
    (`stages.launch.job.accelerate_environment`), so they shard, as the local launch does, to the bit."""
    from stages.dpo import DPOInputs, train_dpo
    from stages.sft import train_sft
    from tests.helpers import dataset, sft_inputs

    train, section, inputs = {
        "sft": (train_sft, tiny_config.sft, sft_inputs(world, tokenizer)),
        "dpo": (train_dpo, tiny_config.dpo, DPOInputs(trained["sft"], dataset(world, tokenizer, "preferences"),
                                                      dataset(world, tokenizer, "preferences_eval"),
                                                      trained["eval_prompts"]))}[stage]
    section = section.model_copy(update={"max_steps": 4})
    local = _run(train, section.model_copy(update={"launch": LaunchConfig(
        num_processes=2, accelerate_config="configs/accelerate/fsdp.yaml")}), inputs, tmp_path / "local")
    on_ray = _run(train, section.model_copy(update={"launch": ray_launch(ray_cluster, ray_placement="SPREAD")}), inputs,
                  tmp_path / "ray")
    assert on_ray.tags["rlhf.held_as"] == local.tags["rlhf.held_as"] == "fsdp2 x 2"
    assert folder_digest(on_ray.checkpoint) == folder_digest(local.checkpoint)


def test_a_rank_killed_mid_run_restarts_the_gang_and_ends_at_the_uninterrupted_digest(ray_cluster, uninterrupted,
                                                                                       tmp_path):
    from tests.stand_in_stages import RankKilledOnce, ppo_with_a_rank_killed_once

    cfg, inputs, digest = uninterrupted
    killed = RankKilledOnce(inputs, rank=1, marker=tmp_path / "killed")
    cfg = with_overrides(cfg, {"launch": ray_launch(ray_cluster, max_failures=1)})
    result = _run(ppo_with_a_rank_killed_once, cfg, killed, tmp_path / "run")
    assert killed.marker.exists()  # it was killed, and the second start resumed from the checkpoint
    assert folder_digest(result.checkpoint) == digest
    launch = json.loads((tmp_path / "run" / "launch" / "launch.json").read_text())
    assert launch["starts"] == 2


def test_a_node_lost_mid_run_and_back_15_s_later_restarts_the_gang_at_the_uninterrupted_digest(
        ray_cluster, uninterrupted, tmp_path):
    """Not one rank: the worker node's raylet and everything under it, as a machine's loss would take them."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests.stand_in_stages import PausedOnce, ppo_paused_once_after_a_checkpoint

    cfg, inputs, digest = uninterrupted
    paused = PausedOnce(inputs, marker=tmp_path / "paused")
    cfg = with_overrides(cfg, {"launch": ray_launch(ray_cluster, max_failures=1, ray_placement="SPREAD")})
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_run, ppo_paused_once_after_a_checkpoint, cfg, paused, tmp_path / "run")
        deadline = time.monotonic() + 300
        while not paused.marker.exists():
            assert not running.done(), running.exception()
            assert time.monotonic() < deadline, "the gang never reached its first checkpoint"
            time.sleep(0.2)
        ray_cluster.lose_node("worker")
        time.sleep(15)
        ray_cluster.bring_back()
        result = running.result(timeout=600)
    assert folder_digest(result.checkpoint) == digest
    launch = json.loads((tmp_path / "run" / "launch" / "launch.json").read_text())
    assert launch["starts"] == 2


_LEFT = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("GROUPS=" + json.dumps([g["state"] for g in ray.util.placement_group_table().values()
                              if g["state"] != "REMOVED"]))
"""


def test_a_node_lost_for_good_fails_the_gang_in_time_naming_it_and_leaves_nothing(ray_cluster, uninterrupted,
                                                                                   tmp_path):
    import subprocess
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    from stages.launch.ray_gang import RESTART_TIMEOUT_S
    from tests.helpers import processes
    from tests.stand_in_stages import PausedOnce, ppo_paused_once_after_a_checkpoint

    cfg, inputs, _ = uninterrupted
    paused = PausedOnce(inputs, marker=tmp_path / "paused")
    cfg = with_overrides(cfg, {"launch": ray_launch(ray_cluster, max_failures=1, ray_placement="SPREAD")})
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_run, ppo_paused_once_after_a_checkpoint, cfg, paused, tmp_path / "run")
            while not paused.marker.exists():
                assert not running.done(), running.exception()
                time.sleep(0.2)
            ray_cluster.lose_node("worker")
            lost = time.monotonic()
            with pytest.raises(LaunchError) as failed:
                running.result(timeout=RESTART_TIMEOUT_S + 120)
            seconds = time.monotonic() - lost
        message = str(failed.value)
        assert seconds < RESTART_TIMEOUT_S + 60, seconds  # the restart's timeout, and the failure's detection
        assert re.search(r"node [0-9a-f]{12} \([0-9.]+\), which held rank \d, left the Ray cluster and was "
                         rf"not back within {RESTART_TIMEOUT_S:.0f} s", message), message
        assert "the gang needs 2 processes x {'CPU': 1} (SPREAD), and the live nodes hold 1 CPU" in message
        assert not processes("ray::RayTrainWorker", environment=ray_cluster.environment)
        assert not processes("ray::TrainController", environment=ray_cluster.environment)
        left = subprocess.run([sys.executable, "-c", _LEFT, str(ray_cluster)], capture_output=True, text=True,
                              timeout=120)
        assert "GROUPS=[]" in left.stdout, left.stdout + left.stderr  # no placement group holds the cluster
    finally:
        ray_cluster.bring_back()


def test_with_no_retries_a_killed_rank_fails_the_stage_naming_it(ray_cluster, uninterrupted, tmp_path):
    from tests.stand_in_stages import RankKilledOnce, ppo_with_a_rank_killed_once

    cfg, inputs, _ = uninterrupted
    killed = RankKilledOnce(inputs, rank=1, marker=tmp_path / "killed")
    with pytest.raises(LaunchError,
                       match=r"rank 1 \(node [0-9a-f]{12}, [0-9.]+, pid \d+\): WorkerHealthCheckFailedError"):
        _run(ppo_with_a_rank_killed_once, with_overrides(cfg, {"launch": ray_launch(ray_cluster)}), killed,
             tmp_path / "run")


def test_a_gang_the_cluster_cannot_hold_fails_before_training_naming_what_is_missing(ray_cluster, uninterrupted,
                                                                                    tmp_path):
    cfg, inputs, _ = uninterrupted
    cfg = with_overrides(cfg, {"launch": ray_launch(ray_cluster).model_copy(update={"num_processes": 4})})
    with pytest.raises(LaunchError, match=r"has 2 CPU in all; the gang needs 4 processes x \{.CPU.: 1\} = 4 CPU"):
        _run(train_ppo, cfg, inputs, tmp_path)
    assert not (tmp_path / "checkpoint").exists()


def test_an_unreachable_cluster_fails_at_once_naming_the_address(tiny_config, trained, tmp_path):
    cfg = with_overrides(tiny_config.ppo, {"launch": ray_launch(f"127.0.0.1:{free_port()}")})
    inputs = ppo_inputs(trained)
    with pytest.raises(LaunchError, match=r"no Ray cluster answers at 127\.0\.0\.1:\d+"):
        _run(train_ppo, cfg, inputs, tmp_path)


def test_a_cluster_that_requires_a_token_refuses_a_driver_without_it_naming_the_cluster(ray_cluster, tiny_config,
                                                                                         trained, tmp_path,
                                                                                         monkeypatch):
    """The local cluster requires its token (its head listens on every interface); without it the
    stage fails before any training, with Ray's reason."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cfg = with_overrides(tiny_config.ppo, {"launch": ray_launch(ray_cluster)})
    inputs = ppo_inputs(trained)
    with pytest.raises(LaunchError, match=r"could not join the Ray cluster at 127\.0\.0\.1:\d+.*(?s:.*)[Tt]oken"):
        _run(train_ppo, cfg, inputs, tmp_path)
    assert not (tmp_path / "checkpoint").exists()
