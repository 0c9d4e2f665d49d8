"""End to end: the real local stack on free ports, a deployment run, and MLflow's API.

Starts a Prefect server, an MLflow server, a process worker and the deployments exactly as
`make up` does, but in a temporary state folder, then stops exactly what it started.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf.sections.base import VLLMConfig, vllm_python
from tests.helpers import BAD, BAD_CASES, vllm_servers
from tests.stack import (
    commands_holding,
    credentials,
    deployment_run,
    logs_holding,
    mlflow_client,
    running_stack,
    submit_and_wait,
)

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("stack")) as env:
        yield env


def full_pipeline_runs(stack, overrides: dict, **params) -> dict:
    """`rlhf/full` on the smoke config with `overrides` (their `experiment` a new one), checked to
    succeed: each stage's MLflow run in that experiment, by stage."""
    done = deployment_run(stack, "rlhf/full", config_file="configs/smoke.yaml", overrides=overrides, **params)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name(overrides["experiment"])
    return {r.data.tags["rlhf.stage"]: r for r in client.search_runs([experiment.experiment_id],
                                                                     filter_string="tags.`rlhf.stage` != ''")}


def test_sft_deployment_runs_and_hands_a_loadable_checkpoint_through_mlflow(stack, tmp_path):
    done = deployment_run(stack, "rlhf/sft", config_file="configs/tiny.yaml")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name("rlhf")
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.stage` = 'sft'")
    assert run.info.status == "FINISHED"
    for tag in ("rlhf.config_hash", "rlhf.data_digest", "rlhf.code_version", "rlhf.git_commit", "mlflow.parentRunId"):
        assert run.data.tags.get(tag), tag
    assert {i.dataset.name for i in run.inputs.dataset_inputs} == {"sft-train", "sft-eval"}
    assert "eval/loss" in run.data.metrics

    import mlflow
    from transformers import AutoModelForCausalLM

    folder = mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/checkpoint", dst_path=str(tmp_path))
    assert AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True).config.model_type == "llama"


def test_reward_deployment_reruns_alone_against_the_latest_sft_run(stack):
    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name("rlhf")
    (sft,) = client.search_runs([experiment.experiment_id],
                                filter_string="tags.`rlhf.stage` = 'sft' and attributes.status = 'FINISHED'")
    done = deployment_run(stack, "rlhf/reward", config_file="configs/tiny.yaml")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.stage` = 'reward'")
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlhf.upstream.sft"] == sft.info.run_id
    assert "eval/accuracy" in run.data.metrics and "eval/gold_accuracy" in run.data.metrics


def test_ppo_deployment_reruns_alone_and_registers_the_policy(stack):
    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name("rlhf")
    # PPO's learning rate through the run form's typed field, as the Prefect UI sends it
    done = deployment_run(stack, "rlhf/ppo", config_file="configs/tiny.yaml", ppo={"learning_rate": 1e-4})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.stage` = 'ppo'")
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlhf.upstream.sft"] and run.data.tags["rlhf.upstream.reward"]
    assert "eval/gold_win_rate" in run.data.metrics and run.data.params["learning_rate"] == "0.0001"
    assert [v.run_id for v in client.search_model_versions("name = 'rlhf-policy'")] == [run.info.run_id]
    assert str(client.get_model_version_by_alias("rlhf-policy", "champion").version) == "1"


def test_dpo_deployment_reruns_alone_and_registers_a_dpo_version(stack):
    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name("rlhf")
    done = deployment_run(stack, "rlhf/dpo", config_file="configs/tiny.yaml", dpo={"beta": 0.2})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.stage` = 'dpo'")
    assert run.info.status == "FINISHED" and run.data.params["beta"] == "0.2"
    assert run.data.tags["rlhf.upstream.sft"] and "rlhf.upstream.reward" not in run.data.tags
    assert {"eval/gold_win_rate", "eval/kl", "eval/preference_accuracy"} <= set(run.data.metrics)
    (version,) = client.search_model_versions(f"name = 'rlhf-policy' and run_id = '{run.info.run_id}'")
    assert version.tags["rlhf.method"] == "dpo" and version.tags["rlhf.judged_by"] == "eval/gold_win_rate"


# One file of the bad-input corpus per kind of check (a parse error, a contract's column check, a
# check across rows, each reader, the token budget only a stage's tokenizer can apply), through the
# deployment of the stage that reads it. Every file of the corpus is refused with its message by
# the readers themselves in tests/test_contracts.py; what this adds is the way from a reader's error
# to a failed deployment run, which is the same for every file (each run costs ~20 s of process start).
SAMPLED = {"sft_malformed_line.jsonl", "sft_missing_column.jsonl", "pairs_identical.jsonl", "prompts_blank.jsonl"}
assert SAMPLED <= {name for name, _, _ in BAD_CASES}, "a sampled bad-input file left tests.helpers.BAD_CASES"
CORPUS = [(name, kind, expected) for name, kind, expected in BAD_CASES if name in SAMPLED] + [
    ("sft_too_long.jsonl", "sft", ["line 2, column 'response'", "over the budget of 64"])]
READER = {"sft": ("rlhf/sft", "sft.train_data.path"), "preference": ("rlhf/reward", "reward.train_data.path"),
          "prompt": ("rlhf/ppo", "ppo.prompts.path")}


def test_bad_inputs_fail_their_deployment_runs_with_one_clear_error_and_no_run(stack):
    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name("rlhf")
    runs_before = len(client.search_runs([experiment.experiment_id]))
    requests = []
    for name, kind, _ in CORPUS:
        deployment, field = READER[kind]
        requests.append((deployment, {"config_file": "configs/tiny.yaml", "overrides": {field: str(BAD / name)}}))
    states = submit_and_wait(stack, requests)

    for (name, kind, expected), (state, message, _) in zip(CORPUS, states, strict=True):
        stage = READER[kind][0].removeprefix("rlhf/")
        assert state == "FAILED", (name, state, message)
        assert message.startswith(f"{stage} stage: {BAD / name}:"), (name, message)
        for line in expected:
            assert line in message, (name, message)
        assert "Traceback" not in message, name
    assert len(client.search_runs([experiment.experiment_id])) == runs_before  # refused before any run


def test_servers_listen_on_localhost_only(stack):
    """Every listening socket on the stack's ports is bound to 127.0.0.1 (from /proc/net/tcp{,6})."""
    ports = {int(stack["RLHF_PREFECT_PORT"]), int(stack["RLHF_MLFLOW_PORT"])}
    bound = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port = local.split(":")
            if state == "0A" and int(port, 16) in ports:  # 0A: LISTEN
                bound.add((int(port, 16), address))
    assert {port for port, _ in bound} == ports
    assert {address for _, address in bound} == {"0100007F"}  # 127.0.0.1, little-endian hex


def test_the_servers_refuse_a_request_without_the_stacks_credentials(stack):
    """Prefect's API wants its auth string, MLflow's its basic-auth user; the state folder and the
    credentials are the stack user's alone."""
    import base64
    import stat

    import httpx

    prefect, mlflow = stack["PREFECT_API_URL"], stack["MLFLOW_TRACKING_URI"]
    token = base64.b64encode(stack["PREFECT_API_AUTH_STRING"].encode()).decode()
    assert httpx.post(prefect + "/flows/filter", json={}).status_code == 401
    wrong = {"Authorization": "Basic d3Jvbmc6d3Jvbmc="}  # wrong:wrong
    assert httpx.post(prefect + "/flows/filter", json={}, headers=wrong).status_code == 401
    right = {"Authorization": f"Basic {token}"}
    assert httpx.post(prefect + "/flows/filter", json={}, headers=right).status_code == 200
    search = mlflow + "/api/2.0/mlflow/experiments/search?max_results=1"
    assert httpx.get(search).status_code == 401 and httpx.get(search, auth=("admin", "wrong")).status_code == 401
    assert httpx.get(search, auth=("admin", stack["MLFLOW_TRACKING_PASSWORD"])).status_code == 200
    assert httpx.get(mlflow + "/health").status_code == 200  # the health probe stays open
    home = Path(stack["RLHF_HOME"])
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "credentials").stat().st_mode) == 0o600
    assert stat.S_IMODE((home / "mlflow-auth.ini").stat().st_mode) == 0o600


def test_no_command_line_on_the_machine_nor_log_of_the_stack_holds_a_credential_of_it(stack):
    """The servers get their secrets through the environment or 0600 files: a command line is readable
    by every local user (tests/test_load.py checks the same of the stack on PostgreSQL)."""
    secrets = credentials(stack)
    assert set(secrets) == {"PREFECT_AUTH", "MLFLOW_PASSWORD", "MLFLOW_SECRET_KEY", "PG_PASSWORD"}
    held = commands_holding(secrets)  # a name, so a failure shows no secret
    assert not held
    logged = logs_holding(stack, secrets)
    assert not logged


def test_full_deployment_with_every_stage_sharded_registers_a_loadable_policy(stack):
    """rlhf/full on the smoke config with SFT, reward and PPO each sharded over two processes
    (FSDP2, gloo): lineage, curves, samples and a registered policy, as on one process."""
    fsdp = {"num_processes": 2, "accelerate_config": "configs/accelerate/fsdp.yaml"}
    overrides = {"experiment": "rlhf-fsdp", "registry.enabled": True, "registry.model_name": "rlhf-policy-fsdp",
                 **{f"{stage}.launch": fsdp for stage in ("sft", "reward", "ppo")}}
    runs = full_pipeline_runs(stack, overrides)
    client = mlflow_client(stack)
    experiment = client.get_experiment_by_name("rlhf-fsdp")
    assert set(runs) == {"sft", "reward", "ppo"}
    for run in runs.values():
        assert run.info.status == "FINISHED" and run.data.tags["rlhf.held_as"] == "fsdp2 x 2"
        assert run.data.params["launch.accelerate_config"] == "configs/accelerate/fsdp.yaml"
    assert runs["ppo"].data.tags["rlhf.upstream.reward"] == runs["reward"].info.run_id
    assert runs["reward"].data.tags["rlhf.upstream.sft"] == runs["sft"].info.run_id
    assert len(client.get_metric_history(runs["ppo"].info.run_id, "rollout/score")) > 1
    assert "eval/gold_win_rate" in runs["ppo"].data.metrics
    assert {"checkpoint", "samples", "evaluation.json"} <= {a.path
                                                             for a in client.list_artifacts(runs["ppo"].info.run_id)}
    assert "samples.json" in {a.path for a in client.list_artifacts(runs["sft"].info.run_id)}

    import mlflow

    (version,) = client.search_model_versions("name = 'rlhf-policy-fsdp'")
    assert version.run_id == runs["ppo"].info.run_id
    generate = mlflow.transformers.load_model("models:/rlhf-policy-fsdp/1")
    assert generate("Describe the cat.", max_new_tokens=4)[0]["generated_text"]

    # the same run again: every sharded stage is reused from the cache
    again = deployment_run(stack, "rlhf/full", config_file="configs/smoke.yaml", overrides=overrides)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    (pipeline,) = [r for r in client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.stages` != ''",
                                                  order_by=["attributes.start_time DESC"], max_results=1)]
    assert {stage: pipeline.data.tags.get(f"rlhf.reused.{stage}") for stage in runs} == {
        stage: run.info.run_id for stage, run in runs.items()}


@pytest.mark.skipif(not vllm_python(VLLMConfig()).exists(),
                    reason=f"no vLLM environment at {VLLMConfig().python}: `make vllm-env` builds it (.ci/run does)")
def test_full_deployment_with_vllm_rollouts_samples_on_a_server_that_is_gone_afterwards(stack):
    """rlhf/full on the smoke config with PPO sampling on a real vLLM server (its CPU build; the demo
    model with 2 heads of 32): the engine's log-probs logged against the trainer's every iteration."""
    overrides = {"experiment": "rlhf-vllm", "registry.enabled": False, "demo.num_heads": 2,
                 "ppo.rollout_engine": "vllm"}
    runs = full_pipeline_runs(stack, overrides)
    client = mlflow_client(stack)
    assert set(runs) == {"sft", "reward", "ppo"} and all(r.info.status == "FINISHED" for r in runs.values())
    ppo = runs["ppo"]
    assert ppo.data.params["rollout_engine"] == "vllm"
    gaps = client.get_metric_history(ppo.info.run_id, "rollout/vllm_logprob_gap_max")
    assert len(gaps) == 6 and max(m.value for m in gaps) < 1e-3  # smoke.yaml: 6 iterations, float32 on both sides
    assert all(m.value > 0 for m in client.get_metric_history(ppo.info.run_id, "time/weight_sync"))
    assert "eval/gold_win_rate" in ppo.data.metrics
    assert not vllm_servers(environment=f"RLHF_HOME={stack['RLHF_HOME']}")  # this stack's, not a test's beside it


def test_full_deployment_with_lora_everywhere_hands_plain_checkpoints_downstream(stack, tmp_path):
    """rlhf/full on the smoke config with LoRA on SFT, reward, PPO and DPO and the reward-lora
    critic: each stage trains adapters, hands a plain merged folder to the next, and the PPO and
    DPO policies are registered as such."""
    lora = {"r": 4, "alpha": 8.0}
    overrides = {"experiment": "rlhf-lora", "registry.enabled": True, "registry.model_name": "rlhf-policy-lora",
                 **{f"{stage}.lora": lora for stage in ("sft", "reward", "ppo", "dpo")},
                 "ppo.critic.kind": "reward-lora"}
    runs = full_pipeline_runs(stack, overrides, stages=["sft", "reward", "ppo", "dpo"])
    client = mlflow_client(stack)
    assert set(runs) == {"sft", "reward", "ppo", "dpo"}
    for run in runs.values():
        assert run.info.status == "FINISHED" and run.data.params["lora.r"] == "4"
        assert "plan/predicted_peak_gib" in run.data.metrics and "memory/peak_rss_gib" in run.data.metrics
    assert runs["ppo"].data.params["critic.kind"] == "reward-lora"
    assert runs["reward"].data.tags["rlhf.upstream.sft"] == runs["sft"].info.run_id
    assert runs["dpo"].data.tags["rlhf.upstream.sft"] == runs["sft"].info.run_id
    assert runs["ppo"].data.tags["rlhf.upstream.reward"] == runs["reward"].info.run_id
    assert {"eval/gold_win_rate", "eval/kl"} <= set(runs["ppo"].data.metrics) & set(runs["dpo"].data.metrics)

    import mlflow
    from safetensors import safe_open

    for stage, run in runs.items():  # a plain Hugging Face folder: no adapter, no peft wrapper
        folder = Path(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/checkpoint",
                                                          dst_path=str(tmp_path / stage)))
        assert not (folder / "adapter_config.json").exists(), stage
        for weights in folder.glob("*.safetensors"):
            with safe_open(weights, "pt") as f:
                assert not [k for k in f.keys() if "lora" in k or "base_layer" in k or "modules_to_save" in k], stage
    versions = {v.run_id: v.version for v in client.search_model_versions("name = 'rlhf-policy-lora'")}
    assert set(versions) == {runs["ppo"].info.run_id, runs["dpo"].info.run_id}  # both methods register a policy
    generate = mlflow.transformers.load_model(f"models:/rlhf-policy-lora/{versions[runs['ppo'].info.run_id]}")
    assert generate("Describe the cat.", max_new_tokens=4)[0]["generated_text"]


def test_a_named_pair_that_does_not_belong_together_fails_the_deployment_run_naming_both(stack):
    """rlhf/ppo given, through the run form's upstream section, the tiny config's SFT run and the
    sharded pipeline's reward run (trained from another SFT run): the deployment run fails before
    any stage run, naming both runs. Which runs a stage starts from when none is named, among other
    models' and configs' pipelines in one experiment, is tests/test_flow.py's (the same flow, in
    process); the deployments rerunning alone are the tests above."""
    client = mlflow_client(stack)
    (sft,) = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id],
                                filter_string="tags.`rlhf.stage` = 'sft'")
    (reward,) = client.search_runs([client.get_experiment_by_name("rlhf-fsdp").experiment_id],
                                   filter_string="tags.`rlhf.stage` = 'reward'")
    other_sft = client.get_run(reward.data.tags["rlhf.upstream.sft"])
    stage_runs = len(client.search_runs([e.experiment_id for e in client.search_experiments()],
                                        filter_string="tags.`rlhf.stage` != ''"))
    mismatched = {"sft_run_id": sft.info.run_id, "reward_run_id": reward.info.run_id}
    ((state, message, _),) = submit_and_wait(stack, [("rlhf/ppo", {"config_file": "configs/tiny.yaml",
                                                                   "upstream": mismatched})])
    assert state == "FAILED" and "Traceback" not in message
    assert (f"reward run `{reward.info.run_name}` ({reward.info.run_id}) was trained from SFT run "
            f"`{other_sft.info.run_name}` ({other_sft.info.run_id}), not from SFT run `{sft.info.run_name}` "
            f"({sft.info.run_id}), given as upstream.sft_run_id") in message
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  filter_string="tags.`rlhf.stage` != ''")) == stage_runs
