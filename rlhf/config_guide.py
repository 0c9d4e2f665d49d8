"""The config as a person reads it: the settings most people change first, then the rest by section.

`rlhf config show [CONFIG]` prints a config's settings that way (the values it holds, and which
differ from the defaults); `rlhf config-reference` writes docs/config.md from the same walk over the
fields' docstrings. `MERGED` settings are listed with where each went."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from rlhf.config import PipelineConfig

FIRST: dict[str, tuple[str, ...]] = {
    "ppo": ("advantage_estimator", "num_iterations", "rollout_batch_size", "samples_per_prompt", "learning_rate",
            "prompts.path", "reward.terms", "sampling.response_length", "sampling.temperature", "kl.init_coef",
            "kl.target", "clip_range", "num_ppo_epochs", "num_minibatches", "critic.kind", "lora.r",
            "environment.tools", "evaluation.every", "launch.num_processes", "rollout_engine"),
    "sft": ("model", "train_data", "learning_rate", "num_train_epochs", "batch_size", "max_length", "lora.r",
            "launch.num_processes"),
    "reward": ("train_data", "learning_rate", "num_train_epochs", "batch_size", "max_length",
               "launch.num_processes"),
    "dpo": ("train_data", "beta", "learning_rate", "num_train_epochs", "batch_size", "max_length",
            "launch.num_processes"),
}
"""Per stage section, the settings most people change first, in the order they are usually decided."""


@dataclass(frozen=True)
class Setting:
    """One config field as the guide shows it."""

    key: str
    """Its dotted name (`ppo.kl.target`; a list of sections' fields as `ppo.reward.terms[].weight`)."""
    default: Any
    required: bool
    meaning: str
    module: str
    """Where it is declared."""
    sections: bool = False
    """A list of sections (`reward.terms`): its items' fields follow it as settings of their own."""


def settings(model: type[BaseModel], prefix: str = "") -> Iterator[Setting]:
    """Every field of `model` and of the sections in it, in declaration order: a section's fields (a list
    of sections: its item's too, under `[]`), not the section itself, except a list's own row."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        nested = next((a for a in typing.get_args(annotation) or (annotation,)
                       if isinstance(a, type) and issubclass(a, BaseModel)), None)
        key = f"{prefix}{name}"
        declared = next(c.__module__ for c in model.__mro__ if name in getattr(c, "__annotations__", {}))
        if nested is not None and typing.get_origin(annotation) is list:  # a list of sections
            yield Setting(key, [item.model_dump() for item in field.default], False, field.description or "", declared,
                          sections=True)
            yield from settings(nested, key + "[].")
        elif nested is not None and name not in ("train_data", "eval_data"):
            yield from settings(nested, key + ".")
        else:
            default = field.default.model_dump() if isinstance(field.default, BaseModel) else field.default
            yield Setting(key, default, field.is_required(), field.description or "", declared)


def leaves(model: type[BaseModel]) -> int:
    """How many settings `model` holds, each section's fields counted where they appear (a list of
    sections' item once): the count the config's growth is watched by."""
    return sum(not s.sections for s in settings(model))


def merged(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(old dotted name, how to write it now) of every setting merged into another, section by section."""
    for old, now in getattr(model, "MERGED", {}).items():
        yield f"{prefix}{old}", now
    for name, field in model.model_fields.items():
        nested = next((a for a in typing.get_args(field.annotation) or (field.annotation,)
                       if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is not None:
            yield from merged(nested, f"{prefix}{name}{'[].' if typing.get_origin(field.annotation) is list else '.'}")


def _section_of(key: str, stage: str) -> str:
    """The section a setting's row goes under: its parent's dotted name (`ppo.kl`), the stage's own for its
    top-level fields."""
    parent = key.rsplit(".", 1)[0] if "." in key.removeprefix(stage + ".") else stage
    return parent.removesuffix("[]")


UNSET = object()
"""The value of a setting whose section is unset (`ppo.lora.r` without `ppo.lora`)."""


def _value_of(cfg: BaseModel, key: str) -> Any:
    """A loaded config's value of a dotted setting (`ppo.kl.target`), sections as dicts; `UNSET` where a
    section it is in is unset."""
    value: Any = cfg
    for part in key.split("."):
        if value is None:
            return UNSET
        value = getattr(value, part)
    if isinstance(value, list):
        return [item.model_dump() if isinstance(item, BaseModel) else item for item in value]
    return value.model_dump() if isinstance(value, BaseModel) else value


def show(cfg: PipelineConfig, stage: str = "ppo", everything: bool = True) -> str:
    """`stage`'s settings in `cfg` as text: the ones most people change first, then (with `everything`) the
    rest by section; `*` marks a value other than the default."""
    rows = {s.key: s for s in settings(PipelineConfig) if s.key.startswith(stage + ".")
            and "[]" not in s.key}
    first = [f"{stage}.{k}" for k in FIRST.get(stage, ())]

    def line(key: str) -> str:
        setting, value = rows[key], _value_of(cfg, key)
        mark = " " if value is UNSET or value == setting.default else "*"
        shown = f"({key.removeprefix(stage + '.').rsplit('.', 1)[0]} unset)" if value is UNSET else repr(value)
        return f"{mark} {key.removeprefix(stage + '.'):<32} {shown:<26} {setting.meaning}"

    out = [f"{stage}: the {len(first)} settings most people change first (* differs from the default)", ""]
    out += [line(key) for key in first if key in rows]
    if everything:
        sections: dict[str, list[str]] = {}
        for key in rows:
            if key not in first:
                sections.setdefault(_section_of(key, stage), []).append(key)
        for section, keys in sections.items():
            out += ["", f"{section}:"] + [line(key) for key in keys]
    return "\n".join(out) + "\n"


def reference() -> str:
    """docs/config.md: per stage, the settings most people change first, then every setting by section,
    each with its default and meaning; and the settings merged into others."""
    every = list(settings(PipelineConfig))
    by_key = {s.key: s for s in every}
    sources = sorted({s.module for s in every})

    def row(setting: Setting) -> str:
        shown = "required" if setting.required else f"`{setting.default!r}`"
        return f"| `{setting.key}` | {shown} | {setting.meaning} |"

    header = "| field | default | meaning |\n|---|---|---|"
    parts = ["# Configuration reference\n",
             "Every config field, its default and its meaning. Generated from the fields' docstrings in\n"
             + ", ".join(f"`{m.replace('.', '/')}.py`" for m in sources) + ":\n"
             "do not edit this page by hand. After changing a field, regenerate it with\n"
             "`.venv/bin/rlhf config-reference --write docs/config.md` (`tests/test_config.py` fails while it\n"
             "is out of date). Fields that need more than a line are explained in [settings.md](settings.md);\n"
             "how to set them (a config file, the run form, an override) is in [running.md](running.md).\n"
             "`rlhf config show CONFIG` prints a config's own values this way.\n"]
    for stage, keys in FIRST.items():
        parts += [f"## {stage}: the settings most people change first\n", header]
        parts += [row(by_key[f"{stage}.{k}"]) for k in keys] + [""]
    parts += ["## Every setting, by section\n"]
    sections: dict[str, list[Setting]] = {}
    for setting in every:
        stage = setting.key.split(".", 1)[0]
        sections.setdefault(_section_of(setting.key, stage) if "." in setting.key else "pipeline", []).append(setting)
    for section, rows in sections.items():
        parts += [f"### `{section}`\n", header] + [row(s) for s in rows] + [""]
    parts += ["## Merged settings\n",
              "Settings that said what another says, merged into it. A config that still names one is refused\n"
              "with the line below.\n", "| was | now |\n|---|---|"]
    parts += [f"| `{old}` | {now} |" for old, now in merged()] + [""]
    return "\n".join(parts)
