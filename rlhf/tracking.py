"""MLflow conventions of the pipeline: experiment, run hierarchy, lineage tags, artifacts.

Stages never import this module; flows do. Every stage run is a child of one pipeline run
and is found again through its tags (`rlhf.stage`, `rlhf.upstream.*`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import math
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import mlflow
import pandas as pd
import requests
from mlflow.entities import Param, RunStatus
from mlflow.tracking import MlflowClient

from rlhf.sections.base import REPO_ROOT, state_dir

TAG_STAGE = "rlhf.stage"
TAG_PIPELINE = "rlhf.pipeline_run_id"
TAG_CONFIG_HASH = "rlhf.config_hash"
TAG_CONFIG_FILE = "rlhf.config_file"  # on a pipeline run: the config file it ran
TAG_OVERRIDES = "rlhf.overrides"  # on a pipeline run: the overrides applied to that file (JSON)
TAG_DATA_DIGEST = "rlhf.data_digest"
TAG_CHECKPOINT_DIGEST = "rlhf.checkpoint_digest"
TAG_CODE_VERSION = "rlhf.code_version"
TAG_GIT_COMMIT = "rlhf.git_commit"
TAG_UPSTREAM = "rlhf.upstream."  # + stage name, e.g. rlhf.upstream.sft -> that stage's run id
TAG_PREFECT_FLOW_RUN = "rlhf.prefect_flow_run_id"
TAG_CACHE_KEY = "rlhf.cache_key"
TAG_WORK_KEY = "rlhf.work_key"  # the cache key less the stack: finds the run a stack change made stale
TAG_TREE = "rlhf.tree"  # clean, dirty (uncommitted changes: see rlhf.git_commit) or unknown (no git checkout)
TAG_REUSED = "rlhf.reused."  # + stage name, on the pipeline run -> the reused stage run id
TAG_ABANDONED_BY = "rlhf.abandoned_by"  # on a killed attempt's runs -> the stage run that took over its work
TAG_WARNINGS = "rlhf.warnings"  # how many warnings a stage raised (their text is in the run's description)
TAG_EVALUATION_KEY = "rlhf.evaluation_key"  # on a model version: what its figures were measured on
TAG_JUDGED_BY = "rlhf.judged_by"  # on a model version: the figure the champion alias compares (eval/...)
TAG_REGISTERED_MODEL = "rlhf.registered_model"  # on a PPO or DPO run -> `<registered model>/<version>` it became
TAG_REWARD_FUNCTIONS = "rlhf.reward_functions"  # on a PPO run: its reward's function terms, weights and source digests
TAG_REWARD_REMOTE = "rlhf.reward_remote"  # on a PPO run: its remote terms (kind, URL, weight, template, served run)
TAG_TEACHER = "rlhf.teacher"  # on a PPO run: its distillation teacher as given, and what that resolved to
TAG_NOTE = "mlflow.note.content"  # the run's description, shown on its overview page
CHECKPOINT_PATH = "checkpoint"
# on a stage run: every installed package, `name==version` (normalized names), sorted
ENVIRONMENT_PATH = "environment.txt"
DATA_PATH = "data"


class TrackingError(RuntimeError):
    """The tracking server could not be reached, or refused to store a stage's results."""


class ServerGone(TrackingError):
    """The tracking server stopped answering, or never answered: what a retry may outlive, whether or not
    the server answers again by the time the failure is handled."""


def server_answers(timeout: float = 5.0) -> bool:
    """True when tracking is local (a database path) or the tracking server answers its health check."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith("http"):
        return True
    try:
        return requests.get(f"{uri.rstrip('/')}/health", timeout=timeout).ok
    except requests.RequestException:
        return False


def wait_for_server(attempts: int = 5, first_delay_s: float = 1.0, log: Callable[[str], None] = print) -> None:
    """Return once the tracking server answers, retrying with exponential backoff (1, 2, 4, ... s);
    raise `ServerGone` naming the server after the last attempt."""
    delay, waited = first_delay_s, 0.0
    for attempt in range(1, attempts + 1):
        if server_answers():
            return
        if attempt < attempts:
            log(f"MLflow tracking server {mlflow.get_tracking_uri()} does not answer "
                f"(attempt {attempt} of {attempts}); retrying in {delay:g} s")
            time.sleep(delay)
            waited, delay = waited + delay, delay * 2
    raise ServerGone(f"MLflow tracking server {mlflow.get_tracking_uri()} did not answer after {attempts} attempts "
                        f"over {waited:g} s; start it (`make up`) or point MLFLOW_TRACKING_URI at a running server")


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


@functools.cache
def code_version() -> tuple[str, str]:
    """(package version, git commit); an uncommitted change adds '+dirty.<digest of the diff>', so
    the cache never mistakes edited code for the commit it started from. Read once per process:
    a flow run executes the code it imported at start."""
    try:
        version = metadata.version("rlhf-pipeline")
    except metadata.PackageNotFoundError:
        version = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD"], cwd=REPO_ROOT, capture_output=True, timeout=30).stdout
        commit += f"+dirty.{hashlib.sha256(diff).hexdigest()[:12]}" if diff.strip() else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return version, commit


def tree_state(commit: str) -> str:
    """`clean`, `dirty` or `unknown`, from `code_version()`'s commit."""
    return "unknown" if commit == "unknown" else "dirty" if "+dirty." in commit else "clean"


def start_pipeline_run(experiment_id: str, name: str, tags: dict[str, str], params: dict[str, str],
                       config_yaml: str) -> str:
    """The pipeline run: the resolved config as params (`sft.learning_rate`, ...) and as `config.yaml`."""
    client = MlflowClient()
    run_id = client.create_run(experiment_id, run_name=name, tags=redacted(tags)).info.run_id
    client.log_batch(run_id, params=[Param(key, value) for key, value in redacted(params).items()])
    client.log_text(run_id, redact(config_yaml), "config.yaml")
    return run_id


def create_stage_run(experiment_id: str, parent_run_id: str, stage: str, name: str, tags: dict[str, str]) -> str:
    tags = {"mlflow.parentRunId": parent_run_id, TAG_PIPELINE: parent_run_id, TAG_STAGE: stage, **tags}
    return MlflowClient().create_run(experiment_id, run_name=name, tags=redacted(tags)).info.run_id


def set_note(run_id: str, markdown: str) -> None:
    """The run's description (MLflow's note), shown on its overview page."""
    MlflowClient().set_tag(run_id, TAG_NOTE, redact(markdown))


def end_run(run_id: str, ok: bool) -> None:
    MlflowClient().set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED))


def close_abandoned_runs(experiment_id: str, stage: str, cache_key: str, by_run_id: str) -> list[str]:
    """Hand the runs of an earlier attempt at the same work that died (a SIGKILL, a lost machine)
    over to `by_run_id`: tag them `rlhf.abandoned_by` and mark KILLED their stage run and its
    pipeline run where still RUNNING. Runs the worker already marked KILLED when the attempt's flow
    run crashed (`kill_runs_of_flow_run`) are handed over too. Called only by the holder of the
    work folder's lock, which proves no live process on this machine owns them."""
    client = MlflowClient()
    same_work = f"tags.`{TAG_STAGE}` = '{stage}' and tags.`{TAG_CACHE_KEY}` = '{cache_key}'"
    dead = client.search_runs([experiment_id], filter_string=f"{same_work} and attributes.status = 'RUNNING'")
    dead += [run for run in client.search_runs([experiment_id], f"{same_work} and attributes.status = 'KILLED'")
             if TAG_ABANDONED_BY not in run.data.tags]
    closed = []
    for run in dead:
        if run.info.run_id == by_run_id:
            continue
        for run_id in (run.info.run_id, run.data.tags.get(TAG_PIPELINE)):
            status = client.get_run(run_id).info.status if run_id else None
            if status in ("RUNNING", "KILLED"):
                client.set_tag(run_id, TAG_ABANDONED_BY, by_run_id)
            if status == "RUNNING":
                client.set_terminated(run_id, RunStatus.to_string(RunStatus.KILLED))
        closed.append(run.info.run_id)
    return closed


def kill_runs_of_flow_run(flow_run_id: str) -> None:
    """Mark KILLED every run still RUNNING that the given (dead) Prefect flow run started; a rerun
    of the same work hands them over (`close_abandoned_runs`)."""
    client = MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    wanted = f"tags.`{TAG_PREFECT_FLOW_RUN}` = '{flow_run_id}' and attributes.status = 'RUNNING'"
    for run in client.search_runs(experiments, filter_string=wanted) if experiments else []:
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))


def log_data(frame: pd.DataFrame, name: str, source: str, digest: str, context: str) -> None:
    """The validated records as a Parquet artifact under `data/` and as a run input."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.parquet"
        frame.to_parquet(path)
        mlflow.log_artifact(str(path), DATA_PATH)
    dataset = mlflow.data.from_pandas(frame.reset_index(drop=True), source=redact(source), name=name,
                                      digest=digest[:32])
    mlflow.log_input(dataset, context=context)


def download_checkpoint(run_id: str, dst: Path) -> Path:
    """An upstream stage's checkpoint, fetched through MLflow (never a local side path)."""
    dst.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=f"runs:/{run_id}/{CHECKPOINT_PATH}",
                                                    dst_path=str(dst)))


@dataclass(frozen=True)
class ModelSource:
    """A model named by an MLflow URI, as the run folder that holds it."""

    run_id: str
    path: str
    """The folder's artifact path in the run."""
    version: str | None = None
    """`<registered model>/<version>`, where the model was named through the registry."""

    def describe(self, given: str) -> str:
        """What a run's tag says of it: the URI given, and what it resolved to."""
        version = f"version {self.version.rsplit('/', 1)[1]}, " if self.version and given.startswith("models:/") \
            and "@" in given else ""
        return f"{given} ({version}runs:/{self.run_id}/{self.path})"


def model_source(location: str) -> ModelSource | None:
    """`runs:/<run id>/<path>`, `models:/<name>@<alias>` or `models:/<name>/<version>` as the run folder it
    names (a registered version: its run's `checkpoint`, the plain folder our stages log beside the
    MLflow model); None for any other location (a folder, a hub id). An alias is resolved now, to the
    version that holds it. Raises `TrackingError` naming what is missing."""
    if location.startswith("runs:/"):
        run_id, _, path = location[len("runs:/"):].partition("/")
        return ModelSource(run_id, path.strip("/") or CHECKPOINT_PATH)
    if not location.startswith("models:/"):
        return None
    name, alias = (location[len("models:/"):].split("@", 1) + [None])[:2]
    name, number = (name, None) if alias else name.rsplit("/", 1)
    try:
        version = MlflowClient().get_model_version_by_alias(name, alias) if alias else \
            MlflowClient().get_model_version(name, number)
    except mlflow.exceptions.MlflowException as e:
        raise TrackingError(f"{location}: no such registered model version ({e.message})") from e
    if not version.run_id or find_run(version.run_id) is None:
        raise TrackingError(f"{location} is version {version.version} of {name}, which names no run of this server "
                            "to fetch its folder from: give the folder or runs:/<run id>/<path> instead")
    return ModelSource(version.run_id, CHECKPOINT_PATH, f"{name}/{version.version}")


def download_model(source: ModelSource, dst: Path, config_only: bool = False) -> Path:
    """The folder `source` names, fetched through MLflow into `dst` (`config_only`: its `config.json` alone)."""
    dst.mkdir(parents=True, exist_ok=True)
    path = source.path + ("/config.json" if config_only else "")
    fetched = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"runs:/{source.run_id}/{path}", dst_path=str(dst)))
    return fetched.parent if config_only else fetched


def finished_runs(experiment_name: str, stage: str, tags: dict[str, str] | None = None, max_results: int = 1000):
    """The FINISHED runs of `stage` whose tags have the given values, most recent first."""
    experiment = MlflowClient().get_experiment_by_name(experiment_name)
    if experiment is None:
        return []
    wanted = f"tags.`{TAG_STAGE}` = '{stage}' and attributes.status = 'FINISHED'"
    for key, value in (tags or {}).items():
        wanted += f" and tags.`{key}` = '{value}'"
    return MlflowClient().search_runs([experiment.experiment_id], filter_string=wanted,
                                      order_by=["attributes.start_time DESC"], max_results=max_results)


def latest_finished_run(experiment_name: str, stage: str, cache_key: str | None = None):
    """The most recent FINISHED run of `stage` (with `cache_key`, when given), or None."""
    runs = finished_runs(experiment_name, stage, {TAG_CACHE_KEY: cache_key} if cache_key is not None else None, 1)
    return runs[0] if runs else None


def find_run(run_id: str):
    """The run with this id, or None when the tracking server has none (other errors are raised)."""
    try:
        return MlflowClient().get_run(run_id)
    except mlflow.exceptions.MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def latest_finished_run_id(experiment_name: str, stage: str) -> str | None:
    run = latest_finished_run(experiment_name, stage)
    return run.info.run_id if run else None


# MLflow 3's UI shows runs in a "GenAI" framing (traces, evaluations) unless the URL, or the
# browser's saved choice, asks for "machine_learning"; the experiment's kind tag does not decide it.
_MODEL_TRAINING_VIEW = "?workflowType=machine_learning"


def experiment_url(experiment_id: str) -> str | None:
    """Link to the experiment's runs table in the MLflow UI (Model-training view), when tracking goes through a
    server."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith("http"):
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs{_MODEL_TRAINING_VIEW}"


def run_url(run_id: str, tab: str = "") -> str | None:
    """Link to a run in the MLflow UI (Model-training view), when tracking goes through a server;
    `tab`: `model-metrics` for its curves, `artifacts`, ... (the overview by default)."""
    uri = mlflow.get_tracking_uri()
    if not uri.startswith("http"):
        return None
    run = MlflowClient().get_run(run_id)
    path = f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}" + (f"/{tab}" if tab else "")
    return path + _MODEL_TRAINING_VIEW


@dataclass(frozen=True)
class Workdir:
    path: Path
    owned: bool
    """True for the work's own keyed folder; False for a private folder, when another live process holds it."""


@contextmanager
def claimed_workdir(name: str) -> Iterator[Workdir]:
    """The local folder for one stage attempt, named by its cache key, so that a rerun of the same
    work (after a kill, or on a Prefect retry) finds the checkpoints an earlier attempt left.

    An exclusive lock for the attempt's lifetime keeps two live runs of the same work apart: the
    second gets a fresh private folder instead of sharing (and clobbering) the first's. The
    folder is removed only when the attempt succeeds; the lock dies with the process.
    """
    root = state_dir() / "work"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            workdir = Workdir(root / name, owned=True)
            workdir.path.mkdir(exist_ok=True)
        except BlockingIOError:
            workdir = Workdir(Path(tempfile.mkdtemp(dir=root, prefix=f"{name}.")), owned=False)
        yield workdir
        shutil.rmtree(workdir.path, ignore_errors=True)  # reached only when the block succeeded


@dataclass(frozen=True)
class Registration:
    version: str
    champion: bool
    """True when the champion alias moved to this version."""
    reason: str
    """Why the alias moved or stayed, for the log."""


def alias_holder(model_name: str, alias: str):
    """The model version that holds `alias`, or None when none does (other server errors are raised)."""
    try:
        return MlflowClient().get_model_version_by_alias(model_name, alias)
    except mlflow.exceptions.MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def register_policy(run_id: str, checkpoint: Path, model_name: str, alias: str, tags: dict[str, str],
                    evaluation_key: str, figure: str, value: float) -> Registration:
    """Log the checkpoint as an MLflow transformers model (text generation) linked to the run and
    register it as a new version of `model_name`, tagged with `tags`. `alias` moves to it only when
    the current holder was measured on the same evaluation (`evaluation_key`) and scored lower on
    `figure`, or when no version holds it yet."""
    import mlflow.transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto")  # in the dtype it was saved in
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    # Named rather than inferred: MLflow's inference imports packages (torchvision) a text model never needs.
    requirements = [f"{name}=={metadata.version(name)}" for name in ("torch", "transformers", "accelerate")]
    # A params schema, so a served model takes `max_new_tokens` per request (else MLflow ignores it).
    signature = mlflow.models.infer_signature(["prompt"], ["response"], params={"max_new_tokens": 64})
    info = mlflow.transformers.log_model({"model": model, "tokenizer": tokenizer}, name="policy",
                                         task="text-generation", registered_model_name=model_name,
                                         signature=signature, pip_requirements=requirements)
    client = MlflowClient()
    version = str(info.registered_model_version)
    value = float(f"{value:.6g}")  # as the tag holds it, so a tie with the holder's tag is a tie
    for key, text in {**tags, TAG_EVALUATION_KEY: evaluation_key, TAG_JUDGED_BY: figure,
                      figure: f"{value:.6g}"}.items():
        client.set_model_version_tag(model_name, version, key, redact(str(text)))
    holder = alias_holder(model_name, alias)
    held = float(holder.tags.get(figure, "nan")) if holder is not None else math.nan
    if not math.isfinite(value):
        moved, reason = False, f"{alias} does not move: {figure} is {value}"
    elif holder is None:
        moved, reason = True, f"{alias} is version {version}: the first with this alias"
    elif holder.tags.get(TAG_EVALUATION_KEY) != evaluation_key or holder.tags.get(TAG_JUDGED_BY) != figure:
        moved, reason = False, (f"{alias} stays on version {holder.version}: it was measured on another evaluation "
                                f"(held-out prompts, SFT baseline, reward model or sampling settings); move it by hand "
                                f"if this one is better")
    elif not math.isfinite(held) or value > held:
        moved, reason = True, f"{alias} moves to version {version}: {figure} {value:.4g} against {held:.4g}"
    else:
        moved, reason = False, (f"{alias} stays on version {holder.version}: {figure} {value:.4g} against "
                                f"{held:.4g} on the same evaluation")
    if moved:
        client.set_registered_model_alias(model_name, alias, version)
    return Registration(version, moved, reason)


_SCHEME = r"(?<![a-zA-Z0-9+.-])[a-zA-Z][a-zA-Z0-9+.-]*:/{1,2}"
"""A URI's scheme, starting where a run of scheme characters starts: tried at every letter of a long word,
it would rescan the word from each (quadratic)."""
_SECRETS = [
    # Each pattern runs in time linear in the text: a start is only where its run of characters starts (a
    # lookbehind), or a scan that may fail is bounded, so no failed attempt rescans what another scanned.
    # user:password@, also after a path library collapsed the URI's "//"; the password up to the host's `@`,
    # the last before the path (a password may hold `@`)
    (re.compile(rf"(?P<keep>{_SCHEME}[^/\s:@]{{1,256}}:)[^\s/]{{0,512}}@"), r"\g<keep>***@"),
    # a token as the whole userinfo: https://token@host (not MLflow's `models:/<name>@<alias>`: a name, no secret)
    (re.compile(rf"(?P<keep>(?!models:){_SCHEME})[^/\s:@*]{{1,512}}@"), r"\g<keep>***@"),
    (re.compile(r"(?P<keep>(?:token|key|secret|password|passwd|sig|signature|credential)s?=)[^&\s\"']+", re.I),
     r"\g<keep>***"),
    # YAML or JSON `api_key: value` (a name ending `_env` names a variable, not a secret; a tokenizer's
    # special tokens are no secret either)
    (re.compile(r"(?P<keep>(?<![\w-])(?!(?:pad|eos|bos|unk|sep|cls|mask)_token\b)(?:[\w-]{0,64}[_-])?"
                r"(?:api[_-]?key|token|secret|password|passwd)[\"']?\s*:\s*[\"']?)"
                r"(?![\"']?\s*(?:$|null\b|\*\*\*))[^\s\"',}]+", re.I | re.M), r"\g<keep>***"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), "hf_***"),  # Hugging Face access tokens
    (re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}"), "sk-***"),  # OpenAI-style and similar API keys
    (re.compile(r"\b(?:gh[pousr]|github_pat)_[A-Za-z0-9_]{20,}"), "gh_***"),  # GitHub tokens
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "AKIA***"),  # AWS access key ids
    (re.compile(r"(?P<keep>\b(?:Bearer|Basic)\s+)[A-Za-z0-9._~+/=-]{8,}", re.I), r"\g<keep>***"),
    # Prefect's `user:password` auth string (the stack's PREFECT_AUTH, PREFECT_API_AUTH_STRING): the user kept
    (re.compile(r"(?P<keep>(?<!\w)\w{0,64}AUTH(?:_STRING)?[\"']?\s*[=:]\s*[\"']?[^:\s\"']{1,128}:)[^\s\"']+", re.I),
     r"\g<keep>***"),
    (re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "eyJ***"),  # JWTs
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), "xox***"),  # Slack tokens
    (re.compile(r"(?P<keep>hooks\.slack\.com/services/)[A-Za-z0-9/]+"), r"\g<keep>***"),  # Slack webhooks
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}"), "AIza***"),  # Google API keys
    (re.compile(r"\bya29\.[0-9A-Za-z_-]{20,}"), "ya29.***"),  # Google OAuth access tokens
]


def redact(text: str) -> str:
    """The text with passwords in URIs and token-like values replaced by ***, for params and tags."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record (`redact`): its message with its `%s` arguments merged in, and
    its traceback, so that a secret in an argument or an exception's text is caught too."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def redact_logs(*names: str) -> None:
    """Every record logged to the loggers `names` redacted from now on (once each, however often it is asked)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(RedactingFilter())


def redacted(values: dict[str, str]) -> dict[str, str]:
    return {key: redact(str(value)) for key, value in values.items()}
