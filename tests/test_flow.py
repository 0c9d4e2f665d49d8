"""The `rlhf` flow in-process: MLflow run hierarchy, lineage, artifacts, and clean refusals."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.testing.utilities import prefect_test_harness
from transformers import AutoModelForCausalLM

from rlhf import tracking
from tests.helpers import DATA

pytestmark = pytest.mark.multiprocess  # a Prefect test server runs beside every test


@pytest.fixture(scope="module")
def tracking_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    previous = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "RLHF_HOME")}
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow.db"
    os.environ["RLHF_HOME"] = str(root / "home")
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    with prefect_test_harness(server_startup_timeout=120):
        yield root
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def finished(tracking_store):
    import flows.stage_runs
    from flows.pipeline import rlhf

    flows.stage_runs.SYSTEM_METRICS_INTERVAL_S = 1.0  # the tiny stages take seconds
    state = rlhf(config_file="configs/tiny.yaml", return_state=True)
    assert state.is_completed(), state.message
    return state.result()


def _runs(filter_string: str):
    experiment = MlflowClient().get_experiment_by_name("rlhf")
    return MlflowClient().search_runs([experiment.experiment_id], filter_string=filter_string)


def test_stage_run_is_a_tagged_child_of_the_pipeline_run(finished):
    record = finished[0]
    run = MlflowClient().get_run(record.run_id)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags[tracking.TAG_STAGE] == "sft"
    parent = MlflowClient().get_run(tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED" and parent.data.tags["rlhf.stages"] == "sft,reward,ppo"
    timing = parent.data.metrics  # the orchestration overhead is measured on every pipeline run
    assert timing["time/wall_seconds"] > timing["time/stage_work_seconds"] > 0
    assert timing["time/stage_work_seconds"] == pytest.approx(sum(r.metrics["time/stage_seconds"] for r in finished))
    assert tags[tracking.TAG_CONFIG_HASH] == record.config_hash
    assert tags[tracking.TAG_DATA_DIGEST] == record.data_digest
    assert tags[tracking.TAG_CODE_VERSION] == "0.1.0" and tags[tracking.TAG_GIT_COMMIT]
    for stage in finished:  # every stage says in which dtypes it trained and saved
        stage_tags = MlflowClient().get_run(stage.run_id).data.tags
        assert stage_tags["rlhf.trainable_dtype"] == "float32" and stage_tags["rlhf.autocast_dtype"] == "none"
        assert stage_tags["rlhf.checkpoint_dtype"] == "float32"  # the demo model is saved in float32
    assert run.data.params["learning_rate"] == "0.003" and run.data.params["train_data.path"] == "demo:sft"
    assert "eval/loss" in run.data.metrics and "eval/loss_untrained" in run.data.metrics
    history = MlflowClient().get_metric_history(record.run_id, "train/loss")
    assert len(history) >= 2  # a curve, not one point


def test_validated_data_is_an_artifact_and_a_run_input(finished):
    record = finished[0]
    run = MlflowClient().get_run(record.run_id)
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"sft-train", "sft-eval"}
    assert inputs["sft-train"].dataset.digest == record.data_digest[:32]
    local = mlflow.artifacts.download_artifacts(f"runs:/{record.run_id}/data/sft-train.parquet")
    frame = pd.read_parquet(local)
    assert list(frame.columns) == ["prompt", "prompt_messages", "response"] and len(frame) == 64


def test_checkpoint_downloads_through_mlflow_and_loads(finished, tmp_path):
    record = finished[0]
    folder = tracking.download_checkpoint(record.run_id, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True)
    assert model.config.model_type == "llama"
    assert tracking.latest_finished_run_id("rlhf", "sft") == record.run_id


def test_bad_data_fails_the_run_with_the_row_level_report_before_any_run(finished):
    from flows.pipeline import rlhf

    before = len(_runs(""))
    bad = str(DATA / "bad" / "sft_null.jsonl")
    state = rlhf(stages=["sft"], config_file="configs/tiny.yaml", overrides={"sft.train_data.path": bad},
                 return_state=True)
    assert state.is_failed()
    assert "line 2, column 'prompt': missing value (null)" in state.message
    assert "Traceback" not in state.message
    assert len(_runs("")) == before  # refused before any MLflow run, let alone training
    assert tracking.latest_finished_run_id("rlhf", "sft") == finished[0].run_id


def test_bad_ppo_prompts_are_refused_before_sft_and_reward_spend_compute(finished):
    from flows.pipeline import rlhf

    before = len(_runs(""))
    bad = str(DATA / "bad" / "prompts_blank.jsonl")
    state = rlhf(config_file="configs/tiny.yaml", overrides={"ppo.prompts.path": bad, "sft.max_steps": 5},
                 return_state=True)
    assert state.is_failed()
    assert state.message.startswith(f"ppo stage: {bad}:")
    assert "line 2, column 'prompt': must not be blank" in state.message
    assert len(_runs("")) == before


def test_bad_config_and_unavailable_stage_are_refused_before_any_run(finished):
    from flows.pipeline import rlhf

    before = len(_runs(""))
    state = rlhf(config_file="configs/tiny.yaml", overrides={"sft.learning_rate": -1}, return_state=True)
    assert state.is_failed() and "sft.learning_rate" in state.message
    state = rlhf(stages=["kto"], config_file="configs/tiny.yaml", return_state=True)
    assert state.is_failed()
    assert len(_runs("")) == before


def test_reward_run_carries_lineage_to_the_sft_run_of_the_same_pipeline(finished):
    sft, reward, _ = finished
    run = MlflowClient().get_run(reward.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[tracking.TAG_STAGE] == "reward"
    assert run.data.tags[tracking.TAG_UPSTREAM + "sft"] == sft.run_id
    assert run.data.tags["mlflow.parentRunId"] == MlflowClient().get_run(sft.run_id).data.tags["mlflow.parentRunId"]
    for metric in ("eval/accuracy", "eval/loss", "eval/margin", "eval/gold_accuracy", "normalization/gain"):
        assert metric in run.data.metrics, metric
    names = {a.path for a in MlflowClient().list_artifacts(reward.run_id)}
    assert {"checkpoint", "data", "extremes.json", "calibration.json"} <= names
    assert {i.dataset.name for i in run.inputs.dataset_inputs} == {"preference-train", "preference-eval",
                                                                   "normalization-prompts"}


def test_reward_alone_reruns_against_the_latest_or_a_given_sft_run(finished):
    from flows.form import UpstreamRuns
    from flows.pipeline import rlhf

    sft = finished[0]
    (latest,) = rlhf(stages=["reward"], config_file="configs/tiny.yaml", use_cache=False)
    assert not latest.reused and latest.run_id != finished[1].run_id
    assert MlflowClient().get_run(latest.run_id).data.tags[tracking.TAG_UPSTREAM + "sft"] == sft.run_id
    state = rlhf(stages=["reward"], config_file="configs/tiny.yaml",
                 upstream=UpstreamRuns(sft_run_id="0" * 32), return_state=True)
    assert state.is_failed()  # an unknown run id is an error, not a silent fallback


def test_reward_gate_stops_the_pipeline_and_leaves_no_finished_reward_run(finished):
    from flows.pipeline import rlhf

    before = {r.info.run_id for r in _runs(f"tags.`{tracking.TAG_STAGE}` = 'reward'")}
    state = rlhf(stages=["reward"], config_file="configs/tiny.yaml", overrides={"reward.min_eval_accuracy": 1.0},
                 return_state=True)
    assert state.is_failed() and "below the required 1.000" in state.message
    (new,) = [r for r in _runs(f"tags.`{tracking.TAG_STAGE}` = 'reward'") if r.info.run_id not in before]
    assert new.info.status == "FAILED" and "eval/accuracy" in new.data.metrics


def test_ppo_run_has_lineage_curves_samples_plots_and_a_registered_policy(finished):
    sft, reward, ppo = finished
    client = MlflowClient()
    run = client.get_run(ppo.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[tracking.TAG_UPSTREAM + "sft"] == sft.run_id
    assert run.data.tags[tracking.TAG_UPSTREAM + "reward"] == reward.run_id
    for metric in ("eval/score", "eval/score_sft", "eval/kl", "eval/gold_reward", "eval/gold_win_rate"):
        assert metric in run.data.metrics, metric
        # curves: evaluated every `evaluation.every` (2) iterations and after the last (3)
        assert [m.step for m in client.get_metric_history(ppo.run_id, metric)] == [2, 3], metric
    assert len(client.get_metric_history(ppo.run_id, "rollout/score")) == 3  # one point per iteration
    # the demo world's gold reward of every iteration's rollouts, judged by the flow (no stage reads it)
    assert [m.step for m in client.get_metric_history(ppo.run_id, "rollout/gold_reward")] == [1, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(ppo.run_id)}
    assert {"checkpoint", "data", "plots", "samples", "evaluation.json", "warnings.txt"} <= artifacts
    assert {a.path for a in client.list_artifacts(ppo.run_id, "plots")} == {
        "plots/kl.png", "plots/length.png", "plots/score.png", "plots/overoptimization.png"}
    versions = client.search_model_versions("name = 'rlhf-policy'")
    assert ppo.run_id in {v.run_id for v in versions}
    assert run.data.tags["rlhf.registered_model"].startswith("rlhf-policy/")
    version = client.get_model_version("rlhf-policy", run.data.tags["rlhf.registered_model"].split("/")[1])
    assert (version.tags["rlhf.method"] == "ppo"
            and version.tags["rlhf.pipeline_run_id"] == run.data.tags["rlhf.pipeline_run_id"])
    assert float(version.tags["eval/gold_win_rate"]) == pytest.approx(run.data.metrics["eval/gold_win_rate"], rel=1e-5)
    assert version.tags[tracking.TAG_CONFIG_HASH] == ppo.config_hash


def test_runs_are_named_after_config_and_flow_run_and_described(finished):
    client = MlflowClient()
    runs = [client.get_run(record.run_id) for record in finished]
    parent = client.get_run(runs[0].data.tags["mlflow.parentRunId"])
    label = parent.info.run_name.removeprefix("tiny · ")
    assert label != parent.info.run_name and [r.info.run_name for r in runs] == [f"{s} · {label}"
                                                                                for s in ("sft", "reward", "ppo")]
    # the resolved config, field by field and whole
    assert (parent.data.params["ppo.learning_rate"] == "0.0003"
            and parent.data.params["sft.train_data.path"] == "demo:sft")
    config = yaml.safe_load(mlflow.artifacts.load_text(f"runs:/{parent.info.run_id}/config.yaml"))
    assert config["ppo"]["num_iterations"] == 3 and config["registry"]["model_name"] == "rlhf-policy"
    note = parent.data.tags["mlflow.note.content"]
    assert (note.startswith("Config `configs/tiny.yaml`, no overrides.") and "| ppo |" in note
            and "gold_win_rate" in note)
    ppo_note = runs[2].data.tags["mlflow.note.content"]
    assert (ppo_note.startswith("**ppo**: gold_win_rate ")
            and runs[2].data.tags["rlhf.warnings"] == str(finished[2].warnings))
    # system metrics: sampled while the stage ran
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(runs[2].data.metrics)
    # samples show what the user said, not the chat template
    table = MlflowClient().load_table(runs[2].info.experiment_id, "samples/iteration_00002.json",
                                      run_ids=[finished[2].run_id])
    assert "user" in table.columns and not table["user"].str.contains("<s>|user:|assistant:").any()


def test_the_run_form_has_typed_described_fields_that_become_overrides():
    from prefect.utilities.callables import parameter_schema

    from flows.form import PPOForm, RewardForm, SFTForm, form_overrides
    from flows.pipeline import rlhf

    schema = parameter_schema(rlhf.fn).model_dump_for_openapi()
    field = schema["definitions"]["PPOForm"]["properties"]["learning_rate"]
    assert {"type": "number", "exclusiveMinimum": 0} in field["anyOf"] and "learning rate" in field["description"]
    assert "e.g." in schema["properties"]["overrides"]["description"]
    with pytest.raises(Exception, match="greater than 0"):
        rlhf.validate_parameters({"ppo": {"learning_rate": -1}})
    assert form_overrides(SFTForm(train_data="my.jsonl"), RewardForm(), PPOForm(learning_rate=1e-4)) == {
        "sft.train_data.path": "my.jsonl", "ppo.learning_rate": 1e-4}


def test_the_champion_alias_moves_only_on_a_win_on_the_same_evaluation(tracking_store, trained):
    from mlflow.transformers import load_model

    client, name = MlflowClient(), "champion-test"
    experiment = tracking.ensure_experiment("champion-test")

    def register(key: str, value: float) -> tracking.Registration:
        with mlflow.start_run(experiment_id=experiment) as run:
            return tracking.register_policy(run.info.run_id, trained["sft"], name, "champion", {"rlhf.method": "ppo"},
                                            key, "eval/win_rate_rm", value)

    first = register("a", 0.6)
    assert first.champion and str(client.get_model_version_by_alias(name, "champion").version) == first.version
    assert not register("a", 0.5).champion  # worse on the same evaluation
    assert not register("b", 0.9).champion  # measured on another evaluation: not comparable
    assert not register("a", float("nan")).champion
    better = register("a", 0.7)
    assert better.champion and str(client.get_model_version_by_alias(name, "champion").version) == better.version
    assert client.get_model_version(name, better.version).tags["eval/win_rate_rm"] == "0.7"
    generate = load_model(f"models:/{name}@champion")  # an MLflow transformers model: loads and generates
    assert generate("user: hello\nassistant: ", max_new_tokens=4)[0]["generated_text"]
    served = mlflow.pyfunc.load_model(f"models:/{name}@champion")  # as `mlflow models serve` calls it
    (text,) = served.predict(["user: hello\nassistant: "], params={"max_new_tokens": 3})
    assert text.startswith("user: hello\nassistant: ")


def test_ppo_alone_reruns_against_the_latest_sft_and_reward_runs(finished):
    from flows.pipeline import rlhf

    sft, reward, _ = finished
    (ppo,) = rlhf(stages=["ppo"], config_file="configs/tiny.yaml", use_cache=False)
    assert not ppo.reused
    tags = MlflowClient().get_run(ppo.run_id).data.tags
    latest_reward = tracking.latest_finished_run_id("rlhf", "reward")
    assert tags[tracking.TAG_UPSTREAM + "reward"] == latest_reward
    assert tags[tracking.TAG_UPSTREAM + "sft"] == sft.run_id
    # with a critic-free estimator, which the registry names
    (rloo,) = rlhf(stages=["ppo"], config_file="configs/tiny.yaml",
                   overrides={"ppo.advantage_estimator": "rloo", "ppo.samples_per_prompt": 2})
    run = MlflowClient().get_run(rloo.run_id)
    assert run.data.params["advantage_estimator"] == "rloo" and "train/value_loss" not in run.data.metrics
    # what `auto` resolved to, written as the config would write it (null: all at once)
    assert run.data.params["micro_batch_size"] == "auto" and run.data.params["auto.micro_batch_size"] == "null"
    model, version = run.data.tags[tracking.TAG_REGISTERED_MODEL].split("/")
    assert MlflowClient().get_model_version(model, version).tags["rlhf.method"] == "ppo-rloo"


def test_stages_alone_start_from_coherent_runs_of_their_own_config_among_other_models_and_configs(
        tracking_store, tmp_path, monkeypatch):
    """One experiment, three pipelines: the tiny config, another model (GPT-2: another tokenizer)
    and the same model with another SFT section, each newer than the last. rlhf/ppo, rlhf/reward and
    rlhf/dpo on the tiny config start from the tiny config's runs (PPO: a reward run and the SFT
    run it was trained from) and finish; a named pair that does not belong together is refused
    before anything is downloaded, naming both runs."""
    from flows.form import UpstreamRuns
    from flows.pipeline import rlhf
    from tests.model_families import CHATML_TEMPLATE, build_family

    own = {"experiment": "rlhf-lineage", "registry.enabled": False}
    gpt2 = {"sft.model": str(build_family("gpt2", tmp_path)), "sft.chat_template": CHATML_TEMPLATE,
            "sft.max_length": 96, "reward.max_length": 96,
            **{f"{stage}.max_prompt_length": 48 for stage in ("sft", "reward", "ppo")}}
    short = {"sft.max_steps": 2}
    tiny = rlhf(stages=["sft", "reward"], config_file="configs/tiny.yaml", overrides=own)
    other_model = rlhf(stages=["sft", "reward"], config_file="configs/tiny.yaml", overrides={**own, **gpt2})
    other_config = rlhf(stages=["sft", "reward"], config_file="configs/tiny.yaml", overrides={**own, **short})
    client = MlflowClient()

    def upstream(record) -> dict[str, str]:
        tags = client.get_run(record.run_id).data.tags
        return {k.removeprefix(tracking.TAG_UPSTREAM): v
                for k, v in tags.items() if k.startswith(tracking.TAG_UPSTREAM)}

    def name(record) -> str:
        return client.get_run(record.run_id).info.run_name

    (ppo,) = rlhf(stages=["ppo"], config_file="configs/tiny.yaml", overrides=own)
    assert upstream(ppo) == {"sft": tiny[0].run_id, "reward": tiny[1].run_id}
    note = client.get_run(ppo.run_id).data.tags[tracking.TAG_NOTE]
    assert (f"Started from reward run `{name(tiny[1])}` (latest with this config); "
            f"SFT run `{name(tiny[0])}` (its own upstream).") in note
    (ppo_short,) = rlhf(stages=["ppo"], config_file="configs/tiny.yaml", overrides={**own, **short})
    assert upstream(ppo_short) == {"sft": other_config[0].run_id, "reward": other_config[1].run_id}
    (dpo,) = rlhf(stages=["dpo"], config_file="configs/tiny.yaml", overrides=own)
    assert upstream(dpo) == {"sft": tiny[0].run_id}
    (reward,) = rlhf(stages=["reward"], config_file="configs/tiny.yaml", overrides=own, use_cache=False)
    assert upstream(reward) == {"sft": tiny[0].run_id}
    assert "(latest with this config)." in client.get_run(reward.run_id).data.tags[tracking.TAG_NOTE]

    downloads = []
    monkeypatch.setattr(tracking, "download_checkpoint", lambda *args: downloads.append(args))
    experiment = client.get_experiment_by_name("rlhf-lineage").experiment_id
    stage_runs = len(client.search_runs([experiment], f"tags.`{tracking.TAG_STAGE}` != ''"))
    mismatched = UpstreamRuns(sft_run_id=tiny[0].run_id, reward_run_id=other_model[1].run_id)
    state = rlhf(stages=["ppo"], config_file="configs/tiny.yaml", overrides=own, upstream=mismatched, return_state=True)
    assert state.is_failed() and "Traceback" not in state.message
    assert (f"reward run `{name(other_model[1])}` ({other_model[1].run_id}) was trained from SFT run "
            f"`{name(other_model[0])}` ({other_model[0].run_id}), not from SFT run `{name(tiny[0])}` "
            f"({tiny[0].run_id}), given as upstream.sft_run_id") in state.message
    assert downloads == [] and len(client.search_runs([experiment], f"tags.`{tracking.TAG_STAGE}` != ''")) == stage_runs


def test_sft_then_dpo_is_a_pipeline_with_lineage_caching_and_a_registered_dpo_policy(tracking_store):
    from flows.pipeline import rlhf

    own = {"experiment": "rlhf-dpo", "registry.model_name": "dpo-policy"}
    sft, dpo = rlhf(stages=["dpo", "sft"], config_file="configs/tiny.yaml", overrides=own)
    assert (sft.stage, dpo.stage) == ("sft", "dpo") and not dpo.reused
    run = MlflowClient().get_run(dpo.run_id)
    assert run.data.tags[tracking.TAG_UPSTREAM + "sft"] == sft.run_id
    assert MlflowClient().get_run(run.data.tags["mlflow.parentRunId"]).data.tags["rlhf.stages"] == "sft,dpo"
    assert {"eval/gold_win_rate", "eval/kl", "eval/preference_accuracy", "train/loss"} <= set(run.data.metrics)
    table = json.loads(Path(mlflow.artifacts.download_artifacts(f"runs:/{dpo.run_id}/evaluation.json")).read_text())
    assert {"user", "policy_response", "sft_response", "kl"} <= set(table["columns"])
    version = MlflowClient().get_model_version("dpo-policy", "1")
    assert version.run_id == dpo.run_id and version.tags["rlhf.method"] == "dpo"
    assert str(MlflowClient().get_model_version_by_alias("dpo-policy", "champion").version) == "1"
    (again,) = rlhf(stages=["dpo"], config_file="configs/tiny.yaml", overrides=own)
    assert again.reused and again.run_id == dpo.run_id


def test_unchanged_rerun_reuses_every_stage_and_changing_ppo_reruns_only_ppo(tracking_store):
    from flows.pipeline import rlhf

    own = {"experiment": "rlhf-cache"}  # an experiment of its own, so other tests' runs do not interfere
    first = rlhf(config_file="configs/tiny.yaml", overrides=own)
    assert [r.reused for r in first] == [False, False, False]
    again = rlhf(config_file="configs/tiny.yaml", overrides=own)
    assert [r.reused for r in again] == [True, True, True]
    assert [r.run_id for r in again] == [r.run_id for r in first]
    assert again[1].metrics["eval/accuracy"] == first[1].metrics["eval/accuracy"]
    experiment = MlflowClient().get_experiment_by_name("rlhf-cache").experiment_id
    parents = MlflowClient().search_runs([experiment], "tags.`rlhf.stages` = 'sft,reward,ppo'",
                                         order_by=["attributes.start_time DESC"])
    assert {k: v for k, v in parents[0].data.tags.items() if k.startswith(tracking.TAG_REUSED)} == {
        tracking.TAG_REUSED + r.stage: r.run_id for r in first}

    changed = rlhf(config_file="configs/tiny.yaml", overrides={**own, "ppo.learning_rate": 1e-4})
    assert [r.reused for r in changed] == [True, True, False]
    tags = MlflowClient().get_run(changed[2].run_id).data.tags
    assert tags[tracking.TAG_UPSTREAM + "reward"] == first[1].run_id
    assert tags[tracking.TAG_CACHE_KEY] != MlflowClient().get_run(first[2].run_id).data.tags[tracking.TAG_CACHE_KEY]


def test_a_changed_package_reruns_every_stage_saying_which_and_restoring_it_reuses_the_cache(
        tracking_store, monkeypatch):
    import dataclasses
    import logging

    from flows.pipeline import rlhf
    from flows.records.lineage import stack_changes
    from rlhf import stack

    own = {"experiment": "rlhf-stack"}
    first = rlhf(config_file="configs/tiny.yaml", overrides=own)
    tags = MlflowClient().get_run(first[0].run_id).data.tags
    here = stack.current()
    assert {k: v for k, v in tags.items() if k.startswith(stack.TAG)} == here.tags()
    assert tags[tracking.TAG_TREE] in ("clean", "dirty") and tags[tracking.TAG_WORK_KEY]
    environment = Path(MlflowClient().download_artifacts(first[0].run_id, tracking.ENVIRONMENT_PATH)).read_text()
    assert f"transformers=={here.versions['transformers']}\n" in environment

    # transformers moved by hand: every stage reruns, saying which package moved and since which run
    moved = dataclasses.replace(here, versions=here.versions | {"transformers": "5.23.0"},
                                differences=here.differences + ("transformers 5.23.0 (lock: 5.24.0)",))
    monkeypatch.setattr(stack, "current", lambda: moved)
    assert stack_changes("sft", _tiny(), MlflowClient().get_run(first[0].run_id)).endswith(
        f"transformers {here.versions['transformers']} -> 5.23.0")
    flow_log, heard = logging.getLogger("prefect.flow_runs"), []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: heard.append(record.getMessage())
    flow_log.addHandler(handler)
    try:
        changed = rlhf(config_file="configs/tiny.yaml", overrides=own)
    finally:
        flow_log.removeHandler(handler)
    assert [r.reused for r in changed] == [False, False, False]
    said = [line for line in heard if "stack changed" in line]
    # SFT says what moved; reward and PPO rerun because they start from the new SFT run
    assert len(said) == 1 and said[0].startswith(f"sft: stack changed since finished run {first[0].run_id} ("), said
    assert f"transformers {here.versions['transformers']} -> 5.23.0" in said[0]
    assert MlflowClient().get_run(changed[1].run_id).data.tags[tracking.TAG_UPSTREAM + "sft"] == changed[0].run_id
    tags = MlflowClient().get_run(changed[0].run_id).data.tags
    assert tags["rlhf.stack.transformers"] == "5.23.0" and tags["rlhf.stack.locked"].startswith("false: ")

    # put back: the first runs are reused again
    monkeypatch.undo()
    again = rlhf(config_file="configs/tiny.yaml", overrides=own)
    assert [r.reused for r in again] == [True, True, True]
    assert [r.run_id for r in again] == [r.run_id for r in first]


def _tiny():
    from rlhf.config import load_config

    return load_config("configs/tiny.yaml", {"experiment": "rlhf-stack"})


def test_cache_key_follows_data_content_not_just_its_name(tmp_path, tiny_config, world):
    from flows.records.lineage import cache_key

    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    cfg = tiny_config.model_copy(update={"sft": tiny_config.sft.model_copy(
        update={"train_data": tiny_config.sft.train_data.model_copy(update={"path": str(data)})})})
    before = cache_key("sft", cfg, str(world), {})
    data.write_text('{"prompt": "a", "response": "c"}\n')
    assert cache_key("sft", cfg, str(world), {}) != before
    assert cache_key("sft", cfg, str(world), {"x": "1"}) != cache_key("sft", cfg, str(world), {})


def test_budget_beyond_the_model_context_is_refused_before_any_run(finished):
    from flows.pipeline import rlhf

    before = len(_runs(""))
    state = rlhf(config_file="configs/tiny.yaml", overrides={"ppo.sampling.response_length": 500}, return_state=True)
    assert state.is_failed()
    assert "ppo.sampling.response_length: 532 tokens do not fit the 128-token context of demo:model" in state.message
    assert len(_runs("")) == before


def test_secrets_in_locations_never_reach_params_tags_or_messages(finished, tmp_path):
    import shutil

    from flows.pipeline import rlhf

    secret = "https://alice:s3cret@data.example/sft.jsonl?token=abc123"
    state = rlhf(stages=["sft"], config_file="configs/tiny.yaml", overrides={"sft.train_data.path": secret},
                 return_state=True)
    assert state.is_failed()  # nothing can be fetched here
    assert "s3cret" not in state.message and "abc123" not in state.message

    (world,) = (tracking.state_dir() / "worlds").iterdir()
    readable = tmp_path / "token=abc123" / "sft.jsonl"  # a token in a path that does load
    readable.parent.mkdir()
    shutil.copy(world / "sft.jsonl", readable)
    state = rlhf(stages=["sft"], config_file="configs/tiny.yaml", return_state=True,
                 overrides={"sft.train_data.path": str(readable), "sft.max_steps": 1})
    assert state.is_completed(), state.message
    run = max(_runs(f"tags.`{tracking.TAG_STAGE}` = 'sft'"), key=lambda r: r.info.start_time)
    logged = json.dumps(run.data.params) + json.dumps(run.data.tags)
    parent = MlflowClient().get_run(run.data.tags["mlflow.parentRunId"])
    logged += json.dumps(parent.data.tags) + json.dumps([i.dataset.source for i in run.inputs.dataset_inputs])
    assert "abc123" not in logged
    assert run.data.params["train_data.path"] == str(tmp_path / "token=***")


def test_secrets_in_overrides_never_reach_the_prefect_flow_runs_parameters_or_logs(tracking_store):
    """Whoever submits a run sends its parameters to the Prefect API in clear; the flow replaces them with
    their redacted values as it starts, so the UI's Parameters tab and the log show no password or token."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    from flows.pipeline import rlhf
    from flows.records.pipeline_run import _redacted_json

    secret = "https://alice:s3cret@data.example/sft.jsonl?token=abc123"
    state = rlhf(stages=["sft"], config_file="configs/tiny.yaml", overrides={"sft.train_data.path": secret},
                 return_state=True)
    assert state.is_failed()  # nothing can be fetched here
    APILogWorker.drain_all(timeout=5)
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
    assert logs  # the refusal, at least
    seen = json.dumps(flow_run.parameters) + "\n".join(log.message for log in logs) + flow_run.state.message
    assert "s3cret" not in seen and "abc123" not in seen
    assert flow_run.parameters["overrides"] == {"sft.train_data.path":
                                                "https://alice:***@data.example/sft.jsonl?token=***"}
    assert flow_run.parameters["config_file"] == "configs/tiny.yaml"  # the rest as it was sent
    assert _redacted_json({"judge.token": 5}) == '{"judge.token": ***}'  # no JSON left: the redacted text


def _made_up_secrets() -> dict[str, str]:
    """One made-up credential of each kind `tracking.redact` knows, by the name a failure reports (never the
    value): random, so that finding one anywhere means it came from this test."""
    import base64
    import secrets
    import string

    def segment(claims: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()

    upper = "".join(secrets.choice(string.ascii_uppercase + string.digits) for _ in range(16))
    return {
        "a URL password": secrets.token_hex(8),
        "a URL password holding @": f"{secrets.token_hex(6)}@{secrets.token_hex(6)}",
        "a token= query parameter": secrets.token_hex(8),
        "an api_key= query parameter": secrets.token_hex(8),
        "a bearer token": secrets.token_urlsafe(24),
        "Basic auth credentials": base64.b64encode(f"alice:{secrets.token_hex(8)}".encode()).decode(),
        "the Prefect auth string password": secrets.token_hex(8),
        "a JWT": ".".join([segment({"alg": "HS256", "typ": "JWT"}), segment({"sub": secrets.token_hex(8)}),
                           secrets.token_urlsafe(32)]),
        "a Slack token": f"xoxb-{secrets.randbelow(10**12):012d}-{secrets.token_hex(12)}",
        "a Google API key": "AIza" + secrets.token_urlsafe(27)[:35],
        "a Google OAuth token": f"ya29.{secrets.token_urlsafe(24)}",
        "a Slack webhook path": f"T{secrets.token_hex(5)}/B{secrets.token_hex(5)}/{secrets.token_hex(12)}",
        "a Hugging Face token": f"hf_{secrets.token_hex(16)}",
        "an OpenAI-style key": f"sk-proj-{secrets.token_urlsafe(24)}",
        "a GitHub token": f"ghp_{secrets.token_hex(18)}",
        "an AWS access key id": f"AKIA{upper}",
        "a YAML password setting": secrets.token_hex(8),
    }


def _every_page(read) -> list:
    """Every item of a Prefect API read, page by page: the API answers a page of 200 at most."""
    items: list = []
    while page := read(offset=len(items)):
        items += page
    return items


def test_every_kind_of_secret_in_a_stages_config_and_warnings_is_found_in_no_record(
        finished, tracking_store, tmp_path, monkeypatch):
    """A PPO run whose config holds one secret of each kind `redact` knows, and whose warnings carry them:
    none is found in its MLflow runs (params, tags, metric names, every artifact, `warnings.txt` among
    them), in any file under the store and `RLHF_HOME`, or in the Prefect API's flow run (parameters,
    state, logs, task runs, artifacts). The reward is scored by a server on 127.0.0.2: this machine, but
    not a loopback name to the client, so the stage's own warning (a token over plain http) quotes the URLs."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    from flows.pipeline import rlhf
    from stages.rewards.remote import RemoteReward
    from tests.helpers import scoring_app, served_in_thread

    secret = _made_up_secrets()
    # Header- and key-shaped secrets pasted into a free text setting (inert under `engine: local`) and into
    # the stage's warnings, as a warning quoting a server's answer would carry them.
    by_shape = ("a JWT", "a Slack token", "a Google API key", "a Google OAuth token", "a Hugging Face token",
                "an OpenAI-style key", "a GitHub token", "an AWS access key id")  # known by their shape alone
    pasted = ", ".join([f"Authorization: Bearer {secret['a bearer token']}",
                        f"Authorization: Basic {secret['Basic auth credentials']}",
                        f"PREFECT_API_AUTH_STRING=rlhf:{secret['the Prefect auth string password']}",
                        f"https://hooks.slack.com/services/{secret['a Slack webhook path']}",
                        f"db_password: {secret['a YAML password setting']}"] + [secret[kind] for kind in by_shape])
    exposed = RemoteReward.exposed_token
    monkeypatch.setattr(RemoteReward, "exposed_token", lambda self: f"{exposed(self)}; it answered {pasted}")
    monkeypatch.setenv("RLHF_SECRET_TEST_TOKEN", secret["a bearer token"])  # the terms' `api_key_env`

    server, sent = scoring_app()
    with served_in_thread(server, host="127.0.0.2") as base:
        host = base.removeprefix("http://")
        urls = {"first": f"http://alice:{secret['a URL password']}@{host}/score?token="
                         f"{secret['a token= query parameter']}&api_key={secret['an api_key= query parameter']}",
                "second": f"http://bob:{secret['a URL password holding @']}@{host}/score"}
        own = {"ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 4, "ppo.num_iterations": 1,
               "ppo.evaluation.every": None, "registry.enabled": False, "ppo.launch.ray_storage_path": pasted,
               "ppo.reward": {"terms": [{"name": name, "remote": {"url": url, "api_key_env": "RLHF_SECRET_TEST_TOKEN"}}
                                        for name, url in urls.items()]}}
        state = rlhf(stages=["ppo"], config_file="configs/tiny.yaml", overrides=own, return_state=True)
    assert state.is_completed(), tracking.redact(str(state.message))
    assert len(sent) >= 4  # both terms scored a training batch and the evaluation's

    places: dict[str, bytes] = {}  # where a secret could be found -> what is there
    (ppo,) = state.result()
    ppo_run = MlflowClient().get_run(ppo.run_id)
    pipeline_run = MlflowClient().get_run(ppo_run.data.tags["mlflow.parentRunId"])
    for name, run in (("PPO", ppo_run), ("pipeline", pipeline_run)):
        places[f"the {name} run's params"] = json.dumps(run.data.params).encode()
        places[f"the {name} run's tags"] = json.dumps(run.data.tags).encode()
        places[f"the {name} run's metric names"] = json.dumps(sorted(run.data.metrics)).encode()
        downloaded = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, dst_path=str(tmp_path / name)))
        places |= {f"the {name} run's artifact {p.relative_to(downloaded)}": p.read_bytes()
                   for p in downloaded.rglob("*") if p.is_file()}
    # Where the secrets went, checked without showing what is there (it may hold them): booleans and names only.
    warned_twice = places["the PPO run's artifact warnings.txt"].count(b"is sent over plain http to 127.0.0.2") == 2
    assert warned_twice, "the PPO run's warnings.txt does not hold the two warnings that carry the secrets"
    assert {"reward.terms", "launch.ray_storage_path"} <= set(ppo_run.data.params)
    # the store (its database, artifacts) and RLHF_HOME (work folders, journals) as they lie on disk
    places |= {f"the file {p.relative_to(tracking_store)}": p.read_bytes() for p in tracking_store.rglob("*")
               if p.is_file()}

    APILogWorker.drain_all(timeout=5)
    this_flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        logs = _every_page(lambda offset: client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), offset=offset))
        task_runs = _every_page(lambda offset: client.read_task_runs(flow_run_filter=this_flow_run, offset=offset))
        artifacts = _every_page(lambda offset: client.read_artifacts(flow_run_filter=this_flow_run, offset=offset))
    logged = sum("is sent over plain http" in log.message for log in logs) == 2
    assert logged, "the Prefect log does not hold the two warnings that carry the secrets"
    places["the Prefect flow run's parameters"] = json.dumps(flow_run.parameters).encode()
    places["the Prefect flow run's state"] = str(flow_run.state.message).encode()
    places["the Prefect flow run's logs"] = "\n".join(log.message for log in logs).encode()
    places["the Prefect task runs' states"] = "\n".join(str(t.state.message) for t in task_runs).encode()
    places["the Prefect artifacts"] = "\n".join(json.dumps(a.data, default=str) for a in artifacts).encode()

    # A password holding `@` is looked for in parts: a redaction that stops at the first `@` leaves the rest.
    found = {place: [kind for kind, value in secret.items() if any(part.encode() in text for part in value.split("@"))]
             for place, text in places.items()}
    leaks = [f"{place}: {', '.join(kinds)}" for place, kinds in found.items() if kinds]
    assert not leaks, "secrets found (their values not shown) in " + "; ".join(leaks)


def test_redaction_patterns():
    assert tracking.redact("postgresql://bob:pa55@db:5432/x") == "postgresql://bob:***@db:5432/x"
    assert tracking.redact("model hf_abcdefghijklmnopqrstuvwx") == "model hf_***"
    assert tracking.redact("s3://bucket/key?X-Amz-Signature=deadbeef&x=1") == "s3://bucket/key?X-Amz-Signature=***&x=1"
    assert tracking.redact("configs/demo.yaml") == "configs/demo.yaml"
    assert tracking.redact("judge https://tok3n@judge.example/v1") == "judge https://***@judge.example/v1"
    assert tracking.redact("teacher models:/rlhf-policy@champion") == "teacher models:/rlhf-policy@champion"
    assert tracking.redact("key sk-proj-abcdefghijklmnop123") == "key sk-***"
    assert tracking.redact("Authorization: Bearer abc.def-123456") == "Authorization: Bearer ***"
    yaml_text = ("api_key: s3cret\napi_key_env: JUDGE_KEY\nturn_tokens: 24\nhf_token: 'abc'\npad_token: <pad>\n"
                 "token: null")
    assert tracking.redact(yaml_text) == ("api_key: ***\napi_key_env: JUDGE_KEY\nturn_tokens: 24\nhf_token: '***'\n"
                                          "pad_token: <pad>\ntoken: null")
    assert tracking.redact('{"password": "hunter2", "tokens": 5}') == '{"password": "***", "tokens": 5}'
    assert tracking.redact("postgresql+psycopg://rlhf:p@ss@w0rd@127.0.0.1:5433/mlflow") == \
        "postgresql+psycopg://rlhf:***@127.0.0.1:5433/mlflow"  # a password holding `@`: none of it left
    assert tracking.redact("http://alice:S3cretPass@10.0.0.5:8400/v1") == "http://alice:***@10.0.0.5:8400/v1"
    assert tracking.redact("Authorization: Basic YWxpY2U6czNjcmV0") == "Authorization: Basic ***"
    assert tracking.redact("PREFECT_API_AUTH_STRING=rlhf:Zq8xv2") == "PREFECT_API_AUTH_STRING=rlhf:***"
    assert tracking.redact("PREFECT_AUTH='rlhf:Zq8xv2' make up") == "PREFECT_AUTH='rlhf:***' make up"
    jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
    assert tracking.redact(f"token {jwt} sent") == "token eyJ*** sent"
    assert tracking.redact("slack xoxb-123456789012-abcdefABCDEF") == "slack xox***"
    assert tracking.redact("https://hooks.slack.com/services/T000/B000/XXXXXXXX") == \
        "https://hooks.slack.com/services/***"
    assert tracking.redact("maps AIzaSyA1234567890abcdefghijklmnopqrstuv") == "maps AIza***"
    assert tracking.redact("teacher models:/rlhf-policy@champion, run at http://host/a@b") == \
        "teacher models:/rlhf-policy@champion, run at http://host/a@b"  # an `@` in a path is not userinfo


def test_a_run_loggers_lines_are_redacted_arguments_and_tracebacks_included():
    """`redact_logs` on the flow's and tasks' loggers: a secret in a `%s` argument or an exception's text is
    redacted before any handler (Prefect's API log, the console) sees the record."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("prefect.flow_runs")
    logger.addHandler(handler)
    try:
        tracking.redact_logs("prefect.flow_runs")
        tracking.redact_logs("prefect.flow_runs")  # asked again: one filter
        assert sum(isinstance(f, tracking.RedactingFilter) for f in logger.filters) == 1
        logger.warning("upstream %s failed", "http://alice:S3cretPass@10.0.0.5:8400")
        try:
            raise RuntimeError("cannot reach postgresql://rlhf:hunter2@db/x")
        except RuntimeError:
            logger.exception("stage failed")
    finally:
        logger.removeHandler(handler)
    assert records[0].getMessage() == "upstream http://alice:***@10.0.0.5:8400 failed"
    assert "rlhf:***@db" in records[1].exc_text and "hunter2" not in records[1].exc_text
    assert "hunter2" not in logging.Formatter().format(records[1])


def test_redaction_takes_linear_time_on_hostile_text():
    """A warning may quote what it was given: 200,000 characters of runs that a pattern could start at
    everywhere are redacted in under 0.5 s, and under 40x the time of 20,000 (linear is 10x). Before
    the lookbehinds and bounds, `a-` repeated took 11.7 s at 20,000 characters."""
    from tests.helpers import cpu_seconds

    units = ["a", "a-", "a.", "a:", "a://", "x@", "token", "token=", "a_token: ", "eyJ-", "AUTH=x", "Bearer ",
             "http://a:", "hooks.slack.com/services/", "\ud800"]
    for unit in units:  # the CPU time of this thread: a loaded machine's waits for a core are not the pattern's
        short = cpu_seconds(tracking.redact, unit * (20_000 // len(unit)), repeats=2)
        long = cpu_seconds(tracking.redact, unit * (200_000 // len(unit)), repeats=2)
        assert long < 0.5 and long < 40 * short + 0.05, (unit, short, long)


def test_summary_lists_ran_and_reused_stage_runs(finished, capsys):
    from flows.cli import main as cli
    from flows.pipeline import rlhf

    rlhf(config_file="configs/tiny.yaml")  # everything reused
    assert cli(["summary"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("(FINISHED reused)" in line for line in lines) == 3, lines


def test_every_stage_on_two_processes_logs_to_its_run_like_one_process(finished):
    """The task launches `accelerate launch` for launch.num_processes = 2 and forwards rank 0's
    curves, samples and result to the same MLflow run shape a one-process stage gets."""
    from flows.pipeline import rlhf

    two = {f"{stage}.launch.num_processes": 2 for stage in ("sft", "reward", "ppo")}
    sft, reward, ppo = rlhf(config_file="configs/tiny.yaml", overrides={"experiment": "rlhf-two", **two})
    client = MlflowClient()
    for record, one in zip((sft, reward, ppo), finished, strict=True):
        run = client.get_run(record.run_id)
        assert run.info.status == "FINISHED" and run.data.params["launch.num_processes"] == "2"
        assert set(one.metrics) <= set(record.metrics), record.stage
        assert ({a.path for a in client.list_artifacts(one.run_id)}
                == {a.path for a in client.list_artifacts(record.run_id)})
    assert (len(client.get_metric_history(sft.run_id, "train/loss"))
            == len(client.get_metric_history(finished[0].run_id, "train/loss")))
    assert len(client.get_metric_history(ppo.run_id, "rollout/score")) == 3
    assert abs(sft.metrics["eval/loss"] - finished[0].metrics["eval/loss"]) < 0.02 * finished[0].metrics["eval/loss"]

    state = rlhf(stages=["reward"], config_file="configs/tiny.yaml", return_state=True,
                 overrides={"experiment": "rlhf-two", "reward.min_eval_accuracy": 1.0, **two})
    assert state.is_failed() and "below the required 1.000" in state.message  # the gate, raised on rank 0


def test_validation_is_reused_for_the_same_content_and_tokenizer_only(tmp_path, world, tokenizer, monkeypatch):
    from flows import inputs
    from rlhf.sections.base import DataSource
    from schemas.validate import LengthBudget
    from stages.runtime.models import load_tokenizer

    calls = []
    real = inputs.load_validated
    monkeypatch.setattr(inputs, "load_validated", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n')
    source = inputs.DataInput(DataSource(path=str(data)), "sft", inputs.TokenizerSource("demo:model", False, None))
    budget = LengthBudget(64, 128)
    first = inputs.validated(source, str(world), tokenizer, budget, "error")
    first.frame.loc[:, "response"] = "changed by a caller"
    # another tokenizer object with the same content (as a checkpoint's copy of the base tokenizer)
    again = inputs.validated(source, str(world), load_tokenizer(str(world / "model")), budget, "error")
    assert len(calls) == 1 and list(again.frame["response"]) == ["b", "d"]  # reused, and a caller's edit did not leak
    inputs.validated(source, str(world), tokenizer, LengthBudget(64, 96), "error")
    data.write_text('{"prompt": "a", "response": "e"}\n')
    changed = inputs.validated(source, str(world), tokenizer, budget, "error")
    assert len(calls) == 3 and list(changed.frame["response"]) == ["e"]  # other rules, other content: validated anew


def test_the_journal_keeps_order_and_a_refused_batch_fails_the_stage(tracking_store, tmp_path):
    import math

    from mlflow.exceptions import MlflowException

    from flows.records.journal import RunJournal

    experiment_id = tracking.ensure_experiment("writer")
    run_id = MlflowClient().create_run(experiment_id).info.run_id
    journal = RunJournal(run_id, tmp_path / "journal", outage_limit_s=600)
    journal.params({"lr": "0.1"})
    for step in range(1, 31):
        journal.log({"loss": 1.0 / step, "lr": 0.1}, step)
    journal.table(pd.DataFrame({"user": ["hi"], "response": ["hello"]}), "samples/iteration_00001.json")
    journal.close()
    history = MlflowClient().get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(s, 1.0 / s) for s in range(1, 31)]
    run = MlflowClient().get_run(run_id)
    assert math.isclose(run.data.metrics["loss"], 1 / 30) and run.data.params["lr"] == "0.1"
    table = json.loads(Path(MlflowClient().download_artifacts(run_id, "samples/iteration_00001.json")).read_text())
    assert table["columns"] == ["user", "response"] and table["data"] == [["hi", "hello"]]
    assert "samples/iteration_00001.json" in run.data.tags["mlflow.loggedArtifacts"]  # shown as a table in the UI

    refusing = RunJournal(run_id, tmp_path / "refusing", outage_limit_s=600)
    refusing.log({"bad key\x00": 1.0}, 1)  # a name the server refuses
    with pytest.raises(MlflowException):
        for step in range(2, 200):  # the refusal surfaces at a later log call (or at close), not never
            refusing.log({"loss": 0.5}, step)
            time.sleep(0.01)
        refusing.close()


def test_a_server_away_for_a_while_costs_the_journal_nothing_and_is_recorded_as_a_gap(tracking_store, tmp_path,
                                                                                   monkeypatch):
    """The sender's side of an outage, with the server's answers stood in for: the real server killed and
    restarted under a running pipeline is `tests/test_faults.py`'s."""
    import flows.records.journal
    from flows.records.journal import TAG_GAPS, RunJournal, send_leftovers
    from flows.stage_runs import is_outage

    experiment_id = tracking.ensure_experiment("writer")
    run_id = MlflowClient().create_run(experiment_id).info.run_id
    away = {"now": True}
    real_send = flows.records.journal.send_entry

    def send(client, run, entry):
        if away["now"]:
            raise ConnectionError("connection refused")
        real_send(client, run, entry)

    monkeypatch.setattr(flows.records.journal, "send_entry", send)
    monkeypatch.setattr(tracking, "server_answers", lambda timeout=5.0: not away["now"])
    journal = RunJournal(run_id, tmp_path / "journal", outage_limit_s=600)
    for step in range(1, 11):
        journal.log({"loss": 1.0 / step}, step)
    time.sleep(1.5)
    assert journal._down_since is not None and not MlflowClient().get_metric_history(run_id, "loss")
    away["now"] = False
    journal.close()
    steps = [m.step for m in MlflowClient().get_metric_history(run_id, "loss")]
    assert sorted(steps) == list(range(1, 11))
    (gap,) = journal.new_gaps()
    assert gap.seconds >= 1.0 and MlflowClient().get_run(run_id).data.tags[TAG_GAPS] == gap.describe()

    # past the limit, the stage's next log stops it, naming the server and how long it has been away
    away["now"] = True
    stopping = RunJournal(run_id, tmp_path / "stopping", outage_limit_s=1.0)
    stopping.log({"loss": 0.1}, 11)
    time.sleep(1.5)
    with pytest.raises(tracking.ServerGone, match=r"has not answered for \d+ s, past the limit of 1 s") as stopped:
        stopping.log({"loss": 0.1}, 12)
    stopping.close_after_failure()
    away["now"] = False  # what it kept is sent by the next attempt, to its own run
    # the task retries it although the server is back by the time it handles the failure (a loaded machine's
    # race); another tracking error, such as a refused upload, is not an outage while the server answers
    assert is_outage(stopped.value) and not is_outage(tracking.TrackingError("the upload was refused"))
    assert send_leftovers(tmp_path / "stopping") == [run_id]
    assert sorted(m.step for m in MlflowClient().get_metric_history(run_id, "loss")) == list(range(1, 12))


def test_every_stage_run_logs_its_memory_plan_beside_the_measured_peak(finished):
    for record in finished:
        run = MlflowClient().get_run(record.run_id)
        metrics = run.data.metrics
        assert 0 < metrics["plan/state_gib"] < metrics["plan/predicted_peak_gib"] < 2, record.stage
        assert metrics["plan/fits"] == 1.0
        assert 0 < metrics["memory/peak_rss_gib"] < 24, record.stage  # the stage's own high-water mark
        table = mlflow.artifacts.load_text(f"runs:/{record.run_id}/memory_plan.md")
        assert f"### {record.stage} (one process)" in table and "| update |" in table or record.stage != "ppo"


def test_a_config_predicted_not_to_fit_a_gpu_is_refused_before_any_stage_trains(finished, monkeypatch):
    import flows.inputs
    from flows.pipeline import rlhf
    from stages.memory.phases import Device
    from stages.memory.shapes import GIB

    before = len(_runs(""))
    monkeypatch.setattr(flows.inputs, "this_device", lambda: Device("cuda", 0.5 * GIB))  # a faked, small GPU
    state = rlhf(config_file="configs/tiny.yaml", return_state=True)
    assert state.is_failed()
    assert state.message.startswith("the memory plan (`rlhf plan`) predicts that these stages do not fit:")
    assert "sft: predicted peak" in state.message and "over one GPU of 0.5 GiB" in state.message
    assert "no combination of LoRA, bf16 frozen models, gradient checkpointing" in state.message  # the knobs tried
    assert "Traceback" not in state.message
    assert len(_runs("")) == before  # refused before any MLflow run, let alone training
    # On the CPU the same verdict is a warning: the machine's memory is the OS's to manage.
    monkeypatch.setattr(flows.inputs, "this_device", lambda: Device("cpu", 0.5 * GIB))
    state = rlhf(stages=["sft"], config_file="configs/tiny.yaml", return_state=True)
    assert state.is_completed(), state.message


def test_a_stage_user_error_fails_the_run_with_its_message_alone(tracking_store, monkeypatch):
    """Every stage task shares one wrapper (`flows.stage_runs.run_stage`), so SFT refuses a user error as
    the others do: a Failed state with the message, no traceback (SFT once let it through as a crash)."""
    import stages.sft
    from flows.pipeline import rlhf
    from stages.common.errors import StageUserError

    def refuse_to_train(*args, **kwargs):
        raise StageUserError("these demonstrations are not what this model can learn from")

    monkeypatch.setattr(stages.sft, "train_sft", refuse_to_train)
    state = rlhf(config_file="configs/tiny.yaml", stages=["sft"], use_cache=False, return_state=True)
    assert state.is_failed()
    assert "stage sft failed: these demonstrations are not what this model can learn from" in state.message



def test_sft_then_ppo_on_reward_functions_alone_needs_no_reward_stage_and_bad_functions_fail_cleanly(
        tracking_store, tmp_path):
    """`stages: [sft, ppo]` with a reward of Python functions alone: a function that cannot be imported
    is refused before any stage runs; one that answers NaN fails PPO naming the function and the row,
    leaving no run RUNNING; fixed, PPO runs from the finished SFT run with no reward run anywhere."""
    from flows.pipeline import rlhf

    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "flow_rules.py").write_text(
        "from pathlib import Path\n"
        "from rlhf.demo.rewards import names_the_subject\n\n"
        "def on_subject(prompts, responses):\n"
        "    if Path(__file__).with_suffix('.broken').exists():\n"
        "        return [float('nan')] * len(responses)\n"
        "    return names_the_subject(prompts, responses)\n")
    own = {"experiment": "rlhf-functions", "ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 4,
           "registry.model_name": "functions-policy",
           "ppo.reward": {"terms": [{"name": "subject", "function": "flow_rules:on_subject"}]},
           "ppo.paths": [str(rules)]}
    experiment = lambda: MlflowClient().get_experiment_by_name("rlhf-functions")  # noqa: E731

    missing = own | {"ppo.reward": own["ppo.reward"] | {"terms": [{"name": "subject", "function": "flow_rules:gone"}]}}
    state = rlhf(stages=["sft", "ppo"], config_file="configs/tiny.yaml", overrides=missing, return_state=True)
    assert state.is_failed() and "reward term 'subject' (flow_rules:gone): module 'flow_rules' has no function 'gone'" \
        in state.message
    assert experiment() is None or not MlflowClient().search_runs([experiment().experiment_id])

    (rules / "flow_rules.broken").touch()
    state = rlhf(stages=["sft", "ppo"], config_file="configs/tiny.yaml", overrides=own, return_state=True)
    assert state.is_failed()
    assert "reward term 'subject' (flow_rules:on_subject): batch 1, row 0 (prompt " in state.message
    assert "nan is not finite" in state.message
    runs = MlflowClient().search_runs([experiment().experiment_id])
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert {r.data.tags.get(tracking.TAG_STAGE): r.info.status for r in runs if tracking.TAG_STAGE in r.data.tags} \
        == {"sft": "FINISHED", "ppo": "FAILED"}

    (rules / "flow_rules.broken").unlink()
    sft, ppo = rlhf(stages=["sft", "ppo"], config_file="configs/tiny.yaml", overrides=own)
    assert sft.reused and not ppo.reused
    run = MlflowClient().get_run(ppo.run_id)
    assert run.data.tags[tracking.TAG_UPSTREAM + "sft"] == sft.run_id
    assert tracking.TAG_UPSTREAM + "reward" not in run.data.tags
    assert run.data.tags[tracking.TAG_REWARD_FUNCTIONS].startswith("subject=flow_rules:on_subject (weight 1, source ")
    assert "; scored by reward functions `subject` (flow_rules:on_subject, weight 1), without a reward model" in \
        run.data.tags[tracking.TAG_NOTE]
    assert {"eval/reward/subject", "eval/reward/subject_sft", "eval/win_rate_reward", "rollout/reward/subject",
            "eval/gold_win_rate"} <= set(run.data.metrics)
    assert not any(key.startswith("normalization/") for key in run.data.metrics)
    assert not MlflowClient().search_runs([experiment().experiment_id], "tags.`rlhf.stage` = 'reward'")


def test_a_registered_teacher_is_resolved_once_per_pipeline_run_and_an_alias_moved_after_changes_nothing(
        tracking_store, world, monkeypatch):
    """`ppo.teacher.model: models:/<name>@<alias>` is resolved once, before the pre-flight check: the
    memory plan, the cache key and the fetch all take that resolution. Here the alias moves to another
    version right after it; the PPO run is still keyed by, tagged with and trained on the first version."""
    from flows.pipeline import rlhf
    from flows.records.lineage import Teacher, cache_key
    from rlhf.config import load_config
    from rlhf.demo.world import build_world

    client, name = MlflowClient(), "teachers-flow"
    experiment = tracking.ensure_experiment("teachers-flow")
    versions = {}
    client.create_registered_model(name)
    for number in (1, 2):
        with mlflow.start_run(experiment_id=experiment) as run:
            mlflow.log_artifacts(str(world / "model"), tracking.CHECKPOINT_PATH)
        client.create_model_version(name, f"runs:/{run.info.run_id}/checkpoint", run.info.run_id)
        versions[number] = run.info.run_id
    client.set_registered_model_alias(name, "champion", "1")

    resolved, fetched = [], []
    real_source, real_download = tracking.model_source, tracking.download_model

    def resolve_then_move_the_alias(location):
        resolved.append(location)
        source = real_source(location)
        client.set_registered_model_alias(name, "champion", "2")  # as a registration elsewhere would
        return source

    monkeypatch.setattr(tracking, "model_source", resolve_then_move_the_alias)
    monkeypatch.setattr(tracking, "download_model", lambda source, *a, **k: fetched.append(source.run_id)
                        or real_download(source, *a, **k))
    given = f"models:/{name}@champion"
    own = {"experiment": "rlhf-teacher", "ppo.advantage_estimator": "distill", "ppo.teacher.model": given,
           "ppo.num_iterations": 2, "ppo.evaluation.every": None, "registry.enabled": False}
    sft, ppo = rlhf(stages=["sft", "ppo"], config_file="configs/tiny.yaml", overrides=own)

    assert resolved == [given]  # once for the pipeline run
    assert len(fetched) == 2 and set(fetched) == {versions[1]}  # the plan's config.json, then the stage's folder
    tags = MlflowClient().get_run(ppo.run_id).data.tags
    assert tags[tracking.TAG_TEACHER] == f"{given} (version 1, runs:/{versions[1]}/checkpoint)"
    cfg = load_config("configs/tiny.yaml", own)
    flow_world = str(build_world(tracking.state_dir() / "worlds", cfg.demo))
    first = Teacher(given, tracking.ModelSource(versions[1], tracking.CHECKPOINT_PATH, f"{name}/1"))
    moved = Teacher(given, tracking.ModelSource(versions[2], tracking.CHECKPOINT_PATH, f"{name}/2"))
    assert tags[tracking.TAG_CACHE_KEY] == cache_key("ppo", cfg, flow_world, {"sft": sft.run_id}, first) != \
        cache_key("ppo", cfg, flow_world, {"sft": sft.run_id}, moved)


def test_ppo_scored_by_the_served_reward_run_records_the_server_and_a_server_away_is_refused(tracking_store):
    """`rlhf serve-reward` serves a pipeline's finished reward run; `stages: [sft, ppo]` with a remote
    term scores on it, and the PPO run's tag names the term, the URL and the reward run it serves. A
    server that does not answer is refused before any stage runs (issue 65)."""
    import signal
    import subprocess
    import sys

    from flows.pipeline import rlhf
    from tests.helpers import free_port, wait_until_healthy

    own = {"experiment": "rlhf-served", "registry.model_name": "served-policy"}
    state = rlhf(stages=["sft", "reward"], config_file="configs/tiny.yaml", overrides=own, return_state=True)
    assert state.is_completed(), state.message
    experiment = MlflowClient().get_experiment_by_name("rlhf-served").experiment_id
    (reward_run,) = MlflowClient().search_runs([experiment], f"tags.`{tracking.TAG_STAGE}` = 'reward'")
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    served = own | {"ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 4,
                    "ppo.reward": {"terms": [{"name": "served", "remote": {"url": url}}]}}
    state = rlhf(stages=["sft", "ppo"], config_file="configs/tiny.yaml", overrides=served, return_state=True)
    assert state.is_failed() and f"reward term 'served' (score at {url}): the server does not answer" in state.message
    assert not MlflowClient().search_runs([experiment], f"tags.`{tracking.TAG_STAGE}` = 'ppo'")

    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-reward", "--experiment", "rlhf-served",
                               "--port", str(port)], start_new_session=True)
    try:
        wait_until_healthy(server, f"http://127.0.0.1:{port}/health", 120)
        state = rlhf(stages=["sft", "ppo"], config_file="configs/tiny.yaml", overrides=served, return_state=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert state.is_completed(), state.message
    (ppo,) = MlflowClient().search_runs([experiment], f"tags.`{tracking.TAG_STAGE}` = 'ppo'")
    assert ppo.data.tags[tracking.TAG_REWARD_REMOTE] == f"served=score {url} (weight 1, serving run " \
                                                       f"{reward_run.info.run_id})"
    assert ppo.data.metrics["rollout/remote_failed_share"] == 0.0 and "time/remote_reward" in ppo.data.metrics
    assert "remote/retries" in ppo.data.metrics and "rollout/reward/served" in ppo.data.metrics
    assert 0.0 <= ppo.data.metrics["eval/win_rate_reward"] <= 1.0  # the evaluation scores on the server too

    # A server that answers the start's check but fails every batch: PPO stops naming it, its run FAILED.
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from tests.helpers import served_in_thread

    broken = FastAPI()
    broken.get("/score")(lambda: {"ok": True})
    broken.post("/score")(lambda: PlainTextResponse("overloaded", status_code=503))
    with served_in_thread(broken) as base:
        failing = served | {"ppo.reward": {"terms": [{"name": "served", "remote": {
            "url": base + "/score", "max_retries": 1, "backoff_s": 0.05}}]}}
        state = rlhf(stages=["sft", "ppo"], config_file="configs/tiny.yaml", overrides=failing, return_state=True)
    assert state.is_failed() and f"(score at {base}/score): batch 1: no score for" in state.message
    assert "HTTP 503: 'overloaded', after 2 tries" in state.message
    runs = MlflowClient().search_runs([experiment], f"tags.`{tracking.TAG_STAGE}` = 'ppo'")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]


def test_rlhf_full_with_llm_judges_on_vllms_cpu_server_scores_training_and_evaluation(tracking_store, tmp_path):
    """`rlhf/full`'s stages with two judge terms on vLLM's OpenAI-compatible server (its CPU build)
    beside the reward model: one grading each response with a number, one choosing between it and
    the SFT policy's response (A or B). The judge is an untrained 2-head demo model (the CPU build
    refuses the default head size 16) whose answers vLLM's structured outputs hold to what the
    parsers read, so every response is scored, in training and in the final evaluation (issue 65)."""
    import signal
    import subprocess

    from flows.pipeline import rlhf
    from rlhf.config import load_config
    from rlhf.demo.world import build_world
    from rlhf.sections.base import VLLMConfig, vllm_python
    from tests.helpers import free_port, wait_until_healthy

    python = vllm_python(VLLMConfig())
    if not python.exists():
        pytest.skip(f"no vLLM environment at {python}: `make vllm-env` builds it (.ci/run does)")
    demo = load_config("configs/tiny.yaml").demo.model_copy(update={"num_heads": 2})
    judge = build_world(tmp_path / "judge", demo) / "model"
    port = free_port()
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    environment = os.environ | {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_NO_USAGE_STATS": "1",
                                **({"LD_PRELOAD": str(iomp)} if iomp.exists() else {})}
    with open(tmp_path / "vllm.log", "wb") as log:
        server = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(judge),
                                   "--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port),
                                   "--max-model-len", "128", "--kv-cache-memory-bytes", str(2**28),
                                   "--dtype", "float32"], stdout=log, stderr=subprocess.STDOUT, env=environment,
                                  start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    digits, letters = [str(i) for i in range(11)], ["A", "B"]
    terms = [{"name": "graded", "remote": {"url": url, "kind": "judge", "template": "{prompt} {response} Score:",
                                           "extra_body": {"structured_outputs": {"choice": digits}}}},
             {"name": "versus", "remote": {"url": url, "kind": "compare",  # the judge reads 128 tokens
                                           "template": "{prompt} A: {a} B: {b} Better:",
                                           "extra_body": {"structured_outputs": {"choice": letters}}}},
             {"name": "reward_model", "weight": 0.1}]
    judged = {"experiment": "rlhf-judged", "registry.model_name": "judged-policy", "ppo.num_iterations": 2,
              "ppo.evaluation.every": None, "ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 2,
              "ppo.reward": {"terms": terms}}
    try:
        wait_until_healthy(server, f"http://127.0.0.1:{port}/health", 300,
                           lambda: (tmp_path / "vllm.log").read_text()[-3000:])
        state = rlhf(stages=["sft", "reward", "ppo"], config_file="configs/tiny.yaml", overrides=judged,
                     return_state=True)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    assert state.is_completed(), state.message
    experiment = MlflowClient().get_experiment_by_name("rlhf-judged").experiment_id
    (ppo,) = MlflowClient().search_runs([experiment], f"tags.`{tracking.TAG_STAGE}` = 'ppo'")
    metrics, tag = ppo.data.metrics, ppo.data.tags[tracking.TAG_REWARD_REMOTE]
    assert metrics["rollout/remote_failed_share"] == 0.0 and metrics["time/sft_reference"] > 0
    assert 0.0 <= metrics["rollout/reward/graded"] <= 10.0 and 0.0 <= metrics["rollout/reward/versus"] <= 1.0
    # The evaluation: the number judge on both policies' responses, the choice judge's win rate over SFT.
    assert 0.0 <= metrics["eval/reward/graded"] <= 10.0 and 0.0 <= metrics["eval/reward/graded_sft"] <= 10.0
    assert 0.0 <= metrics["eval/reward/versus"] <= 1.0 and "eval/reward/versus_sft" not in metrics
    # A number judge is kind `judge`, a choice between two responses kind `compare` (they were one
    # kind with `parse: number | choice`, merged in issue 88).
    assert f"graded=judge {url} (weight 1, template " in tag and ", model judge)" in tag
    assert f"versus=compare {url} (weight 1, template " in tag
    assert f"servers `graded` (judge at {url}, weight 1), `versus` (compare at {url}, weight 1) " \
           "beside the reward model (weight 0.1)" in ppo.data.tags["mlflow.note.content"]
