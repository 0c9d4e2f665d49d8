"""Lineage: what a stage run depends on (its cache key), which upstream runs it starts from, PPO's
teacher as the pipeline run resolved it, and the small record a stage hands to the next. No training,
no validation here.

Which upstream runs a stage starts from (`upstream_runs`) is decided along lineage, not stage by
stage: PPO's SFT run is the one its reward run was trained from, and a stage run alone starts
from the latest runs made with the config's own upstream sections (their `rlhf.config_hash`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from rlhf import stack, tracking
from rlhf.config import PipelineConfig, config_hash
from rlhf.demo.locations import resolve_location
from rlhf.sections.base import DataSource, StageName, vllm_python
from stages.rewards.functions import source_digests
from stages.runtime.models import folder_digest

AVAILABLE_STAGES: tuple[StageName, ...] = ("sft", "reward", "ppo", "dpo")
"""Stages in pipeline order; `dpo` is the alternative to reward + PPO (`stages: [sft, dpo]`)."""
RLHF_STAGES: tuple[StageName, ...] = ("sft", "reward", "ppo")
"""The classic pipeline, what a flow run runs when no stages are named."""
UPSTREAM: dict[str, tuple[StageName, ...]] = {"sft": (), "reward": ("sft",), "ppo": ("sft", "reward"), "dpo": ("sft",)}
"""The stages whose results each stage starts from (`upstream_stages`: PPO without a reward model needs no reward
run)."""


def upstream_stages(stage: StageName, cfg: PipelineConfig) -> tuple[StageName, ...]:
    """The stages whose results `stage` starts from under `cfg`: PPO whose reward is functions alone
    (no reward-model term) starts from SFT only."""
    if stage == "ppo" and not cfg.ppo.reward.uses_model:
        return ("sft",)
    return UPSTREAM[stage]


class StageRecord(BaseModel):
    """What a stage task hands back: identities and figures, never a model."""

    stage: StageName
    run_id: str
    checkpoint_uri: str
    config_hash: str
    data_digest: str
    checkpoint_digest: str
    metrics: dict[str, float]
    warnings: int = 0
    """How many warnings the stage raised (their text: the run's description and `warnings.txt`)."""
    reused: bool = False
    """True when an earlier finished run with the same cache key stood in for this stage."""


@dataclass(frozen=True)
class Fingerprint:
    """The identity of an input: the digest of a local file's or folder's content, or for a
    name this machine cannot read (a hub model or dataset) the name alone."""

    location: str
    digest: str | None
    """None: not readable here, so identified by its name only."""

    @classmethod
    def of(cls, location: str) -> Fingerprint:
        path = Path(location)
        if path.is_file():
            return cls(location, hashlib.sha256(path.read_bytes()).hexdigest())
        if path.is_dir():
            return cls(location, folder_digest(path))
        return cls(location, None)

    def key(self) -> str:
        return self.digest if self.digest is not None else f"name:{self.location}"


@dataclass(frozen=True)
class Teacher:
    """PPO's distillation teacher (`ppo.teacher.model`) as a pipeline run resolved it: once, before the
    memory plan, the cache key and the stage's fetch read it, so an alias moved on the registry meanwhile
    changes none of them; the next pipeline run resolves it again."""

    given: str
    """`ppo.teacher.model` as the config names it."""
    source: tracking.ModelSource | None
    """The run folder an MLflow URI names (an alias: its version's run, as of the resolution); None for a
    folder or a hub id, read as given."""

    @classmethod
    def of(cls, cfg: PipelineConfig) -> Teacher | None:
        """The config's teacher resolved (`tracking.model_source`); None where it names none. Raises
        `TrackingError` for a name the tracking server lacks."""
        if not cfg.ppo.teacher:
            return None
        return cls(cfg.ppo.teacher.model, tracking.model_source(cfg.ppo.teacher.model))

    def key(self, world: str | None) -> str:
        """What a cache key holds of it: the run folder resolved, or the folder's content."""
        if self.source is not None:
            return f"runs:/{self.source.run_id}/{self.source.path}"
        return Fingerprint.of(resolve_location(self.given, world)).key()

    def describe(self) -> str:
        """As a stage run's tag names it: as given, and what it resolved to."""
        return self.given if self.source is None else self.source.describe(self.given)


def resolved_teacher(cfg: PipelineConfig, teacher: Teacher | None, reader: str) -> Teacher:
    """`teacher` where it is the one `cfg` names, as the pipeline run resolved it (`Teacher.of`); else a
    ValueError naming `reader` (the cache key, the memory plan), which never resolves it on its own."""
    if teacher is None or teacher.given != cfg.ppo.teacher.model:
        raise ValueError(f"ppo.teacher.model {cfg.ppo.teacher.model}: {reader} takes the teacher as the pipeline "
                         f"run resolved it (Teacher.of(cfg)); got {teacher.given if teacher else 'none'}")
    return teacher


def cache_key(stage: str, cfg: PipelineConfig, world: str | None, upstream: dict[str, str],
              teacher: Teacher | None = None) -> str:
    """What a stage's result depends on: its resolved config, the content of every input it reads
    (PPO's teacher as `teacher` resolved it), the code version, the upstream runs it starts from, the
    pipeline's determinism settings, and the stack it computes with (`rlhf.stack`: the compute packages'
    versions, whether the environment is its lock)."""
    return stage_keys(stage, cfg, world, upstream, teacher)[0]


def stage_keys(stage: str, cfg: PipelineConfig, world: str | None, upstream: dict[str, str],
               teacher: Teacher | None = None) -> tuple[str, str]:
    """(`cache_key`, work key): the work key is the cache key without the stack, the same work under
    any stack. A finished run with this work key but another cache key is one a stack change made
    stale (`stack_changes` says what moved). The inputs are read and digested once for both."""
    work = _work(stage, cfg, world, upstream, teacher)
    with_stack = work | {"stack": stack.current().key(stage_vllm(stage, cfg))}
    return _digest(with_stack), _digest(work)


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _work(stage: str, cfg: PipelineConfig, world: str | None, upstream: dict[str, str],
          teacher: Teacher | None) -> dict:
    section = getattr(cfg, stage)
    inputs = {}
    for name, value in section:
        if isinstance(value, DataSource):
            inputs[name] = Fingerprint.of(resolve_location(value.path, world)).key() + f":{value.split}:{value.format}"
        elif name == "model" and isinstance(value, str):
            inputs[name] = Fingerprint.of(resolve_location(value, world)).key()
    parts = {"stage": stage, "config": config_hash(section), "inputs": inputs, "code": tracking.code_version(),
             "upstream": upstream, "determinism": [cfg.deterministic, cfg.num_threads]}
    if stage == "ppo" and cfg.ppo.reward.functions:  # a reward function's source, wherever it lives
        parts["reward_functions"] = source_digests(cfg.ppo)
    if stage == "ppo" and cfg.ppo.teacher:  # the run the pipeline run resolved it to, or the folder's content
        parts["teacher"] = resolved_teacher(cfg, teacher, "the cache key").key(world)
    return parts


def stage_vllm(stage: str, cfg: PipelineConfig) -> Path | None:
    """The vLLM environment's Python where `stage` samples on vLLM (its version is then part of the stack), else
    None."""
    section = getattr(cfg, stage)
    return vllm_python(section.vllm) if getattr(section, "rollout_engine", "hf") == "vllm" else None


def stack_tags(stage: str, cfg: PipelineConfig) -> dict[str, str]:
    """The stack a stage run computes with, as its tags (`rlhf.stack.*`)."""
    return stack.current().tags(stage_vllm(stage, cfg))


def stack_changes(stage: str, cfg: PipelineConfig, earlier_run) -> str:
    """What moved in the stack since `earlier_run` (a stage run with the same work key):
    `transformers 5.24.0 -> 5.23.0; environment locked -> unlocked`."""
    now = stack.current().key(stage_vllm(stage, cfg))
    tags = earlier_run.data.tags
    before = {name: tags.get(stack.TAG + name, "unrecorded") for name in now if name != "environment"}
    before["environment"] = "locked" if tags.get(stack.TAG + "locked") == "true" else "unlocked"
    return ("; ".join(stack.changes(before, now))
            or "the stack's tags are unchanged (the earlier run recorded another key)")


def reused_record(stage: StageName, run) -> StageRecord:
    """The record of an earlier finished MLflow run that stands in for `stage`."""
    tags = run.data.tags
    return StageRecord(stage=stage, run_id=run.info.run_id,
                       checkpoint_uri=f"runs:/{run.info.run_id}/{tracking.CHECKPOINT_PATH}",
                       config_hash=tags[tracking.TAG_CONFIG_HASH], data_digest=tags.get(tracking.TAG_DATA_DIGEST, ""),
                       checkpoint_digest=tags.get(tracking.TAG_CHECKPOINT_DIGEST, ""), metrics=run.data.metrics,
                       warnings=int(tags.get(tracking.TAG_WARNINGS, 0)), reused=True)


class Runs(Protocol):
    """Where `upstream_runs` finds runs: `ExperimentRuns` (the MLflow experiment), or a test's own list."""

    experiment: str

    def finished(self, stage: str, tags: dict[str, str] | None = None) -> list[Any]:
        """The FINISHED runs of `stage` (MLflow `Run`s) whose tags have these values, most recent first."""

    def get(self, run_id: str) -> Any | None:
        """The run with this id, or None when there is none."""


@dataclass(frozen=True)
class ExperimentRuns:
    """The runs of an MLflow experiment, as `upstream_runs` reads them."""

    experiment: str

    def finished(self, stage: str, tags: dict[str, str] | None = None) -> list[Any]:
        return tracking.finished_runs(self.experiment, stage, tags)

    def get(self, run_id: str) -> Any | None:
        return tracking.find_run(run_id)


LABELS = {"sft": "SFT", "reward": "reward"}
THIS_PIPELINE = "this pipeline run"
GIVEN = "given"
LATEST = "latest with this config"
LATEST_ANY = "latest whatever its config, as upstream.any_config asks"
FROM_SFT = "latest with this config trained from that SFT run"
FROM_SFT_ANY = "latest trained from that SFT run whatever its config, as upstream.any_config asks"
OWN = "its own upstream"
SEPARATE_REWARD_MODEL = ("reward.model makes the reward model a separate model, so its run need not come from this "
                         "SFT run")


@dataclass(frozen=True)
class Chosen:
    """An upstream run a stage starts from, and why that one."""

    run: Any
    """The MLflow `Run`."""
    why: str


@dataclass(frozen=True)
class Upstream:
    """The upstream runs a stage starts from, by stage name, in the order they were decided."""

    chosen: dict[str, Chosen]

    @property
    def run_ids(self) -> dict[str, str]:
        return {name: c.run.info.run_id for name, c in self.chosen.items()}

    def describe(self) -> str:
        """`reward run `reward · mature-goose` (latest with this config); SFT run `sft · mature-goose` (its own
        upstream)`."""
        return "; ".join(f"{LABELS[name]} run `{_name(c.run)}` ({c.why})" for name, c in self.chosen.items())


def upstream_runs(stage: StageName, records: dict[str, StageRecord], given: dict[str, str | None],
                  cfg: PipelineConfig, runs: Runs, any_config: bool = False) -> Upstream:
    """The runs `stage` starts from, decided along lineage. Each upstream stage's run comes from
    this pipeline run (`records`), else as `given` by stage name, else by recency:

    - reward, dpo: the latest finished SFT run made with `cfg.sft` (its `rlhf.config_hash`).
    - ppo whose reward is functions alone: as reward and dpo.
    - ppo: a reward run and the SFT run it was trained from (its `rlhf.upstream.sft` tag). With
      neither named, the latest reward run made with `cfg.reward` whose own SFT run was made with
      `cfg.sft`; with the SFT run named, the latest reward run made with `cfg.reward` trained from
      it; with the reward run named, its own SFT run. A named pair whose reward run was not trained
      from that SFT run is refused, unless `cfg.reward.model` makes the reward model a separate model.

    `any_config` drops the config condition (still a coherent pair for PPO). LookupError, with the
    message for the user, when no run fits, a named run does not exist or the named pair does not
    belong together; nothing is downloaded here."""
    needs = upstream_stages(stage, cfg)
    named: dict[str, Chosen] = {}
    for name in needs:
        if name in records:
            named[name] = Chosen(_named_run(runs, name, records[name].run_id, THIS_PIPELINE), THIS_PIPELINE)
        elif given.get(name):
            named[name] = Chosen(_named_run(runs, name, given[name], f"upstream.{name}_run_id"), GIVEN)
    wanted = {name: {} if any_config else {tracking.TAG_CONFIG_HASH: config_hash(getattr(cfg, name))} for name in needs}
    if "reward" not in needs:
        if needs and "sft" not in named:
            latest = runs.finished("sft", wanted["sft"])
            if not latest:
                raise LookupError(_nothing_fits(stage, "sft", cfg, runs, any_config))
            named["sft"] = Chosen(latest[0], LATEST_ANY if any_config else LATEST)
        return Upstream(named)

    reward, sft = named.get("reward"), named.get("sft")
    if reward is not None:
        own_id = reward.run.data.tags.get(tracking.TAG_UPSTREAM + "sft")
        if sft is None:
            own = runs.get(own_id) if own_id else None
            if own is None:
                raise LookupError(f"stage {stage}: reward run `{_name(reward.run)}` ({reward.run.info.run_id}) "
                                  f"names no "
                                  f"SFT run that still exists as the one it was trained from (tag "
                                  f"{tracking.TAG_UPSTREAM}sft: {own_id or 'none'}); pass upstream.sft_run_id")
            return Upstream({"reward": reward, "sft": Chosen(own, OWN)})
        if sft.run.info.run_id != own_id:
            if cfg.reward.model is None:
                raise LookupError(_mismatch(stage, sft, reward, own_id, runs))
            sft = Chosen(sft.run, f"{sft.why}; {SEPARATE_REWARD_MODEL}")
        return Upstream({"reward": reward, "sft": sft})

    if sft is not None:
        trained = runs.finished("reward", wanted["reward"] | {tracking.TAG_UPSTREAM + "sft": sft.run.info.run_id})
        if not trained:
            raise LookupError(_nothing_fits(stage, "reward", cfg, runs, any_config, sft))
        return Upstream({"sft": sft, "reward": Chosen(trained[0], FROM_SFT_ANY if any_config else FROM_SFT)})

    fitting_sft = {run.info.run_id: run for run in runs.finished("sft", wanted["sft"])}
    for candidate in runs.finished("reward", wanted["reward"]):
        own = fitting_sft.get(candidate.data.tags.get(tracking.TAG_UPSTREAM + "sft", ""))
        if own is not None:
            return Upstream({"reward": Chosen(candidate, LATEST_ANY if any_config else LATEST),
                             "sft": Chosen(own, OWN)})
    raise LookupError(_nothing_fits(stage, "reward", cfg, runs, any_config))


def _name(run) -> str:
    return run.info.run_name or run.info.run_id


def _named_run(runs: Runs, stage: str, run_id: str, source: str):
    """The run a user (or this pipeline run) named as `stage`'s; LookupError when it is none, or another stage's."""
    run = runs.get(run_id)
    if run is None:
        raise LookupError(f"{source} {run_id}: no such run on the tracking server")
    if run.data.tags.get(tracking.TAG_STAGE) != stage:
        raise LookupError(f"{source} {run_id} is not an {stage} run: `{_name(run)}` is a "
                          f"{run.data.tags.get(tracking.TAG_STAGE) or 'non-stage'} run")
    return run


def _mismatch(stage: str, sft: Chosen, reward: Chosen, own_id: str | None, runs: Runs) -> str:
    own = runs.get(own_id) if own_id else None
    own_text = f"SFT run `{_name(own)}` ({own_id})" if own is not None else f"SFT run {own_id or '(none recorded)'}"
    sft_source = "given as upstream.sft_run_id" if sft.why == GIVEN else f"from {sft.why}"
    return (f"stage {stage}: reward run `{_name(reward.run)}` ({reward.run.info.run_id}) was trained from {own_text}, "
            f"not from SFT run `{_name(sft.run)}` ({sft.run.info.run_id}), {sft_source}; a policy and a reward "
            f"model that do not belong together are refused before anything is downloaded. Pass only "
            f"upstream.reward_run_id to start from its own SFT run, only upstream.sft_run_id to start from the "
            f"latest reward run trained from that SFT run, or set reward.model when the reward model is a separate "
            f"model (its tokenizer is then checked against the policy's)")


def _nothing_fits(stage: str, name: str, cfg: PipelineConfig, runs: Runs, any_config: bool,
                  sft: Chosen | None = None) -> str:
    """Why no `name` run fits, the nearest candidates and what to do."""
    recent = runs.finished(name)
    if sft is not None:
        recent = [run for run in recent
                  if run.data.tags.get(tracking.TAG_UPSTREAM + "sft") == sft.run.info.run_id] or recent
    wanted = ("" if any_config
              else f" made with this config's {name} section (rlhf.config_hash {config_hash(getattr(cfg, name))})")
    if sft is not None:
        wanted += f" trained from SFT run `{_name(sft.run)}` ({sft.run.info.run_id})"
    elif name == "reward" and not any_config:
        wanted += f" from an SFT run made with its sft section (rlhf.config_hash {config_hash(cfg.sft)})"
    todo = (f"Run rlhf/{name} with this config first"
            + (" (rlhf/full for both stages)" if name == "reward" and sft is None else "")
            + (f" with upstream.sft_run_id {sft.run.info.run_id}" if sft is not None else "")
            + f", or pass upstream.{name}_run_id" + ("" if any_config else "; upstream.any_config takes the latest "
                                                     "run whatever its config"))
    if not recent:
        return f"stage {stage} needs a finished {name} run{wanted}; none is in experiment {runs.experiment!r}. {todo}"
    nearest = "\n".join(f"  - {_candidate(run, runs)}" for run in recent[:3])
    return (f"stage {stage} needs a finished {name} run{wanted}; none of the {len(recent)} finished {name} runs in "
            f"experiment {runs.experiment!r} is. The most recent:\n{nearest}\n{todo}")


def _candidate(run, runs: Runs) -> str:
    """`reward · mature-goose` (configs/tiny.yaml, 2026-11-23 18:02 UTC, reward section 1a2b3c4d5e6f, from SFT
    run ...)."""
    tags = run.data.tags
    pipeline = runs.get(tags[tracking.TAG_PIPELINE]) if tags.get(tracking.TAG_PIPELINE) else None
    made = pipeline.data.tags if pipeline is not None else {}
    made_with = made.get(tracking.TAG_CONFIG_FILE, "config unknown")
    overrides = made.get(tracking.TAG_OVERRIDES, "{}")
    made_with += f" with overrides {overrides}" if overrides not in ("{}", "") else ""
    when = datetime.fromtimestamp(run.info.start_time / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")
    stage = tags.get(tracking.TAG_STAGE, "?")
    text = f"`{_name(run)}` ({made_with}, {when}, {stage} section {tags.get(tracking.TAG_CONFIG_HASH, '?')[:12]}"
    own_id = tags.get(tracking.TAG_UPSTREAM + "sft")
    if own_id:
        own = runs.get(own_id)
        text += (f", from SFT run `{_name(own)}` (sft section {own.data.tags.get(tracking.TAG_CONFIG_HASH, '?')[:12]})"
                 if own is not None else f", from SFT run {own_id}")
    return text + ")"
