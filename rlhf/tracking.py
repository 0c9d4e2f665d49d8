"""MLflow conventions of the pipeline: experiment, run hierarchy, lineage tags, artifacts.

Stages never import this module; flows do. Every stage run is a child of one pipeline run
and is found again through its tags (`rlhf.stage`, `rlhf.upstream.*`).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.entities import RunStatus
from mlflow.tracking import MlflowClient

from rlhf.config import REPO_ROOT

TAG_STAGE = "rlhf.stage"
TAG_PIPELINE = "rlhf.pipeline_run_id"
TAG_CONFIG_HASH = "rlhf.config_hash"
TAG_DATA_DIGEST = "rlhf.data_digest"
TAG_CODE_VERSION = "rlhf.code_version"
TAG_GIT_COMMIT = "rlhf.git_commit"
TAG_UPSTREAM = "rlhf.upstream."  # + stage name, e.g. rlhf.upstream.sft -> that stage's run id
TAG_PREFECT_FLOW_RUN = "rlhf.prefect_flow_run_id"
CHECKPOINT_PATH = "checkpoint"
DATA_PATH = "data"


def ensure_experiment(name: str) -> str:
    """The experiment's id, creating it if needed. Against a SQLite store without a server,
    artifacts go to an explicit folder beside the database (MLflow's default would be the
    current directory); through a tracking server, the server's artifact store is used."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    uri = mlflow.get_tracking_uri()
    location = None
    if uri.startswith("sqlite:"):
        location = (Path(uri.split(":///", 1)[1]).parent / "mlartifacts").as_uri()
    try:
        # The experiment kind makes the MLflow 3 UI open on runs and their curves, not on GenAI traces.
        return client.create_experiment(name, artifact_location=location,
                                        tags={"mlflow.experimentKind": "custom_model_development"})
    except mlflow.exceptions.MlflowException:  # created concurrently by another run
        return client.get_experiment_by_name(name).experiment_id


def code_version() -> tuple[str, str]:
    """(package version, git commit with '+dirty' when the work tree has uncommitted changes)."""
    try:
        version = metadata.version("rlhf-pipeline")
    except metadata.PackageNotFoundError:
        version = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return version, commit


def start_pipeline_run(experiment_id: str, tags: dict[str, str]) -> str:
    run = MlflowClient().create_run(experiment_id, run_name="pipeline", tags=tags)
    return run.info.run_id


def create_stage_run(experiment_id: str, parent_run_id: str, stage: str, tags: dict[str, str]) -> str:
    tags = {"mlflow.parentRunId": parent_run_id, TAG_PIPELINE: parent_run_id, TAG_STAGE: stage, **tags}
    return MlflowClient().create_run(experiment_id, run_name=stage, tags=tags).info.run_id


def end_run(run_id: str, ok: bool) -> None:
    MlflowClient().set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED))


def log_data(frame: pd.DataFrame, name: str, source: str, digest: str, context: str) -> None:
    """The validated records as a Parquet artifact under `data/` and as a run input."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.parquet"
        frame.to_parquet(path)
        mlflow.log_artifact(str(path), DATA_PATH)
    dataset = mlflow.data.from_pandas(frame.reset_index(drop=True), source=source, name=name, digest=digest[:32])
    mlflow.log_input(dataset, context=context)


def download_checkpoint(run_id: str, dst: Path) -> Path:
    """An upstream stage's checkpoint, fetched through MLflow (never a local side path)."""
    dst.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=f"runs:/{run_id}/{CHECKPOINT_PATH}", dst_path=str(dst)))


def latest_finished_run(experiment_name: str, stage: str) -> str | None:
    """The most recent FINISHED run of `stage`, or None."""
    experiment = MlflowClient().get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    runs = MlflowClient().search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{TAG_STAGE}` = '{stage}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def run_url(run_id: str) -> str | None:
    """Link to a run in the MLflow UI, when tracking goes through a server."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith("http"):
        return None
    run = MlflowClient().get_run(run_id)
    return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"


def state_dir() -> Path:
    """The folder that holds all local state: `$RLHF_HOME`, by default `.rlhf/` in the repository."""
    return Path(os.environ.get("RLHF_HOME", REPO_ROOT / ".rlhf"))


def workdir() -> Path:
    """A fresh scratch folder for one stage's outputs before upload."""
    root = state_dir() / "work"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root))


def register_checkpoint(run_id: str, model_name: str) -> str:
    """Register the run's `checkpoint/` as a new version of `model_name`; returns the version."""
    client = MlflowClient()
    try:
        client.create_registered_model(model_name)
    except mlflow.exceptions.MlflowException:  # already registered
        pass
    source = f"{client.get_run(run_id).info.artifact_uri}/{CHECKPOINT_PATH}"
    return client.create_model_version(model_name, source=source, run_id=run_id).version
