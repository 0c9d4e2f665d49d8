"""Rewards from Python functions beside the reward model (`ppo.reward.terms`).

What is checked: a function term is imported from a folder the config names and checked to take
`(prompts, responses, **columns)`; every bad answer (wrong length, not a number, NaN, infinite)
and every fault (cannot be imported, wrong signature, raises) is refused naming the term, the
function and, where it applies, the batch, the row and the prompt; the PPO stage scores with the
weighted sum of its terms, logs each term, shows each in the rollouts table, passes declared prompt
columns by name, and stops on a raising function with its last checkpoint kept, from which it
resumes; the pre-flight check refuses a function that cannot be used before any stage runs; the
RL stage's cache key follows the function's source.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from rlhf.config import load_config, with_overrides
from rlhf.sections.ppo import PPOConfig
from stages.rewards.functions import RewardFunctionError, load_reward_functions, reward_values, source_digests
from tests.helpers import ppo_inputs, run_ppo

PROMPTS = [[{"role": "user", "content": "Describe my dog."}], [{"role": "user", "content": "How is the park?"}]]
RESPONSES = ["The dog is kind.", "It is fine."]


def _module(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def _terms(folder: Path, function: str, **extra) -> PPOConfig:
    """A ppo section whose reward is the reward model and `function`, found in `folder` (`ppo.paths`)."""
    terms = {"terms": [{"name": "reward_model"}, {"name": "rule", "function": function, "weight": 0.5}], **extra}
    return PPOConfig(reward=terms, paths=[str(folder)])


def test_functions_are_imported_from_the_named_folder_and_called_with_the_declared_columns(tmp_path):
    _module(tmp_path, "rules_ok", """
        def exact(prompts, responses, answer):
            return [1.0 if a in r else None for r, a in zip(responses, answer)]
        """)
    [function] = load_reward_functions(_terms(tmp_path, "rules_ok:exact", columns=["answer"]))
    values = reward_values(function, PROMPTS, RESPONSES, {"answer": ["dog", "cat"]}, batch=1)
    assert values == [1.0, None]


@pytest.mark.parametrize("body, function, message", [
    ("", "rules_missing_module:f", "cannot import 'rules_missing_module'"),
    ("def f(prompts, responses):\n    return []\n", "rules_attr:g", "module 'rules_attr' has no function 'g'"),
    ("def f(texts):\n    return []\n", "rules_sig:f", "it must take (prompts, responses, answer)"),
    ("def f(prompts, responses):\n    return []\n", "rules_cols:f", "it must take (prompts, responses, answer)"),
    ("raise RuntimeError('broken at import')\n", "rules_import_error:f", "RuntimeError: broken at import"),
])
def test_a_function_that_cannot_be_used_is_refused_naming_it(tmp_path, body, function, message):
    if body:
        _module(tmp_path, function.split(":")[0], body)
    with pytest.raises(RewardFunctionError) as refused:
        load_reward_functions(_terms(tmp_path, function, columns=["answer"]))
    assert f"reward term 'rule' ({function})" in str(refused.value) and message in str(refused.value)


@pytest.mark.parametrize("answer, message", [
    ("[1.0]", "returned 1 values for 2 responses in batch 7"),
    ("'ab'", "returned str in batch 7"),
    ("[1.0, 'x']", "batch 7, row 1 (prompt 'How is the park?'): 'x' is not a number"),
    ("[1.0, True]", "batch 7, row 1 (prompt 'How is the park?'): True is not a number"),
    ("[float('nan'), 0.0]", "batch 7, row 0 (prompt 'Describe my dog.'): nan is not finite"),
    ("[0.0, float('inf')]", "batch 7, row 1 (prompt 'How is the park?'): inf is not finite"),
])
def test_an_answer_that_is_not_one_finite_number_per_response_is_refused_naming_batch_and_row(tmp_path, answer,
                                                                                            message):
    name = f"rules_answer_{abs(hash(answer))}"
    _module(tmp_path, name, f"def f(prompts, responses):\n    return {answer}\n")
    [function] = load_reward_functions(_terms(tmp_path, f"{name}:f"))
    with pytest.raises(RewardFunctionError) as refused:
        reward_values(function, PROMPTS, RESPONSES, {}, batch=7)
    assert str(refused.value).startswith(f"reward term 'rule' ({name}:f)") and message in str(refused.value)


def test_a_raising_function_is_reported_with_the_prompt_it_fails_on(tmp_path):
    _module(tmp_path, "rules_raise", """
        def f(prompts, responses):
            return [1.0 / (len(r) - len("It is fine.")) for r in responses]
        """)
    [function] = load_reward_functions(_terms(tmp_path, "rules_raise:f"))
    with pytest.raises(RewardFunctionError, match=r"raised in batch 3 on row 1 \(prompt 'How is the park\?'\): "
                                                  r"ZeroDivisionError"):
        reward_values(function, PROMPTS, RESPONSES, {}, batch=3)


def test_the_cache_key_of_ppo_follows_the_function_source_and_no_other_stage_does(world, tmp_path):
    from flows.records.lineage import cache_key

    source = _module(tmp_path, "rules_cache", "def f(prompts, responses):\n    return [0.0] * len(responses)\n")
    section = _terms(tmp_path, "rules_cache:f")
    cfg = load_config("configs/tiny.yaml", {"ppo.reward": section.reward.model_dump(), "ppo.paths": section.paths})
    before = {stage: cache_key(stage, cfg, str(world), {}) for stage in ("sft", "ppo")}
    digest = source_digests(cfg.ppo)
    source.write_text("def f(prompts, responses):\n    return [1.0] * len(responses)\n")
    assert source_digests(cfg.ppo) != digest
    after = {stage: cache_key(stage, cfg, str(world), {}) for stage in ("sft", "ppo")}
    assert after["sft"] == before["sft"] and after["ppo"] != before["ppo"]


def test_declared_prompt_columns_are_required_and_kept(world, tokenizer, tmp_path):
    from schemas.errors import DataContractError
    from schemas.validate import load_validated

    rows = [{"prompt": "Describe my dog.", "answer": "dog"}, {"prompt": "How is the park?", "answer": "park"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    frame = load_validated(str(path), "prompt", tokenizer=tokenizer, columns=("answer",)).frame
    assert list(frame["answer"]) == ["dog", "park"]
    with pytest.raises(DataContractError, match="column 'reference': missing column"):
        load_validated(str(path), "prompt", tokenizer=tokenizer, columns=("answer", "reference"))


def _ppo(tiny_config, folder: Path, function: str, **changes):
    terms = {"terms": [{"name": "reward_model"}, {"name": "rule", "function": function, "weight": 0.5}]}
    return with_overrides(tiny_config.ppo, {"reward": terms, "paths": [str(folder)], "num_iterations": 2,
                                            "evaluation.every": None} | changes)


def test_ppo_scores_with_the_weighted_sum_and_logs_each_term(tiny_config, trained, tmp_path):
    from stages.common.reporting import Reporting

    _module(tmp_path / "rules", "rules_constant", """
        def one_or_none(prompts, responses):
            return [None if i == 0 else 1.0 for i in range(len(responses))]
        """)
    tables = []
    result = run_ppo(_ppo(tiny_config, tmp_path / "rules", "rules_constant:one_or_none"), trained, tmp_path / "run",
                     Reporting(rollouts=lambda frame, step: tables.append(frame)))
    for row, table in zip(result.history, tables, strict=True):
        n = len(table)
        # score_used = mean over responses of (model term + 0.5 x rule), the first response's rule giving nothing
        assert row["rollout/score_used"] == pytest.approx(row["rollout/reward/reward_model"] + 0.5 * (n - 1) / n,
                                                          abs=1e-5)
        assert row["rollout/reward/rule"] == 1.0 and row["rollout/reward/rule_none"] == pytest.approx(1 / n)
        assert math.isnan(table["reward/rule"].iloc[0]) and (table["reward/rule"].iloc[1:] == 1.0).all()
        assert "reward/reward_model" in table.columns and "time/reward_functions" in row


def test_a_raising_function_stops_ppo_naming_the_prompt_and_the_rerun_resumes(tiny_config, trained, tmp_path):
    rules = tmp_path / "rules"
    _module(rules, "rules_flaky", """
        from pathlib import Path

        CALLS = Path(__file__).with_suffix(".calls")

        def f(prompts, responses):
            calls = int(CALLS.read_text()) + 1 if CALLS.exists() else 1
            CALLS.write_text(str(calls))
            if calls >= 3 and not Path(__file__).with_suffix(".fixed").exists():
                raise ValueError("no reward for this one")
            return [0.0] * len(responses)
        """)
    cfg = _ppo(tiny_config, rules, "rules_flaky:f", num_iterations=4, checkpoint_every=2)
    with pytest.raises(RewardFunctionError, match=r"reward term 'rule' \(rules_flaky:f\) raised in batch 3 on row 0 "
                                                  r"\(prompt '.+'\): ValueError: no reward for this one"):
        run_ppo(cfg, trained, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "state" / "loop.json").read_text())["iteration"] == 2
    (rules / "rules_flaky.fixed").touch()
    result = run_ppo(cfg, trained, tmp_path / "run")
    assert [row["iteration"] for row in result.history] == [1, 2, 3, 4]


def test_the_pre_flight_check_refuses_a_function_that_cannot_be_imported(world, tmp_path):
    from flows.inputs import input_problems

    section = _terms(tmp_path, "rules_nowhere:f")
    cfg = load_config("configs/tiny.yaml", {"ppo.reward": section.reward.model_dump(), "ppo.paths": section.paths})
    problems = input_problems(cfg, ["ppo"], str(world))
    assert any(p.startswith("ppo stage: reward term 'rule' (rules_nowhere:f): cannot import") for p in problems)


@pytest.mark.multiprocess
def test_on_two_processes_the_function_runs_on_the_main_process_for_every_response(tiny_config, trained, tmp_path):
    """Every process's responses are scored by one call on the first process; each process trains on
    its own rows' values (the logged figures are the whole batch's)."""
    from rlhf.sections.base import LaunchConfig
    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.ppo import train_ppo

    rules = tmp_path / "rules"
    _module(rules, "rules_where", """
        import os
        from pathlib import Path

        def f(prompts, responses):
            with open(Path(__file__).with_suffix(".calls"), "a") as calls:
                calls.write(f"{os.getpid()} {len(responses)}\\n")
            return [float(len(r)) for r in responses]
        """)
    cfg = _ppo(tiny_config, rules, "rules_where:f", launch=LaunchConfig(num_processes=2))
    inputs = ppo_inputs(trained)
    result = call_stage(train_ppo, cfg, inputs, tmp_path / "run", Reporting(), Determinism(num_threads=2))
    calls = [line.split() for line in (rules / "rules_where.calls").read_text().splitlines()]
    # each iteration's rollouts, then the final evaluation's policy and SFT responses (every held-out prompt once)
    assert len(calls) == cfg.num_iterations + 2 and len({pid for pid, _ in calls}) == 1
    held_out = len(trained["eval_prompts"]) * cfg.evaluation.samples_per_prompt
    assert [int(n) for _, n in calls] == [cfg.rollout_batch_size] * cfg.num_iterations + [held_out] * 2
    assert all(row["rollout/reward/rule"] > 0 for row in result.history)


# --- a reward of functions alone: no reward model ----------------------------------------------------

FUNCTIONS_ALONE = {"terms": [{"name": "subject", "function": "rlhf.demo.rewards:names_the_subject"},
                             {"name": "length", "function": "rlhf.demo.rewards:length_penalty", "weight": 0.1}]}


def test_a_reward_of_functions_alone_takes_no_reward_model_and_gae_starts_its_critic_from_the_policy():
    from rlhf.config import ConfigError

    gae = load_config("configs/tiny.yaml", {"ppo.reward": FUNCTIONS_ALONE})
    assert not gae.ppo.reward.uses_model and gae.ppo.critic.kind == "policy"
    grpo = load_config("configs/tiny.yaml", {"ppo.reward": FUNCTIONS_ALONE, "ppo.advantage_estimator": "grpo"})
    assert grpo.ppo.critic is None
    for kind in ("reward", "reward-lora"):
        with pytest.raises(ConfigError, match=f"critic.kind '{kind}' starts from the reward model, but reward.terms "
                                              "has no reward-model term"):
            load_config("configs/tiny.yaml", {"ppo.reward": FUNCTIONS_ALONE, "ppo.critic.kind": kind})
    # A section changed to functions alone takes the critic its reward now needs, as `advantage_estimator` does.
    assert with_overrides(load_config("configs/tiny.yaml").ppo, {"reward": FUNCTIONS_ALONE}).critic.kind == "policy"
    # A critic section that names no kind (a warm-up, say) takes the kind its reward needs, not the reward model's.
    warm = load_config("configs/tiny.yaml", {"ppo.reward": FUNCTIONS_ALONE, "ppo.critic.freeze_policy_iterations": 2})
    assert warm.ppo.critic.kind == "policy" and warm.ppo.critic.freeze_policy_iterations == 2


def test_ppo_without_a_reward_model_trains_on_the_functions_and_evaluates_by_them(tiny_config, trained, tmp_path):
    from stages.common.reporting import Reporting
    from stages.ppo import train_ppo

    cfg = with_overrides(tiny_config.ppo, {"reward": FUNCTIONS_ALONE, "advantage_estimator": "grpo",
                                           "samples_per_prompt": 4, "num_iterations": 2, "evaluation.every": 1})
    samples = []
    result = train_ppo(cfg, ppo_inputs(trained, reward=False),
                       tmp_path / "run", Reporting(samples=lambda table, step: samples.append(table)))
    assert len(samples) == 2 and all({"score", "reward/subject", "reward/length"} <= set(t.columns) for t in samples)
    for row in result.history:
        # the shown score is the weighted sum itself; no reward model, so no raw score
        assert row["rollout/score"] == pytest.approx(row["rollout/score_used"], abs=1e-6)
        assert "rollout/score_raw" not in row and {"rollout/reward/subject", "rollout/reward/length"} <= set(row)
    assert "eval/reward/subject" in result.history[0] and "eval/win_rate_reward" in result.history[0]
    metrics, table = result.metrics, result.evaluation
    assert not any(key.startswith("normalization/") for key in metrics) and "eval/win_rate_rm" not in metrics
    assert {"eval/reward/subject", "eval/reward/subject_sft", "eval/reward/length", "eval/reward/length_sft",
            "eval/win_rate_reward", "eval/win_rate_reward_se"} <= set(metrics)
    # the evaluation's score is the weighted sum of its functions' columns ("no reward" adding nothing)
    expected = table["policy_reward/subject"].fillna(0) + 0.1 * table["policy_reward/length"]
    assert table["policy_score"].to_numpy() == pytest.approx(expected.to_numpy())
    assert metrics["eval/score"] == pytest.approx(expected.mean())


def test_a_reward_model_term_without_a_reward_checkpoint_is_refused(tiny_config, trained, tmp_path):
    from stages.common.errors import StageUserError
    from stages.ppo import train_ppo

    with pytest.raises(StageUserError, match="reward-model term .* but no reward checkpoint was given"):
        train_ppo(tiny_config.ppo, ppo_inputs(trained, reward=False),
                  tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_policy_critic_starts_from_the_sft_body_with_a_fresh_head(tiny_config, trained):
    from stages.rl.ppo_models import load_models

    cfg = with_overrides(tiny_config.ppo, {"reward": FUNCTIONS_ALONE})
    models = load_models(cfg, trained["sft"], None)
    assert models.scorer is None
    body = dict(models.critic.model.base_model.named_parameters())
    for name, parameter in models.policy.base_model.named_parameters():
        assert torch.equal(parameter, body[name]), name
    assert models.critic.model.score.weight.shape == (1, models.policy.config.hidden_size)


def test_the_memory_plan_of_ppo_without_a_reward_model_holds_none(tiny_config, world):
    from flows.inputs import memory_plan

    with_model = memory_plan(tiny_config, ["ppo"], str(world), None).stages["ppo"]
    alone = memory_plan(load_config("configs/tiny.yaml", {"ppo.reward": FUNCTIONS_ALONE,
                                                          "ppo.advantage_estimator": "grpo"}), ["ppo"],
                        str(world), None).stages["ppo"]
    assert "reward model" in [h.name for h in with_model.held] and "critic" in [h.name for h in with_model.held]
    assert [h.name for h in alone.held] == ["policy", "reference"]
    assert "scoring" not in alone.phases["rollout_forwards"]
    policy_critic = memory_plan(load_config("configs/tiny.yaml", {"ppo.reward": FUNCTIONS_ALONE}), ["ppo"],
                                str(world), None).stages["ppo"]
    assert [h.name for h in policy_critic.held] == ["policy", "reference", "critic"]


@pytest.mark.multiprocess
def test_sharded_ppo_without_a_reward_model_trains_its_policy_critic_and_evaluates_by_the_functions(
        tiny_config, trained, tmp_path):
    """FSDP2 over two processes, GAE with the critic started from the policy: nothing of the sharded
    path needs a reward model."""
    from rlhf.sections.base import LaunchConfig
    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.ppo import train_ppo

    fsdp = LaunchConfig(num_processes=2, accelerate_config="configs/accelerate/fsdp.yaml")
    cfg = with_overrides(tiny_config.ppo, {"reward": FUNCTIONS_ALONE, "launch": fsdp, "num_iterations": 2})
    assert cfg.critic.kind == "policy"
    result = call_stage(train_ppo, cfg, ppo_inputs(trained, reward=False),
                        tmp_path / "run", Reporting(), Determinism(num_threads=1))
    assert result.tags["rlhf.held_as"] == "fsdp2 x 2"
    assert all("train/explained_variance" in row and "rollout/reward/subject" in row for row in result.history)
    assert {"eval/reward/subject", "eval/win_rate_reward"} <= set(result.metrics)
