"""What the flow logs about a stage besides its metrics: the checkpoint, tables, plots, the
demo world's gold figures, and the Prefect summaries. MLflow calls log to the active run."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.context import get_run_context

from flows.records.lineage import StageRecord
from rlhf import tracking
from rlhf.demo.world import gold_accuracy, judge_evaluation, last_user_turns, mean_gold_reward
from rlhf.sections.ppo import PPOConfig
from schemas.adapters import last_user_message

STAGE_SECONDS = "time/stage_seconds"
"""Metric: wall time of the stage's own work (training, evaluation, samples), without the wiring around it."""


HEADLINES: dict[str, tuple[str, ...]] = {
    "sft": ("eval/loss", "eval/loss_untrained"),
    "reward": ("eval/accuracy", "eval/gold_accuracy"),
    "ppo": ("eval/gold_win_rate", "eval/win_rate_rm", "eval/win_rate_reward", "eval/kl", "eval/gold_reward"),
    "dpo": ("eval/gold_win_rate", "eval/kl", "eval/preference_accuracy", "eval/gold_reward"),
}
"""The figures a stage is judged by, in its description and summaries (those it has)."""


def headline(stage: str, metrics: dict[str, float]) -> str:
    return ", ".join(f"{key.removeprefix('eval/')} {metrics[key]:.4g}" for key in HEADLINES[stage] if key in metrics)


def stage_summary(stage: str, run_id: str, metrics: dict[str, float], warnings: list[str],
                  samples: list[dict[str, str]]) -> str:
    """Markdown for a stage's Prefect summary: its run, headline figures, warnings, every final metric
    and its samples (what the user said last, and the response)."""
    rows = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in sorted(metrics.items()))
    shown = "\n".join(f"| {_cell(s['user'])} | {_cell(s['response'])} |" for s in samples)
    return (f"# {stage} stage\n\nMLflow run (its curves): {_run_link(run_id)}\n\n{headline(stage, metrics)}\n\n"
            f"{_warnings_section(warnings)}| metric | value |\n|---|---|\n{rows}\n\n## Samples\n\n| user | response |\n"
            f"|---|---|\n{shown}\n")


def _cell(text: str, limit: int = 120) -> str:
    """Text for a Markdown table cell: one line, pipes escaped, cut at `limit` characters."""
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def _warnings_section(warnings: list[str], shown: int = 10) -> str:
    if not warnings:
        return ""
    lines = "\n".join(f"- {w}" for w in warnings[:shown])
    more = f"\n- ... and {len(warnings) - shown} more (warnings.txt)" if len(warnings) > shown else ""
    return f"## ⚠ {len(warnings)} warning{'s' if len(warnings) > 1 else ''}\n\n{lines}{more}\n\n"


def _links(links: dict[str, str]) -> str:
    return " · ".join(f"[{name}]({url})" for name, url in links.items() if url)


def lineage_note(lineage: str) -> str:
    """Which upstream runs a stage run started from and why, as its description says it."""
    return f"Started from {lineage}.\n\n" if lineage else ""


def reward_terms_note(ppo: PPOConfig) -> str:
    """How PPO's score is made, where it has terms besides the reward model or a distillation teacher
    (empty for the reward model alone), to follow the upstream runs in its description: `; scored by
    reward functions `on_subject` (rlhf.demo.rewards:names_the_subject, weight 1), servers `served` (score
    at http://..., weight 1), the teacher models:/rlhf-policy@champion (weight 1, k1 per token), without a
    reward model`."""
    reward, teacher, parts = ppo.reward, ppo.teacher, []
    if reward.functions:
        parts.append("reward functions " + ", ".join(f"`{t.name}` ({t.function}, weight {t.weight:g})"
                                                     for t in reward.functions))
    if reward.remotes:
        parts.append("servers " + ", ".join(
            f"`{t.name}` ({t.remote.kind} at "
            f"{t.remote.url}, weight {t.weight:g})" for t in reward.remotes))
    if teacher is not None:
        how = f"KL over its top {teacher.top_k} as a loss" if teacher.top_k else f"{teacher.kl_estimator} per token"
        parts.append(f"the teacher {teacher.model} (weight {teacher.weight:g}, {how})")
    model = next((f" beside the reward model (weight {t.weight:g})" for t in reward.terms if t.is_model),
                 ", without a reward model")
    return f"; scored by {', '.join(parts)}{model}" if parts else ""


def stage_note(stage: str, metrics: dict[str, float], warnings: list[str], links: dict[str, str],
               lineage: str = "") -> str:
    """A stage run's description: its headline figures, the upstream runs it started from and why,
    its warnings, and links (upstream runs, the Prefect run)."""
    return (f"**{stage}**: {headline(stage, metrics) or 'no evaluation figures'}\n\n{lineage_note(lineage)}"
            f"{_warnings_section(warnings)}{_links(links)}\n")


def stage_table(records: list[StageRecord]) -> str:
    """Markdown: each stage's run (linked), whether it ran or was reused, its figures and warnings."""
    rows = "".join(f"| {r.stage} | {_run_link(r.run_id)} | {'reused' if r.reused else 'ran'} | "
                   f"{headline(r.stage, r.metrics)} | {r.warnings} |\n" for r in records)
    return "| stage | MLflow run | | figures | warnings |\n|---|---|---|---|---|\n" + rows


def pipeline_note(config_file: str, overrides: dict, records: list[StageRecord], links: dict[str, str]) -> str:
    """The pipeline run's description: what it ran on, and each stage's run, figures and warnings."""
    changed = f"overrides `{json.dumps(overrides)}`" if overrides else "no overrides"
    table = stage_table(records) + "\n" if records else ""
    return f"Config `{config_file}`, {changed}.\n\n{table}{_links(links)}\n"


class Progress:
    """A stage's progress as a Prefect progress artifact (updated every `update_s` at most: each
    update is an event that `prefect deployment run --watch` prints) and a log line every `log_s`:
    steps or iterations done of the total, and the time left at the pace so far. The artifact is
    updated from a background thread with the latest figures, so a Prefect server that does not
    answer never holds the stage up; the update it could not take is made when it answers."""

    def __init__(self, stage: str, unit: str, update_s: float = 15.0, log_s: float = 30.0):
        self.stage, self.unit, self.update_s, self.log_s = stage, unit, update_s, log_s
        self.artifact = create_progress_artifact(0.0, key=f"{stage}-progress", description=f"{stage}: {unit}s done")
        self.started = self.updated = self.logged = time.monotonic()
        self.first_done: int | None = None
        """Units done before this attempt: a resumed stage's first report is past one."""
        self.progress, self.events = 0.0, []
        self._logger = get_run_logger()
        self._latest: tuple[float, str] | None = None
        self._wake, self._closing = threading.Event(), False
        self._sender = threading.Thread(target=self._send_loop, name="prefect-progress", daemon=True)
        self._sender.start()

    def event(self, text: str) -> None:
        """Something the stage went through (a tracking server's gap), added to the artifact's description."""
        self.events.append(text)
        self._update()

    def _update(self) -> None:
        self._latest = (self.progress, "; ".join([f"{self.stage}: {self.unit}s done", *self.events]))
        self._wake.set()

    def _send_loop(self) -> None:
        away = False
        while not (self._closing and self._latest is None):
            self._wake.wait(timeout=5.0)
            self._wake.clear()
            if (latest := self._latest) is None:
                continue
            try:
                update_progress_artifact(self.artifact, latest[0], description=latest[1])
            except Exception as e:  # noqa: BLE001 - progress is shown, not kept: the next update carries it
                if not away:
                    self._logger.warning("%s: progress not updated, the Prefect server did not take it (%s)",
                                         self.stage, type(e).__name__)
                away = True
                if self._closing:
                    return
                continue
            away = False
            if self._latest is latest:
                self._latest = None

    def close(self, timeout: float = 10.0) -> None:
        """Send the last figures (within `timeout`) and stop the sender."""
        self._closing = True
        self._wake.set()
        self._sender.join(timeout=timeout)

    def __call__(self, done: int, total: int) -> None:
        now, last = time.monotonic(), done >= total
        if self.first_done is None:
            self.first_done = done - 1
        self.progress = 100.0 * min(done / max(total, 1), 1.0)
        if now - self.updated >= self.update_s or last:
            self._update()
            self.updated = now
        if now - self.logged >= self.log_s or last:
            elapsed = now - self.started
            left = elapsed / max(done - self.first_done, 1) * max(total - done, 0)
            self._logger.info("%s: %s %d of %d (%.0f%%), %.0f s so far, about %.0f s to go", self.stage, self.unit,
                              done, total, 100 * done / max(total, 1), elapsed, left)
            self.logged = now


def reward_report(result, metrics: dict[str, float], num_table_rows: int, demo: bool) -> list[dict[str, str]]:
    """Calibration and the highest- and lowest-scored held-out responses as tables; on the demo
    world, the gold function's agreement with the model (into `metrics`). Returns samples to show."""
    scores = result.eval_scores
    if demo:
        metrics["eval/gold_accuracy"] = gold_accuracy(
            last_user_turns(scores["prompt_messages"]), list(scores["chosen"]), list(scores["rejected"]),
            list(scores["score_chosen"]), list(scores["score_rejected"]))
    mlflow.log_table(result.calibration, "calibration.json")
    shown = scores.assign(user=[last_user_message(json.loads(m)) for m in scores["prompt_messages"]])
    responses = pd.concat([
        shown[["user", "chosen", "score_chosen"]].set_axis(["user", "response", "score"], axis=1),
        shown[["user", "rejected", "score_rejected"]].set_axis(["user", "response", "score"], axis=1),
    ]).sort_values("score", ascending=False)
    extremes = pd.concat([responses.head(num_table_rows).assign(rank="highest"),
                          responses.tail(num_table_rows).assign(rank="lowest")])
    mlflow.log_table(extremes, "extremes.json")
    return [{"user": u, "response": f"{r}  (score {s:+.2f})"} for u, r, s in
            extremes[["user", "response", "score"]].head(3).itertuples(index=False)]


class GoldJudgments:
    """Demo world: gold figures of PPO's episodes, judged here because no stage may read the gold
    function, logged at their iteration. Kept in the work folder too, so a resumed run's curves
    start at iteration 1 (the stage replays its own history; this one is ours to replay)."""

    def __init__(self, file: Path, log: Callable[[dict[str, float], int], None],
                 judge: Callable[[pd.DataFrame], dict[str, float]]):
        self.file, self.log, self._judge = file, log, judge
        self.by_iteration: dict[int, dict[str, float]] = {}
        if self.file.exists():
            for row in map(json.loads, self.file.read_text().splitlines()):
                self.by_iteration[row["iteration"]] = row["figures"]
                self.log(row["figures"], row["iteration"])

    def __call__(self, table: pd.DataFrame, iteration: int) -> None:
        if iteration in self.by_iteration:  # a resumed run redoes the iterations after its checkpoint: judged already
            return
        figures = self._judge(table)
        self.by_iteration[iteration] = figures
        self.log(figures, iteration)
        with self.file.open("a") as f:
            f.write(json.dumps({"iteration": iteration, "figures": figures}) + "\n")

    @classmethod
    def of_rollouts(cls, folder: Path, log) -> GoldJudgments:
        """`rollout/gold_reward` of every iteration's episodes (the over-optimisation curve); in the tool
        world (a `liked` column) by its gold, on the episodes' final answers."""
        return cls(folder / "rollout-gold.jsonl", log, lambda table: {
            "rollout/gold_reward": mean_gold_reward(list(table["prompt_messages"]), list(table["response"]),
                                                    list(table["liked"]) if "liked" in table else None)})

    @classmethod
    def of_evaluations(cls, folder: Path, log) -> GoldJudgments:
        """`eval/gold_win_rate` and the rest of `gold_comparison` for every evaluation before the last."""
        return cls(folder / "evaluation-gold.jsonl", log, judge_evaluation)


def evaluation_report(table: pd.DataFrame, metrics: dict[str, float], warnings: list[str],
                      demo_evaluation: bool) -> list[dict[str, str]]:
    """A policy's held-out evaluation (PPO's or DPO's) as a table, its warnings, and the gold figures
    of the evaluation (into `metrics`) when its prompts are the demo world's. Returns samples to show."""
    if demo_evaluation:
        metrics |= judge_evaluation(table)
    users = [last_user_message(json.loads(m)) for m in table["prompt_messages"]]
    mlflow.log_table(table.drop(columns=["prompt", "prompt_messages"]).assign(user=users), "evaluation.json")
    mlflow.log_text("\n".join(warnings) or "no warnings", "warnings.txt")
    return [{"user": u, "response": f"{r}  (SFT: {s})"} for u, r, s in
            zip(users[:4], table["policy_response"].head(4), table["sft_response"].head(4), strict=True)]


def ppo_report(result, metrics: dict[str, float], warnings: list[str], gold: GoldJudgments | None,
               demo_evaluation: bool) -> list[dict[str, str]]:
    """PPO's evaluation against SFT and its curves; the over-optimisation plot when the rollouts
    were judged (`gold`). Returns samples to show."""
    from rlhf.plots import curves, overoptimization

    samples = evaluation_report(result.evaluation, metrics, warnings, demo_evaluation)
    scores = ["rollout/score"] + [k for k in ("rollout/score_raw",) if k in result.history[-1]]  # raw: a reward model's
    for keys, name in ((scores, "score"), (["rollout/kl", "rollout/kl_coef"], "kl"),
                       (["rollout/response_length", "rollout/eos_rate"], "length")):
        mlflow.log_figure(curves(result.history, keys, f"PPO {name}"), f"plots/{name}.png")
    if gold is not None and gold.by_iteration:
        by_iteration = {i: figures["rollout/gold_reward"] for i, figures in gold.by_iteration.items()}
        proxy = "proxy score (normalised)" if len(scores) > 1 else "proxy score (reward functions)"
        mlflow.log_figure(overoptimization(result.history, by_iteration, proxy=proxy), "plots/overoptimization.png")
    return samples


def log_overhead(parent_run_id: str, ran: list[StageRecord]) -> None:
    """Wall time since the flow run was requested against the stages' own work: what Prefect,
    MLflow, data validation, artifact transfer and process start-up cost, on the pipeline run."""
    wall = (datetime.now(UTC) - get_run_context().flow_run.created).total_seconds()
    work = sum(r.metrics.get(STAGE_SECONDS, 0.0) for r in ran)
    figures = {"time/wall_seconds": wall, "time/stage_work_seconds": work,
               "time/orchestration_seconds": wall - work, "time/orchestration_share": (wall - work) / wall}
    MlflowClient().log_batch(parent_run_id,
                             metrics=[Metric(k, v, int(time.time() * 1000), 0) for k, v in figures.items()])
    get_run_logger().info("orchestration: %.1f s of %.1f s since the run was requested (%.0f%%); "
                          "stages' own work %.1f s",
                          wall - work, wall, 100 * (wall - work) / wall, work)


def pipeline_summary(records: list[StageRecord]) -> None:
    create_markdown_artifact(key="pipeline-summary", description="which stage runs ran and which were reused",
                             markdown="# Pipeline\n\n" + stage_table(records))


def _run_link(run_id: str, tab: str = "model-metrics") -> str:
    """Markdown: the run's id, linked to its `tab` (its curves by default) where the UI is reachable."""
    url = tracking.run_url(run_id, tab)
    return f"[{run_id[:8]}]({url})" if url else f"`{run_id}`"
