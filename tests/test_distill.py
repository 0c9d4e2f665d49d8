"""On-policy distillation (`ppo.teacher`, `advantage_estimator: distill`): the student moves towards its
teacher on one process, with LoRA, and on two (DDP, FSDP2); a teacher of another vocabulary is refused;
a teacher named through MLflow resolves to a run's folder and keys the stage's cache. The term's
equation is worked by hand in tests/test_ppo_math.py."""

from __future__ import annotations

import pytest

from flows.records.lineage import cache_key
from rlhf import tracking
from rlhf.config import load_config, with_overrides
from rlhf.demo.world import build_world
from stages.common.reporting import Reporting
from stages.launch.call import Determinism, call_stage
from stages.ppo import train_ppo
from tests.helpers import ppo_inputs

DISTILL = {"advantage_estimator": "distill", "num_iterations": 4, "learning_rate": 1e-3, "evaluation.every": None}


def _distilled(tiny_config, trained, world, tmp_path, **settings):
    """The tiny SFT policy distilled from the tiny world's base model (another policy of the same tokenizer),
    its config loaded as a user's is (`auto` fields resolved for `distill`: no reward terms, beta 0)."""
    cfg = load_config("configs/tiny.yaml", {f"ppo.{key}": value for key, value in (
        DISTILL | {"teacher": {"model": str(world / "model")}} | settings).items()}).ppo
    return cfg, ppo_inputs(trained, reward=False, teacher=str(world / "model"))


def _moved_towards_the_teacher(result) -> None:
    first, last = result.history[0], result.history[-1]
    assert last["rollout/teacher_kl"] < 0.5 * first["rollout/teacher_kl"], (first, last)
    assert last["rollout/teacher_kl_per_token"] < first["rollout/teacher_kl_per_token"]
    assert first["rollout/kl_coef"] == 0.0  # no KL to the SFT policy
    assert result.metrics["eval/teacher_kl"] == pytest.approx(result.evaluation["teacher_kl"].mean())
    assert "eval/score" not in result.metrics  # no reward model was loaded


def test_the_student_moves_towards_its_teacher(tiny_config, trained, world, tmp_path):
    cfg, inputs = _distilled(tiny_config, trained, world, tmp_path)
    rollouts = []
    result = train_ppo(cfg, inputs, tmp_path / "run", Reporting(rollouts=lambda table, i: rollouts.append(table)))
    _moved_towards_the_teacher(result)
    assert "teacher_kl" in rollouts[0].columns  # every episode's KL to the teacher, in the episodes table


def test_a_top_k_teacher_trains_through_its_loss_term(tiny_config, trained, world, tmp_path):
    cfg, inputs = _distilled(tiny_config, trained, world, tmp_path,
                             teacher={"model": str(world / "model"), "top_k": 8})
    result = train_ppo(cfg, inputs, tmp_path / "run", Reporting())
    _moved_towards_the_teacher(result)
    first, last = result.history[0], result.history[-1]
    assert 0 < last["train/teacher_loss"] < first["train/teacher_loss"]
    assert first["train/policy_loss"] == 0.0  # no reward, no term in it: the advantages are 0


def test_a_lora_student_distills(tiny_config, trained, world, tmp_path):
    cfg, inputs = _distilled(tiny_config, trained, world, tmp_path, lora={}, learning_rate=3e-3)
    _moved_towards_the_teacher(train_ppo(cfg, inputs, tmp_path / "run", Reporting()))


def test_a_teacher_beside_the_reward_model_grades_every_token_of_gae(tiny_config, trained, world, tmp_path):
    cfg = with_overrides(tiny_config.ppo, {"teacher": {"model": str(world / "model"), "weight": 0.1},
                                           "num_iterations": 2, "evaluation.every": None})
    result = train_ppo(cfg, ppo_inputs(trained, teacher=str(world / "model")), tmp_path / "run", Reporting())
    assert "eval/score" in result.metrics and "eval/teacher_kl" in result.metrics
    assert result.history[0]["rollout/teacher_kl"] > 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch", [{"num_processes": 2},
                                    {"num_processes": 2, "accelerate_config": "configs/accelerate/fsdp.yaml"}],
                         ids=["ddp", "fsdp2"])
def test_distillation_on_two_processes(tiny_config, trained, world, tmp_path, launch):
    cfg, inputs = _distilled(tiny_config, trained, world, tmp_path, launch=launch, rollout_batch_size=16)
    result = call_stage(train_ppo, cfg, inputs, tmp_path / "run", Reporting(), Determinism(num_threads=2))
    _moved_towards_the_teacher(result)


def test_a_teacher_of_another_vocabulary_is_refused(tiny_config, trained, tmp_path):
    other = build_world(tmp_path / "worlds", tiny_config.demo.model_copy(update={"vocab_size": 400}))
    cfg = with_overrides(tiny_config.ppo, DISTILL | {"teacher": {"model": str(other / "model")},
                                           "reward": {"terms": []}})
    with pytest.raises(ValueError, match="has another vocabulary .* grade other tokens than the policy's"):
        train_ppo(cfg, ppo_inputs(trained, reward=False, teacher=str(other / "model")), tmp_path / "run")


def test_a_registered_teacher_resolves_to_its_versions_run_and_keys_the_cache(tmp_path, world, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(tracking, "code_version", lambda: ("test", "test"))  # the cache key's, without git
    try:
        _resolves_and_keys(world, tmp_path)
    finally:
        mlflow.set_tracking_uri(None)


def _resolves_and_keys(world, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from flows.inputs import fetched_teacher, memory_plan
    from flows.records.lineage import Teacher

    experiment = tracking.ensure_experiment("teachers")  # its artifacts beside the database, in tmp_path
    with mlflow.start_run(experiment_id=experiment) as run:
        mlflow.log_artifacts(str(world / "model"), tracking.CHECKPOINT_PATH)
    client = MlflowClient()
    client.create_registered_model("teachers")
    version = client.create_model_version("teachers", f"runs:/{run.info.run_id}/checkpoint", run.info.run_id)
    client.set_registered_model_alias("teachers", "champion", version.version)
    source = tracking.model_source("models:/teachers@champion")
    assert (source.run_id, source.path, source.version) == (run.info.run_id, "checkpoint", "teachers/1")
    assert source.describe("models:/teachers@champion") == (
        f"models:/teachers@champion (version 1, runs:/{run.info.run_id}/checkpoint)")
    assert tracking.model_source(f"models:/teachers/{version.version}") == source
    assert tracking.model_source("/a/folder") is None
    fetched = tracking.download_model(source, tmp_path / "fetched", config_only=True)
    assert (fetched / "config.json").exists() and not (fetched / "model.safetensors").exists()
    with pytest.raises(tracking.TrackingError, match="models:/teachers@nobody: no such registered model version"):
        tracking.model_source("models:/teachers@nobody")
    # Before any stage trains the pipeline run resolves the teacher once; the plan reads its config alone.
    cfg = load_config("configs/tiny.yaml", {"ppo.advantage_estimator": "distill",
                                            "ppo.teacher.model": "models:/teachers@champion"})
    teacher = Teacher.of(cfg)
    assert teacher == Teacher("models:/teachers@champion", source)
    assert "teacher" in [h.name for h in memory_plan(cfg, ["ppo"], str(world), teacher).stages["ppo"].held]
    missing = load_config("configs/tiny.yaml", {"ppo.advantage_estimator": "distill",
                                                "ppo.teacher.model": "models:/teachers@nobody"})
    with pytest.raises(tracking.TrackingError, match="models:/teachers@nobody: no such registered model version"):
        Teacher.of(missing)
    # The cache key and the fetch hold the run the alias named at the resolution, wherever the alias is now;
    # the next pipeline run, resolving it again, gets another key.
    before = cache_key("ppo", cfg, str(world), {"sft": "s"}, teacher)
    with mlflow.start_run(experiment_id=experiment) as other:
        mlflow.log_artifacts(str(world / "model"), tracking.CHECKPOINT_PATH)
    moved = client.create_model_version("teachers", f"runs:/{other.info.run_id}/checkpoint", other.info.run_id)
    client.set_registered_model_alias("teachers", "champion", moved.version)
    assert cache_key("ppo", cfg, str(world), {"sft": "s"}, teacher) == before
    with mlflow.start_run(experiment_id=experiment) as stage:
        folder = fetched_teacher(teacher, str(world), tmp_path / "teacher")
    assert folder == str(tmp_path / "teacher" / "checkpoint")  # the whole folder of the first version's run
    assert (tmp_path / "teacher" / "checkpoint" / "model.safetensors").exists()
    assert client.get_run(stage.info.run_id).data.tags[tracking.TAG_TEACHER] == (
        f"models:/teachers@champion (version 1, runs:/{run.info.run_id}/checkpoint)")
    assert cache_key("ppo", cfg, str(world), {"sft": "s"}, Teacher.of(cfg)) != before
    with pytest.raises(ValueError, match=r"the cache key takes the teacher as the pipeline run resolved it"):
        cache_key("ppo", cfg, str(world), {"sft": "s"})


def test_the_memory_plan_holds_the_teacher_and_its_logits(world):
    from stages.memory.phases import Device, Target
    from stages.memory.plan import plan_stage
    from stages.memory.shapes import model_shape

    cfg = load_config("configs/tiny.yaml", {"ppo.advantage_estimator": "distill", "ppo.teacher.model": "demo:model",
                                            "ppo.sampling.micro_batch_size": None, "ppo.micro_batch_size": None})
    policy = model_shape(str(world / "model"))
    plan = plan_stage(cfg, "ppo", {"policy": policy, "teacher": policy}, Target(Device(kind="cpu", memory=64 * 2**30)))
    held = {h.name: h for h in plan.held}
    assert list(held) == ["policy", "reference", "teacher"]  # no reward model, no critic
    assert held["teacher"].weights == held["reference"].weights > 0  # frozen alike, in frozen_dtype
    forwards = plan.phases["rollout_forwards"]
    assert forwards["teacher_logits"] == forwards["logits"] > 0  # beside the policy's, which the rollout holds


def test_the_run_form_and_the_runs_description_name_the_teacher():
    from flows.form import PPOForm
    from flows.records.reports import reward_terms_note

    form = PPOForm(advantage_estimator="distill", teacher_model="runs:/abc/checkpoint")
    assert form.overrides() == {"ppo.advantage_estimator": "distill", "ppo.teacher.model": "runs:/abc/checkpoint"}
    assert "teacher" in PPOForm.model_fields["teacher_model"].description
    assert load_config("configs/tiny.yaml", form.overrides()).ppo.teacher.model == "runs:/abc/checkpoint"
    assert reward_terms_note(load_config("configs/distill.yaml").ppo) == (
        "; scored by the teacher models:/rlhf-policy@champion (weight 1, KL over its top 8 as a loss), without a "
        "reward model")
    beside = load_config("configs/tiny.yaml", {"ppo.teacher": {"model": "demo:model", "weight": 0.1}}).ppo
    assert reward_terms_note(beside) == "; scored by the teacher demo:model (weight 0.1, k1 per token) beside the " \
        "reward model (weight 1)"
