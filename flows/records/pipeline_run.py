"""A flow run's own MLflow run, the pipeline run its stage runs are children of: opened with what the
flow run was asked for and what it computes with, asked for each stage whether a finished run can stand
in for it, and closed with its description. Also the hook that closes what a crashed flow run left open, and
the flow run's parameters on the Prefect API with their secrets hidden.

The flow (`flows.pipeline`) says which stages run and in what order; this module keeps the record."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from mlflow.tracking import MlflowClient
from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.context import get_run_context
from prefect.utilities.urls import url_for

from flows.records.lineage import StageRecord, reused_record, stack_changes
from flows.records.reports import pipeline_note
from rlhf import stack, tracking
from rlhf.config import PipelineConfig, config_hash, flatten
from rlhf.sections.base import StageName


@dataclass(frozen=True)
class PipelineRun:
    """An open pipeline run and what its stage runs take from it."""

    cfg: PipelineConfig
    config_file: str
    overrides: dict[str, Any]
    """Every override applied to the config file: the form's fields, then the explicit ones."""
    experiment_id: str
    run_id: str
    label: str
    """The Prefect flow run's name (`super-earwig`): every MLflow run of this pipeline run carries it."""
    flow_run_url: str | None
    """The Prefect flow run in the Prefect UI."""

    @classmethod
    def start(cls, cfg: PipelineConfig, stages: list[StageName], config_file: str,
              overrides: dict[str, Any]) -> PipelineRun:
        """The pipeline run of this flow run, tagged with its stages, config file and overrides, the code
        and the stack it computes with; the resolved config as its params and `config.yaml`. Warns when the
        environment is not its lock (its stage runs are then never reused by locked ones)."""
        experiment_id = tracking.ensure_experiment(cfg.experiment)
        version, commit = tracking.code_version()
        flow_run = get_run_context().flow_run
        flow_run_url = url_for(flow_run)
        run_id = tracking.start_pipeline_run(
            experiment_id, f"{Path(config_file).stem} · {flow_run.name}", {
                "rlhf.stages": ",".join(stages), tracking.TAG_CONFIG_FILE: config_file,
                tracking.TAG_OVERRIDES: json.dumps(overrides),
                tracking.TAG_CONFIG_HASH: config_hash(cfg), tracking.TAG_CODE_VERSION: version,
                tracking.TAG_GIT_COMMIT: commit, tracking.TAG_TREE: tracking.tree_state(commit),
                tracking.TAG_PREFECT_FLOW_RUN: str(flow_run.id),
                tracking.TAG_NOTE: pipeline_note(config_file, overrides, [], {"Prefect flow run": flow_run_url})}
            | stack.current().tags(),
            flatten(cfg), yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        logger = get_run_logger()
        logger.info("MLflow pipeline run %s", tracking.run_url(run_id) or run_id)
        if not stack.current().locked:
            logger.warning("this environment is not %s (%s): its stage runs are tagged rlhf.stack.locked false and "
                           "are never reused by runs from the locked environment; `make install` restores the lock",
                           stack.environment_lock(), "; ".join(stack.current().differences[:8]) or "no lock file")
        return cls(cfg, config_file, overrides, experiment_id, run_id, flow_run.name, flow_run_url)

    @property
    def links(self) -> dict[str, str | None]:
        return {"Prefect flow run": self.flow_run_url}

    def reused(self, stage: StageName, cache_key: str, work_key: str) -> StageRecord | None:
        """The record of a finished run of `stage` with this cache key, named on the pipeline run as the one
        reused; None when there is none, saying which packages moved where the same work (`work_key`)
        finished under another stack."""
        logger, cfg = get_run_logger(), self.cfg
        cached = tracking.latest_finished_run(cfg.experiment, stage, cache_key)
        if cached is None:
            stale = tracking.finished_runs(cfg.experiment, stage, {tracking.TAG_WORK_KEY: work_key}, 1)
            if stale:
                logger.warning("%s: stack changed since finished run %s (%s); running the stage again", stage,
                               stale[0].info.run_id, stack_changes(stage, cfg, stale[0]))
            return None
        MlflowClient().set_tag(self.run_id, tracking.TAG_REUSED + stage, cached.info.run_id)
        logger.info("%s: reusing finished run %s (same config, data, code and upstream runs)", stage,
                    cached.info.run_id)
        if stage in ("ppo", "dpo") and cfg.registry.enabled and tracking.TAG_REGISTERED_MODEL not in cached.data.tags:
            logger.warning("%s: the reused run %s registered no policy (it ran with registry.enabled false); "
                           "rerun with use_cache false to register one", stage, cached.info.run_id)
        return reused_record(stage, cached)

    def close(self, records: list[StageRecord], ok: bool) -> None:
        """The pipeline run described (each stage's run, figures and warnings) and ended, FINISHED when `ok`.
        Where the server is gone, a warning: the error that ended the flow run is the one to report."""
        try:
            tracking.set_note(self.run_id, pipeline_note(self.config_file, self.overrides, records, self.links))
            tracking.end_run(self.run_id, ok)
        except Exception as e:
            get_run_logger().warning("could not mark pipeline run %s %s: %s", self.run_id,
                                     "FINISHED" if ok else "FAILED", type(e).__name__)


def hide_secret_parameters() -> None:
    """The flow run's parameters on the Prefect API (the UI's Parameters tab, `prefect flow-run inspect`) with
    any secret redacted: an override may hold a URL's password or a token. Whoever submitted the run sent
    them in clear, so they are replaced as the run starts; a retry from the UI then runs with `***` in their
    place and fails where it needs the secret (a config names a secret's variable instead: `*_env`). And every
    line the flow and its tasks log from then on is redacted, arguments and tracebacks included."""
    tracking.redact_logs("prefect.flow_runs", "prefect.task_runs")
    flow_run = get_run_context().flow_run
    hidden = {name: _redacted_json(value) for name, value in flow_run.parameters.items()}
    if hidden != flow_run.parameters:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, parameters=hidden)


def _redacted_json(value: Any) -> Any:
    """A parameter's value, redacted as JSON text so that a key naming a secret (`{"token": ...}`) hides its
    value too; the redacted text itself where that left no JSON (`"token": 5` became `"token": ***`)."""
    text = json.dumps(value, default=str)
    hidden = tracking.redact(text)
    if hidden == text:
        return value
    try:
        return json.loads(hidden)
    except ValueError:
        return hidden


def close_crashed_runs(flow, flow_run, state) -> None:
    """`on_crashed` hook, run by the worker when the flow run's process died (killed, out of
    memory): its task runs still Running end Crashed, and its MLflow runs still RUNNING end
    KILLED, so neither UI shows work that no process does. A rerun resumes the stage's work."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Crashed

    message = f"the flow run's process died ({state.message or 'crashed'})"
    with get_client(sync_client=True) as client:
        for task_run in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))):
            if task_run.state is not None and not task_run.state.is_final():
                client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
    tracking.kill_runs_of_flow_run(str(flow_run.id))
