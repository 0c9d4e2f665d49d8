"""Lineage: what a stage run depends on (its cache key), which upstream runs it starts from, and
the small record a stage hands to the next. No training, no validation here."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from rlhf import tracking
from rlhf.config import DataSource, PipelineConfig, config_hash
from rlhf.demo_locations import resolve_location
from stages.models import folder_digest

StageName = Literal["sft", "reward", "ppo", "dpo"]
AVAILABLE_STAGES: tuple[StageName, ...] = ("sft", "reward", "ppo", "dpo")
"""Stages in pipeline order; `dpo` is the alternative to reward + PPO (`stages: [sft, dpo]`)."""
RLHF_STAGES: tuple[StageName, ...] = ("sft", "reward", "ppo")
"""The classic pipeline, what a flow run runs when no stages are named."""
UPSTREAM: dict[str, tuple[StageName, ...]] = {"sft": (), "reward": ("sft",), "ppo": ("sft", "reward"), "dpo": ("sft",)}
"""The stages whose results each stage starts from."""


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


def cache_key(stage: str, cfg: PipelineConfig, world: str | None, upstream: dict[str, str]) -> str:
    """What a stage's result depends on: its resolved config, the content of every input it reads,
    the code version, the upstream runs it starts from, and the pipeline's determinism settings."""
    section = getattr(cfg, stage)
    inputs = {}
    for name, value in section:
        if isinstance(value, DataSource):
            inputs[name] = Fingerprint.of(resolve_location(value.path, world)).key() + f":{value.split}:{value.format}"
        elif name == "model" and isinstance(value, str):
            inputs[name] = Fingerprint.of(resolve_location(value, world)).key()
    parts = {"stage": stage, "config": config_hash(section), "inputs": inputs, "code": tracking.code_version(),
             "upstream": upstream, "determinism": [cfg.deterministic, cfg.num_threads]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def reused_record(stage: StageName, run) -> StageRecord:
    """The record of an earlier finished MLflow run that stands in for `stage`."""
    tags = run.data.tags
    return StageRecord(stage=stage, run_id=run.info.run_id, checkpoint_uri=f"runs:/{run.info.run_id}/{tracking.CHECKPOINT_PATH}",
                       config_hash=tags[tracking.TAG_CONFIG_HASH], data_digest=tags.get(tracking.TAG_DATA_DIGEST, ""),
                       checkpoint_digest=tags.get(tracking.TAG_CHECKPOINT_DIGEST, ""), metrics=run.data.metrics,
                       warnings=int(tags.get(tracking.TAG_WARNINGS, 0)), reused=True)


def upstream_runs(stage: StageName, records: dict[str, StageRecord], given: dict[str, str | None],
                  experiment: str) -> dict[str, str]:
    """Run ids of `stage`'s upstream stages: from this pipeline run, else as `given` by stage name,
    else the latest finished run. LookupError when there is none."""
    resolved = {}
    for name in UPSTREAM[stage]:
        run_id = records[name].run_id if name in records else given.get(name)
        run_id = run_id or tracking.latest_finished_run_id(experiment, name)
        if run_id is None:
            raise LookupError(f"stage {stage} needs a finished {name} run; none is in experiment {experiment!r}. "
                              f"Run rlhf/{name} first or pass upstream.{name}_run_id")
        resolved[name] = run_id
    return resolved
