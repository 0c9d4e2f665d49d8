"""A minibatch's PPO gradient does not depend on memory settings: the same for every
`micro_batch_size`, and the same on one process as on two at the same global batch, whether
the two hold whole models (DDP) or shards of them (FSDP2), for both critics and with LoRA.

Every loss term is a token mean over the whole minibatch (across micro-batches and processes),
so splitting the minibatch only changes how the sum is computed. Responses of different lengths
make the test bite: per-micro-batch means weighted by sequence counts gave a policy gradient
0.34 (relative L2) away at `micro_batch_size=2`.

Run as a script (`accelerate launch tests/test_ppo_gradients.py ENGINE WORK...`), this file is also
the two-process worker: each rank takes its half of each saved rollout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:  # assert_close calls `msg` at once, in this iteration
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")  # noqa: B023


@pytest.mark.parametrize("critic", ["reward", "shared"])
def test_micro_batch_size_does_not_change_the_gradient(tiny_config, trained, critic):
    from accelerate import Accelerator

    from stages.rl.ppo_models import ActorCritic
    from tests.helpers import ppo_gradient_setup, ppo_gradients

    cfg, models, batch, advantages, returns = ppo_gradient_setup(tiny_config, trained, critic)
    accelerator, actor_critic = Accelerator(cpu=True), ActorCritic(models)
    whole = ppo_gradients(models, accelerator, actor_critic, batch, advantages, returns, cfg)
    assert sum(g.norm() for g in whole.values()) > 0
    for micro in (1, 2, 4):
        split = ppo_gradients(models, accelerator, actor_critic, batch, advantages, returns,
                          cfg.model_copy(update={"micro_batch_size": micro}))
        _assert_same(split, whole)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_no_loss_aggregation_or_ratio_level_depends_on_the_micro_batch_size(tiny_config, trained, ratio_level):
    """Every `loss_aggregation`, with the policy ratio per token or per sequence (GSPO), the k3 KL
    loss term aggregated alike, clip-higher, and two responses left out of the loss
    (`mask_truncated_responses`): the accumulated gradient is the whole minibatch's."""
    from accelerate import Accelerator

    from rlhf.config import with_overrides
    from rlhf.sections.ppo import PPOConfig
    from stages.rl.ppo_models import ActorCritic
    from tests.helpers import ppo_gradient_setup, ppo_gradients

    cfg, models, batch, advantages, returns = ppo_gradient_setup(tiny_config, trained)
    accelerator, actor_critic = Accelerator(cpu=True), ActorCritic(models)
    counted = batch.mask.clone()
    counted[[0, 3]] = 0.0  # as two truncated responses are with `mask_truncated_responses`
    for aggregation in PPOConfig.model_fields["loss_aggregation"].annotation.__args__:
        varied = with_overrides(cfg, {"loss_aggregation": aggregation, "ratio_level": ratio_level,
                                      "clip_range": [cfg.clip_low, 0.28], "kl.loss_coef": 0.1})
        whole = ppo_gradients(models, accelerator, actor_critic, batch, advantages, returns, varied, counted)
        assert sum(g.norm() for g in whole.values()) > 0
        for micro in (1, 4):
            split = ppo_gradients(models, accelerator, actor_critic, batch, advantages, returns,
                              varied.model_copy(update={"micro_batch_size": micro}), counted)
            _assert_same(split, whole)


def test_masking_truncated_responses_trains_as_if_only_the_ended_ones_were_sampled(tiny_config, trained):
    """The gradient with truncated responses masked out is the gradient of the ended responses alone:
    nothing of a cut-off response (policy, KL or entropy term) reaches the loss or its token count."""
    from accelerate import Accelerator

    from rlhf.config import with_overrides
    from stages.common.batches import rows_of
    from stages.rl.advantages import counted as counted_tokens
    from stages.rl.ppo_models import ActorCritic, load_models
    from stages.rl.rollout import policy_sampler
    from tests.helpers import AUTO_RESOLVED, ppo_gradients, single_turn_rollout

    cfg = with_overrides(tiny_config.ppo, AUTO_RESOLVED | {
        "advantage_estimator": "grpo", "samples_per_prompt": 4, "rollout_batch_size": 8, "num_minibatches": 1,
        "mask_truncated_responses": True, "sampling": {"response_length": 6}})
    torch.manual_seed(0)
    models = load_models(cfg, trained["sft"], trained["reward"])
    batch = single_turn_rollout(models, policy_sampler(models), list(trained["prompts"]["prompt"].head(8)),
                                cfg.sampling)
    assert batch.has_eos.any() and not batch.has_eos.all(), batch.has_eos  # some ended, some were cut off
    counted = counted_tokens(batch, cfg)
    assert torch.equal(counted, batch.mask * batch.has_eos.unsqueeze(1))
    advantages = torch.randn(8, 1) * batch.mask
    with torch.no_grad():  # a step away from the rollout policy, so ratios differ from 1
        for parameter in models.policy.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    accelerator, actor_critic = Accelerator(cpu=True), ActorCritic(models)
    masked = ppo_gradients(models, accelerator, actor_critic, batch, advantages, None, cfg, counted)
    ended = batch.has_eos.nonzero().flatten().tolist()
    alone = ppo_gradients(models, accelerator, actor_critic, rows_of(batch, ended), advantages[ended], None,
                      cfg.model_copy(update={"micro_batch_size": None}))
    assert sum(g.norm() for g in masked.values()) > 0
    for name in masked:
        torch.testing.assert_close(masked[name], alone[name], atol=1e-5, rtol=1e-5)


def test_the_critics_gradient_does_not_shrink_the_policys_step(tiny_config, trained):
    """Policy and critic are clipped each on its own: a value loss 1000 times heavier leaves the
    policy's update as it was (clipped jointly, the critic's large gradient shrank it)."""
    from accelerate import Accelerator

    from rlhf.config import with_overrides
    from stages.rl.ppo_models import ActorCritic
    from stages.rl.update import ppo_update
    from tests.helpers import ppo_episodes, ppo_gradient_setup, ppo_trainer

    def one_update(vf_coef: float):
        cfg, models, batch, advantages, returns = ppo_gradient_setup(tiny_config, trained)
        cfg = with_overrides(cfg, {"critic.vf_coef": vf_coef, "num_ppo_epochs": 1})
        optimizer = torch.optim.SGD(models.trainable(), lr=1e-2)  # Adam would hide a rescaled gradient
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        trainer = ppo_trainer(cfg, Accelerator(cpu=True), models, ActorCritic(models), optimizer, scheduler)
        figures = ppo_update(trainer, ppo_episodes(cfg, batch, advantages, returns), iteration=1)
        return figures, models

    light, light_models = one_update(0.1)
    heavy, heavy_models = one_update(100.0)
    assert heavy["critic_grad_norm"] > 1000 * light["critic_grad_norm"] * 0.5 and heavy["critic_grad_norm"] > 1.0
    assert heavy["grad_norm"] == pytest.approx(light["grad_norm"], rel=1e-5)
    _assert_same(dict(heavy_models.policy.named_parameters()), dict(light_models.policy.named_parameters()))


CASES = {
    "ddp": [("reward", False, {}), ("reward-lora", False, {}),
            ("reward", False, {"loss_aggregation": "seq-mean-token-mean", "ratio_level": "sequence"}),
            # packed passes in micro-batches by tokens, as many on both ranks whatever their rows' lengths
            ("reward", False, {"padding_free": True, "micro_batch_tokens": 40})],
    "fsdp": [("reward", False, {}), ("shared", False, {}), ("reward", True, {}), ("reward-lora", True, {}),
             ("reward", False, {"loss_aggregation": "seq-mean-token-sum-norm", "kl.loss_coef": 0.1}),
             ("shared", False, {"padding_free": True, "micro_batch_tokens": 40})]}
"""Per engine, the (critic, LoRA, loss settings) its two processes are checked on, in one launch: its
process start costs more than the cases' work."""


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", list(CASES))
def test_two_processes_give_the_one_process_gradient_at_the_same_global_batch(tiny_config, trained, tmp_path, engine):
    from accelerate import Accelerator

    from rlhf.config import with_overrides
    from stages.rl.ppo_models import ActorCritic
    from tests.helpers import ppo_gradient_setup, ppo_gradients

    folders, expected = [], []
    for number, (critic, lora, loss) in enumerate(CASES[engine]):
        cfg, models, batch, advantages, returns = ppo_gradient_setup(tiny_config, trained, critic, lora)
        cfg = with_overrides(cfg, loss)
        one = ppo_gradients(models, Accelerator(cpu=True), ActorCritic(models), batch, advantages, returns, cfg)
        assert all(g.norm() > 0 for g in one.values())
        folders.append(tmp_path / f"case-{number}")
        folders[-1].mkdir()
        torch.save({"cfg": cfg.model_dump(mode="json"), "sft": trained["sft"], "reward": trained["reward"],
                    "trained": ActorCritic(models).state_dict(), "batch": batch, "advantages": advantages,
                    "returns": returns}, folders[-1] / "work.pt")
        expected.append(one)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), __file__, engine, *map(str, folders)]
    done = subprocess.run(command, cwd=REPO, env=dict(os.environ, ACCELERATE_USE_CPU="true"), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for folder, case, one in zip(folders, CASES[engine], expected, strict=True):
        found = torch.load(folder / "gradients.pt")
        assert found.pop("sharded") == (engine == "fsdp"), case
        before, after = found.pop("head_rescaled", (None, None))  # a critic on the reward model's score head
        if case[0].startswith("reward"):
            assert torch.equal(after, 2 * before), f"{engine}, critic {case[0]}: head not rescaled in its shards"
        try:
            _assert_same(found, one)
        except AssertionError as e:
            raise AssertionError(f"{engine}, critic {case[0]}, lora {case[1]}, {case[2]}: {e}") from e


def _worker(folder: Path, engine: str) -> None:
    """One rank: its half of the rollout, in micro-batches of 2, under DDP or FSDP2 (each process
    holding half of every parameter); rank 0 saves the gradients."""
    from accelerate import Accelerator, PartialState
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from rlhf.sections.ppo import PPOConfig
    from stages.common.batches import rows_of
    from stages.rl.ppo_models import ActorCritic, load_models
    from stages.runtime.holding import Replicated, Sharded
    from tests.helpers import ppo_gradients

    state = PartialState(cpu=True)
    work = torch.load(folder / "work.pt", weights_only=False)
    cfg = PPOConfig.model_validate(work["cfg"]).model_copy(update={"micro_batch_size": 2})
    accelerator = Accelerator(cpu=True)
    holding = Sharded(accelerator=accelerator) if engine == "fsdp" else Replicated(accelerator)
    models = load_models(cfg, work["sft"], work["reward"], holding)
    actor_critic = holding.trained(ActorCritic(models))
    # Whole tensors into whatever each process holds of them (a `reward-lora` critic's adapters were
    # sharded with the reward model as it loaded).
    set_model_state_dict(actor_critic, work["trained"], options=StateDictOptions(full_state_dict=True))
    sharded = all(hasattr(p, "full_tensor") for p in models.trainable())
    half = len(work["batch"].responses) // state.num_processes
    rows = torch.arange(state.process_index * half, (state.process_index + 1) * half)
    local = rows_of(work["batch"], rows.tolist())
    found = ppo_gradients(models, accelerator, actor_critic, local, work["advantages"][rows], work["returns"][rows],
                          cfg)
    if hasattr(models.critic, "head"):
        found["head_rescaled"] = _head_rescaled(models, local, lambda: ppo_gradients(
            models, accelerator, actor_critic, local, work["advantages"][rows], work["returns"][rows], cfg))
    if state.is_main_process:
        torch.save(found | {"sharded": sharded}, folder / "gradients.pt")


def _head_rescaled(models, batch, update: Callable[[], object]) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's score head, whole, before a values pass outside the update (as the rollout's: FSDP2
    leaves the root unit gathered after it), and after the first rollout's normalisation adopted at gain 2
    and an update's forward and backward (after which FSDP2 holds the shards again)."""
    from stages.common.batches import Sequences

    def whole() -> torch.Tensor:
        weight = models.critic.head.weight.detach()
        return (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).clone()

    before = whole()
    sequences = Sequences(batch.queries, batch.query_mask, batch.responses, batch.mask, batch.restarts)
    with torch.no_grad():
        values = models.critic.values(None, sequences, models.passes("values"))
    models.adopt_normalization(2.0, 0.0, values)
    update()
    return before, whole()


if __name__ == "__main__":  # ends as a stage's rank does (`stages.launch.local.leave_job`)
    sys.path.insert(0, str(REPO))
    from accelerate import PartialState

    from stages.launch.local import leave_job

    for case in sys.argv[2:]:  # ENGINE FOLDER...: each case's folder in turn, on the same process group
        _worker(Path(case), sys.argv[1])
    leave_job(PartialState())
