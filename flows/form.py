"""The deployments' run form: the settings users change most, as typed, described fields.

Prefect renders a flow's parameters as a form; a pydantic model becomes a section of it. Each
section here lists a few fields of a stage's config under the same names, types and descriptions
(taken from `rlhf.config`, so they cannot drift apart). A field left empty keeps the config
file's value; a filled one becomes the override `<stage>.<field>` (for data, `<stage>.<field>.path`).
Anything else is set through the flow's `overrides` parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model

from rlhf.config import DataSource, PPOConfig, RewardConfig, SFTConfig


class StageForm(BaseModel):
    """A stage's section of the run form; empty fields keep the config file's values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def overrides(self, stage: str, config: type[BaseModel]) -> dict[str, Any]:
        """The filled fields as dotted overrides of `config` (the stage's config class)."""
        found = {}
        for name, value in self:
            if value is None:
                continue
            is_data = config.model_fields[name].annotation in (DataSource, Optional[DataSource])
            found[f"{stage}.{name}.path" if is_data else f"{stage}.{name}"] = value
        return found


def _form(title: str, config: type[BaseModel], names: list[str]) -> type[StageForm]:
    fields = {}
    for name in names:
        field = config.model_fields[name]
        if field.annotation in (DataSource, Optional[DataSource]):
            annotation, description = str, f"Path or `datasets` name. {DataSource.model_fields['path'].description}"
            description = f"{field.description} {description}"
        else:  # the type with its constraints (a PositiveFloat keeps its `gt=0`)
            annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            description = field.description
        fields[name] = (Optional[annotation], Field(None, description=description))
    return create_model(title, __base__=StageForm, __doc__=f"{title}: empty fields keep the config file's values.",
                        **fields)


SFTForm = _form("SFTForm", SFTConfig, ["model", "train_data", "learning_rate", "num_train_epochs", "max_steps",
                                       "batch_size"])
RewardForm = _form("RewardForm", RewardConfig, ["model", "train_data", "learning_rate", "num_train_epochs",
                                                "max_steps", "batch_size", "min_eval_accuracy"])
PPOForm = _form("PPOForm", PPOConfig, ["prompts", "learning_rate", "num_iterations", "rollout_batch_size",
                                       "num_minibatches", "init_kl_coef", "target_kl", "clip_range",
                                       "response_length", "eval_every"])


def form_overrides(sft: StageForm, reward: StageForm, ppo: StageForm) -> dict[str, Any]:
    """Every filled field of the form as a dotted override."""
    return sft.overrides("sft", SFTConfig) | reward.overrides("reward", RewardConfig) | ppo.overrides("ppo", PPOConfig)
