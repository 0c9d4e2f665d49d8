"""The `rlhf` Prefect flow: the pipeline sft -> reward -> ppo, wiring stages to MLflow.

No training math and no stage internals live here. Each task fetches what its stage needs
(validated data from `flows.inputs`, upstream checkpoints through MLflow artifacts), calls the
stage function, logs what it produced (`flows.reports`), and returns a small `StageRecord`
(`flows.lineage`, which also keys the cache).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger, task
from prefect.context import get_run_context
from prefect.states import Failed, State
from pydantic import BaseModel, Field

from flows.inputs import context_problems, input_problems, is_demo, logged_prompts, train_and_eval_data
from flows.lineage import AVAILABLE_STAGES, StageName, StageRecord, cache_key, reused_record, upstream_runs
from flows.reports import (STAGE_SECONDS, RolloutGold, finish, log_overhead, pipeline_summary, ppo_report,
                           reward_report)
from rlhf import tracking
from rlhf.config import ConfigError, PipelineConfig, config_hash, flatten, load_config
from rlhf.demo_locations import DemoWorldConfig, resolve_location
from rlhf.demo_world import build_world
from schemas.errors import DataContractError
from stages.distributed import LaunchError, call_stage
from stages.errors import RewardGateError, StageUserError
from stages.models import load_tokenizer, set_determinism
from stages.reporting import Reporting

POLICY_MODEL_NAME = "rlhf-policy"
"""MLflow Model Registry name under which every PPO policy is registered."""


class UpstreamRuns(BaseModel):
    """MLflow run ids of upstream stages for single-stage reruns; empty means the latest finished run."""

    sft_run_id: str | None = Field(None, description="SFT run whose checkpoint later stages start from.")
    reward_run_id: str | None = Field(None, description="Reward run whose model PPO optimises against.")


@dataclass(frozen=True)
class StageContext:
    """What a stage task gets from the flow."""

    config: PipelineConfig
    world: str | None
    experiment_id: str
    parent_run_id: str
    upstream: dict[str, str]
    """Run id of each upstream stage, by stage name."""
    cache_key: str
    """Identity of the stage's work: see `flows.lineage.cache_key`."""

    def call(self, train, section, inputs, scratch: Path, reporting: Reporting):
        """The stage function on the processes its config asks for, as this process set itself up."""
        return call_stage(train, section, inputs, scratch, reporting, deterministic=self.config.deterministic,
                          num_threads=self.config.num_threads)


class StageRefused(Exception):
    """A stage cannot start (no upstream run to start from); the flow run fails with this message."""


class StageFailed(Exception):
    """A stage task ended failed (its task has logged why); the flow run fails with this message."""


def refuse(message: str) -> State:
    """A user error (bad data, bad config, a failed gate): logged as the message alone, without a
    traceback, and with any secret in it (a password in a URI, a token) redacted."""
    message = tracking.redact(message)
    get_run_logger().error(message)
    return Failed(message=message)


@task(retries=1, retry_delay_seconds=5)
def build_demo_world(demo: DemoWorldConfig) -> str:
    """Build (or reuse) the embedded demo world; returns its folder."""
    return str(build_world(tracking.state_dir() / "worlds", demo))


@contextmanager
def stage_run(stage: str, section: BaseModel, ctx: StageContext) -> Iterator[tuple[str, Path, tracking.MetricWriter]]:
    """A child MLflow run with the stage's config as params and lineage tags, active inside the
    block, the work folder keyed by the cache key (removed only when the block succeeds), and the
    run's background metric writer (drained before the run can end FINISHED).

    An exception leaves the run FAILED and the folder with whatever the stage wrote, so a rerun
    resumes from it. When the tracking server stopped answering, the error says so and where the
    work is kept; the run then stays unfinished, never FINISHED.
    """
    version, commit = tracking.code_version()
    tags = {tracking.TAG_CONFIG_HASH: config_hash(section), tracking.TAG_CODE_VERSION: version,
            tracking.TAG_GIT_COMMIT: commit, tracking.TAG_CACHE_KEY: ctx.cache_key}
    tags |= {tracking.TAG_UPSTREAM + name: run_id for name, run_id in ctx.upstream.items()}
    with tracking.claimed_workdir(f"{stage}-{ctx.cache_key[:16]}") as workdir:
        try:
            run_id = tracking.create_stage_run(ctx.experiment_id, ctx.parent_run_id, stage, tags)
            if workdir.owned:
                for abandoned in tracking.close_abandoned_runs(ctx.experiment_id, stage, ctx.cache_key, run_id):
                    get_run_logger().warning("%s: run %s of an interrupted attempt marked KILLED; this run "
                                             "continues its work from %s", stage, abandoned, workdir.path)
            with mlflow.start_run(run_id=run_id):
                mlflow.log_params(tracking.redacted(flatten(section)))
                metrics = tracking.MetricWriter(run_id)
                try:
                    yield run_id, workdir.path, metrics
                except BaseException:
                    metrics.close_after_failure()
                    raise
                metrics.close()
        except (DataContractError, tracking.TrackingError):
            raise
        except Exception as e:
            if tracking.server_answers():
                raise
            raise tracking.TrackingError(
                f"stage {stage}: the MLflow tracking server {mlflow.get_tracking_uri()} stopped answering "
                f"({type(e).__name__}); the stage's local work is kept in {workdir.path} and a rerun "
                f"resumes from it") from e


# --- stage tasks ----------------------------------------------------------------------------


@task
def sft(ctx: StageContext) -> StageRecord | State:
    """Validate demonstrations, fine-tune the base model, log everything to a child run."""
    from stages.sft import SFTInputs, train_sft  # here: the training libraries take seconds to import

    section = ctx.config.sft
    model_location = resolve_location(section.model, ctx.world)
    try:
        with stage_run("sft", section, ctx) as (run_id, scratch, metrics_writer):
            mlflow.set_tag("rlhf.base_model", tracking.redact(section.model))
            tokenizer = load_tokenizer(model_location, trust_remote_code=section.trust_remote_code,
                                       chat_template=section.chat_template)
            train, evaluation = train_and_eval_data(ctx.config, "sft", ctx.world, tokenizer)
            started = time.perf_counter()
            result = ctx.call(train_sft, section, SFTInputs(model_location, train.frame, evaluation.frame), scratch,
                              Reporting(metrics=metrics_writer.log))
            metrics = result.metrics | {STAGE_SECONDS: time.perf_counter() - started}
            mlflow.set_tags(result.tags)
            mlflow.log_table(pd.DataFrame(result.samples), "samples.json")
            return finish("sft", run_id, section, train, metrics, result.checkpoint, result.samples,
                          int(result.metrics["train/steps"]))
    except DataContractError as e:
        return refuse(e.report())
    except (LaunchError, tracking.TrackingError) as e:
        return refuse(str(e))


@task
def reward(ctx: StageContext) -> StageRecord | State:
    """Train the reward model from the upstream SFT checkpoint (downloaded through MLflow)."""
    from stages.reward import RewardInputs, train_reward

    section = ctx.config.reward
    try:
        with stage_run("reward", section, ctx) as (run_id, scratch, metrics_writer):
            policy_location = str(tracking.download_checkpoint(ctx.upstream["sft"], scratch / "sft"))
            model_location = resolve_location(section.model, ctx.world) if section.model else policy_location
            mlflow.set_tag("rlhf.base_model", tracking.redact(section.model or f"runs:/{ctx.upstream['sft']}/checkpoint"))
            tokenizer = load_tokenizer(model_location, trust_remote_code=section.trust_remote_code,
                                       chat_template=section.chat_template)
            train, evaluation = train_and_eval_data(ctx.config, "reward", ctx.world, tokenizer)
            prompts = logged_prompts(ctx.config, "reward", "normalization", "normalization-prompts", ctx.world,
                                     load_tokenizer(policy_location))
            started = time.perf_counter()
            try:
                result = ctx.call(train_reward, section, RewardInputs(model_location, policy_location, train.frame,
                                                                       evaluation.frame, prompts.frame),
                                  scratch, Reporting(metrics=metrics_writer.log))
            except RewardGateError as gate:
                mlflow.log_metrics(gate.metrics)
                raise
            metrics = result.metrics | {STAGE_SECONDS: time.perf_counter() - started}
            mlflow.set_tags(result.tags)
            demo = is_demo(section.eval_data) or (section.eval_data is None and is_demo(section.train_data))
            samples = reward_report(result, metrics, section.num_table_rows, demo)
            return finish("reward", run_id, section, train, metrics, result.checkpoint, samples,
                          int(metrics["train/steps"]))
    except DataContractError as e:
        return refuse(e.report())
    except (StageUserError, LaunchError, tracking.TrackingError) as e:
        return refuse(str(e))


@task
def ppo(ctx: StageContext) -> StageRecord | State:
    """PPO from the upstream SFT policy against the upstream reward model, both fetched through MLflow."""
    from stages.ppo import PPOInputs, train_ppo

    section = ctx.config.ppo
    logger = get_run_logger()
    try:
        with stage_run("ppo", section, ctx) as (run_id, scratch, metrics_writer):
            sft_location = str(tracking.download_checkpoint(ctx.upstream["sft"], scratch / "sft"))
            reward_location = str(tracking.download_checkpoint(ctx.upstream["reward"], scratch / "reward"))
            tokenizer = load_tokenizer(sft_location, trust_remote_code=section.trust_remote_code)
            train = logged_prompts(ctx.config, "ppo", "prompts", "prompts", ctx.world, tokenizer)
            evaluation = logged_prompts(ctx.config, "ppo", "eval_prompts", "eval-prompts", ctx.world, tokenizer)
            mlflow.set_tag(tracking.TAG_DATA_DIGEST, train.digest)
            warnings: list[str] = []

            def warn(message: str) -> None:
                warnings.append(message)
                logger.warning(message)

            gold = RolloutGold(scratch, metrics_writer.log) if is_demo(section.prompts) else None
            reporting = Reporting(metrics=metrics_writer.log, warning=warn,
                                  samples=lambda table, i: mlflow.log_table(table, f"samples/iteration_{i:05d}.json"),
                                  **({"rollouts": gold.judge} if gold else {}))
            started = time.perf_counter()
            result = ctx.call(train_ppo, section, PPOInputs(sft_location, reward_location, train.frame,
                                                             evaluation.frame), scratch, reporting)
            metrics = result.metrics | {STAGE_SECONDS: time.perf_counter() - started}
            mlflow.set_tags(result.tags)
            samples = ppo_report(result, metrics, warnings, gold, demo_evaluation=is_demo(section.eval_prompts))
            record = finish("ppo", run_id, section, train, metrics, result.checkpoint, samples,
                            int(metrics["train/iterations"]))
            version = tracking.register_checkpoint(run_id, POLICY_MODEL_NAME)
            mlflow.set_tag("rlhf.registered_model", f"{POLICY_MODEL_NAME}/{version}")
            return record
    except DataContractError as e:
        return refuse(e.report())
    except (StageUserError, LaunchError, tracking.TrackingError) as e:
        return refuse(str(e))


@task
def check_inputs(cfg: PipelineConfig, stages: list[str], world: str | None) -> list[str]:
    """Validate every data source the run's stages will read, before any stage trains: a bad file
    for PPO is refused before SFT and reward spend their compute. Returns one report per bad source."""
    return input_problems(cfg, stages, world)


# --- the flow -----------------------------------------------------------------------------------


@flow(name="rlhf")
def rlhf(
    stages: list[StageName] = list(AVAILABLE_STAGES),
    config_file: str = "configs/demo.yaml",
    overrides: dict[str, Any] = {},
    upstream: UpstreamRuns = UpstreamRuns(),
    use_cache: bool = True,
) -> list[StageRecord] | State:
    """Run the named RLHF stages in pipeline order, as children of one MLflow pipeline run.

    `config_file` is a YAML config (relative to the repository); `overrides` sets single
    fields by dotted name, e.g. {"sft.learning_rate": 3e-4}. A stage run alone starts from
    `upstream` run ids, or from the latest finished run of each upstream stage. With
    `use_cache`, a stage whose cache key matches a finished run is not run again: that run is reused.
    """
    logger = get_run_logger()
    missing = [s for s in stages if s not in AVAILABLE_STAGES]
    if missing:
        return refuse(f"stage(s) {', '.join(missing)} not available in this version; available: {', '.join(AVAILABLE_STAGES)}")
    try:
        cfg = load_config(config_file, overrides)
    except ConfigError as e:
        return refuse(str(e))
    ordered = [s for s in AVAILABLE_STAGES if s in stages]
    set_determinism(cfg.deterministic, cfg.num_threads)
    world = build_demo_world(cfg.demo) if cfg.demo is not None else None
    too_long = context_problems(cfg, ordered, world)
    if too_long:
        return refuse("invalid config:\n" + "\n".join(f"  {problem}" for problem in too_long))
    bad_inputs = check_inputs(cfg, ordered, world)
    if bad_inputs:
        return refuse("\n\n".join(bad_inputs))
    try:
        tracking.wait_for_server(log=logger.warning)
        return _run_stages(cfg, ordered, config_file, overrides, upstream, use_cache, world)
    except tracking.TrackingError as e:
        return refuse(str(e))
    except Exception as e:
        if tracking.server_answers():
            raise
        return refuse(f"the MLflow tracking server {mlflow.get_tracking_uri()} stopped answering "
                      f"({type(e).__name__}: {str(e)[:300]}); rerun when it is back: finished stages are reused")


def _run_stages(cfg: PipelineConfig, ordered: list[StageName], config_file: str, overrides: dict[str, Any],
                upstream: UpstreamRuns, use_cache: bool, world: str | None) -> list[StageRecord] | State:
    """The stages in pipeline order under one MLflow pipeline run: each starts from the records
    of the stages before it (or the given upstream runs) and is reused from cache or run as a task."""
    logger = get_run_logger()
    experiment_id = tracking.ensure_experiment(cfg.experiment)
    version, commit = tracking.code_version()
    parent_run_id = tracking.start_pipeline_run(experiment_id, {
        "rlhf.stages": ",".join(ordered), "rlhf.config_file": config_file, "rlhf.overrides": json.dumps(overrides),
        tracking.TAG_CONFIG_HASH: config_hash(cfg), tracking.TAG_CODE_VERSION: version,
        tracking.TAG_GIT_COMMIT: commit, tracking.TAG_PREFECT_FLOW_RUN: str(get_run_context().flow_run.id),
    })
    logger.info("MLflow pipeline run %s", tracking.run_url(parent_run_id) or parent_run_id)
    given = {"sft": upstream.sft_run_id, "reward": upstream.reward_run_id}
    records: dict[str, StageRecord] = {}

    def run_or_reuse(name: StageName, stage_task) -> StageRecord:
        try:
            upstream_ids = upstream_runs(name, records, given, cfg.experiment)
        except LookupError as e:
            raise StageRefused(str(e)) from e
        key = cache_key(name, cfg, world, upstream_ids)
        cached = tracking.latest_finished_run(cfg.experiment, name, key) if use_cache else None
        if cached is not None:
            MlflowClient().set_tag(parent_run_id, tracking.TAG_REUSED + name, cached.info.run_id)
            logger.info("%s: reusing finished run %s (same config, data, code and upstream runs)", name,
                        cached.info.run_id)
            return reused_record(name, cached)
        state = stage_task(StageContext(cfg, world, experiment_id, parent_run_id, upstream_ids, key), return_state=True)
        if not state.is_completed():
            raise StageFailed(f"stage {name} failed: {state.message}")
        record = state.result()
        logger.info("%s run %s: %s", name, record.run_id, ", ".join(f"{k}={v:.4g}" for k, v in sorted(record.metrics.items())))
        return record

    ok = False
    try:
        if "sft" in ordered:
            records["sft"] = run_or_reuse("sft", sft)
        if "reward" in ordered:
            records["reward"] = run_or_reuse("reward", reward)
        if "ppo" in ordered:
            records["ppo"] = run_or_reuse("ppo", ppo)
        ok = True
        log_overhead(parent_run_id, [r for r in records.values() if not r.reused])
        pipeline_summary(list(records.values()))
        return list(records.values())
    except StageRefused as e:
        return refuse(str(e))
    except StageFailed as e:
        return Failed(message=str(e))
    finally:
        try:
            tracking.end_run(parent_run_id, ok)
        except Exception as e:  # the server is gone; the error that brought us here is the one to report
            logger.warning("could not mark pipeline run %s %s: %s", parent_run_id, "FINISHED" if ok else "FAILED",
                           type(e).__name__)
