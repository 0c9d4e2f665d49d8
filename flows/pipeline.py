"""The `rlhf` Prefect flow: wires stages to MLflow. No training math lives here.

Each task fetches what its stage needs (validated data, upstream checkpoints through MLflow
artifacts), calls the stage, logs what it produced, and returns a small `StageRecord`.
"""

from __future__ import annotations

import json
import shutil
from typing import Any, Literal

import mlflow
import pandas as pd
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.context import get_run_context
from prefect.states import Failed, State
from pydantic import BaseModel, Field

from rlhf import tracking
from rlhf.config import ConfigError, PipelineConfig, config_hash, flatten, load_config
from rlhf.demo_world import DemoWorldConfig, build_world, resolve_location
from schemas.errors import DataContractError
from schemas.validate import LengthBudget, ValidatedData, data_digest, load_validated
from stages.models import load_tokenizer

StageName = Literal["sft", "reward", "ppo"]
AVAILABLE_STAGES: tuple[StageName, ...] = ("sft",)
"""Stages this version can run; reward and PPO arrive with their own issues."""


class UpstreamRuns(BaseModel):
    """MLflow run ids of upstream stages for single-stage reruns; empty means the latest finished run."""

    sft_run_id: str | None = Field(None, description="SFT run whose checkpoint later stages start from.")


class StageRecord(BaseModel):
    """What a stage task hands back: identities and figures, never a model."""

    stage: StageName
    run_id: str
    checkpoint_uri: str
    config_hash: str
    data_digest: str
    metrics: dict[str, float]


@task(retries=1, retry_delay_seconds=5)
def build_demo_world(demo: DemoWorldConfig) -> str:
    """Build (or reuse) the embedded demo world; returns its folder."""
    return str(build_world(tracking.state_dir() / "worlds", demo))


def _validated_pair(cfg, world: str | None, kind: str, tokenizer, budget: LengthBudget) -> tuple[ValidatedData, ValidatedData]:
    """Train and eval data for a stage; eval is split off train when the config names none."""
    def load(source) -> ValidatedData:
        return load_validated(resolve_location(source.path, world), kind, format=source.format, split=source.split,
                              tokenizer=tokenizer, budget=budget, duplicates=cfg.duplicates)

    train = load(cfg.train_data)
    if cfg.eval_data is not None:
        return train, load(cfg.eval_data)
    held_out = train.frame.sample(frac=cfg.eval_fraction, random_state=cfg.seed)
    kept = train.frame.drop(index=held_out.index)

    def part(frame: pd.DataFrame, name: str) -> ValidatedData:
        return ValidatedData(frame, f"{train.source} ({name})", kind, train.format, data_digest(frame))

    return part(kept, "train split"), part(held_out, "eval split")


def refuse(message: str) -> State:
    """A user error (bad data or config): logged as the message alone, without a traceback."""
    get_run_logger().error(message)
    return Failed(message=message)


def _publish_summary(stage: str, run_id: str, metrics: dict[str, float], samples: list[dict[str, str]]) -> None:
    url = tracking.run_url(run_id)
    link = f"[{run_id}]({url})" if url else f"`{run_id}`"
    rows = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in sorted(metrics.items()))
    shown = "\n".join(f"- `{s['prompt'][-60:]}` → `{s['response']}`" for s in samples)
    create_markdown_artifact(
        key=f"{stage}-summary",
        markdown=f"# {stage} stage\n\nMLflow run: {link}\n\n| metric | value |\n|---|---|\n{rows}\n\n## Samples\n{shown}\n",
        description=f"{stage} stage results",
    )


@task
def sft(cfg: PipelineConfig, world: str | None, experiment_id: str, parent_run_id: str) -> StageRecord | State:
    """Validate demonstrations, fine-tune the base model, log everything to a child run."""
    from stages.sft import train_sft

    stage = cfg.sft
    model_location = resolve_location(stage.model, world)
    version, commit = tracking.code_version()
    tags = {tracking.TAG_CONFIG_HASH: config_hash(stage), tracking.TAG_CODE_VERSION: version,
            tracking.TAG_GIT_COMMIT: commit, "rlhf.base_model": stage.model}
    run_id = tracking.create_stage_run(experiment_id, parent_run_id, "sft", tags)
    out = tracking.workdir()
    try:
        with mlflow.start_run(run_id=run_id):
            mlflow.log_params(flatten(stage))
            tokenizer = load_tokenizer(model_location, trust_remote_code=stage.trust_remote_code)
            budget = LengthBudget(stage.max_prompt_length, stage.max_length)
            train, evaluation = _validated_pair(stage, world, "sft", tokenizer, budget)
            mlflow.set_tag(tracking.TAG_DATA_DIGEST, train.digest)
            tracking.log_data(train.frame, "sft-train", train.source, train.digest, "train")
            tracking.log_data(evaluation.frame, "sft-eval", evaluation.source, evaluation.digest, "eval")

            result = train_sft(stage, model_location, train.frame, evaluation.frame, out,
                               sink=lambda metrics, step: mlflow.log_metrics(metrics, step=step))
            mlflow.log_metrics(result.metrics)
            mlflow.log_table(pd.DataFrame(result.samples), "samples.json")
            mlflow.log_artifacts(str(result.checkpoint), tracking.CHECKPOINT_PATH)
        _publish_summary("sft", run_id, result.metrics, result.samples)
        return StageRecord(stage="sft", run_id=run_id, checkpoint_uri=f"runs:/{run_id}/{tracking.CHECKPOINT_PATH}",
                           config_hash=tags[tracking.TAG_CONFIG_HASH], data_digest=train.digest, metrics=result.metrics)
    except DataContractError as e:  # the run is already marked FAILED by the `with` block
        return refuse(e.report())
    finally:
        shutil.rmtree(out, ignore_errors=True)


STAGE_TASKS = {"sft": sft}


@flow(name="rlhf")
def rlhf(
    stages: list[StageName] = list(AVAILABLE_STAGES),
    config_file: str = "configs/demo.yaml",
    overrides: dict[str, Any] = {},
    upstream: UpstreamRuns = UpstreamRuns(),
) -> list[StageRecord] | State:
    """Run the named RLHF stages in order, as children of one MLflow pipeline run.

    `config_file` is a YAML config (relative to the repository); `overrides` sets single
    fields by dotted name, e.g. {"sft.learning_rate": 3e-4}.
    """
    logger = get_run_logger()
    missing = [s for s in stages if s not in AVAILABLE_STAGES]
    if missing:
        return refuse(f"stage(s) {', '.join(missing)} not available in this version; available: {', '.join(AVAILABLE_STAGES)}")
    try:
        cfg = load_config(config_file, overrides)
    except ConfigError as e:
        return refuse(str(e))
    experiment_id = tracking.ensure_experiment(cfg.experiment)
    version, commit = tracking.code_version()
    flow_run_id = str(get_run_context().flow_run.id)
    parent_run_id = tracking.start_pipeline_run(experiment_id, {
        "rlhf.stages": ",".join(stages), "rlhf.config_file": config_file, "rlhf.overrides": json.dumps(overrides),
        tracking.TAG_CONFIG_HASH: config_hash(cfg), tracking.TAG_CODE_VERSION: version,
        tracking.TAG_GIT_COMMIT: commit, tracking.TAG_PREFECT_FLOW_RUN: flow_run_id,
    })
    logger.info("MLflow pipeline run %s", tracking.run_url(parent_run_id) or parent_run_id)
    ok = False
    try:
        world = build_demo_world(cfg.demo) if cfg.demo is not None else None
        records = []
        for name in stages:
            state = STAGE_TASKS[name](cfg, world, experiment_id, parent_run_id, return_state=True)
            if not state.is_completed():
                return Failed(message=f"stage {name} failed: {state.message}")
            record = state.result()
            logger.info("%s run %s: %s", record.stage, record.run_id,
                        ", ".join(f"{k}={v:.4g}" for k, v in sorted(record.metrics.items())))
            records.append(record)
        ok = True
        return records
    finally:
        tracking.end_run(parent_run_id, ok)
