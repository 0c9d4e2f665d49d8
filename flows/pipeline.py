"""The `rlhf` Prefect flow: wires stages to MLflow. No training math lives here.

Each task fetches what its stage needs (validated data, upstream checkpoints through MLflow
artifacts), calls the stage, logs what it produced, and returns a small `StageRecord`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import mlflow
import pandas as pd
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.context import get_run_context
from prefect.states import Failed, State
from pydantic import BaseModel, Field

from rlhf import tracking
from rlhf.config import ConfigError, DataSource, PipelineConfig, TrainingConfig, config_hash, flatten, load_config
from rlhf.demo_world import (DEMO_SCHEME, DemoWorldConfig, build_world, gold_accuracy, gold_comparison,
                              last_user_turns, mean_gold_reward, resolve_location)
from schemas.errors import DataContractError
from schemas.validate import LengthBudget, ValidatedData, data_digest, load_validated
from stages.distributed import LaunchError, Reporting, call_stage
from stages.errors import ChatTemplateError, NonFiniteLossError, RewardGateError
from stages.models import folder_digest, load_tokenizer, set_determinism, tokenizer_digest

StageName = Literal["sft", "reward", "ppo"]
AVAILABLE_STAGES: tuple[StageName, ...] = ("sft", "reward", "ppo")
"""Stages in pipeline order."""
POLICY_MODEL_NAME = "rlhf-policy"
"""MLflow Model Registry name under which every PPO policy is registered."""
UPSTREAM: dict[str, tuple[str, ...]] = {"sft": (), "reward": ("sft",), "ppo": ("sft", "reward")}
STAGE_SECONDS = "time/stage_seconds"
"""Metric: wall time of the stage's own work (training, evaluation, samples), without the wiring around it."""


class UpstreamRuns(BaseModel):
    """MLflow run ids of upstream stages for single-stage reruns; empty means the latest finished run."""

    sft_run_id: str | None = Field(None, description="SFT run whose checkpoint later stages start from.")
    reward_run_id: str | None = Field(None, description="Reward run whose model PPO optimises against.")


class StageRecord(BaseModel):
    """What a stage task hands back: identities and figures, never a model."""

    stage: StageName
    run_id: str
    checkpoint_uri: str
    config_hash: str
    data_digest: str
    checkpoint_digest: str
    metrics: dict[str, float]
    reused: bool = False
    """True when an earlier finished run with the same cache key stood in for this stage."""


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
    """Identity of the stage's work: see `cache_key`."""

    @property
    def determinism(self) -> dict[str, Any]:
        """What a stage launched on several processes needs to set up as this process did."""
        return {"deterministic": self.config.deterministic, "num_threads": self.config.num_threads}


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


# --- the skeleton every stage task shares ---------------------------------------------------


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


_VALIDATED: dict[str, ValidatedData] = {}
"""Validation results of this process by what decides them, so the stage's own check of a file
the pre-flight check already passed with the same tokenizer costs nothing."""


def validated(source: DataSource, kind: str, world: str | None, tokenizer, budget: LengthBudget,
              duplicates: str) -> ValidatedData:
    """`load_validated` of a configured source, answered from `_VALIDATED` (as a copy) when the
    same file content, tokenizer content and rules were validated before in this process."""
    location = resolve_location(source.path, world)

    def validate() -> ValidatedData:
        return load_validated(location, kind, format=source.format, split=source.split, tokenizer=tokenizer,
                              budget=budget, duplicates=duplicates)

    content, rendering = _source_fingerprint(location), tokenizer_digest(tokenizer)
    if content.startswith("name:") or rendering is None:  # a hub dataset or a slow tokenizer: not identifiable
        return validate()
    key = json.dumps([location, content, kind, source.format, source.split, rendering, astuple(budget), duplicates])
    if key not in _VALIDATED:
        _VALIDATED[key] = validate()
        while len(_VALIDATED) > 32:
            _VALIDATED.pop(next(iter(_VALIDATED)))
    data = _VALIDATED[key]
    return replace(data, frame=data.frame.copy())


def train_and_eval_data(section: TrainingConfig, kind: str, world: str | None, tokenizer) -> tuple[ValidatedData, ValidatedData]:
    """Validated train and eval data, logged to the active run; eval is split off train when the config names none."""
    budget = LengthBudget(section.max_prompt_length, section.max_length)
    train = validated(section.train_data, kind, world, tokenizer, budget, section.duplicates)
    if section.eval_data is not None:
        evaluation = validated(section.eval_data, kind, world, tokenizer, budget, section.duplicates)
    else:
        held_out = train.frame.sample(frac=section.eval_fraction, random_state=section.seed)
        kept = train.frame.drop(index=held_out.index)
        evaluation = ValidatedData(held_out, f"{train.source} (eval split)", kind, train.format, data_digest(held_out))
        train = ValidatedData(kept, f"{train.source} (train split)", kind, train.format, data_digest(kept))
    mlflow.set_tag(tracking.TAG_DATA_DIGEST, train.digest)
    for name, data in (("train", train), ("eval", evaluation)):
        tracking.log_data(data.frame, f"{kind}-{name}", data.source, data.digest, name)
    return train, evaluation


def finish(stage: StageName, run_id: str, section: BaseModel, data: ValidatedData, metrics: dict[str, float],
           checkpoint: Path, samples: list[dict[str, str]], last_step: int) -> StageRecord:
    """Log final metrics and the checkpoint (inside the active run), publish the Prefect summary."""
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
    url = tracking.run_url(run_id)
    link = f"[{run_id}]({url})" if url else f"`{run_id}`"
    rows = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in sorted(metrics.items()))
    shown = "\n".join(f"- `{s['prompt'][-60:]}` → `{s['response']}`" for s in samples)
    create_markdown_artifact(
        key=f"{stage}-summary",
        markdown=f"# {stage} stage\n\nMLflow run: {link}\n\n| metric | value |\n|---|---|\n{rows}\n\n## Samples\n{shown}\n",
        description=f"{stage} stage results",
    )
    return StageRecord(stage=stage, run_id=run_id, checkpoint_uri=f"runs:/{run_id}/{tracking.CHECKPOINT_PATH}",
                       config_hash=config_hash(section), data_digest=data.digest,
                       checkpoint_digest=checkpoint_digest, metrics=metrics)


def _is_demo(source: DataSource | None) -> bool:
    return source is not None and source.path.startswith(DEMO_SCHEME)


# --- stage tasks ----------------------------------------------------------------------------


@task
def sft(ctx: StageContext) -> StageRecord | State:
    """Validate demonstrations, fine-tune the base model, log everything to a child run."""
    section = ctx.config.sft
    model_location = resolve_location(section.model, ctx.world)
    try:
        with stage_run("sft", section, ctx) as (run_id, scratch, metrics_writer):
            mlflow.set_tag("rlhf.base_model", tracking.redact(section.model))
            tokenizer = load_tokenizer(model_location, trust_remote_code=section.trust_remote_code,
                                       chat_template=section.chat_template)
            train, evaluation = train_and_eval_data(section, "sft", ctx.world, tokenizer)
            started = time.perf_counter()
            result = call_stage("sft", section, scratch, Reporting(metrics=metrics_writer.log), **ctx.determinism,
                                model_location=model_location, train=train.frame, evaluation=evaluation.frame)
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
    section = ctx.config.reward
    try:
        with stage_run("reward", section, ctx) as (run_id, scratch, metrics_writer):
            policy_location = str(tracking.download_checkpoint(ctx.upstream["sft"], scratch / "sft"))
            model_location = resolve_location(section.model, ctx.world) if section.model else policy_location
            mlflow.set_tag("rlhf.base_model", tracking.redact(section.model or f"runs:/{ctx.upstream['sft']}/checkpoint"))
            tokenizer = load_tokenizer(model_location, trust_remote_code=section.trust_remote_code,
                                       chat_template=section.chat_template)
            train, evaluation = train_and_eval_data(section, "preference", ctx.world, tokenizer)
            prompts = validated(section.normalization_prompts, "prompt", ctx.world, load_tokenizer(policy_location),
                                LengthBudget(section.max_prompt_length, section.max_length), section.duplicates)
            tracking.log_data(prompts.frame, "normalization-prompts", prompts.source, prompts.digest, "normalization")
            started = time.perf_counter()
            try:
                result = call_stage("reward", section, scratch, Reporting(metrics=metrics_writer.log), **ctx.determinism,
                                    model_location=model_location, policy_location=policy_location, train=train.frame,
                                    evaluation=evaluation.frame, normalization_prompts=prompts.frame)
            except RewardGateError as gate:
                mlflow.log_metrics(gate.metrics)
                raise
            scores, metrics = result.eval_scores, result.metrics | {STAGE_SECONDS: time.perf_counter() - started}
            mlflow.set_tags(result.tags)
            if _is_demo(section.eval_data) or (section.eval_data is None and _is_demo(section.train_data)):
                last_user = last_user_turns(scores["prompt_messages"])
                metrics["eval/gold_accuracy"] = gold_accuracy(
                    last_user, list(scores["chosen"]), list(scores["rejected"]),
                    list(scores["score_chosen"]), list(scores["score_rejected"]))
            mlflow.log_table(result.calibration, "calibration.json")
            responses = pd.concat([
                scores[["prompt", "chosen", "score_chosen"]].set_axis(["prompt", "response", "score"], axis=1),
                scores[["prompt", "rejected", "score_rejected"]].set_axis(["prompt", "response", "score"], axis=1),
            ]).sort_values("score", ascending=False)
            n = section.num_table_rows
            extremes = pd.concat([responses.head(n).assign(rank="highest"), responses.tail(n).assign(rank="lowest")])
            mlflow.log_table(extremes, "extremes.json")
            samples = [{"prompt": p, "response": f"{r}  (score {s:+.2f})"} for p, r, s in
                       extremes[["prompt", "response", "score"]].head(3).itertuples(index=False)]
            return finish("reward", run_id, section, train, metrics, result.checkpoint, samples,
                          int(metrics["train/steps"]))
    except DataContractError as e:
        return refuse(e.report())
    except (RewardGateError, LaunchError, tracking.TrackingError) as e:
        return refuse(str(e))


@task
def ppo(ctx: StageContext) -> StageRecord | State:
    """PPO from the upstream SFT policy against the upstream reward model, both fetched through MLflow."""
    from rlhf.plots import curves, overoptimization

    section = ctx.config.ppo
    logger = get_run_logger()
    try:
        with stage_run("ppo", section, ctx) as (run_id, scratch, metrics_writer):
            sft_location = str(tracking.download_checkpoint(ctx.upstream["sft"], scratch / "sft"))
            reward_location = str(tracking.download_checkpoint(ctx.upstream["reward"], scratch / "reward"))
            tokenizer = load_tokenizer(sft_location, trust_remote_code=section.trust_remote_code)
            budget = LengthBudget(section.max_prompt_length, section.max_prompt_length + section.response_length)

            def prompts(source: DataSource, name: str) -> ValidatedData:
                data = validated(source, "prompt", ctx.world, tokenizer, budget, section.duplicates)
                tracking.log_data(data.frame, name, data.source, data.digest, name)
                return data

            train, evaluation = prompts(section.prompts, "prompts"), prompts(section.eval_prompts, "eval-prompts")
            mlflow.set_tag(tracking.TAG_DATA_DIGEST, train.digest)
            warnings: list[str] = []

            def warn(message: str) -> None:
                warnings.append(message)
                logger.warning(message)

            # Demo world: the gold reward of every iteration's rollouts, judged here because no stage may
            # read the gold function; kept in the work folder so a resumed run's curve starts at iteration 1.
            gold_file = scratch / "rollout-gold.jsonl"
            gold_by_iteration: dict[int, float] = {}
            if gold_file.exists():  # a resumed run: the stage replays its history, the gold curve is ours to replay
                for row in map(json.loads, gold_file.read_text().splitlines()):
                    gold_by_iteration[row["iteration"]] = row["gold_reward"]
                    metrics_writer.log({"rollout/gold_reward": row["gold_reward"]}, row["iteration"])

            def judge_rollouts(table: pd.DataFrame, iteration: int) -> None:
                gold = mean_gold_reward(list(table["prompt_messages"]), list(table["response"]))
                gold_by_iteration[iteration] = gold
                metrics_writer.log({"rollout/gold_reward": gold}, iteration)
                with gold_file.open("a") as f:
                    f.write(json.dumps({"iteration": iteration, "gold_reward": gold}) + "\n")

            reporting = Reporting(metrics=metrics_writer.log, warning=warn,
                                  samples=lambda table, i: mlflow.log_table(table, f"samples/iteration_{i:05d}.json"),
                                  rollouts=judge_rollouts if _is_demo(section.prompts) else None)
            started = time.perf_counter()
            result = call_stage("ppo", section, scratch, reporting, **ctx.determinism, sft_location=sft_location,
                                reward_location=reward_location, prompts=train.frame, eval_prompts=evaluation.frame)
            table, metrics = result.evaluation, result.metrics | {STAGE_SECONDS: time.perf_counter() - started}
            mlflow.set_tags(result.tags)
            if _is_demo(section.eval_prompts):
                metrics |= gold_comparison(last_user_turns(table["prompt_messages"]), list(table["ppo_response"]),
                                           list(table["sft_response"]))
            mlflow.log_table(table.drop(columns=["prompt_messages"]), "evaluation.json")
            mlflow.log_text("\n".join(warnings) or "no warnings", "warnings.txt")
            for keys, name in ((["rollout/score", "rollout/score_raw"], "score"), (["rollout/kl", "rollout/kl_coef"], "kl"),
                               (["rollout/response_length", "rollout/eos_rate"], "length")):
                mlflow.log_figure(curves(result.history, keys, f"PPO {name}"), f"plots/{name}.png")
            if gold_by_iteration:
                mlflow.log_figure(overoptimization(result.history, gold_by_iteration), "plots/overoptimization.png")
            samples = [{"prompt": p, "response": f"{r}  (SFT: {s})"} for p, r, s in
                       table[["prompt", "ppo_response", "sft_response"]].head(4).itertuples(index=False)]
            record = finish("ppo", run_id, section, train, metrics, result.checkpoint, samples,
                            int(metrics["train/iterations"]))
            version = tracking.register_checkpoint(run_id, POLICY_MODEL_NAME)
            mlflow.set_tag("rlhf.registered_model", f"{POLICY_MODEL_NAME}/{version}")
            return record
    except DataContractError as e:
        return refuse(e.report())
    except (NonFiniteLossError, LaunchError, tracking.TrackingError) as e:
        return refuse(str(e))


STAGE_TASKS = {"sft": sft, "reward": reward, "ppo": ppo}


def _source_fingerprint(location: str) -> str:
    """Content digest of a local file or folder; a hub name stands for itself."""
    path = Path(location)
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    if path.is_dir():
        return folder_digest(path)
    return f"name:{location}"


def cache_key(stage: str, cfg: PipelineConfig, world: str | None, upstream: dict[str, str]) -> str:
    """What a stage's result depends on: its resolved config, the content of every input it reads,
    the code version, the upstream runs it starts from, and the pipeline's determinism settings."""
    section = getattr(cfg, stage)
    inputs = {}
    for name, value in section:
        if isinstance(value, DataSource):
            inputs[name] = _source_fingerprint(resolve_location(value.path, world)) + f":{value.split}:{value.format}"
        elif name == "model" and isinstance(value, str):
            inputs[name] = _source_fingerprint(resolve_location(value, world))
    parts = {"stage": stage, "config": config_hash(section), "inputs": inputs, "code": tracking.code_version(),
             "upstream": upstream, "determinism": [cfg.deterministic, cfg.num_threads]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def reused_record(stage: StageName, run) -> StageRecord:
    tags = run.data.tags
    return StageRecord(stage=stage, run_id=run.info.run_id, checkpoint_uri=f"runs:/{run.info.run_id}/{tracking.CHECKPOINT_PATH}",
                       config_hash=tags[tracking.TAG_CONFIG_HASH], data_digest=tags.get(tracking.TAG_DATA_DIGEST, ""),
                       checkpoint_digest=tags.get(tracking.TAG_CHECKPOINT_DIGEST, ""), metrics=run.data.metrics,
                       reused=True)


def context_problems(cfg: PipelineConfig, stages: list[str], world: str | None) -> list[str]:
    """Token budgets that do not fit the model's context, as 'field: reason' lines.

    The base model's config stands for the checkpoints derived from it (SFT, the reward model
    started from SFT, the PPO policy); a reward model named in the config is checked itself.
    """
    from transformers import AutoConfig

    def context(location: str, trust_remote_code: bool) -> int | None:
        config = AutoConfig.from_pretrained(resolve_location(location, world), trust_remote_code=trust_remote_code)
        return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

    base = context(cfg.sft.model, cfg.sft.trust_remote_code)
    needs = {"sft": ("sft.max_length", cfg.sft.max_length, cfg.sft.model, base),
             "reward": ("reward.max_length", cfg.reward.max_length, cfg.reward.model or cfg.sft.model,
                        context(cfg.reward.model, cfg.reward.trust_remote_code) if cfg.reward.model else base),
             "ppo": ("ppo.response_length", cfg.ppo.max_prompt_length + cfg.ppo.response_length, cfg.sft.model, base)}
    problems = []
    for stage in stages:
        field, tokens, model, limit = needs[stage]
        if limit is not None and tokens > limit:
            problems.append(f"{field}: {tokens} tokens do not fit the {limit}-token context of {model}")
    return problems


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer the way a stage loads it: the model location, remote code, and the chat template given in the config."""

    model: str
    trust_remote_code: bool
    chat_template: str | None


def _inputs(cfg: PipelineConfig, stage: str) -> list[tuple[DataSource, str, TokenizerSource, LengthBudget]]:
    """Every data source `stage` reads: (source, contract kind, tokenizer that measures it, budget).
    The SFT checkpoint carries the SFT tokenizer (and its template) to the later stages."""
    sft, reward, ppo = cfg.sft, cfg.reward, cfg.ppo
    policy = TokenizerSource(sft.model, sft.trust_remote_code, sft.chat_template)
    if stage == "sft":
        budget = LengthBudget(sft.max_prompt_length, sft.max_length)
        return [(s, "sft", policy, budget) for s in (sft.train_data, sft.eval_data) if s]
    if stage == "reward":
        budget = LengthBudget(reward.max_prompt_length, reward.max_length)
        scorer = (TokenizerSource(reward.model, reward.trust_remote_code, reward.chat_template) if reward.model
                  else TokenizerSource(sft.model, sft.trust_remote_code, reward.chat_template or sft.chat_template))
        pairs = [(s, "preference", scorer, budget) for s in (reward.train_data, reward.eval_data) if s]
        return pairs + [(reward.normalization_prompts, "prompt", policy, budget)]
    budget = LengthBudget(ppo.max_prompt_length, ppo.max_prompt_length + ppo.response_length)
    return [(s, "prompt", policy, budget) for s in (ppo.prompts, ppo.eval_prompts)]


@task
def check_inputs(cfg: PipelineConfig, stages: list[str], world: str | None) -> list[str]:
    """Validate every data source the run's stages will read, before any stage trains: a bad file
    for PPO is refused before SFT and reward spend their compute. Lengths are measured with the
    configured base model's tokenizer (the checkpoints derived from it share it); each stage
    validates its data again with the tokenizer it actually loads. Returns one report per bad source."""
    tokenizers: dict[TokenizerSource, Any] = {}
    refused: set[TokenizerSource] = set()  # reported once, however many sources it measures
    reports = []
    for stage in stages:
        for source, kind, measured_by, budget in _inputs(cfg, stage):
            if measured_by in refused:
                continue
            try:
                if measured_by not in tokenizers:
                    tokenizers[measured_by] = load_tokenizer(resolve_location(measured_by.model, world),
                                                             trust_remote_code=measured_by.trust_remote_code,
                                                             chat_template=measured_by.chat_template)
                validated(source, kind, world, tokenizers[measured_by], budget, getattr(cfg, stage).duplicates)
            except DataContractError as e:
                reports.append(f"{stage} stage: {e.report()}")
            except ChatTemplateError as e:
                refused.add(measured_by)
                reports.append(f"{stage} stage: {e}")
    return reports


def _resolve_upstream(stage: str, records: dict[str, StageRecord], given: UpstreamRuns, experiment: str) -> dict[str, str]:
    """Run ids of `stage`'s upstream stages: from this pipeline run, else as given, else the latest finished."""
    resolved = {}
    for name in UPSTREAM[stage]:
        run_id = records[name].run_id if name in records else getattr(given, f"{name}_run_id")
        run_id = run_id or tracking.latest_finished_run_id(experiment, name)
        if run_id is None:
            raise LookupError(f"stage {stage} needs a finished {name} run; none is in experiment {experiment!r}. "
                              f"Run rlhf/{name} first or pass upstream.{name}_run_id")
        resolved[name] = run_id
    return resolved


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


def _log_overhead(parent_run_id: str, ran: list[StageRecord]) -> None:
    """Wall time since the flow run was requested against the stages' own work: what Prefect,
    MLflow, data validation, artifact transfer and process start-up cost, on the pipeline run."""
    wall = (datetime.now(timezone.utc) - get_run_context().flow_run.created).total_seconds()
    work = sum(r.metrics.get(STAGE_SECONDS, 0.0) for r in ran)
    figures = {"time/wall_seconds": wall, "time/stage_work_seconds": work,
               "time/orchestration_seconds": wall - work, "time/orchestration_share": (wall - work) / wall}
    MlflowClient().log_batch(parent_run_id, metrics=[Metric(k, v, int(time.time() * 1000), 0) for k, v in figures.items()])
    get_run_logger().info("orchestration: %.1f s of %.1f s since the run was requested (%.0f%%); stages' own work %.1f s",
                          wall - work, wall, 100 * (wall - work) / wall, work)


def _run_stages(cfg: PipelineConfig, ordered: list[StageName], config_file: str, overrides: dict[str, Any],
                upstream: UpstreamRuns, use_cache: bool, world: str | None) -> list[StageRecord] | State:
    """The stages in order under one MLflow pipeline run, each reused from cache or run as a task."""
    logger = get_run_logger()
    experiment_id = tracking.ensure_experiment(cfg.experiment)
    version, commit = tracking.code_version()
    parent_run_id = tracking.start_pipeline_run(experiment_id, {
        "rlhf.stages": ",".join(ordered), "rlhf.config_file": config_file, "rlhf.overrides": json.dumps(overrides),
        tracking.TAG_CONFIG_HASH: config_hash(cfg), tracking.TAG_CODE_VERSION: version,
        tracking.TAG_GIT_COMMIT: commit, tracking.TAG_PREFECT_FLOW_RUN: str(get_run_context().flow_run.id),
    })
    logger.info("MLflow pipeline run %s", tracking.run_url(parent_run_id) or parent_run_id)
    ok = False
    try:
        records: dict[str, StageRecord] = {}
        for name in ordered:
            try:
                upstream_ids = _resolve_upstream(name, records, upstream, cfg.experiment)
            except LookupError as e:
                return refuse(str(e))
            key = cache_key(name, cfg, world, upstream_ids)
            cached = tracking.latest_finished_run(cfg.experiment, name, key) if use_cache else None
            if cached is not None:
                record = reused_record(name, cached)
                MlflowClient().set_tag(parent_run_id, tracking.TAG_REUSED + name, record.run_id)
                logger.info("%s: reusing finished run %s (same config, data, code and upstream runs)", name, record.run_id)
            else:
                state = STAGE_TASKS[name](StageContext(cfg, world, experiment_id, parent_run_id, upstream_ids, key),
                                          return_state=True)
                if not state.is_completed():
                    return Failed(message=f"stage {name} failed: {state.message}")
                record = state.result()
                logger.info("%s run %s: %s", name, record.run_id,
                            ", ".join(f"{k}={v:.4g}" for k, v in sorted(record.metrics.items())))
            records[name] = record
        ok = True
        _log_overhead(parent_run_id, [r for r in records.values() if not r.reused])
        create_markdown_artifact(key="pipeline-summary", description="which stage runs ran and which were reused",
                                 markdown="# Pipeline\n\n| stage | MLflow run | |\n|---|---|---|\n" + "\n".join(
                                     f"| {r.stage} | `{r.run_id}` | {'reused' if r.reused else 'ran'} |"
                                     for r in records.values()))
        return list(records.values())
    finally:
        try:
            tracking.end_run(parent_run_id, ok)
        except Exception as e:  # the server is gone; the error that brought us here is the one to report
            logger.warning("could not mark pipeline run %s %s: %s", parent_run_id, "FINISHED" if ok else "FAILED",
                           type(e).__name__)
