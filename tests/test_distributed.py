"""Every stage on two CPU processes (`accelerate launch`, DDP over gloo) against one process at
the same global batch.

Tolerances: SFT and reward training see the same examples in the same global batches either
way (the distributed sampler splits each global batch), so their figures agree up to float
reduction order: 0.5% relative (measured: SFT train loss equal to 7 digits, eval loss 0.08%
apart; reward equal to 6 digits). Processes that train apart instead of in step (as when
`evaluate()` ran before `train()` left the model outside DDP) were 1% apart on SFT's train loss.
PPO processes sample with different seeds, so the two runs see different responses; they must
agree in kind: both beat the SFT policy on the reward model (32 held-out samples a side), stay
within the KL budget, and land within 1.0 (normalised reward units; 0.41 measured) of each other.
"""

from __future__ import annotations

import re

import pytest
from transformers import AutoModelForCausalLM

from rlhf.config import with_overrides
from rlhf.sections.base import LaunchConfig
from stages.common.reporting import Reporting
from stages.launch.call import Determinism, call_stage
from stages.ppo import train_ppo
from stages.reward import train_reward
from stages.sft import train_sft
from tests.helpers import close, ppo_inputs, reward_inputs, sft_inputs

pytestmark = pytest.mark.multiprocess  # every test launches a stage on two processes

TWO = LaunchConfig(num_processes=2)


def _run(train, section, inputs, folder):
    logged = []
    reporting = Reporting(metrics=lambda metrics, step: logged.append((step, metrics)))
    result = call_stage(train, section, inputs, folder, reporting, Determinism(num_threads=2))
    return result, logged


def test_sft_on_two_processes_matches_one_at_the_same_global_batch(world, tiny_config, tokenizer, tmp_path):
    one_cfg = tiny_config.sft.model_copy(update={"max_steps": 12, "batch_size": 16})
    two_cfg = one_cfg.model_copy(update={"batch_size": 8, "launch": TWO})
    inputs = sft_inputs(world, tokenizer)
    one, one_logged = _run(train_sft, one_cfg, inputs, tmp_path / "one")
    two, two_logged = _run(train_sft, two_cfg, inputs, tmp_path / "two")
    assert two.metrics["train/steps"] == one.metrics["train/steps"] == 12
    for key in ("train/loss", "eval/loss", "eval/loss_untrained"):
        assert close(two.metrics[key], one.metrics[key]), (key, one.metrics[key], two.metrics[key])
    assert two.metrics["eval/loss"] < 0.8 * two.metrics["eval/loss_untrained"]
    # rank 0 alone reports, once per logging step, as one process does
    assert [step for step, _ in two_logged] == [step for step, _ in one_logged]
    assert AutoModelForCausalLM.from_pretrained(two.checkpoint, use_safetensors=True) is not None


def test_reward_on_two_processes_matches_one_at_the_same_global_batch(world, tiny_config, tokenizer, trained, tmp_path):
    one_cfg = tiny_config.reward.model_copy(update={"max_steps": 12, "batch_size": 16})
    two_cfg = one_cfg.model_copy(update={"batch_size": 8, "launch": TWO})
    inputs = reward_inputs(world, tokenizer, trained)
    one, _ = _run(train_reward, one_cfg, inputs, tmp_path / "one")
    two, _ = _run(train_reward, two_cfg, inputs, tmp_path / "two")
    for key in ("train/loss", "eval/loss", "eval/margin", "eval/accuracy", "normalization/gain"):
        assert close(two.metrics[key], one.metrics[key]), (key, one.metrics[key], two.metrics[key])
    assert list(two.eval_scores.columns) == list(one.eval_scores.columns)
    assert len(two.calibration) == len(one.calibration)


def test_ppo_on_two_processes_samples_apart_and_lands_where_one_does(tiny_config, trained, tmp_path):
    one_cfg = with_overrides(tiny_config.ppo, {"num_iterations": 6, "rollout_batch_size": 16, "learning_rate": 1e-3,
                                               "evaluation.samples_per_prompt": 4})
    two_cfg = one_cfg.model_copy(update={"launch": TWO})
    inputs = ppo_inputs(trained)
    one, _ = _run(train_ppo, one_cfg, inputs, tmp_path / "one")
    samples, rollouts = [], []
    reporting = Reporting(samples=lambda table, i: samples.append((i, len(table))),
                          rollouts=lambda table, i: rollouts.append((i, len(table))))
    two = call_stage(train_ppo, two_cfg, inputs, tmp_path / "two", reporting, Determinism(num_threads=2))
    assert two.metrics["train/iterations"] == one.metrics["train/iterations"] == 6
    assert [h["iteration"] for h in two.history] == [h["iteration"] for h in one.history]
    assert samples == [(2, 8), (4, 8), (6, 8)]  # rank 0's own table, at the configured iterations
    assert rollouts == [(i, 8) for i in range(1, 7)]  # rank 0's share of every iteration's episodes
    for result in (one, two):
        assert result.metrics["eval/score"] > result.metrics["eval/score_sft"], result.metrics
        assert result.metrics["eval/kl"] < one_cfg.evaluation.kl_budget
    assert abs(two.metrics["eval/score"] - one.metrics["eval/score"]) < 1.0
    # the ranks' samples differ: two processes' first rollouts are not one process's (raw scores:
    # the normalised ones are mean 0 on both by construction, refitted on those first rollouts)
    assert two.history[0]["rollout/score_raw"] != one.history[0]["rollout/score_raw"]
    assert abs(two.history[0]["rollout/score"]) < 1e-5 and abs(two.history[0]["rollout/score_std"] - 1) < 1e-5


def test_a_crashed_process_fails_the_stage_with_its_log(world, tiny_config, tokenizer, tmp_path):
    from stages.launch.job import LaunchError

    cfg = tiny_config.sft.model_copy(update={"launch": TWO})
    with pytest.raises(LaunchError, match="accelerate launch.*exited with code") as raised:
        call_stage(train_sft, cfg, sft_inputs(world, tokenizer, str(tmp_path / "no-such-model")), tmp_path, Reporting(),
                   Determinism(num_threads=2))
    # the cause, not only the launcher's report
    assert re.search(r"; rank 0: OSError: .*no-such-model", str(raised.value))


def test_the_other_processes_wait_for_the_main_one_to_finish_alone(tiny_config, tmp_path):
    from tests.stand_in_stages import Pause, pause_on_the_main_process

    cfg = tiny_config.sft.model_copy(update={"launch": TWO})
    result = call_stage(pause_on_the_main_process, cfg, Pause(8.0), tmp_path / "run", Reporting(),
                        Determinism(num_threads=2))
    assert result == {"paused": 8.0}
    left = float((tmp_path / "run" / "rank-1-left").read_text())
    assert left >= (tmp_path / "run" / "launch" / "result.pkl").stat().st_mtime  # rank 1 left after rank 0's result


def test_a_main_process_slower_than_the_process_group_timeout_fails_the_stage(tiny_config, tmp_path):
    from stages.launch.job import LaunchError
    from tests.stand_in_stages import Pause, pause_on_the_main_process

    # 15 s leaves room for the processes' start to differ at the first rendezvous on a loaded machine.
    cfg = tiny_config.sft.model_copy(update={"launch": TWO.model_copy(update={"timeout_seconds": 15})})
    with pytest.raises(LaunchError, match="exited with code") as raised:
        call_stage(pause_on_the_main_process, cfg, Pause(60.0), tmp_path / "run", Reporting(),
                   Determinism(num_threads=2))
    assert re.search(r"rank 1: RuntimeError: .*Timed out waiting 15000ms", str(raised.value))  # at the final wait


def test_a_rank_that_aborts_after_every_rank_recorded_its_work_done_leaves_the_result_with_a_warning(tiny_config,
                                                                                                   tmp_path):
    from tests.stand_in_stages import Abort, abort_on_a_rank

    warnings = []
    result = call_stage(abort_on_a_rank, tiny_config.sft.model_copy(update={"launch": TWO}), Abort(1, after_done=True),
                        tmp_path / "run", Reporting(warning=warnings.append), Determinism(num_threads=2))
    assert result == {"aborted": 1}
    assert len(warnings) == 1
    # The launcher may stop rank 0 (SIGTERM) while it still runs its own exit handlers: the result stands all the same.
    assert re.search(r"finished its work .* then exited with code 1 in teardown; (rank 0: .*; )?"
                     r"rank 1: killed by Signal 6 \(SIGABRT\); "
                     r"the result stands\. Its log is .*launch\.log", warnings[0]), warnings[0]


def test_a_rank_that_aborts_in_its_work_fails_the_stage_naming_it(tiny_config, tmp_path):
    from stages.launch.job import LaunchError
    from tests.stand_in_stages import Abort, abort_on_a_rank

    with pytest.raises(LaunchError) as raised:
        call_stage(abort_on_a_rank, tiny_config.sft.model_copy(update={"launch": TWO}), Abort(1, after_done=False),
                   tmp_path / "run", Reporting(), Determinism(num_threads=2))
    # Rank 0 may see its peer gone at the final barrier (a RuntimeError), or be stopped before it records "done".
    assert re.search(r"exited with code 1; (rank 0: .*; )?rank 1: killed by Signal 6 \(SIGABRT\); "
                     r"ranks that had not recorded their work done: (0, )?1;", str(raised.value)), str(raised.value)


def test_a_caller_that_stops_stops_every_process_of_the_launch(tiny_config, tmp_path):
    """The ranks run in sessions of their own under torch's launcher: killing the launcher alone left them running."""
    import psutil

    from tests.stand_in_stages import Pause, report_then_pause

    def stop(message: str) -> None:
        raise RuntimeError(f"the caller stops at: {message}")

    with pytest.raises(RuntimeError, match="the caller stops at: paused"):
        call_stage(report_then_pause, tiny_config.sft.model_copy(update={"launch": TWO}), Pause(600.0),
                   tmp_path / "run", Reporting(warning=stop), Determinism(num_threads=2))
    ranks = [psutil.Process(int(f.read_text())) for f in sorted((tmp_path / "run").glob("pid-*"))]
    assert len(ranks) == 2
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive
