"""The data a stage reads: which sources, measured with which tokenizer, under which length
budget; validated once per content and rules in this process, and logged to the stage's run.

`data_inputs` and `length_budget` answer for the pre-flight check (every stage's data, before
anything trains) and for the tasks alike, so the two can never read or measure a file differently."""

from __future__ import annotations

import json
import tempfile
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Any

import mlflow

from flows.records.lineage import Fingerprint, Teacher, resolved_teacher
from rlhf import tracking
from rlhf.config import PipelineConfig
from rlhf.demo.locations import DEMO_SCHEME, resolve_location
from rlhf.sections.base import DataSource, TrainingConfig
from schemas.errors import DataContractError
from schemas.validate import LengthBudget, ValidatedData, data_digest, load_validated
from stages.common.errors import ChatTemplateError
from stages.envs.remote.served import env_source, server_problems
from stages.memory.phases import Counts, Target, this_device
from stages.memory.plan import Plan, model_shapes, plan
from stages.memory.shapes import ModelShape
from stages.rewards.functions import RewardFunctionError, load_reward_functions
from stages.rewards.remote import RemoteRewardError, remote_rewards
from stages.runtime.models import load_tokenizer, tokenizer_digest


def length_budget(cfg: PipelineConfig, stage: str) -> LengthBudget:
    """The token budget `stage`'s records must fit: PPO's prompts leave room for the response."""
    if stage == "ppo":
        return LengthBudget(cfg.ppo.max_prompt_length, cfg.ppo.max_prompt_length + cfg.ppo.response_tokens)
    section = getattr(cfg, stage)
    return LengthBudget(section.max_prompt_length, section.max_length)


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer the way a stage loads it: the model location, remote code, and the chat template given in the
    config."""

    model: str
    trust_remote_code: bool
    chat_template: str | None

    def load(self, world: str | None):
        return load_tokenizer(resolve_location(self.model, world), trust_remote_code=self.trust_remote_code,
                              chat_template=self.chat_template)


@dataclass(frozen=True)
class DataInput:
    source: DataSource
    kind: str
    """The contract it must meet: `sft`, `preference` or `prompt`."""
    measured_by: TokenizerSource
    """The tokenizer the pre-flight check measures it with (the stage measures it again with the one it loads)."""
    columns: tuple[str, ...] = ()
    """Extra columns every record must have, kept for the stage (PPO's `reward.columns`, for its reward functions)."""


def data_inputs(cfg: PipelineConfig, stage: str) -> dict[str, DataInput]:
    """Every data source `stage` reads, by its role: `train` and `eval` (absent: split off `train`),
    the reward stage's `normalization` prompts, PPO's `prompts` and `eval_prompts` (`evaluation.prompts`),
    DPO's `eval_prompts`.
    The SFT checkpoint carries the SFT tokenizer (and its template) to the later stages."""
    sft, reward, ppo = cfg.sft, cfg.reward, cfg.ppo
    policy = TokenizerSource(sft.model, sft.trust_remote_code, sft.chat_template)
    if stage == "ppo":  # `env:` prompts are the environment server's own, fetched into a file
        prompts, evaluation = (env_source(s, ppo.environment, tracking.state_dir() / "env-datasets")
                               for s in (ppo.prompts, ppo.evaluation.prompts))
        return {"prompts": DataInput(prompts, "prompt", policy, tuple(ppo.reward.columns)),
                "eval_prompts": DataInput(evaluation, "prompt", policy, tuple(ppo.reward.columns))}
    if stage == "sft":
        kind, measured_by, extra = "sft", policy, {}
    elif stage == "dpo":
        kind, measured_by, extra = "preference", policy, {"eval_prompts": DataInput(cfg.dpo.evaluation.prompts,
                                                                                   "prompt", policy)}
    else:
        kind, extra = "preference", {"normalization": DataInput(reward.normalization_prompts, "prompt", policy)}
        measured_by = (TokenizerSource(reward.model, reward.trust_remote_code, reward.chat_template) if reward.model
                       else TokenizerSource(sft.model, sft.trust_remote_code,
                                            reward.chat_template or sft.chat_template))
    section = getattr(cfg, stage)
    found = {"train": DataInput(section.train_data, kind, measured_by)}
    if section.eval_data is not None:
        found["eval"] = DataInput(section.eval_data, kind, measured_by)
    return found | extra


_VALIDATED: dict[str, ValidatedData] = {}
"""Validation results of this process by what decides them, so the stage's own check of a file
the pre-flight check already passed with the same tokenizer costs nothing."""


def validated(data: DataInput, world: str | None, tokenizer, budget: LengthBudget, duplicates: str) -> ValidatedData:
    """`load_validated` of a configured source against its contract, answered from `_VALIDATED` (as a
    copy) when the same file content, tokenizer content and rules were validated before in this process."""
    source, kind, columns = data.source, data.kind, data.columns
    location = resolve_location(source.path, world)

    def validate() -> ValidatedData:
        return load_validated(location, kind, format=source.format, split=source.split, tokenizer=tokenizer,
                              budget=budget, duplicates=duplicates, columns=columns)

    content, rendering = Fingerprint.of(location), tokenizer_digest(tokenizer)
    if content.digest is None or rendering is None:  # a hub dataset or a slow tokenizer: not identifiable
        return validate()
    key = json.dumps([location, content.digest, kind, source.format, source.split, rendering, astuple(budget),
                      duplicates, columns])
    if key not in _VALIDATED:
        _VALIDATED[key] = validate()
        while len(_VALIDATED) > 32:
            _VALIDATED.pop(next(iter(_VALIDATED)))
    data = _VALIDATED[key]
    return replace(data, frame=data.frame.copy())


def input_problems(cfg: PipelineConfig, stages: list[str], world: str | None) -> list[str]:
    """Every data source the run's stages will read, validated before any stage trains: one
    report per bad source. Lengths are measured with the configured base model's tokenizer (the
    checkpoints derived from it share it); each stage validates its data again with the
    tokenizer it actually loads."""
    tokenizers: dict[TokenizerSource, Any] = {}
    refused: set[TokenizerSource] = set()  # reported once, however many sources it measures
    reports = []
    for stage in stages:
        for data in data_inputs(cfg, stage).values():
            measured_by = data.measured_by
            if measured_by in refused:
                continue
            try:
                if measured_by not in tokenizers:
                    tokenizers[measured_by] = measured_by.load(world)
                validated(data, world, tokenizers[measured_by], length_budget(cfg, stage),
                          getattr(cfg, stage).duplicates)
            except DataContractError as e:
                reports.append(f"{stage} stage: {e.report()}")
            except ChatTemplateError as e:
                refused.add(measured_by)
                reports.append(f"{stage} stage: {e}")
    if "ppo" in stages:
        try:  # imported and their signatures checked now, not after the stages before PPO have run
            load_reward_functions(cfg.ppo)
        except RewardFunctionError as e:
            reports.append(f"ppo stage: {e}")
        for client in remote_rewards(cfg.ppo.reward.remotes):  # a server down now is refused before anything trains
            try:
                client.check()
            except RemoteRewardError as e:
                reports.append(f"ppo stage: {e}")
        reports += [f"ppo stage: {problem}" for problem in server_problems(cfg.ppo.environment)]
    return reports


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
    needs = {"sft": ("sft.max_length", cfg.sft.model, base),
             "reward": ("reward.max_length", cfg.reward.model or cfg.sft.model,
                        context(cfg.reward.model, cfg.reward.trust_remote_code) if cfg.reward.model else base),
             "ppo": ("ppo.environment.episode_tokens" if cfg.ppo.environment else "ppo.sampling.response_length",
                     cfg.sft.model, base),
             "dpo": ("dpo.max_length", cfg.sft.model, base)}
    problems = []
    for stage in stages:
        field, model, limit = needs[stage]
        tokens = length_budget(cfg, stage).max_length
        if limit is not None and tokens > limit:
            problems.append(f"{field}: {tokens} tokens do not fit the {limit}-token context of {model}")
    return problems


def train_and_eval_data(cfg: PipelineConfig, stage: str, world: str | None,
                        tokenizer) -> tuple[ValidatedData, ValidatedData]:
    """`stage`'s validated train and eval data, logged to the active run; eval is split off train
    when the config names none."""
    section: TrainingConfig = getattr(cfg, stage)
    inputs, budget = data_inputs(cfg, stage), length_budget(cfg, stage)
    kind = inputs["train"].kind
    train = validated(inputs["train"], world, tokenizer, budget, section.duplicates)
    if "eval" in inputs:
        evaluation = validated(inputs["eval"], world, tokenizer, budget, section.duplicates)
    else:
        held_out = train.frame.sample(frac=section.eval_fraction, random_state=section.seed)
        kept = train.frame.drop(index=held_out.index)
        evaluation = ValidatedData(held_out, f"{train.source} (eval split)", kind, train.format, data_digest(held_out))
        train = ValidatedData(kept, f"{train.source} (train split)", kind, train.format, data_digest(kept))
    mlflow.set_tag(tracking.TAG_DATA_DIGEST, train.digest)
    for name, data in (("train", train), ("eval", evaluation)):
        tracking.log_data(data.frame, f"{kind}-{name}", data.source, data.digest, name)
    return train, evaluation


def logged_prompts(cfg: PipelineConfig, stage: str, role: str, name: str, world: str | None,
                   tokenizer) -> ValidatedData:
    """`stage`'s validated prompts in `role` (see `data_inputs`), logged to the active run as the dataset `name`."""
    prompts = data_inputs(cfg, stage)[role]
    data = validated(prompts, world, tokenizer, length_budget(cfg, stage), getattr(cfg, stage).duplicates)
    tracking.log_data(data.frame, name, data.source, data.digest, name)
    return data


def is_demo(source: DataSource | None) -> bool:
    """Whether the source is the embedded demo world's (whose gold function may judge the results)."""
    return source is not None and source.path.startswith(DEMO_SCHEME)


def data_counts(cfg: PipelineConfig, world: str | None) -> Counts:
    """The records of the prompt sets some phases sample all at once (evaluations, the reward
    model's normalisation), for the memory plan; a set that cannot be read here is left uncounted."""
    from schemas.readers import read_table

    def count(source: DataSource) -> int | None:
        try:
            return len(read_table(resolve_location(source.path, world), source.split)[0])
        except (DataContractError, ValueError):
            return None

    return Counts(ppo_eval_prompts=count(cfg.ppo.evaluation.prompts),
                  dpo_eval_prompts=count(cfg.dpo.evaluation.prompts),
                  reward_normalization_prompts=count(cfg.reward.normalization_prompts))


def fetched_teacher(teacher: Teacher, world: str | None, scratch: Path) -> str:
    """PPO's distillation teacher as a folder here, fetched through MLflow from the run the pipeline run
    resolved it to (`Teacher.source`), the stage's run tagged with it (`rlhf.teacher`: as given, and what
    it resolved to)."""
    folder = (resolve_location(teacher.given, world) if teacher.source is None
              else str(tracking.download_model(teacher.source, scratch)))
    mlflow.set_tag(tracking.TAG_TEACHER, tracking.redact(teacher.describe()))
    return folder


def model_shapes_of(cfg: PipelineConfig, stages: list[str], world: str | None,
                    teacher: Teacher | None) -> dict[str, ModelShape]:
    """Each model's shape from its config alone (`stages.memory.plan.model_shapes`); PPO's teacher as
    the pipeline run resolved it (a run's: its `config.json` fetched alone), and not read at all where
    PPO is not planned."""
    if cfg.ppo.teacher and "ppo" not in stages:
        cfg = cfg.model_copy(update={"ppo": cfg.ppo.model_copy(update={"teacher": None})})
    elif cfg.ppo.teacher:
        resolved_teacher(cfg, teacher, "the memory plan")
    with tempfile.TemporaryDirectory() as scratch:
        def readable(location: str) -> str:
            if teacher is not None and teacher.source is not None and location == teacher.given:
                return str(tracking.download_model(teacher.source, Path(scratch) / "teacher", config_only=True))
            return resolve_location(location, world)

        return model_shapes(cfg, readable)


def memory_plan(cfg: PipelineConfig, stages: list[str], world: str | None, teacher: Teacher | None) -> Plan:
    """The memory plan of `stages` on the device they will use, from the models' configs alone
    (`stages.memory.plan`); `rlhf plan` plans for other devices and process counts from the same parts."""
    shapes = model_shapes_of(cfg, stages, world, teacher)
    return plan(cfg, stages, shapes, Target(this_device(), data_counts(cfg, world)))


def memory_problems(result: Plan) -> tuple[list[str], list[str]]:
    """(refusals, warnings): on a GPU a stage predicted not to fit is refused before any stage
    trains; on the CPU (whose memory the OS may swap or overcommit) it is a warning."""
    over = [result.message(stage) for stage, fits in result.verdicts.items() if not fits]
    return (over, []) if result.device.kind == "cuda" else ([], over)
