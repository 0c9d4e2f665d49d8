"""Every stage sharded over two CPU processes (FSDP2 over gloo, `configs/accelerate/fsdp.yaml`)
against one process at the same global batch.

SFT, reward and DPO see the same examples in the same global batches sharded or not, so their
figures agree up to float reduction order: the 0.5% of `tests/test_distributed.py`. Each
process must hold half of the parameters (the launch log says so), so a run that silently fell
back to DDP fails. PPO's gradients are compared exactly in `tests/test_ppo_gradients.py`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.config import with_overrides
from rlhf.sections.base import LaunchConfig
from stages.common.reporting import MEASURED, Reporting
from stages.dpo import DPOInputs, train_dpo
from stages.launch.call import Determinism, call_stage
from stages.ppo import train_ppo
from stages.reward import train_reward
from stages.sft import train_sft
from tests.helpers import close, dataset, ppo_inputs, reward_inputs, sft_inputs

pytestmark = pytest.mark.multiprocess  # every test launches a stage on two FSDP2 processes

FSDP = LaunchConfig(num_processes=2, accelerate_config="configs/accelerate/fsdp.yaml")


def _run(train, section, inputs, folder):
    return call_stage(train, section, inputs, folder, Reporting(), Determinism(num_threads=2))


def _agree(one: dict, two: dict, keys) -> None:
    for key in keys:
        assert close(two[key], one[key]), (key, one[key], two[key])


def test_sft_sharded_matches_one_process(world, tiny_config, tokenizer, tmp_path):
    one_cfg = tiny_config.sft.model_copy(update={"max_steps": 12, "batch_size": 16})
    two_cfg = one_cfg.model_copy(update={"batch_size": 8, "launch": FSDP})
    inputs = sft_inputs(world, tokenizer)
    one, two = _run(train_sft, one_cfg, inputs, tmp_path / "one"), _run(train_sft, two_cfg, inputs, tmp_path / "two")
    _agree(one.metrics, two.metrics, ("train/loss", "eval/loss", "eval/loss_untrained"))
    assert (one.tags["rlhf.held_as"], two.tags["rlhf.held_as"]) == ("one process", "fsdp2 x 2")
    assert two.metrics["eval/loss"] < 0.8 * two.metrics["eval/loss_untrained"]
    assert [s["response"] for s in two.samples] == [s["response"] for s in one.samples]
    _same_weights(one.checkpoint, two.checkpoint, AutoModelForCausalLM)


def _same_weights(one, two, auto) -> None:
    """The sharded run's hand-off (written a tensor at a time) reads back as the one-process run's."""
    one, two = (auto.from_pretrained(folder, use_safetensors=True).state_dict() for folder in (one, two))
    assert set(one) == set(two)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=name)


def test_reward_sharded_matches_one_process(world, tiny_config, tokenizer, trained, tmp_path):
    one_cfg = tiny_config.reward.model_copy(update={"max_steps": 12, "batch_size": 16})
    two_cfg = one_cfg.model_copy(update={"batch_size": 8, "launch": FSDP})
    inputs = reward_inputs(world, tokenizer, trained)
    one, two = (_run(train_reward, one_cfg, inputs, tmp_path / "one"),
                _run(train_reward, two_cfg, inputs, tmp_path / "two"))
    _agree(one.metrics, two.metrics, ("train/loss", "eval/loss", "eval/margin", "eval/accuracy", "normalization/gain"))
    assert two.tags["rlhf.held_as"] == "fsdp2 x 2"
    _same_weights(one.checkpoint, two.checkpoint, AutoModelForSequenceClassification)


def test_dpo_sharded_matches_one_process(world, tiny_config, tokenizer, trained, tmp_path):
    one_cfg = tiny_config.dpo.model_copy(update={"max_steps": 8, "batch_size": 16})
    two_cfg = one_cfg.model_copy(update={"batch_size": 8, "launch": FSDP})
    inputs = DPOInputs(trained["sft"], dataset(world, tokenizer, "preferences"),
                       dataset(world, tokenizer, "preferences_eval"), trained["eval_prompts"])
    one, two = _run(train_dpo, one_cfg, inputs, tmp_path / "one"), _run(train_dpo, two_cfg, inputs, tmp_path / "two")
    _agree(one.metrics, two.metrics, ("train/loss", "eval/loss", "eval/loss_untrained", "eval/preference_accuracy"))
    assert two.tags["rlhf.held_as"] == "fsdp2 x 2"
    _same_weights(one.checkpoint, two.checkpoint, AutoModelForCausalLM)


def test_sharded_dpo_trains_lora_on_bf16_weights(world, tiny_config, tokenizer, trained, tmp_path):
    """FSDP2 with float32 adapters and bf16 frozen weights in one sharded unit (`frozen_dtype` under LoRA:
    how DPO fits 70B on 8 GPUs), handed over as a plain float32 checkpoint."""
    cfg = with_overrides(tiny_config.dpo, {"max_steps": 4, "batch_size": 8, "launch": FSDP, "lora": {"r": 4},
                                           "frozen_dtype": "bfloat16"})
    inputs = DPOInputs(trained["sft"], dataset(world, tokenizer, "preferences"),
                       dataset(world, tokenizer, "preferences_eval"), trained["eval_prompts"])
    result = _run(train_dpo, cfg, inputs, tmp_path)
    assert result.tags["rlhf.held_as"] == "fsdp2 x 2"
    assert result.metrics["eval/loss"] < result.metrics["eval/loss_untrained"]
    saved = AutoModelForCausalLM.from_pretrained(result.checkpoint, use_safetensors=True)
    assert {p.dtype for p in saved.parameters()} == {torch.float32}
    assert not any("lora" in name for name, _ in saved.named_parameters())


def test_offloaded_sft_matches_the_sharded_run(world, tiny_config, tokenizer, tmp_path):
    """configs/accelerate/fsdp-offload.yaml: shards, gradients and optimizer state in host memory (on
    the CPU the same memory; what runs is FSDP2's offloading path); the same training either way."""
    section = tiny_config.sft.model_copy(update={"max_steps": 4, "batch_size": 8, "launch": FSDP})
    offloaded = section.model_copy(update={"launch": FSDP.model_copy(
        update={"accelerate_config": "configs/accelerate/fsdp-offload.yaml"})})
    assert offloaded.launch.offload_params and not section.launch.offload_params
    inputs = sft_inputs(world, tokenizer)
    one, two = _run(train_sft, section, inputs, tmp_path / "one"), _run(train_sft, offloaded, inputs, tmp_path / "two")
    _agree(one.metrics, two.metrics, ("train/loss", "eval/loss"))
    _same_weights(one.checkpoint, two.checkpoint, AutoModelForCausalLM)


@pytest.mark.parametrize("settings", [
    {"critic.kind": "shared", "ref_refresh_every": 2, "sharded_sampling": "per_layer", "offload_frozen": True},
    {"advantage_estimator": "grpo", "samples_per_prompt": 2, "lora": {"r": 4},
     "launch": FSDP.model_copy(update={"accelerate_config": "configs/accelerate/fsdp-offload.yaml"})},
])
def test_sharded_ppo_variants_run_and_hand_over_a_plain_checkpoint(tiny_config, trained, tmp_path, settings):
    """The sharded paths the gradient and resume tests do not take: a shared value head with the
    reference refreshed from the sharded policy, sampling gathered layer by layer and the frozen
    models offloaded (FSDP2's offloading path; on the CPU the same memory); a critic-free estimator
    with LoRA (the reference is the sharded policy with adapters off) and every model offloaded."""
    cfg = with_overrides(tiny_config.ppo, {"launch": FSDP} | settings)
    inputs = ppo_inputs(trained)
    result = _run(train_ppo, cfg, inputs, tmp_path / "fsdp")
    assert result.tags["rlhf.held_as"] == "fsdp2 x 2"
    assert result.metrics["train/iterations"] == cfg.num_iterations
    assert all(math.isfinite(v) for h in result.history for v in h.values())
    saved = AutoModelForCausalLM.from_pretrained(result.checkpoint, use_safetensors=True)
    assert not any("lora" in name for name, _ in saved.named_parameters())  # merged: a plain model
    if cfg.lora is not None:
        # The demo model ties its output head to the embeddings; the head's adapters (gathered from the
        # shards) are merged into a head of its own, and the embeddings stay the SFT policy's.
        sft = AutoModelForCausalLM.from_pretrained(trained["sft"], use_safetensors=True)
        assert cfg.lora.output_layer and sft.config.tie_word_embeddings and not saved.config.tie_word_embeddings
        assert saved.model.embed_tokens.weight.equal(sft.model.embed_tokens.weight)
        assert (saved.lm_head.weight - sft.lm_head.weight).abs().max() > 1e-4


@pytest.mark.parametrize("settings", [{}, {"critic.kind": "reward-lora", "frozen_dtype": "bfloat16"}])
def test_sharded_ppo_killed_mid_run_resumes_to_the_uninterrupted_weights(tiny_config, trained, tmp_path, settings):
    """The critic from the reward model, or LoRA adapters on the reward model's own sharded body
    (bf16, the float32 adapters in the same units) whose shards the checkpoint holds."""
    from stages.launch.job import LaunchError
    from stages.runtime.models import folder_digest
    from tests.stand_in_stages import KilledAfterFirstCheckpoint, ppo_killed_after_first_checkpoint

    cfg = with_overrides(tiny_config.ppo, {"launch": FSDP, "num_iterations": 4, "checkpoint_every": 2} | settings)
    inputs = ppo_inputs(trained)
    whole = _run(train_ppo, cfg, inputs, tmp_path / "uninterrupted")

    killed = tmp_path / "killed"
    with pytest.raises(LaunchError, match="exited with code"):
        _run(ppo_killed_after_first_checkpoint, cfg, KilledAfterFirstCheckpoint(inputs), killed)
    state = killed / "state"
    assert json.loads((state / "loop.json").read_text())["iteration"] == 2
    assert len(list((state / "sharded").glob("*.distcp"))) == 2  # one shard file per process
    resumed = _run(train_ppo, cfg, inputs, killed)
    assert folder_digest(resumed.checkpoint) == folder_digest(whole.checkpoint)
    # Leaves out what measures the processes (their time, `call_stage`'s peak memory), not the run.
    untimed = lambda metrics: {k: v for k, v in metrics.items() if not k.startswith(MEASURED)}  # noqa: E731
    assert untimed(resumed.metrics) == untimed(whole.metrics)
    assert [untimed(h) for h in resumed.history] == [untimed(h) for h in whole.history]


def test_two_machines_one_stage_sharded_over_both(world, tiny_config, tokenizer, tmp_path):
    """configs/accelerate/two-nodes-fsdp.yaml as two "machines" on this one: the flow's task starts
    machine 0's share (`call_stage`), and the same `accelerate launch` command with machine_rank 1
    starts the other's against the same work folder, as docs/scaling.md tells a user to on the
    second node; one rendezvous, each process holding half of the model."""
    import os
    import socket
    import subprocess
    import threading
    import time

    import yaml

    from stages.launch.local import launch_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shipped = yaml.safe_load(open("configs/accelerate/two-nodes-fsdp.yaml"))
    machines = []
    for rank in (0, 1):
        path = tmp_path / f"machine-{rank}.yaml"
        path.write_text(yaml.safe_dump(shipped | {"machine_rank": rank, "main_process_ip": "127.0.0.1",
                                                  "main_process_port": port, "num_processes": 2}))
        machines.append(path)

    one_cfg = tiny_config.sft.model_copy(update={"max_steps": 12, "batch_size": 16})
    two_cfg = one_cfg.model_copy(update={"batch_size": 8, "launch": LaunchConfig(
        num_processes=2, accelerate_config=str(machines[0]))})
    inputs = sft_inputs(world, tokenizer)
    folder, outcome = tmp_path / "two-machines", {}
    first = threading.Thread(target=lambda: outcome.update(result=_run(train_sft, two_cfg, inputs, folder)))
    first.start()
    spec = folder / "launch"
    while not (spec / "call.pkl").exists():  # machine 0's task has written the call both machines run
        assert first.is_alive(), "machine 0 ended before writing its launch"
        time.sleep(0.2)
    other = two_cfg.launch.model_copy(update={"accelerate_config": str(machines[1])})
    second = subprocess.run(launch_command(spec, other), env=dict(os.environ, ACCELERATE_USE_CPU="true"),
                            capture_output=True, text=True, timeout=600)
    first.join(timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    two, one = outcome["result"], _run(train_sft, one_cfg, inputs, tmp_path / "one")
    assert two.tags["rlhf.held_as"] == "fsdp2 x 2"
    _agree(one.metrics, two.metrics, ("train/loss", "eval/loss", "eval/loss_untrained"))


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_no_process_holds_a_whole_model_while_loading(world, tiny_config, tokenizer, trained, tmp_path, stage):
    """Sharded loading: every model every process builds is built on the meta device (no bytes of
    weights, but for what the stage makes itself: a fresh score head); the first process reads the
    checkpoint a tensor at a time as it sends each its shards, never holding two tensors' worth at once
    beyond the embeddings it resizes; the others read nothing; the hand-off loads nothing again."""
    from tests.stand_in_stages import RecordingLoads, record_loads

    if stage == "sft":
        section = tiny_config.sft.model_copy(update={"max_steps": 2, "launch": FSDP})
        call = RecordingLoads(train_sft, sft_inputs(world, tokenizer))
    elif stage == "reward":
        section = tiny_config.reward.model_copy(update={"max_steps": 2, "launch": FSDP})
        call = RecordingLoads(train_reward, reward_inputs(world, tokenizer, trained))
    elif stage == "dpo":
        section = tiny_config.dpo.model_copy(update={"max_steps": 2, "launch": FSDP})
        call = RecordingLoads(train_dpo, DPOInputs(trained["sft"], dataset(world, tokenizer, "preferences"),
                                                   dataset(world, tokenizer, "preferences_eval"),
                                                   trained["eval_prompts"]))
    else:
        section = with_overrides(tiny_config.ppo, {"launch": FSDP, "num_iterations": 1, "critic.kind": "reward"})
        call = RecordingLoads(train_ppo, ppo_inputs(trained))
    result = _run(record_loads, section, call, tmp_path)
    first, second = (json.loads((tmp_path / f"loads-{rank}.json").read_text()) for rank in (0, 1))
    assert all(load["real_bytes"] == 0 for load in second), second
    assert all(load["real_bytes"] <= 0.01 * load["bytes"] for load in first), first  # a fresh head at most
    # The first process also asks transformers what it would load (`from_pretrained` onto the meta device).
    built = [load for load in first if load["how"] == "from_config"]
    assert built and len(built) == len(second)  # nothing loaded whole again to hand the trained model off
    model_bytes = max(load["bytes"] for load in first if load["how"] == "from_pretrained")
    reads, others = (json.loads((tmp_path / f"reads-{rank}.json").read_text()) for rank in (0, 1))
    assert others["sizes"] == [] and reads["sizes"], (reads, others)
    assert sum(reads["sizes"]) >= model_bytes  # every weight came from the checkpoint, read by the first process
    assert reads["peak_alive"] <= 2 * max(reads["sizes"]) < model_bytes, (reads["peak_alive"], model_bytes)
    assert result.tags["rlhf.held_as"] == "fsdp2 x 2"


def test_episodes_in_rounds_on_a_sharded_policy(tools_trained, tmp_path):
    """The tool world's episodes on FSDP2 x 2 with transformers' loop: every decode step is collective,
    so the processes agree on each round's budget and one whose episodes ended steps on a placeholder
    until the other's have (the SFT baseline's evaluation episodes too); the run ends, its figures of
    turns and tool calls finite. Continuous episodes stay refused there."""
    from tests.helpers import AUTO_RESOLVED

    cfg, trained = tools_trained
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {"launch": FSDP, "advantage_estimator": "grpo",
                                                   "samples_per_prompt": 2})
    result = _run(train_ppo, ppo, ppo_inputs(trained, reward=False), tmp_path / "fsdp")
    assert result.tags["rlhf.held_as"] == "fsdp2 x 2"
    assert result.metrics["train/iterations"] == ppo.num_iterations
    assert all(math.isfinite(row[key]) for row in result.history for key in ("rollout/turns", "rollout/tool_calls"))
    assert {"eval/tool_call_rate", "eval/tool_call_rate_sft"} <= set(result.metrics)
    with pytest.raises(ValueError, match="schedule continuous"):
        with_overrides(ppo, {"environment": {"schedule": "continuous"}})
