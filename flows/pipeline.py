"""The `rlhf` Prefect flow: the pipeline sft -> reward -> ppo (or sft -> dpo), wiring stages to MLflow.

No training math and no stage internals live here, and no bookkeeping: what the pipeline writes down
and reads back (its MLflow run, cache keys and lineage, what is logged) is `flows.records`. Each task
fetches what its stage needs (validated data from `flows.inputs`, upstream checkpoints through MLflow
artifacts), calls the stage function, logs what it produced (`flows.records.reports`), and returns a
small `StageRecord` (`flows.records.lineage`, which also keys the cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlflow
import pandas as pd
from prefect import flow, get_run_logger, task
from prefect.states import Failed, State

from flows.form import DPOForm, PPOForm, RewardForm, SFTForm, UpstreamRuns, form_overrides
from flows.inputs import (
    context_problems,
    fetched_teacher,
    input_problems,
    is_demo,
    logged_prompts,
    memory_plan,
    memory_problems,
    train_and_eval_data,
)
from flows.records.lineage import (
    AVAILABLE_STAGES,
    RLHF_STAGES,
    ExperimentRuns,
    StageRecord,
    Teacher,
    stage_keys,
    upstream_runs,
)
from flows.records.pipeline_run import PipelineRun, close_crashed_runs, hide_secret_parameters
from flows.records.reports import (
    GoldJudgments,
    evaluation_report,
    log_overhead,
    pipeline_summary,
    ppo_report,
    reward_report,
    reward_terms_note,
)
from flows.stage_runs import (
    STAGE_RETRIES,
    StageContext,
    StageJob,
    StageRun,
    refuse,
    run_stage,
    stage_memory,
)
from rlhf import tracking
from rlhf.config import ConfigError, PipelineConfig, load_config
from rlhf.demo.locations import DemoWorldConfig, resolve_location
from rlhf.demo.world import build_world
from rlhf.sections.base import StageName
from stages.memory.plan import Plan
from stages.runtime.models import load_tokenizer, set_determinism


@dataclass(frozen=True)
class Request:
    """What the flow run was asked for, beside the config it loaded: the pipeline run records it."""

    config_file: str
    overrides: dict[str, Any]
    """Every override applied to the config file: the form's fields, then the explicit ones."""
    upstream: UpstreamRuns
    use_cache: bool


class StageRefused(Exception):
    """A stage cannot start (no upstream run to start from); the flow run fails with this message."""


class StageFailed(Exception):
    """A stage task ended failed (its task has logged why); the flow run fails with this message."""


@task(retries=1, retry_delay_seconds=5)
def build_demo_world(demo: DemoWorldConfig) -> str:
    """Build (or reuse) the embedded demo world; returns its folder."""
    return str(build_world(tracking.state_dir() / "worlds", demo))


# --- stage tasks ----------------------------------------------------------------------------


@task(name="sft", **STAGE_RETRIES)
def run_sft(ctx: StageContext) -> StageRecord | State:
    """Validate demonstrations, fine-tune the base model, log everything to a child run."""
    from stages.sft import SFTInputs, train_sft  # here: the training libraries take seconds to import

    section = ctx.config.sft

    def prepare(run: StageRun) -> StageJob:
        model_location = resolve_location(section.model, ctx.world)
        mlflow.set_tag("rlhf.base_model", tracking.redact(section.model))
        tokenizer = load_tokenizer(model_location, trust_remote_code=section.trust_remote_code,
                                   chat_template=section.chat_template)
        train, evaluation = train_and_eval_data(ctx.config, "sft", ctx.world, tokenizer)

        def report(result, metrics: dict[str, float]) -> list[dict[str, str]]:
            mlflow.log_table(pd.DataFrame(result.samples), "samples.json")
            return result.samples

        return StageJob(train_sft, SFTInputs(model_location, train.frame, evaluation.frame), train, run.reporting(),
                        report)

    return run_stage("sft", ctx, "step", prepare)


@task(name="reward", **STAGE_RETRIES)
def run_reward(ctx: StageContext) -> StageRecord | State:
    """Train the reward model from the upstream SFT checkpoint (downloaded through MLflow)."""
    from stages.reward import RewardInputs, train_reward

    section = ctx.config.reward

    def prepare(run: StageRun) -> StageJob:
        policy_location = str(tracking.download_checkpoint(ctx.upstream["sft"], run.scratch / "sft"))
        model_location = resolve_location(section.model, ctx.world) if section.model else policy_location
        mlflow.set_tag("rlhf.base_model", tracking.redact(section.model or f"runs:/{ctx.upstream['sft']}/checkpoint"))
        tokenizer = load_tokenizer(model_location, trust_remote_code=section.trust_remote_code,
                                   chat_template=section.chat_template)
        train, evaluation = train_and_eval_data(ctx.config, "reward", ctx.world, tokenizer)
        prompts = logged_prompts(ctx.config, "reward", "normalization", "normalization-prompts", ctx.world,
                                 load_tokenizer(policy_location))
        demo = is_demo(section.eval_data) or (section.eval_data is None and is_demo(section.train_data))
        inputs = RewardInputs(model_location=model_location, policy_location=policy_location, train=train.frame,
                              evaluation=evaluation.frame, normalization_prompts=prompts.frame)
        return StageJob(train_reward, inputs, train, run.reporting(),
                        lambda result, metrics: reward_report(result, metrics, section.num_table_rows, demo))

    return run_stage("reward", ctx, "step", prepare)


@task(name="ppo", **STAGE_RETRIES)
def run_ppo(ctx: StageContext) -> StageRecord | State:
    """PPO from the upstream SFT policy against the upstream reward model (none where the reward is
    Python functions alone), fetched through MLflow; the policy registered (as an MLflow
    transformers model) unless the config says not to."""
    from stages.ppo import PPOInputs, train_ppo
    from stages.rewards.functions import source_digests
    from stages.rewards.remote import remote_rewards

    section = ctx.config.ppo

    def prepare(run: StageRun) -> StageJob:
        sft_location = str(tracking.download_checkpoint(ctx.upstream["sft"], run.scratch / "sft"))
        reward_location = (str(tracking.download_checkpoint(ctx.upstream["reward"], run.scratch / "reward"))
                           if "reward" in ctx.upstream else None)
        teacher = fetched_teacher(ctx.teacher, ctx.world, run.scratch / "teacher") if ctx.teacher else None
        if section.reward.functions:  # which functions, and which source of each, made this run's reward
            digests = source_digests(section)
            mlflow.set_tag(tracking.TAG_REWARD_FUNCTIONS, ", ".join(
                f"{t.name}={t.function} (weight {t.weight:g}, source {digests[t.name][:12]})"
                for t in section.reward.functions))
        if section.reward.remotes:  # which servers scored, and the run a served reward model came from
            mlflow.set_tag(tracking.TAG_REWARD_REMOTE, tracking.redact(", ".join(
                client.lineage() for client in remote_rewards(section.reward.remotes))))
        tokenizer = load_tokenizer(sft_location, trust_remote_code=section.trust_remote_code)
        train = logged_prompts(ctx.config, "ppo", "prompts", "prompts", ctx.world, tokenizer)
        evaluation = logged_prompts(ctx.config, "ppo", "eval_prompts", "eval-prompts", ctx.world, tokenizer)
        mlflow.set_tag(tracking.TAG_DATA_DIGEST, train.digest)
        gold = GoldJudgments.of_rollouts(run.scratch, run.log) if is_demo(section.prompts) else None
        demo_evaluation = is_demo(section.evaluation.prompts)
        judged = {"rollouts": gold} if gold else {}
        if demo_evaluation:
            judged["evaluation"] = GoldJudgments.of_evaluations(run.scratch, run.log)
        reporting = run.reporting(samples=lambda table, i: run.table(table, f"samples/iteration_{i:05d}.json"),
                                  **judged)
        return StageJob(train_ppo, PPOInputs(sft_location=sft_location, reward_location=reward_location,
                                             prompts=train.frame, eval_prompts=evaluation.frame,
                                             teacher_location=teacher), train,
                        reporting, lambda result, metrics: ppo_report(result, metrics, run.warnings, gold,
                                                                      demo_evaluation),
                        registered_on=evaluation.digest)

    return run_stage("ppo", ctx, "iteration", prepare)


@task(name="dpo", **STAGE_RETRIES)
def run_dpo(ctx: StageContext) -> StageRecord | State:
    """DPO from the upstream SFT checkpoint (fetched through MLflow) on preference pairs, judged
    as PPO is; the policy registered unless the config says not to."""
    from stages.dpo import DPOInputs, train_dpo

    section = ctx.config.dpo

    def prepare(run: StageRun) -> StageJob:
        sft_location = str(tracking.download_checkpoint(ctx.upstream["sft"], run.scratch / "sft"))
        tokenizer = load_tokenizer(sft_location, trust_remote_code=section.trust_remote_code)
        train, pairs_eval = train_and_eval_data(ctx.config, "dpo", ctx.world, tokenizer)
        evaluation = logged_prompts(ctx.config, "dpo", "eval_prompts", "eval-prompts", ctx.world, tokenizer)
        demo = is_demo(section.evaluation.prompts)
        return StageJob(train_dpo, DPOInputs(sft_location, train.frame, pairs_eval.frame, evaluation.frame), train,
                        run.reporting(),
                        lambda result, metrics: evaluation_report(result.evaluation, metrics, run.warnings, demo),
                        registered_on=evaluation.digest)

    return run_stage("dpo", ctx, "step", prepare)


@task
def check_inputs(cfg: PipelineConfig, stages: list[str], world: str | None) -> list[str]:
    """Validate every data source the run's stages will read, before any stage trains: a bad file
    for PPO is refused before SFT and reward spend their compute. Returns one report per bad source."""
    return input_problems(cfg, stages, world)


@task
def plan_memory(cfg: PipelineConfig, stages: list[str], world: str | None, teacher: Teacher | None) -> Plan | None:
    """The memory each stage needs per process on the device it will use, from the models' configs
    alone, before any stage trains (`rlhf plan` prints the same); None, with a warning, for a model
    the planner cannot read (no decoder-layer classes named, a config it cannot build)."""
    try:
        return memory_plan(cfg, stages, world, teacher)
    except (ValueError, OSError, TypeError, KeyError, AttributeError) as e:
        get_run_logger().warning("no memory plan: %s: %s; the stages run unplanned", type(e).__name__, e)
        return None


# --- the flow -----------------------------------------------------------------------------------


# The defaults are the run form's, which Prefect shows as they are; the flow never mutates them (B006, B008).
# Each line of the docstring's Args is a form field's description, which Prefect reads line by line (a line
# broken there would show broken in the form): they stay long (E501).
@flow(name="rlhf", on_crashed=[close_crashed_runs])
def rlhf(
    stages: list[StageName] = list(RLHF_STAGES),  # noqa: B006
    config_file: str = "configs/demo.yaml",
    sft: SFTForm = SFTForm(),
    reward: RewardForm = RewardForm(),
    ppo: PPOForm = PPOForm(),
    dpo: DPOForm = DPOForm(),
    overrides: dict[str, Any] = {},  # noqa: B006
    upstream: UpstreamRuns = UpstreamRuns(),  # noqa: B008
    use_cache: bool = True,
) -> list[StageRecord] | State:
    """Run the named RLHF stages in pipeline order, as children of one MLflow pipeline run.

    Args:
        stages: Stages to run (sft, reward, ppo; dpo instead of reward and ppo, or beside them); they run in pipeline order whatever the order given.
        config_file: YAML config, relative to the repository; configs/demo.yaml is the embedded demo world.
        sft: SFT settings for this run; empty fields keep the config file's values.
        reward: Reward-model settings for this run; empty fields keep the config file's values.
        ppo: PPO settings for this run; empty fields keep the config file's values.
        dpo: DPO settings for this run; empty fields keep the config file's values.
        overrides: Any other config field by dotted name, applied last, e.g. {"ppo.evaluation.kl_budget": 8, "ppo.lora": {"r": 16}}; docs/config.md lists every field.
        upstream: Upstream runs for a stage run alone; empty: the latest finished runs made with this config's sft and reward sections that belong together (PPO: a reward run and the SFT run it was trained from); the flow's log and the stage run's description say which and why.
        use_cache: Reuse a finished run with the same config, data, code and upstream runs instead of running the stage again.
    """  # noqa: E501
    hide_secret_parameters()
    logger = get_run_logger()
    missing = [s for s in stages if s not in AVAILABLE_STAGES]
    if missing:
        return refuse(f"stage(s) {', '.join(missing)} not available in this version; "
                      f"available: {', '.join(AVAILABLE_STAGES)}")
    overrides = form_overrides(sft, reward, ppo, dpo) | overrides
    try:
        cfg = load_config(config_file, overrides)
    except ConfigError as e:
        return refuse(str(e))
    ordered = [s for s in AVAILABLE_STAGES if s in stages]
    if "ppo" in ordered and not cfg.ppo.reward.uses_model:
        if "reward" in ordered:
            logger.warning("the reward stage runs, but ppo.reward.terms has no reward-model term, so PPO will not "
                           "use it; name stages [sft, ppo] to skip it")
        if upstream.reward_run_id:
            logger.warning("upstream.reward_run_id %s is ignored: ppo.reward.terms has no reward-model term",
                           upstream.reward_run_id)
    set_determinism(cfg.deterministic, cfg.num_threads)
    world = build_demo_world(cfg.demo) if cfg.demo is not None else None
    too_long = context_problems(cfg, ordered, world)
    if too_long:
        return refuse("invalid config:\n" + "\n".join(f"  {problem}" for problem in too_long))
    try:  # once per pipeline run: the memory plan, the cache key and the stage's fetch all take this resolution
        teacher = Teacher.of(cfg) if "ppo" in ordered else None
    except tracking.TrackingError as e:
        return refuse(f"ppo stage: teacher.model {e}")
    bad_inputs = check_inputs(cfg, ordered, world)
    if bad_inputs:
        return refuse("\n\n".join(bad_inputs))
    memory = plan_memory(cfg, ordered, world, teacher)
    too_big, tight = memory_problems(memory) if memory is not None else ([], [])
    if too_big:
        return refuse("the memory plan (`rlhf plan`) predicts that these stages do not fit:\n"
                      + "\n".join(f"  {problem}" for problem in too_big))
    for problem in tight:
        logger.warning("memory plan: %s (on the CPU this is a warning, not a refusal)", problem)
    try:
        tracking.wait_for_server(log=logger.warning)
        return _run_stages(cfg, ordered, Request(config_file, overrides, upstream, use_cache), world, memory, teacher)
    except tracking.TrackingError as e:
        return refuse(str(e))
    except Exception as e:
        if tracking.server_answers():
            raise
        return refuse(f"the MLflow tracking server {mlflow.get_tracking_uri()} stopped answering "
                      f"({type(e).__name__}: {str(e)[:300]}); rerun when it is back: finished stages are reused")


def _run_stages(cfg: PipelineConfig, ordered: list[StageName], request: Request, world: str | None,
                memory: Plan | None, teacher: Teacher | None) -> list[StageRecord] | State:
    """The stages in pipeline order under one MLflow pipeline run: each starts from the records
    of the stages before it (or the given upstream runs) and is reused from cache or run as a task."""
    logger = get_run_logger()
    pipeline = PipelineRun.start(cfg, ordered, request.config_file, request.overrides)
    upstream = request.upstream
    given = {"sft": upstream.sft_run_id, "reward": upstream.reward_run_id}
    runs = ExperimentRuns(cfg.experiment)
    records: dict[str, StageRecord] = {}

    def run_or_reuse(name: StageName, stage_task) -> StageRecord:
        try:
            resolved = upstream_runs(name, records, given, cfg, runs, upstream.any_config)
        except LookupError as e:
            raise StageRefused(str(e)) from e
        if resolved.chosen:
            logger.info("%s starts from %s", name, resolved.describe())
        key, work = stage_keys(name, cfg, world, resolved.run_ids, teacher)
        cached = pipeline.reused(name, key, work) if request.use_cache else None
        if cached is not None:
            return cached
        ctx = StageContext(config=cfg, world=world, experiment_id=pipeline.experiment_id,
                           parent_run_id=pipeline.run_id, upstream=resolved.run_ids, cache_key=key, work_key=work,
                           label=pipeline.label, flow_run_url=pipeline.flow_run_url,
                           memory=memory and stage_memory(memory, name), teacher=teacher,
                           lineage=resolved.describe() + (reward_terms_note(cfg.ppo) if name == "ppo" else ""))
        state = stage_task(ctx, return_state=True)
        if not state.is_completed():
            raise StageFailed(f"stage {name} failed: {state.message}")
        record = state.result()
        logger.info("%s run %s: %s", name, record.run_id,
                    ", ".join(f"{k}={v:.4g}" for k, v in sorted(record.metrics.items())))
        return record

    ok = False
    try:
        if "sft" in ordered:
            records["sft"] = run_or_reuse("sft", run_sft)
        if "reward" in ordered:
            records["reward"] = run_or_reuse("reward", run_reward)
        if "ppo" in ordered:
            records["ppo"] = run_or_reuse("ppo", run_ppo)
        if "dpo" in ordered:
            records["dpo"] = run_or_reuse("dpo", run_dpo)
        ok = True
        log_overhead(pipeline.run_id, [r for r in records.values() if not r.reused])
        pipeline_summary(list(records.values()))
        return list(records.values())
    except StageRefused as e:
        return refuse(str(e))
    except StageFailed as e:
        return Failed(message=str(e))
    finally:
        pipeline.close(list(records.values()), ok)
