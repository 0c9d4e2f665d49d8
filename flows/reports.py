"""What the flow logs about a stage besides its metrics: the checkpoint, tables, plots, the
demo world's gold figures, and the Prefect summaries. MLflow calls log to the active run."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import get_run_context
from pydantic import BaseModel

from flows.lineage import StageName, StageRecord
from rlhf import tracking
from rlhf.config import config_hash
from rlhf.demo_world import gold_accuracy, gold_comparison, last_user_turns, mean_gold_reward
from schemas.validate import ValidatedData
from stages.models import folder_digest

STAGE_SECONDS = "time/stage_seconds"
"""Metric: wall time of the stage's own work (training, evaluation, samples), without the wiring around it."""


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


def reward_report(result, metrics: dict[str, float], num_table_rows: int, demo: bool) -> list[dict[str, str]]:
    """Calibration and the highest- and lowest-scored held-out responses as tables; on the demo
    world, the gold function's agreement with the model (into `metrics`). Returns samples to show."""
    scores = result.eval_scores
    if demo:
        metrics["eval/gold_accuracy"] = gold_accuracy(
            last_user_turns(scores["prompt_messages"]), list(scores["chosen"]), list(scores["rejected"]),
            list(scores["score_chosen"]), list(scores["score_rejected"]))
    mlflow.log_table(result.calibration, "calibration.json")
    responses = pd.concat([
        scores[["prompt", "chosen", "score_chosen"]].set_axis(["prompt", "response", "score"], axis=1),
        scores[["prompt", "rejected", "score_rejected"]].set_axis(["prompt", "response", "score"], axis=1),
    ]).sort_values("score", ascending=False)
    extremes = pd.concat([responses.head(num_table_rows).assign(rank="highest"),
                          responses.tail(num_table_rows).assign(rank="lowest")])
    mlflow.log_table(extremes, "extremes.json")
    return [{"prompt": p, "response": f"{r}  (score {s:+.2f})"} for p, r, s in
            extremes[["prompt", "response", "score"]].head(3).itertuples(index=False)]


class RolloutGold:
    """Demo world: the gold reward of every PPO iteration's rollouts, judged here because no
    stage may read the gold function. Kept in the work folder too, so a resumed run's curve
    starts at iteration 1 (the stage replays its own history; this one is ours to replay)."""

    def __init__(self, folder: Path, log):
        self.file, self.log = folder / "rollout-gold.jsonl", log
        self.by_iteration: dict[int, float] = {}
        if self.file.exists():
            for row in map(json.loads, self.file.read_text().splitlines()):
                self.by_iteration[row["iteration"]] = row["gold_reward"]
                self.log({"rollout/gold_reward": row["gold_reward"]}, row["iteration"])

    def judge(self, table: pd.DataFrame, iteration: int) -> None:
        gold = mean_gold_reward(list(table["prompt_messages"]), list(table["response"]))
        self.by_iteration[iteration] = gold
        self.log({"rollout/gold_reward": gold}, iteration)
        with self.file.open("a") as f:
            f.write(json.dumps({"iteration": iteration, "gold_reward": gold}) + "\n")


def ppo_report(result, metrics: dict[str, float], warnings: list[str], gold: RolloutGold | None,
               demo_evaluation: bool) -> list[dict[str, str]]:
    """The held-out evaluation table, warnings and curves; the over-optimisation plot when the
    rollouts were judged (`gold`), and the gold figures of the evaluation (into `metrics`) when its
    prompts are the demo world's. Returns samples to show."""
    from rlhf.plots import curves, overoptimization

    table = result.evaluation
    if demo_evaluation:
        metrics |= gold_comparison(last_user_turns(table["prompt_messages"]), list(table["ppo_response"]),
                                   list(table["sft_response"]))
    mlflow.log_table(table.drop(columns=["prompt_messages"]), "evaluation.json")
    mlflow.log_text("\n".join(warnings) or "no warnings", "warnings.txt")
    for keys, name in ((["rollout/score", "rollout/score_raw"], "score"), (["rollout/kl", "rollout/kl_coef"], "kl"),
                       (["rollout/response_length", "rollout/eos_rate"], "length")):
        mlflow.log_figure(curves(result.history, keys, f"PPO {name}"), f"plots/{name}.png")
    if gold is not None and gold.by_iteration:
        mlflow.log_figure(overoptimization(result.history, gold.by_iteration), "plots/overoptimization.png")
    return [{"prompt": p, "response": f"{r}  (SFT: {s})"} for p, r, s in
            table[["prompt", "ppo_response", "sft_response"]].head(4).itertuples(index=False)]


def log_overhead(parent_run_id: str, ran: list[StageRecord]) -> None:
    """Wall time since the flow run was requested against the stages' own work: what Prefect,
    MLflow, data validation, artifact transfer and process start-up cost, on the pipeline run."""
    wall = (datetime.now(timezone.utc) - get_run_context().flow_run.created).total_seconds()
    work = sum(r.metrics.get(STAGE_SECONDS, 0.0) for r in ran)
    figures = {"time/wall_seconds": wall, "time/stage_work_seconds": work,
               "time/orchestration_seconds": wall - work, "time/orchestration_share": (wall - work) / wall}
    MlflowClient().log_batch(parent_run_id, metrics=[Metric(k, v, int(time.time() * 1000), 0) for k, v in figures.items()])
    get_run_logger().info("orchestration: %.1f s of %.1f s since the run was requested (%.0f%%); stages' own work %.1f s",
                          wall - work, wall, 100 * (wall - work) / wall, work)


def pipeline_summary(records: list[StageRecord]) -> None:
    create_markdown_artifact(key="pipeline-summary", description="which stage runs ran and which were reused",
                             markdown="# Pipeline\n\n| stage | MLflow run | |\n|---|---|---|\n" + "\n".join(
                                 f"| {r.stage} | `{r.run_id}` | {'reused' if r.reused else 'ran'} |" for r in records))
