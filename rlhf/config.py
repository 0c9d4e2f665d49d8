"""Typed, frozen configuration for the whole pipeline, loaded from YAML plus dotted overrides.

Every field has a one-line docstring; the configuration reference is generated from them (`rlhf
config-reference`), and docs/settings.md explains them at length. Unknown keys are errors, and so
is any value a stage could not use, so a bad config fails at parameter validation, before anything
trains."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from rlhf.demo.locations import DEMO_SCHEME, DemoWorldConfig
from rlhf.sections.base import (
    REPO_ROOT,
    VLLM_CPU_HEAD_SIZES,
    DataSource,
    EvaluationConfig,
    SampledStage,
    SamplingConfig,
    TrainingConfig,
    _Frozen,
)
from rlhf.sections.ppo import PPOConfig


class SFTConfig(TrainingConfig):
    """Supervised fine-tuning of the base model on demonstrations (TRL `SFTTrainer`)."""

    model: str = "demo:model"
    """Base causal LM: a Hugging Face hub id, a local folder, or `demo:model`."""
    train_data: DataSource = DataSource(path="demo:sft")
    """Demonstrations to train on."""
    eval_data: DataSource | None = DataSource(path="demo:sft_eval")
    """Held-out demonstrations; when unset, `eval_fraction` of `train_data` is held out."""
    num_samples: int = Field(4, ge=0)
    """Held-out prompts answered greedily after training, shown as samples."""
    padding_free: bool = False
    """TRL's padding-free batches: a batch as one row, sequences kept apart by position ids (for flash-attention)."""


class RewardConfig(TrainingConfig, SampledStage):
    """Bradley-Terry reward model on preference pairs (TRL `RewardTrainer`)."""

    model: str | None = None
    """Initial weights: unset means the upstream SFT run's checkpoint; else a hub id or local folder."""
    train_data: DataSource = DataSource(path="demo:preferences")
    """Preference pairs to train on."""
    eval_data: DataSource | None = DataSource(path="demo:preferences_eval")
    """Held-out pairs; when unset, `eval_fraction` of `train_data` is held out."""
    center_rewards_coefficient: float | None = Field(None, ge=0)
    """Weight of the reward-centering term mean((r_chosen + r_rejected)^2); unset disables it."""
    normalization_prompts: DataSource = DataSource(path="demo:prompts_eval")
    """Held-out prompts whose SFT responses define the normalised scale (mean 0, std 1)."""
    normalization_samples: PositiveInt = 4
    """Responses sampled from the SFT policy per normalisation prompt."""
    normalization_micro_batch_size: PositiveInt | Literal["auto"] | None = "auto"
    """Normalisation responses sampled at once (bounds the KV cache); `auto`: fitted at launch; null: all at once."""
    min_eval_accuracy: float = Field(0.6, ge=0, le=1)
    """Quality gate: below this held-out accuracy the stage fails and the pipeline stops."""
    calibration_buckets: PositiveInt = 5
    """Margin buckets (equal counts) in the calibration view."""
    num_table_rows: PositiveInt = 10
    """Highest- and lowest-scored held-out responses logged as a table."""


class DPOConfig(TrainingConfig, SampledStage):
    """Direct preference optimisation of the SFT policy on preference pairs (TRL `DPOTrainer`): no
    reward model and no sampling while training; the SFT model is the reference. Its final
    evaluation is PPO's: held-out prompts, the SFT policy's responses as the baseline."""

    train_data: DataSource = DataSource(path="demo:preferences")
    """Preference pairs to train on."""
    eval_data: DataSource | None = DataSource(path="demo:preferences_eval")
    """Held-out pairs; when unset, `eval_fraction` of `train_data` is held out."""
    beta: PositiveFloat = 0.1
    """Temperature of the implicit reward beta * log(pi / pi_ref): larger keeps the policy nearer the SFT model."""
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """DPO's loss on the log-ratio margin: sigmoid (Rafailov et al.), ipo, hinge (SLiC), or robust (noisy labels)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Assumed share of flipped preference labels (conservative DPO, robust loss)."""
    sampling: SamplingConfig = SamplingConfig()
    """How the final evaluation samples: the same as PPO's to compare the two on one evaluation."""
    evaluation: EvaluationConfig = EvaluationConfig()
    """The final evaluation against the SFT policy (as PPO's)."""
    frozen_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of frozen weights (the evaluation's reference, with `lora` the policy's own): auto is bf16 under bf16."""


class RegistryConfig(_Frozen):
    """Where finished policies go in the MLflow Model Registry."""

    enabled: bool = True
    """Register each PPO policy as a new version of `model_name`; off for smoke runs that leave the registry alone."""
    model_name: str = "rlhf-policy"
    """Registered model that holds the policies, one version per run."""
    champion_alias: str = "champion"
    """Alias that moves to a new version only when it beats the current holder on the same evaluation."""


class PipelineConfig(_Frozen):
    """One pipeline run: the demo world (when used) and each stage's settings."""

    demo: DemoWorldConfig | None = DemoWorldConfig()
    """The embedded demo world, built locally from its seed; needed by any `demo:` location."""
    experiment: str = "rlhf"
    """MLflow experiment that holds the pipeline's runs."""
    deterministic: bool = True
    """Deterministic torch kernels: the same config, seed and data give identical results on CPU."""
    num_threads: PositiveInt | None = None
    """CPU threads for torch; fix it where runs must match across machines (unset: torch's default)."""
    outage_limit_s: PositiveFloat = 600.0
    """How long a stage trains on while the MLflow server does not answer (its logs wait on disk); then it stops."""
    sft: SFTConfig = SFTConfig()
    """Supervised fine-tuning stage."""
    reward: RewardConfig = RewardConfig()
    """Reward-model stage."""
    ppo: PPOConfig = PPOConfig()
    """PPO stage."""
    dpo: DPOConfig = DPOConfig()
    """DPO stage (`stages: [sft, dpo]`), an alternative to reward + PPO."""
    registry: RegistryConfig = RegistryConfig()
    """Model Registry settings for the final policy."""

    @model_validator(mode="after")
    def _demo_locations_need_demo(self) -> PipelineConfig:
        """A `demo:` location needs the demo world."""
        if self.demo is None:
            used = [loc for loc in _locations(self) if loc.startswith(DEMO_SCHEME)]
            if used:
                raise ValueError(f"{used[0]!r} refers to the demo world, but `demo` is unset")
        return self

    @model_validator(mode="after")
    def _demo_model_is_servable(self) -> PipelineConfig:
        """vLLM's CPU build refuses some head sizes (the demo model's 16 among them); a checkpoint's is
        checked when its server starts."""
        on_vllm = [name for name in ("reward", "ppo", "dpo") if getattr(self, name).rollout_engine == "vllm"]
        if on_vllm and self.demo is not None and self.sft.model.startswith(DEMO_SCHEME):
            head_size = self.demo.hidden_size // self.demo.num_heads
            if head_size not in VLLM_CPU_HEAD_SIZES:
                raise ValueError(f"{on_vllm[0]}.rollout_engine 'vllm': the demo model's attention heads are "
                                 f"{head_size} wide (demo.hidden_size {self.demo.hidden_size} / demo.num_heads "
                                 f"{self.demo.num_heads}), which vLLM's CPU build does not serve (it serves "
                                 f"{list(VLLM_CPU_HEAD_SIZES)}); set demo.num_heads so that the width is one of them, "
                                 f"e.g. demo.num_heads: {max(1, self.demo.hidden_size // 32)}")
        return self


def _locations(cfg: PipelineConfig) -> list[str]:
    sft, reward = cfg.sft, cfg.reward
    sources = [sft.train_data, sft.eval_data, reward.train_data, reward.eval_data, reward.normalization_prompts,
               cfg.ppo.prompts, cfg.ppo.evaluation.prompts]
    if "dpo" in cfg.model_fields_set:  # a config that never mentions DPO (older ones) need not repoint its data
        sources += [cfg.dpo.train_data, cfg.dpo.eval_data, cfg.dpo.evaluation.prompts]
    return [sft.model, reward.model or ""] + [s.path for s in sources if s is not None]


class ConfigError(ValueError):
    """A configuration that cannot run, with every offending field named."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
        node = child
    node[leaf] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read a YAML config (relative paths from the repo root too) and apply dotted overrides,
    e.g. {"sft.learning_rate": 3e-4}."""
    tree: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_absolute() and not file.exists():
            file = REPO_ROOT / file
        if not file.exists():
            raise ConfigError(f"config file {path} not found")
        try:
            tree = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"invalid config{f' {path}' if path else ''}:\n" + "\n".join(_error_lines(e))) from None


def _error_lines(error: ValidationError) -> list[str]:
    """Each error by the dotted name of what it is about: `  ppo.learning_rate: <why>`, and for a key its
    section does not have, `  ppo: unknown key 'kl_budget'`. In a section that may also be something else
    (`critic: auto`), pydantic names the union's member in the path and reports every other member's refusal
    as well: where a key is unknown, the section was meant as that member, so only its errors are shown."""
    errors = error.errors()
    meant = {tuple(err["loc"][:i]): part for err in errors if err["type"] == "extra_forbidden"
             for i, part in enumerate(err["loc"][:-1]) if _union_member(part)}
    lines = []
    for err in errors:
        loc = err["loc"]
        unions = [len(union) for union in meant if len(loc) > len(union) and loc[:len(union)] == union
                  and _union_member(loc[len(union)])]
        if any(loc[i] != meant[loc[:i]] for i in unions):
            continue  # another member's refusal of the section
        loc = tuple(part for i, part in enumerate(loc) if i not in unions)
        if err["type"] == "extra_forbidden":
            lines.append(f"  {'.'.join(map(str, loc[:-1])) or '(top level)'}: unknown key {loc[-1]!r}")
        else:
            lines.append(f"  {'.'.join(map(str, loc)) or '(top level)'}: {err['msg']}")
    return lines


def _union_member(part: str | int) -> bool:
    """Whether a part of an error's path is pydantic's name of a union's member (`CriticConfig`,
    `literal['auto']`), not a key: every key of the config is lower case."""
    return isinstance(part, str) and (part != part.lower() or any(c in part for c in "['-("))


Section = TypeVar("Section", bound=BaseModel)


def _get_dotted(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _merge(tree: dict, changes: dict[str, Any]) -> None:
    """`changes` into `tree` as `_set_dotted` sets overrides, except that a mapping given for a
    section (a dict or a config object) is merged into it field by field."""
    for dotted, value in changes.items():
        if isinstance(value, BaseModel):
            value = value.model_dump()
        if isinstance(value, dict) and isinstance(_get_dotted(tree, dotted), dict):
            _merge(tree, {f"{dotted}.{key}": inner for key, inner in value.items()})
        else:
            _set_dotted(tree, dotted, value)


def with_overrides(section: Section, changes: dict[str, Any]) -> Section:
    """`section` with `changes` applied and the whole validated again, as `load_config` applies
    overrides to a file: `{"kl.target": None}`, or `{"critic": {"kind": "shared"}}` (merged into the
    section). A field resolved from `auto` by another (PPO's `critic` by `advantage_estimator`) is
    resolved again when that one changes (or PPO's `reward`), unless `changes` sets it too."""
    tree = section.model_dump()
    for field, derived in getattr(type(section), "DERIVED", {}).items():
        changed = {key.split(".")[0] for key in changes}
        if field in changed and derived not in changed:
            tree[derived] = "auto"
    _merge(tree, changes)
    return type(section).model_validate(tree)


OUTSIDE_THE_HASH = {"launch": {"timeout_seconds", "engine", "ray_address", "ray_placement", "ray_storage_path",
                               "max_failures"}, "offload_frozen": True}
"""Stage settings that cannot change its result, left out of its hash and so of its cache key: a run
that timed out and is rerun with a longer timeout resumes the stage's work instead of starting over;
where the processes run (this machine or a Ray cluster, its address, placement, storage and
retries) gives the same result to the bit at the same process count (tests/test_ray.py); frozen
models computed from host memory compute what they computed from the device."""


def config_hash(section: BaseModel) -> str:
    """Stable digest of a resolved config section."""
    dumped = section.model_dump(mode="json", exclude=OUTSIDE_THE_HASH)  # a section without `launch` ignores it
    return hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()


def param_value(value: Any) -> str:
    """A setting as an MLflow param shows it: lists and null as JSON (as the config writes them), the rest as text."""
    return json.dumps(value) if isinstance(value, (list, type(None))) else str(value)


def flatten(section: BaseModel, prefix: str = "") -> dict[str, str]:
    """{"train_data.path": "...", ...}: a config section as MLflow params."""
    flat: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else k)
        else:
            flat[key] = param_value(node)

    walk(section.model_dump(mode="json"), prefix)
    return flat
