"""End to end: the real local stack on free ports, a deployment run, and MLflow's API.

Starts a Prefect server, an MLflow server, a process worker and the deployments exactly as
`make up` does, but in a temporary state folder, then stops exactly what it started.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STACK = REPO / "scripts" / "stack.sh"
pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("stack")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(RLHF_HOME=str(home), RLHF_PREFECT_PORT=str(_free_port()), RLHF_MLFLOW_PORT=str(_free_port()),
               RLHF_POOL=f"rlhf-test-{os.getpid()}", RLHF_PYTHON=sys.executable)
    exported = subprocess.run([str(STACK), "env"], env=env, capture_output=True, text=True, check=True).stdout
    for line in exported.splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value.strip('"').replace("$PATH", env.get("PATH", ""))
    up = subprocess.run([str(STACK), "up"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield env
    finally:
        subprocess.run([str(STACK), "down"], env=env, capture_output=True, text=True, timeout=120)
        pids = home / "pids"
        assert not list(pids.iterdir()) if pids.exists() else True


def _deployment_run(env, deployment: str, **params) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "prefect", "deployment", "run", deployment, "--watch"]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


def _mlflow(env):
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    return MlflowClient(env["MLFLOW_TRACKING_URI"])


def test_sft_deployment_runs_and_hands_a_loadable_checkpoint_through_mlflow(stack, tmp_path):
    done = _deployment_run(stack, "rlhf/sft", config_file="configs/tiny.yaml")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    client = _mlflow(stack)
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


def test_bad_input_through_a_deployment_fails_and_leaves_no_finished_run(stack):
    bad = str(REPO / "tests" / "data" / "bad" / "sft_wrong_type.jsonl")
    done = _deployment_run(stack, "rlhf/sft", config_file="configs/tiny.yaml",
                           overrides={"sft.train_data.path": bad})
    assert done.returncode != 0
    client = _mlflow(stack)
    experiment = client.get_experiment_by_name("rlhf")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"params.`train_data.path` = '{bad}'")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_reward_deployment_reruns_alone_against_the_latest_sft_run(stack):
    client = _mlflow(stack)
    experiment = client.get_experiment_by_name("rlhf")
    (sft,) = client.search_runs([experiment.experiment_id],
                                filter_string="tags.`rlhf.stage` = 'sft' and attributes.status = 'FINISHED'")
    done = _deployment_run(stack, "rlhf/reward", config_file="configs/tiny.yaml")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.stage` = 'reward'")
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlhf.upstream.sft"] == sft.info.run_id
    assert "eval/accuracy" in run.data.metrics and "eval/gold_accuracy" in run.data.metrics


def test_ppo_deployment_reruns_alone_and_registers_the_policy(stack):
    client = _mlflow(stack)
    experiment = client.get_experiment_by_name("rlhf")
    done = _deployment_run(stack, "rlhf/ppo", config_file="configs/tiny.yaml")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.stage` = 'ppo'")
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlhf.upstream.sft"] and run.data.tags["rlhf.upstream.reward"]
    assert "eval/gold_win_rate" in run.data.metrics
    assert [v.run_id for v in client.search_model_versions("name = 'rlhf-policy'")] == [run.info.run_id]
