"""Faults, each against the real servers: MLflow down at start, MLflow and Prefect away together for
a minute mid-PPO, MLflow away past the stage's limit (stopped, retried, resumed), an artifact upload the server
refuses, and two pipeline runs at once.

MLflow's client retries are shortened here (2 retries, backoff factor 1) so that each fault
ends in seconds; the stack's defaults are in scripts/stack.sh.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf import tracking
from stages.runtime.models import folder_digest
from tests.stack import (
    final_states,
    flow_run_logs,
    kill_service,
    mlflow_client,
    running_stack,
    start,
    submit,
    submit_and_wait,
)

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]
TINY = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("faults"), MLFLOW_HTTP_REQUEST_MAX_RETRIES="2",
                       MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="1") as env:
        yield env


def _runs(env, filter_string: str = ""):
    client = mlflow_client(env)
    experiment = client.get_experiment_by_name("rlhf")
    return client.search_runs([experiment.experiment_id], filter_string=filter_string) if experiment else []


def _wait_for(condition, what: str, submitted, timeout: float = 300):
    """Poll `condition` while the submitted deployment runs are under way."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert submitted.poll() is None, f"the runs ended before {what}: {final_states(submitted)}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)
    return found


def test_mlflow_down_at_start_retries_with_backoff_then_fails_clearly(stack):
    kill_service(stack, "mlflow")
    try:
        ((state, message, _),) = submit_and_wait(stack, [("rlhf/sft", {"config_file": TINY})])
    finally:
        start(stack)
    assert state == "FAILED"
    assert f"MLflow tracking server {stack['MLFLOW_TRACKING_URI']} did not answer after 5 attempts over 15 s" in message
    assert not _runs(stack)


def test_refused_checkpoint_upload_leaves_the_run_unfinished_and_the_checkpoint_on_disk(stack):
    overrides = {"sft.max_steps": 40, "sft.seed": 11}
    submitted = submit(stack, [("rlhf/sft", {"config_file": TINY, "overrides": overrides})])
    (run,) = _wait_for(lambda: _runs(stack, "tags.`rlhf.stage` = 'sft' and params.seed = '11'"), "sft run", submitted)
    # The server stores artifacts under mlartifacts/<experiment>/<run>/artifacts; a file where the
    # checkpoint folder must go makes the server refuse every checkpoint upload (HTTP 500).
    stored = Path(stack["RLHF_HOME"]) / "mlartifacts" / run.info.artifact_uri.split(":/", 1)[1]
    stored.mkdir(parents=True, exist_ok=True)
    (stored / tracking.CHECKPOINT_PATH).write_text("in the way")
    ((state, message, _),) = final_states(submitted)

    assert state == "FAILED"
    assert "stage sft: uploading the checkpoint" in message and "failed after retries" in message
    kept = Path(message.split("the checkpoint is kept in ", 1)[1].split(" until", 1)[0])
    assert (kept / "model.safetensors").is_file()
    assert mlflow_client(stack).get_run(run.info.run_id).info.status == "FAILED"

    (stored / tracking.CHECKPOINT_PATH).unlink()  # the store is fixed; the rerun uploads
    ((state, message, _),) = submit_and_wait(stack, [("rlhf/sft", {"config_file": TINY, "overrides": overrides})])
    assert state == "COMPLETED", message
    (rerun,) = _runs(stack, "tags.`rlhf.stage` = 'sft' and params.seed = '11' and attributes.status = 'FINISHED'")
    assert {a.path for a in mlflow_client(stack).list_artifacts(rerun.info.run_id, tracking.CHECKPOINT_PATH)} >= {
        f"{tracking.CHECKPOINT_PATH}/model.safetensors"}
    assert not kept.exists()  # the local copy goes once the upload is confirmed


OUTAGE_S = 60
"""How long a server stays away in the outage tests: a minute, the blip a healthy stage must outlive."""


def _ppo_run_away(stack, services: tuple[str, ...], overrides: dict, away_s: float = OUTAGE_S):
    """An `rlhf/full` run whose `services` (mlflow, prefect) are killed at PPO's first full-state checkpoint
    and started again `away_s` later: (final state, message, flow run id)."""
    submitted = submit(stack, [("rlhf/full", {"config_file": TINY, "overrides": overrides})])
    work = Path(stack["RLHF_HOME"]) / "work"
    before = set(work.glob("ppo-*/state/loop.json"))
    _wait_for(lambda: set(work.glob("ppo-*/state/loop.json")) - before, "PPO full-state checkpoint", submitted)
    for service in services:
        kill_service(stack, service)
    try:
        time.sleep(away_s)
    finally:
        start(stack)
    return final_states(submitted)[0]


def _stage_runs(stack, flow_run_id: str, stage: str) -> list:
    return _runs(stack, f"tags.`{tracking.TAG_PREFECT_FLOW_RUN}` = '{flow_run_id}' and tags.`rlhf.stage` = '{stage}'")


def test_mlflow_and_prefect_away_for_a_minute_mid_ppo_cost_the_run_nothing(stack):
    """Both servers killed at once (the machine that holds them restarting) and back a minute later:
    the stage trains on, its figures wait in the journal, and the flow run's reports to Prefect
    are retried. One test for both: each alone is the same wait, and this is the harder case."""
    from flows.records.journal import TAG_GAPS

    overrides = {"ppo.num_iterations": 60, "ppo.checkpoint_every": 2, "ppo.seed": 21}
    state, message, flow_run_id = _ppo_run_away(stack, ("mlflow", "prefect"), overrides)
    assert state == "COMPLETED", message
    (run,) = _stage_runs(stack, flow_run_id, "ppo")  # one run: the stage trained on, it was not rerun
    assert run.info.status == "FINISHED"
    steps = [m.step for m in mlflow_client(stack).get_metric_history(run.info.run_id, "rollout/kl")]
    assert sorted(steps) == list(range(1, 61))  # every iteration's figures, those of the outage included
    (gap,) = run.data.tags[TAG_GAPS].split("; ")
    assert int(gap.split(" s from ")[0]) >= OUTAGE_S - 10, gap
    warnings = Path(mlflow_client(stack).download_artifacts(run.info.run_id, "warnings.txt")).read_text()
    assert "the MLflow tracking server did not answer for" in warnings


def test_mlflow_away_past_the_limit_stops_the_stage_naming_it_and_the_retry_resumes(stack):
    overrides = {"ppo.num_iterations": 60, "ppo.checkpoint_every": 2, "ppo.seed": 23, "outage_limit_s": 5}
    state, message, flow_run_id = _ppo_run_away(stack, ("mlflow",), overrides, away_s=20)
    logs = flow_run_logs(stack, flow_run_id)
    assert state == "COMPLETED", "\n".join([message, *logs[-30:]])
    stopped = [line for line in logs if "has not answered for" in line]
    assert stopped and f"the MLflow tracking server {stack['MLFLOW_TRACKING_URI']}" in stopped[0], logs[-20:]
    assert "past the limit of 5 s (outage_limit_s)" in stopped[0]
    assert any("Retry 1/2" in line for line in logs), logs[-20:]
    interrupted, resumed = sorted(_stage_runs(stack, flow_run_id, "ppo"), key=lambda r: r.info.start_time)
    client = mlflow_client(stack)
    assert client.get_run(interrupted.info.run_id).data.tags[tracking.TAG_ABANDONED_BY] == resumed.info.run_id
    assert resumed.info.status == "FINISHED"
    # what the stopped attempt logged while the server was away reached its own run with the retry
    assert client.get_metric_history(interrupted.info.run_id, "rollout/kl")
    warnings = Path(client.download_artifacts(resumed.info.run_id, "warnings.txt")).read_text()
    assert "resumed from the full-state checkpoint after iteration" in warnings
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "rollout/kl")]
    assert sorted(steps) == list(range(1, 61))  # the whole curve, not only from the resume point


def test_two_pipeline_runs_at_once_keep_their_files_and_runs_apart(stack):
    params = {"config_file": TINY, "overrides": {"sft.max_steps": 30, "sft.seed": 5}, "use_cache": False}
    states = submit_and_wait(stack, [("rlhf/full", params), ("rlhf/full", params)])
    assert [s[0] for s in states] == ["COMPLETED", "COMPLETED"], states

    client = mlflow_client(stack)
    digests, spans = [], []
    for _, _, flow_run_id in states:
        (pipeline,) = _runs(stack,
                            f"tags.`{tracking.TAG_PREFECT_FLOW_RUN}` = '{flow_run_id}' and tags.`rlhf.stages` != ''")
        stage_runs = {r.data.tags[tracking.TAG_STAGE]: r for r in
                      _runs(stack, f"tags.`{tracking.TAG_PIPELINE}` = '{pipeline.info.run_id}'")}
        assert sorted(stage_runs) == ["ppo", "reward", "sft"]
        assert all(r.info.status == "FINISHED" for r in stage_runs.values())
        for run in stage_runs.values():  # what was uploaded is what was trained, byte for byte
            folder = client.download_artifacts(run.info.run_id, tracking.CHECKPOINT_PATH)
            assert folder_digest(Path(folder)) == run.data.tags[tracking.TAG_CHECKPOINT_DIGEST]
        digests.append({stage: r.data.tags[tracking.TAG_CHECKPOINT_DIGEST] for stage, r in stage_runs.items()})
        spans.append((pipeline.info.start_time, pipeline.info.end_time))
    # the two pipelines really ran side by side (their SFT stages alone may not: the worker can start the
    # second flow run seconds after the first, and 30 steps of SFT on the tiny config take about as long)
    (a_start, a_end), (b_start, b_end) = spans
    assert a_start < b_end and b_start < a_end
    assert digests[0] == digests[1]  # same work, same result, although it ran side by side
    work = Path(stack["RLHF_HOME"]) / "work"
    assert not [p for p in work.iterdir() if p.is_dir()]  # both attempts cleaned up after themselves


def test_a_flow_run_killed_mid_ppo_leaves_no_task_or_mlflow_run_running(stack):
    import psutil

    params = {"config_file": TINY, "overrides": {"ppo.num_iterations": 50, "ppo.checkpoint_every": 2}}
    submitted = submit(stack, [("rlhf/full", params)])
    work = Path(stack["RLHF_HOME"]) / "work"
    _wait_for(lambda: list(work.glob("ppo-*/state/loop.json")), "PPO full-state checkpoint", submitted)
    worker = psutil.Process(int((Path(stack["RLHF_HOME"]) / "pids" / "worker").read_text()))
    for process in worker.children(recursive=True):  # the flow run's process, as the OOM killer would end it
        process.kill()
    ((state, message, flow_run_id),) = final_states(submitted)
    assert state == "CRASHED", message
    # the worker's on_crashed hook closed what the dead process left open
    script = ("import json, sys; from prefect import get_client; from prefect.client.schemas.filters import "
              "FlowRunFilter, FlowRunFilterId\n"
              "with get_client(sync_client=True) as c:\n"
              "    runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[sys.argv[1]])))\n"
              "    print(json.dumps({r.name.split('-')[0]: r.state.type.value for r in runs}))")
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run([sys.executable, "-c", script, flow_run_id], env=stack, capture_output=True, text=True)
        tasks = json.loads(out.stdout.strip().splitlines()[-1])
        mlflow_runs = _runs(stack, f"tags.`{tracking.TAG_PREFECT_FLOW_RUN}` = '{flow_run_id}'")
        if tasks.get("ppo") == "CRASHED" and all(r.info.status != "RUNNING" for r in mlflow_runs):
            break
        assert time.monotonic() < deadline, (tasks, [(r.info.run_name, r.info.status) for r in mlflow_runs])
        time.sleep(1)
    (crashed,) = [r for r in mlflow_runs if r.data.tags.get(tracking.TAG_STAGE) == "ppo"]
    assert crashed.info.status == "KILLED"
    # a rerun takes the crashed attempt's work over, and says so on its runs
    ((state, message, _),) = submit_and_wait(stack, [("rlhf/full", params)])
    assert state == "COMPLETED", message
    (resumed,) = _runs(stack, f"tags.`{tracking.TAG_CACHE_KEY}` = '{crashed.data.tags[tracking.TAG_CACHE_KEY]}' "
                              "and attributes.status = 'FINISHED'")
    assert mlflow_client(stack).get_run(crashed.info.run_id).data.tags[tracking.TAG_ABANDONED_BY] == resumed.info.run_id
