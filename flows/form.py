"""The deployments' run form: the settings users change most, as typed, described fields.

Prefect renders a flow's parameters as a form; a pydantic model becomes a section of it. Each
section here lists a few fields of a stage's config with the same types and descriptions (taken
from `rlhf.config`, so they cannot drift apart), named as in the config (a field of a section
inside the stage's, `kl.target`, as `kl_target`). A field left empty keeps the config file's
value; a filled one becomes the override `<stage>.<field>` (for data, `<stage>.<field>.path`).
Anything else, and unsetting a field the file sets (`ppo.evaluation.every: null`), goes through
the flow's `overrides` parameter. `UpstreamRuns` is the form's section for a stage run alone: which
upstream runs it starts from.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, create_model

from rlhf.config import DPOConfig, RewardConfig, SFTConfig
from rlhf.sections.base import DataSource
from rlhf.sections.ppo import PPOConfig


class StageForm(BaseModel):
    """A stage's section of the run form; empty fields keep the config file's values."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: ClassVar[str]
    """The config section the fields belong to."""
    data_fields: ClassVar[frozenset[str]]
    """Fields that stand for a `DataSource`'s path."""
    paths: ClassVar[dict[str, str]]
    """Each field's dotted name in the stage's section (`kl_target`: `kl.target`)."""

    def overrides(self) -> dict[str, Any]:
        """The filled fields as dotted overrides (`ppo.learning_rate`, `ppo.kl.target`, `sft.train_data.path`)."""
        return {f"{self.stage}.{self.paths[name]}" + (".path" if name in self.data_fields else ""): value
                for name, value in self if value is not None}


def _field(config: type[BaseModel], dotted: str):
    """The pydantic field `dotted` (`kl.target`) of `config`, through its sections."""
    *sections, leaf = dotted.split(".")
    for section in sections:  # an optional section (`teacher: TeacherConfig | None`) as its config
        annotation = config.model_fields[section].annotation
        config = next(a for a in (annotation, *get_args(annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel))
    return config.model_fields[leaf]


def _form(title: str, stage: str, config: type[BaseModel], dotted_names: list[str]) -> type[StageForm]:
    """A form section with `config`'s fields `dotted_names`: their types with constraints (a
    PositiveFloat keeps its `gt=0`) and descriptions; a data source as its path."""
    fields, data_fields, paths = {}, set(), {}
    for dotted in dotted_names:
        name, field = dotted.replace(".", "_"), _field(config, dotted)
        paths[name] = dotted
        if field.annotation is DataSource:
            data_fields.add(name)
            annotation = str
            description = f"{field.description} Path or `datasets` name. {DataSource.model_fields['path'].description}"
        else:
            annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            description = field.description
        # Optional[] (not `annotation | None`): a type built at run time; Optional takes any type form as it is.
        fields[name] = (Optional[annotation], Field(None, description=description))  # noqa: UP045
    form = create_model(title, __base__=StageForm,
                        __doc__=f"{stage} settings for this run: empty fields keep the config file's values.", **fields)
    form.stage, form.data_fields, form.paths = stage, frozenset(data_fields), paths
    return form


SFTForm = _form("SFTForm", "sft", SFTConfig, ["model", "train_data", "learning_rate", "num_train_epochs",
                                              "max_steps", "batch_size"])
RewardForm = _form("RewardForm", "reward", RewardConfig, ["model", "train_data", "learning_rate", "num_train_epochs",
                                                          "max_steps", "batch_size", "min_eval_accuracy"])
PPOForm = _form("PPOForm", "ppo", PPOConfig, ["prompts", "advantage_estimator", "samples_per_prompt", "learning_rate",
                                              "num_iterations", "rollout_batch_size", "num_minibatches",
                                              "kl.init_coef", "kl.target", "clip_range", "sampling.response_length",
                                              "evaluation.every", "teacher.model"])
DPOForm = _form("DPOForm", "dpo", DPOConfig, ["train_data", "beta", "loss_type", "learning_rate",
                                              "num_train_epochs", "max_steps", "batch_size",
                                              "sampling.response_length"])


def form_overrides(*forms: StageForm) -> dict[str, Any]:
    """Every filled field of the forms as a dotted override."""
    return {key: value for form in forms for key, value in form.overrides().items()}


class UpstreamRuns(BaseModel):
    """MLflow run ids of upstream stages for single-stage reruns. Empty fields are resolved along
    lineage (`flows.records.lineage.upstream_runs`): the latest finished runs made with this config's
    upstream sections, and for PPO a reward run with the SFT run it was trained from."""

    sft_run_id: str | None = Field(None, description=(
        "SFT run to start from. Empty: for reward and DPO, the latest finished SFT run made with this config's "
        "sft section; for PPO, the SFT run its reward run was trained from."))
    reward_run_id: str | None = Field(None, description=(
        "Reward run PPO optimises against. Empty: the latest finished reward run made with this config's reward "
        "section whose SFT run was made with its sft section, or, with an SFT run given, the latest trained from "
        "that one. Given with an SFT run it was not trained from, the pair is refused (unless reward.model is set)."))
    any_config: bool = Field(False, description=(
        "Take the latest runs whatever config made them (PPO still gets a reward run and the SFT run it was "
        "trained from). Off: only runs made with this config's sft and reward sections are candidates."))
