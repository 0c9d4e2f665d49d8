"""One wrapper for every stage task: its MLflow run, the stage call, its timing and tags, the
finished record, the registry, and one set of error handlers.

A stage task in `flows.pipeline` only says what is particular to its stage: inside the run it
fetches the stage's inputs (validated data, upstream checkpoints through MLflow) and returns a
`StageJob`, the stage call with how to report its result; `run_stage` does the rest the same
way for every stage.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import get_run_context
from prefect.states import Failed, State
from pydantic import BaseModel

from flows.records.journal import RunJournal, send_leftovers
from flows.records.lineage import StageRecord, Teacher, stack_tags
from flows.records.reports import (
    STAGE_SECONDS,
    Progress,
    lineage_note,
    stage_note,
    stage_summary,
)
from rlhf import stack, tracking
from rlhf.config import PipelineConfig, config_hash, flatten, param_value
from rlhf.sections.base import StageName
from schemas.errors import DataContractError
from schemas.validate import ValidatedData
from stages.common.errors import RewardGateError, StageUserError
from stages.common.reporting import Reporting
from stages.launch.call import Determinism, call_stage
from stages.launch.job import LaunchError
from stages.memory.plan import Plan, plan_table
from stages.memory.shapes import GIB
from stages.rewards.functions import source_digests
from stages.runtime.models import folder_digest

SYSTEM_METRICS_INTERVAL_S = 5.0
"""Seconds between samples of a stage run's system metrics (`system/cpu_utilization_percentage`, ...)."""


@dataclass(frozen=True)
class StageMemory:
    """A stage's memory plan as its run logs it."""

    figures: dict[str, float]
    """`plan/predicted_peak_gib` (per process), `plan/state_gib` (weights, gradients, optimizer), `plan/fits`
    (1 or 0)."""
    table: str
    """The plan in Markdown (`memory_plan.md` on the run)."""


def stage_memory(result: Plan, stage: str) -> StageMemory:
    planned = result.stages[stage]
    return StageMemory({"plan/predicted_peak_gib": planned.peak / GIB, "plan/state_gib": planned.state_bytes() / GIB,
                        "plan/fits": float(result.verdicts[stage])},
                       plan_table(Plan(device=result.device, stages={stage: planned},
                                       verdicts={stage: result.verdicts[stage]},
                                       fixes={stage: result.fixes.get(stage, [])},
                                       micro_batches={stage: result.micro_batches.get(stage, {})})))


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
    """Identity of the stage's work: see `flows.records.lineage.cache_key`."""
    work_key: str
    """The same without the stack: see `flows.records.lineage.stage_keys`."""
    label: str
    """The Prefect flow run's name (`super-earwig`): every MLflow run of this pipeline run carries it."""
    flow_run_url: str | None
    """The Prefect flow run in the Prefect UI."""
    memory: StageMemory | None = None
    """What the memory plan predicted for this stage (logged on its run beside the measured peak)."""
    lineage: str = ""
    """Which upstream runs the stage starts from and why (`flows.records.lineage.Upstream.describe`), for its
    description."""
    teacher: Teacher | None = None
    """PPO's distillation teacher as the flow resolved it, once for the pipeline run: what the stage's cache key
    names and its task fetches."""

    def links(self) -> dict[str, str | None]:
        """Where a stage run's description points: its pipeline run, its upstream runs, the Prefect flow run."""
        return ({"pipeline run": tracking.run_url(self.parent_run_id)}
                | {f"upstream {name} run": tracking.run_url(run_id) for name, run_id in self.upstream.items()}
                | {"Prefect flow run": self.flow_run_url})

    def call(self, train, section, inputs, scratch: Path, reporting: Reporting):
        """The stage function on the processes its config asks for, as this process set itself up."""
        return call_stage(train, section, inputs, scratch, reporting,
                          Determinism(self.config.deterministic, self.config.num_threads))


def finish(run: StageRun, ctx: StageContext, data: ValidatedData, metrics: dict[str, float], checkpoint: Path,
           samples: list[dict[str, str]]) -> StageRecord:
    """Log final metrics (at the last step or iteration) and the checkpoint inside the active run,
    describe the run (its note: headline figures, the upstream runs it started from and why, its
    warnings, its links), publish the Prefect summary. `samples`: what the user said last and the response."""
    stage, run_id, warnings, section = run.stage, run.run_id, run.warnings, getattr(ctx.config, run.stage)
    last_step = int(metrics[f"train/{run.progress.unit}s"])
    # At the last training step, so these (and not a trainer's running average of the same name)
    # are what MLflow shows as each metric's latest value.
    mlflow.log_metrics(metrics, step=last_step)
    checkpoint_digest = folder_digest(checkpoint)
    mlflow.set_tag(tracking.TAG_CHECKPOINT_DIGEST, checkpoint_digest)
    try:
        mlflow.log_artifacts(str(checkpoint), tracking.CHECKPOINT_PATH)
    except Exception as e:
        raise tracking.TrackingError(
            f"stage {stage}: uploading the checkpoint to {mlflow.get_artifact_uri(tracking.CHECKPOINT_PATH)} failed "
            f"after retries ({type(e).__name__}: {str(e)[:300]}); the run is not marked finished and the checkpoint "
            f"is kept in {checkpoint} until a rerun uploads it") from e
    mlflow.set_tag(tracking.TAG_WARNINGS, str(len(warnings)))
    tracking.set_note(run_id, stage_note(stage, metrics, warnings, ctx.links(), ctx.lineage))
    create_markdown_artifact(key=f"{stage}-summary", markdown=stage_summary(stage, run_id, metrics, warnings, samples),
                             description=f"{stage} stage results")
    return StageRecord(stage=stage, run_id=run_id, checkpoint_uri=f"runs:/{run_id}/{tracking.CHECKPOINT_PATH}",
                       config_hash=config_hash(section), data_digest=data.digest,
                       checkpoint_digest=checkpoint_digest, metrics=metrics, warnings=len(warnings))


SERVER_UNREACHABLE = "ServerUnreachable"
"""The name of a stage task's Failed state when the tracking server stopped answering for longer than the
stage waits (`outage_limit_s`): the one failure the stage tasks retry."""


def refuse(message: str, server_unreachable: bool = False) -> State:
    """A user error (bad data, bad config, a failed gate), or a server gone: logged as the message alone,
    without a traceback, and with any secret in it (a password in a URI, a token) redacted."""
    message = tracking.redact(message)
    get_run_logger().error(message)
    return Failed(message=message, name=SERVER_UNREACHABLE if server_unreachable else "Failed")


def retried_on_outage(task, task_run, state: State) -> bool:
    """The stage tasks' `retry_condition_fn`: a server that stopped answering is retried, a user error
    (bad data, a bad reward function, a failed gate) or a bug is not."""
    return state.name == SERVER_UNREACHABLE


def is_outage(error: tracking.TrackingError) -> bool:
    """Whether a stage's tracking error is an outage, which its task retries. A server that stopped
    answering is one even if it answers again by the time the failure is handled (closing the run may
    outlast a short outage); another error (a refused upload) is one only while the server is away."""
    return isinstance(error, tracking.ServerGone) or not tracking.server_answers(timeout=2.0)


STAGE_RETRIES = {"retries": 2, "retry_delay_seconds": [30, 120], "retry_condition_fn": retried_on_outage}
"""The stage tasks' retries (`@task(**STAGE_RETRIES)`): a `SERVER_UNREACHABLE` failure only, twice; each
retry resumes from the stage's checkpoint."""


@dataclass
class StageRun:
    """A stage's open MLflow run, as its task uses it."""

    stage: StageName
    run_id: str
    scratch: Path
    """The work folder, keyed by the cache key: an interrupted attempt's checkpoints are found here again."""
    journal: RunJournal
    """What the run logs while the stage trains, kept on disk and sent in order (`flows.records.journal`)."""
    progress: Progress
    warnings: list[str]

    def warn(self, message: str) -> None:
        """A stage's warning, redacted (a URL's password, a token), to the Prefect log and the run's warnings."""
        message = tracking.redact(message)
        self.warnings.append(message)
        get_run_logger().warning(message)

    def reporting(self, **callbacks) -> Reporting:
        """The stage's `Reporting`: metrics and the settings it chose to MLflow (through the journal),
        warnings to the log and the run's description, progress to Prefect; `callbacks` adds the stage's own."""
        return Reporting(metrics=self.log, warning=self.warn, progress=self.progress, params=self.params,
                         **callbacks)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.journal.log(metrics, step)
        self._report_gaps()

    def flush(self) -> None:
        """Everything logged so far on the server, through an outage up to the limit (`RunJournal.flush`)."""
        self.journal.flush()
        self._report_gaps()

    def _report_gaps(self) -> None:
        """A warning (the log, the run's description) and a progress event for each gap that ended."""
        for gap in self.journal.new_gaps():
            text = f"the MLflow tracking server did not answer for {gap.describe()}"
            self.warn(f"{text}; the stage trained on, and what it logged meanwhile was written when it answered")
            self.progress.event(text)

    def params(self, values: dict) -> None:
        self.journal.params({name: param_value(value) for name, value in values.items()})

    def table(self, frame, artifact_file: str) -> None:
        """`mlflow.log_table` while the stage trains, through the journal."""
        self.journal.table(frame, artifact_file)


@contextmanager
def active_run(run_id: str) -> Iterator[None]:
    """`mlflow.start_run` for a stage's run, sampling system metrics: the run ends FINISHED after the
    block, FAILED when it raises. When the server is away as a failed block ends, the run stays RUNNING
    (the retry or rerun marks it KILLED) and the block's own error is raised, not the server's."""
    mlflow.set_system_metrics_sampling_interval(SYSTEM_METRICS_INTERVAL_S)
    mlflow.start_run(run_id=run_id, log_system_metrics=True)
    try:
        yield
    except BaseException:
        _end_run(run_id, "FAILED", quietly=True)
        raise
    _end_run(run_id, "FINISHED", quietly=False)


def _end_run(run_id: str, status: str, quietly: bool) -> None:
    """`mlflow.end_run`; where the server does not take it, the run's system-metrics sampler is
    stopped all the same (mlflow leaves it running then), and the error raised unless `quietly`."""
    from mlflow.tracking.fluent import run_id_to_system_metrics_monitor

    try:
        mlflow.end_run(status)
    except Exception:
        monitor = run_id_to_system_metrics_monitor.pop(run_id, None)
        if monitor is not None:
            monitor.finish()
        if not quietly:
            raise


@contextmanager
def stage_run(stage: StageName, section: BaseModel, ctx: StageContext, unit: str) -> Iterator[StageRun]:
    """A child MLflow run named `<stage> · <flow run>`, with the stage's config as params, lineage
    tags and system metrics (CPU, memory; GPU where present), active inside the block; the work
    folder keyed by the cache key (removed only when the block succeeds); a Prefect progress
    artifact counting `unit`s; and the run's background metric writer (drained before the run can
    end FINISHED).

    An exception leaves the run FAILED and the folder with whatever the stage wrote, so a rerun
    resumes from it. When the tracking server stopped answering, the error says so and where the
    work is kept; the run then stays unfinished, never FINISHED.
    """
    version, commit = tracking.code_version()
    tags = {tracking.TAG_CONFIG_HASH: config_hash(section), tracking.TAG_CODE_VERSION: version,
            tracking.TAG_GIT_COMMIT: commit, tracking.TAG_TREE: tracking.tree_state(commit),
            tracking.TAG_CACHE_KEY: ctx.cache_key, tracking.TAG_WORK_KEY: ctx.work_key,
            tracking.TAG_PREFECT_FLOW_RUN: str(get_run_context().task_run.flow_run_id)}
    tags |= {tracking.TAG_UPSTREAM + name: run_id for name, run_id in ctx.upstream.items()}
    tags |= stack_tags(stage, ctx.config)
    with tracking.claimed_workdir(f"{stage}-{ctx.cache_key[:16]}") as workdir:
        for earlier in send_leftovers(workdir.path / "journal"):  # nothing an interrupted attempt logged is lost
            get_run_logger().info("%s: sent what run %s logged while the tracking server was away", stage, earlier)
        try:
            run_id = tracking.create_stage_run(ctx.experiment_id, ctx.parent_run_id, stage, f"{stage} · {ctx.label}",
                                               tags)
            if ctx.lineage:  # until `finish` writes the whole description; a failed run keeps this
                tracking.set_note(run_id, lineage_note(ctx.lineage))
            if workdir.owned:
                for abandoned in tracking.close_abandoned_runs(ctx.experiment_id, stage, ctx.cache_key, run_id):
                    get_run_logger().warning("%s: run %s of an interrupted attempt marked KILLED; this run "
                                             "continues its work from %s", stage, abandoned, workdir.path)
            with active_run(run_id):
                mlflow.log_params(tracking.redacted(flatten(section)))
                mlflow.log_text(stack.freeze(), tracking.ENVIRONMENT_PATH)
                if ctx.memory is not None:
                    mlflow.log_metrics(ctx.memory.figures, step=0)
                    mlflow.log_text(ctx.memory.table, "memory_plan.md")
                journal = RunJournal(run_id, workdir.path / "journal", ctx.config.outage_limit_s)
                run = StageRun(stage, run_id, workdir.path, journal, Progress(stage, unit), [])
                try:
                    yield run
                except BaseException:
                    journal.close_after_failure()
                    run.progress.close()
                    raise
                journal.close()
                run.progress.close()
        except (DataContractError, tracking.TrackingError):
            raise
        except Exception as e:
            if tracking.server_answers():
                raise
            raise tracking.ServerGone(
                f"stage {stage}: the MLflow tracking server {mlflow.get_tracking_uri()} stopped answering "
                f"({type(e).__name__}); the stage's local work is kept in {workdir.path} and a rerun "
                f"resumes from it") from e

@dataclass(frozen=True)
class StageJob:
    """What a stage task prepares inside its run: the stage call, and how to report its result."""

    train: Callable
    """The stage function, `train_<stage>(cfg, inputs, output_dir, reporting)`."""
    inputs: Any
    """Its typed inputs (`SFTInputs`, ...)."""
    data: ValidatedData
    """The training data: its digest goes into the stage's record."""
    reporting: Reporting
    report: Callable[[Any, dict[str, float]], list[dict[str, str]]]
    """Logs what the stage produced besides its metrics, given its result and final metrics; returns
    the samples its summary shows (what the user said last, and the response)."""
    registered_on: str | None = None
    """The held-out prompts' digest a policy is registered under (PPO, DPO); None: nothing to register."""


def run_stage(stage: StageName, ctx: StageContext, unit: str,
              prepare: Callable[[StageRun], StageJob]) -> StageRecord | State:
    """The stage's task body: its run (`stage_run`), `prepare` inside it, the stage called on the
    processes its config asks for and timed (`time/stage_seconds`), its tags, report and `finish`,
    the policy registered when `prepare` says so and the config allows. A user error (bad data, a
    failed gate, a failed launch, the tracking server gone) fails the task with its message alone."""
    section = getattr(ctx.config, stage)
    try:
        with stage_run(stage, section, ctx, unit) as run:
            job = prepare(run)
            started = time.perf_counter()
            try:
                result = ctx.call(job.train, section, job.inputs, run.scratch, job.reporting)
            except RewardGateError as gate:
                mlflow.log_metrics(gate.metrics)
                raise
            metrics = result.metrics | {STAGE_SECONDS: time.perf_counter() - started}
            run.flush()  # through an outage up to the limit: what follows talks to the server directly
            mlflow.set_tags(result.tags)
            samples = job.report(result, metrics)
            record = finish(run, ctx, job.data, metrics, result.checkpoint, samples)
            if job.registered_on is not None and ctx.config.registry.enabled:
                register(ctx, stage, run.run_id, result.checkpoint, metrics, job.registered_on)
            return record
    except DataContractError as e:
        return refuse(e.report())
    except tracking.TrackingError as e:
        return refuse(str(e), server_unreachable=is_outage(e))
    except (StageUserError, LaunchError) as e:
        return refuse(str(e))


def register(ctx: StageContext, method: StageName, run_id: str, checkpoint: Path, metrics: dict[str, float],
             eval_digest: str) -> None:
    """The policy `method` (ppo, dpo) made as a new version of the registry's model, tagged with how
    it was made and judged; the champion alias moves to it only when it beats the holder on the
    same evaluation."""
    registry, section = ctx.config.registry, getattr(ctx.config, method)
    figure = next((f for f in ("eval/gold_win_rate", "eval/win_rate_rm", "eval/win_rate_reward") if f in metrics),
                  "eval/win_rate_rm")
    # What the win rate was measured on: the same held-out prompts, sampling and SFT baseline, and
    # the same judge, so two versions with equal keys have comparable figures whatever method made
    # them. The gold function judges alike for every version; a reward model's judgement depends
    # on the reward run and the precision it scores in.
    # Under the names the settings had before they moved into sections, so keys made before stay comparable.
    judged_on = {"eval_prompts": eval_digest, "sft": ctx.upstream["sft"], "eval_seed": section.evaluation.seed,
                 "eval_samples_per_prompt": section.evaluation.samples_per_prompt,
                 "response_length": section.sampling.response_length, "temperature": section.sampling.temperature}
    if figure == "eval/win_rate_rm" and method == "ppo":  # DPO has no reward model to judge by
        judged_on |= {"reward": ctx.upstream["reward"]} | {
            name: getattr(section, name) for name in ("missing_eos_score", "precision", "frozen_dtype")}
    if figure == "eval/win_rate_reward":  # judged by the reward functions: their weights and their source
        judged_on |= {"reward_terms": [t.model_dump() for t in section.reward.terms],
                      "reward_functions": source_digests(section)}
    evaluation_key = hashlib.sha256(json.dumps(judged_on, sort_keys=True).encode()).hexdigest()
    tags = {"rlhf.method": method_name(ctx.config, method), tracking.TAG_PIPELINE: ctx.parent_run_id,
            tracking.TAG_CONFIG_HASH: config_hash(section),
            **{tracking.TAG_UPSTREAM + name: run for name, run in ctx.upstream.items()},
            **{key: f"{value:.6g}" for key, value in metrics.items() if key.startswith("eval/")}}
    registration = tracking.register_policy(run_id, checkpoint, registry.model_name, registry.champion_alias, tags,
                                            evaluation_key, figure, metrics.get(figure, float("nan")))
    mlflow.set_tag(tracking.TAG_REGISTERED_MODEL, f"{registry.model_name}/{registration.version}")
    get_run_logger().info("registered %s version %s; %s", registry.model_name, registration.version,
                          registration.reason)


def method_name(cfg: PipelineConfig, stage: StageName) -> str:
    """How a policy was made, as the registry tags it: `dpo`, `ppo`, or PPO's critic-free estimator (`ppo-grpo`)."""
    if stage == "ppo" and cfg.ppo.advantage_estimator != "gae":
        return f"ppo-{cfg.ppo.advantage_estimator}"
    return stage
