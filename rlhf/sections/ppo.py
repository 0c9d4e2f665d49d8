"""The RL stage's config section, `ppo`: the advantage estimator and its critic, the KL penalty and
its control, the reward's terms (the reward model and Python functions), the warnings, and the
evaluations. Every field has a one-line docstring (the configuration reference, `rlhf
config-reference`); docs/settings.md explains each at length."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from rlhf.sections.base import (
    DataSource,
    EvaluationConfig,
    LoRAConfig,
    PolicyLoRAConfig,
    SampledStage,
    SamplingConfig,
    TrainedStage,
    _Frozen,
)
from rlhf.sections.environment import EnvironmentConfig
from rlhf.sections.reward_terms import RewardTermsConfig, TeacherConfig


class PPOEvaluationConfig(EvaluationConfig):
    """PPO's evaluations: at the end, and every `every` iterations."""

    every: PositiveInt | None = 10
    """Evaluate every this many iterations as well as at the end, so `eval/*` are curves; unset: at the end only."""


class CriticConfig(_Frozen):
    """The value function GAE learns (`advantage_estimator: gae`; the other estimators have none)."""

    kind: Literal["reward", "reward-lora", "policy", "shared", "detached"] = "reward"
    """Built on the reward model (`reward`, `reward-lora`) or on the policy (`policy`, `shared`, `detached`)."""
    lora: LoRAConfig = LoRAConfig()
    """The adapters of the `reward-lora` critic on the reward model."""
    vf_coef: float = Field(0.1, ge=0)
    """c1: weight of the value loss."""
    clip_range_value: PositiveFloat = 0.2
    """Value clip epsilon around the rollout values."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    whiten_rewards: bool = False
    """Whiten per-token rewards (keeping their mean) before GAE."""
    normalize: bool = True
    """With `reward` or `reward-lora`: apply the fitted reward normalisation to the critic's head as well."""
    freeze_policy_iterations: NonNegativeInt | Literal["auto"] = "auto"
    """Warm-up: for this many first iterations only the critic learns (OpenRLHF's `freezing_actor_steps`);
    `auto`: a tenth of `num_iterations` for a value head that starts untrained (`policy`, `shared`,
    `detached`), none for one that starts from the reward model's head."""


class KLConfig(_Frozen):
    """PPO's KL to the reference: the penalty, its coefficient's control, and an optional loss term.

    `rollout/kl` is the `estimator`'s per-token KL summed over each rollout response; it is what the
    reward's penalty takes, what the adaptive controller steers to `target`, and what each
    iteration's budget check (`evaluation.kl_budget`) reads. The loss term is always k3 (its
    gradient is unbiased on the policy's own samples); `eval/kl` is always k1 (the log-ratio)."""

    estimator: Literal["k1", "k3"] = "k1"
    """Per-token KL estimator of the reward's penalty and of `rollout/kl`: k1 the log-ratio, k3 (never negative)."""
    init_coef: NonNegativeFloat | Literal["auto"] = "auto"
    """Initial (or fixed) beta of the reward's KL penalty (`grpo`: of its KL loss); `auto`: 0.05, 0.2 with `grpo`."""
    target: PositiveFloat | None = 6.0
    """Adaptive control target for `rollout/kl` (Ziegler et al.); unset keeps beta fixed."""
    horizon: PositiveFloat = 10000.0
    """Adaptive control horizon, in episodes."""
    loss_coef: float = Field(0.0, ge=0)
    """c3: weight of a k3 KL term (policy to reference) in the loss, besides the penalty in the reward."""


class WarningsConfig(_Frozen):
    """When a PPO run warns (in its log and its run's description); none of these changes the training."""

    eos_rate: float = Field(0.5, ge=0, le=1)
    """Warn when the share of responses ending with EOS falls below this."""
    length_drift: PositiveFloat = 0.5
    """Warn when mean response length drifts by more than this share from the first iteration's."""
    length_collapse: float = Field(0.4, gt=0, lt=1)
    """Warn when mean response length falls by more than this share within one iteration."""
    ratio_max: PositiveFloat = 10.0
    """Warn when the largest policy ratio exceeds this."""
    initial_ratio_deviation: PositiveFloat | None = None
    """Warn when max abs(ratio - 1) before an iteration's first update exceeds this; unset: 1e-3 fp32, 5e-2 16-bit."""


class DynamicSamplingConfig(_Frozen):
    """DAPO's dynamic sampling: prompt groups whose rewards are all equal carry no signal for a group
    baseline; drop them and sample more prompts until the batch is full of groups that differ."""

    max_rounds: PositiveInt = 4
    """Sampling rounds an iteration may take, its first included; then dropped groups fill the batch, with a warning."""


class CorrectionConfig(_Frozen):
    """How the update weights tokens that another policy sampled than the one it recomputes them under:
    the vLLM server's numerics differ from the trainer's, and sampled ahead they come from an older
    version. The ratio rho = pi_train / pi_sampled is taken per token, or per sequence (the product
    over its tokens), and bounded (docs/settings.md, "rollout.correction")."""

    kind: Literal["tis", "mis", "icepop", "none"] = "tis"
    """`tis`: rho truncated to [low, high]; `mis`: rho, 0 outside [low, high]; `icepop`: `mis` per token; `none`: 1."""
    level: Literal["token", "sequence"] = "token"
    """One ratio per token, or one per sequence (the product of its tokens' ratios) on each of its tokens."""
    bounds: tuple[NonNegativeFloat, PositiveFloat] | None = None
    """[low, high] of rho; unset: the kind's (tis and mis [0, 2], icepop [0.5, 5])."""

    DEFAULT_BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "tis": (0.0, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0), "none": (0.0, math.inf)}
    """Each kind's bounds: truncation at 2 as before (TRL caps at 3), and IcePop's published [0.5, 5]
    (Ling team, 2025)."""

    @model_validator(mode="after")
    def _icepop_is_per_token(self) -> CorrectionConfig:
        """IcePop masks tokens; a sequence-level mask is `mis` with `level: sequence`. Bounds are ordered."""
        if self.kind == "icepop" and self.level == "sequence":
            raise ValueError("rollout.correction.kind icepop masks single tokens: use level token, or kind mis "
                             "with level sequence to mask whole sequences")
        low, high = self.resolved_bounds
        if low >= high:
            raise ValueError(f"rollout.correction.bounds: low ({low}) must lie below high ({high})")
        return self

    @property
    def resolved_bounds(self) -> tuple[float, float]:
        """(low, high): the ones given, else the kind's."""
        return self.DEFAULT_BOUNDS[self.kind] if self.bounds is None else self.bounds


class RolloutConfig(_Frozen):
    """When rollouts are sampled relative to the updates that train on them, and how the update corrects
    for tokens another policy sampled."""

    max_staleness: int = Field(0, ge=0)
    """Updates a rollout may lag behind the policy it trains (0: synchronous); above 0 needs `rollout_engine: vllm`."""
    partial: bool = False
    """Episodes sampled ahead go on across a weight sync, their next turns by the new weights (needs an environment)."""
    correction: CorrectionConfig = CorrectionConfig()
    """The importance weights for tokens the vLLM server sampled: truncated (`tis`) or masked (`mis`, `icepop`)."""


class PPOConfig(TrainedStage, SampledStage):
    """PPO fine-tuning of the SFT policy against the frozen reward model (and the critic-free estimators GRPO,
    RLOO, REINFORCE++)."""

    # --- algorithm ---
    paths: list[str] = []
    """Folders put in front of the import path for the stage's `module:function`s (reward terms, environments)."""
    prompts: DataSource = DataSource(path="demo:prompts")
    """Prompts for rollouts, cycled in a seeded shuffled order."""
    reward: RewardTermsConfig = RewardTermsConfig()
    """The score: the reward model's, Python functions', or a weighted sum of both; `distill`: none unless given."""
    teacher: TeacherConfig | None = None
    """On-policy distillation: a frozen teacher's per-token term in the reward (`distill`: alone); unset: none."""
    lora: PolicyLoRAConfig | None = None
    """Train LoRA adapters on the policy instead of all its weights; the reference is the policy with adapters off."""
    sampling: SamplingConfig = SamplingConfig()
    """How rollouts and evaluations sample."""
    num_iterations: PositiveInt = 100
    """PPO iterations (rollout, score, update)."""
    rollout_batch_size: PositiveInt = 64
    """Responses per iteration, over all processes together: `rollout_batch_size / samples_per_prompt` prompts."""
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce++", "reinforce++-baseline", "distill"] = "gae"
    """How tokens get advantages: GAE with a critic (`gae`), from scores (`grpo`, ...), or by a teacher (`distill`)."""
    samples_per_prompt: PositiveInt | Literal["auto"] = "auto"
    """Responses per prompt per iteration (a group); `auto`: 1 for `gae` and `reinforce++`, 4 for group estimators."""
    group_normalization: Literal["std", "mean", "batch", "std+batch"] = "std"
    """Group advantages (grpo, rloo): `std` ÷ the group's std (GRPO), `mean` (Dr. GRPO), `batch` whitened overall."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """DAPO's dynamic sampling: drop groups whose scores are all equal, sample more prompts instead; unset: off."""
    num_ppo_epochs: PositiveInt = 4
    """Passes over each iteration's rollouts."""
    num_minibatches: PositiveInt = 4
    """Optimizer steps per epoch; the rollout batch is split into this many shuffled minibatches."""
    learning_rate: PositiveFloat = 1e-5
    """Peak AdamW learning rate of policy and critic."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of optimizer steps with a linearly rising learning rate; then linear decay to zero."""
    clip_range: PositiveFloat | tuple[PositiveFloat, PositiveFloat] = 0.2
    """Policy ratio clip epsilon: the ratio is clipped to [1 - eps, 1 + eps]; `[low, high]`: DAPO's clip-higher."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The ratio the policy loss clips: per token (PPO), or per sequence, its tokens' geometric mean (GSPO)."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm"] = "token-mean"
    """How the policy loss averages a minibatch: every token alike, or by response (token mean, sum, sum / constant)."""
    mask_truncated_responses: bool = False
    """Leave responses cut off without an end token out of every loss term (DAPO's overlong filtering)."""
    entropy_coef: float = Field(0.0, ge=0)
    """c2: weight of the entropy bonus."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount (GAE and REINFORCE++ returns)."""
    critic: CriticConfig | None | Literal["auto"] = "auto"
    """The critic GAE learns; `auto`: the default critic with `gae`, none with the critic-free estimators."""
    kl: KLConfig = KLConfig()
    """The KL to the reference: penalty, control, loss term."""
    missing_eos_score: float | None = -3.0
    """Score of a response cut off without an end token, by the reward model or a `score` server; unset: theirs."""
    score_clip: PositiveFloat | None = None
    """Clip normalised scores to [-score_clip, score_clip]."""
    refit_normalization: bool = True
    """Refit the reward normalisation (gain, bias) on the first iteration's rollouts: scores start at mean 0, std 1."""
    ref_refresh_every: PositiveInt | None = None
    """Copy the policy into the reference every this many iterations; unset: never. Not with `lora`."""

    # --- diagnostics ---
    num_logged_samples: PositiveInt = 8
    """Rows of the samples table (prompt, response, score) logged at each evaluation (`evaluation.every`)."""
    evaluation: PPOEvaluationConfig = PPOEvaluationConfig()
    """The evaluations against the SFT policy on held-out prompts."""
    warnings: WarningsConfig = WarningsConfig()
    """When a run warns."""

    # --- systems ---
    checkpoint_every: PositiveInt = 25
    """Full-state checkpoint (for resuming) every this many iterations."""
    micro_batch_size: PositiveInt | Literal["auto"] | None = "auto"
    """Sequences per forward pass in a process's minibatch; `auto`: the most that fits, at launch; null: all of it."""
    micro_batch_tokens: PositiveInt | Literal["auto"] | None = None
    """The update's micro-batches by tokens computed, not rows; `auto`: micro_batch_size x the longest sequence."""
    padding_free: bool | Literal["auto"] = False
    """Passes over prompt + response packed without padding (`auto`: where it saves 10%), ended rows out of decoding."""
    compile: bool | Literal["auto"] = False
    """torch.compile the passes over prompt + response (shapes bucketed); `auto`: where a probe at load says it pays."""
    old_logprobs: Literal["auto", "sampling", "recompute"] = "auto"
    """Where rollout log-probs and values come from: the sampling pass, a second forward, or auto (the first batch)."""
    frozen_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the frozen reference and reward models (with `lora`, the policy's own): auto is bf16 under bf16."""
    offload_frozen: bool = False
    """With a sharded launch: hold the reference's and reward model's shards in host memory, copied in per layer."""
    sharded_sampling: Literal["whole", "per_layer", "auto"] = "auto"
    """With FSDP2: gather the whole policy per rollout (`whole`) or a layer per token (`per_layer`); `auto`: by fit."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling ahead of the updates (asynchronous rollouts on the vLLM server)."""
    environment: EnvironmentConfig | None = None
    """Multi-turn episodes against an environment (tools); unset: one response to each prompt."""

    MERGED: ClassVar[dict[str, str]] = {
        "clip_range_high": "clip_range: [low, high] (DAPO's clip-higher: [0.2, 0.28])",
        "group_std_normalize": "group_normalization: std (true) or mean (false: Dr. GRPO)",
        "group_batch_normalize": "group_normalization: batch (or std+batch, keeping the group's std)",
        "sample_every": "the samples table is logged with each evaluation (evaluation.every) and at the end",
        "loss_aggregation_length": "loss_aggregation 'seq-mean-token-sum-norm' divides each token sum by "
                                   "sampling.response_length (Dr. GRPO's constant: the generation budget)",
    }
    DERIVED: ClassVar[dict[str, str]] = {"advantage_estimator": "critic", "reward": "critic"}
    """`auto` fields resolved from another, which `with_overrides` resolves again when that one changes."""

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_of_any_stage(cls, value: Any) -> Any:
        """A `LoRAConfig` made for another stage is taken as its fields (the policy's own defaults for the rest)."""
        return value.model_dump() if type(value) is LoRAConfig else value

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto(cls, data: Any) -> Any:
        """`auto` fields take the value their advantage estimator needs; explicit values stay as given."""
        if not isinstance(data, dict):
            return data
        estimator = data.get("advantage_estimator", "gae")
        if estimator == "distill" and "reward" not in data:  # pure distillation: the teacher's term is the reward
            data = data | {"reward": {"terms": []}}
        if data.get("samples_per_prompt", "auto") == "auto":
            data = data | {"samples_per_prompt": GROUP_SIZE if estimator in GROUP_ESTIMATORS else 1}
        critic = data.get("critic", "auto")
        if critic == "auto":
            critic = _default_critic(data.get("reward")) if estimator == "gae" else None
        elif isinstance(critic, dict) and "kind" not in critic:  # a section that names no kind: the default one
            critic = _default_critic(data.get("reward")) | critic
        data = data | {"critic": critic}
        kl = data.get("kl", {})
        if isinstance(kl, dict) and kl.get("init_coef", "auto") == "auto":
            data = data | {"kl": kl | {"init_coef": KL_COEF.get(estimator, 0.05)}}
        return data

    # Validators run in this order, the first broken rule reported.

    @model_validator(mode="after")
    def _batches_divide(self) -> PPOConfig:
        """Whole groups per process, whole minibatches per process, whole micro-batches per minibatch."""
        processes = self.launch.num_processes
        times = f" x launch.num_processes ({processes})" if processes > 1 else ""
        if self.rollout_batch_size % (self.samples_per_prompt * processes):
            raise ValueError(f"samples_per_prompt ({self.samples_per_prompt}){times} must divide rollout_batch_size "
                             f"({self.rollout_batch_size}): each process samples whole groups of responses")
        if self.rollout_batch_size % (self.num_minibatches * processes):
            raise ValueError(f"num_minibatches ({self.num_minibatches}){times} must divide rollout_batch_size "
                             f"({self.rollout_batch_size})")
        minibatch = self.rollout_batch_size // (self.num_minibatches * processes)
        if isinstance(self.micro_batch_size, int) and minibatch % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide the minibatch ({minibatch})")
        return self

    @model_validator(mode="after")
    def _estimator_fits_critic(self) -> PPOConfig:
        """A group estimator has groups; GAE has a critic and the critic-free estimators none."""
        if self.advantage_estimator in GROUP_ESTIMATORS and self.samples_per_prompt < 2:
            raise ValueError(f"advantage_estimator {self.advantage_estimator!r} compares responses to the same prompt: "
                             "set samples_per_prompt to 2 or more")
        if self.critic is not None and self.advantage_estimator != "gae":
            raise ValueError(f"critic: advantage_estimator {self.advantage_estimator!r} learns no critic; leave the "
                             "critic section out (or set it to null)")
        if self.critic is None and self.advantage_estimator == "gae":
            raise ValueError("critic: advantage_estimator 'gae' learns a value function; give it a critic section "
                             "(or leave it out for the default)")
        return self

    @model_validator(mode="after")
    def _launch_supports_ppo(self) -> PPOConfig:
        """Offloading needs a sharded launch; PPO runs on DDP or FSDP2, not DeepSpeed."""
        if self.offload_frozen and not self.launch.sharded:
            raise ValueError("offload_frozen: frozen models are offloaded shard by shard, so it needs a sharded launch "
                             "(launch.accelerate_config: configs/accelerate/fsdp.yaml and num_processes above 1)")
        if self.compile is True and self.launch.sharded:
            raise ValueError("compile: compiled passes run on one process or DDP; FSDP2's per-layer gathers are not "
                             "compiled here yet (set compile to auto, which runs them eager, or false)")
        if self.launch.accelerate_settings().get("distributed_type", "MULTI_GPU") not in ("MULTI_GPU", "NO", "FSDP"):
            raise ValueError("ppo.launch.accelerate_config: PPO runs on DDP (distributed_type MULTI_GPU) or FSDP2 "
                             "(configs/accelerate/fsdp.yaml); DeepSpeed is for the SFT, reward and DPO stages (PPO's "
                             "optimizer and scheduler step outside DeepSpeed's engine)")
        return self

    @model_validator(mode="after")
    def _reward_fits_critic(self) -> PPOConfig:
        """A critic started from the reward model needs a reward-model term."""
        if not self.reward.uses_model and self.critic is not None and self.critic.kind in ("reward", "reward-lora"):
            raise ValueError(f"critic.kind {self.critic.kind!r} starts from the reward model, but reward.terms has no "
                             "reward-model term (a term without `function`): use critic.kind 'policy', 'shared' or "
                             "'detached', or a critic-free advantage_estimator (grpo, rloo, reinforce++)")
        return self

    @model_validator(mode="after")
    def _teacher_gives_the_reward(self) -> PPOConfig:
        """`distill` distils a teacher; a reward without terms is the teacher's term alone."""
        if self.teacher is None and self.advantage_estimator == "distill":
            raise ValueError("advantage_estimator 'distill' learns from a teacher's log-probs: set teacher.model "
                             "(a folder, runs:/<run id>/checkpoint or models:/<name>@<alias>)")
        served = self.environment is not None and self.environment.server is not None  # its rewards are the score
        if self.teacher is None and not self.reward.terms and not served:
            raise ValueError("reward.terms: give at least one term (the reward model, or a function), a teacher, or "
                             "an environment server (whose rewards land as turn rewards)")
        return self

    @model_validator(mode="after")
    def _reference_can_refresh(self) -> PPOConfig:
        """A LoRA policy's reference is its own body: nothing to refresh."""
        if self.lora is not None and self.ref_refresh_every is not None:
            raise ValueError("ref_refresh_every cannot act with lora: the reference is the policy with its adapters "
                             "disabled, so there is no copy to refresh; unset one of them")
        return self

    @model_validator(mode="after")
    def _warm_up_leaves_training(self) -> PPOConfig:
        """The critic's warm-up leaves iterations that train the policy."""
        if self.critic is not None and self.freeze_policy_iterations >= self.num_iterations:
            raise ValueError(f"critic.freeze_policy_iterations ({self.freeze_policy_iterations}) leaves no "
                             f"iteration of num_iterations ({self.num_iterations}) to train the policy")
        return self

    @model_validator(mode="after")
    def _clip_and_loss_settings_act(self) -> PPOConfig:
        """Clip-higher raises the upper bound."""
        if self.clip_high < self.clip_low:
            raise ValueError(f"clip_range [{self.clip_low}, {self.clip_high}]: the upper epsilon is below the lower "
                             "one: clip-higher raises the upper bound; give one number for a symmetric clip")
        return self

    @model_validator(mode="after")
    def _group_settings_act(self) -> PPOConfig:
        """Batch-normalised group advantages need grpo or rloo; dynamic sampling needs groups."""
        if self.group_normalization != "std" and self.advantage_estimator not in ("grpo", "rloo"):
            raise ValueError(f"group_normalization {self.group_normalization!r} cannot act with advantage_estimator "
                             f"{self.advantage_estimator!r}: it scales grpo's and rloo's group advantages (gae and the "
                             "reinforce++ estimators whiten over the batch already)")
        if self.group_normalization == "mean" and self.advantage_estimator == "rloo":
            raise ValueError("group_normalization 'mean' is grpo's (Dr. GRPO): rloo's baseline is the group's others' "
                             "mean already; use std (its default) or batch")
        if self.dynamic_sampling is not None and self.samples_per_prompt < 2:
            raise ValueError("dynamic_sampling drops prompt groups whose responses all score the same, so it needs "
                             f"groups: set samples_per_prompt to 2 or more (it is {self.samples_per_prompt})")
        return self

    @model_validator(mode="after")
    def _overlong_fits_response(self) -> PPOConfig:
        """The overlong penalty's buffer is shorter than a response."""
        if self.reward.overlong is not None and self.reward.overlong.buffer >= self.sampling.response_length:
            raise ValueError(f"reward.overlong.buffer ({self.reward.overlong.buffer}) must be shorter than "
                             f"sampling.response_length ({self.sampling.response_length})")
        return self

    @model_validator(mode="after")
    def _can_sample_ahead(self) -> PPOConfig:
        """`rollout.max_staleness` above 0 needs the vLLM server, importance sampling, and no dynamic sampling."""
        if not self.rollout.max_staleness:
            return self
        staleness = f"rollout.max_staleness ({self.rollout.max_staleness})"
        if self.rollout_engine != "vllm":
            raise ValueError(f"{staleness} samples on the vLLM server while the trainer updates; with rollout_engine "
                             f"{self.rollout_engine!r} the trained model samples itself, in the trainer's own "
                             "processes, so there is nothing to overlap: set rollout_engine: vllm, or max_staleness 0")
        if self.rollout.correction.kind == "none":
            raise ValueError(f"{staleness} trains on rollouts an older policy sampled, which only "
                             "rollout.correction's weights (pi_trainer / pi_vllm) correct; without them the "
                             "update is biased: set rollout.correction.kind to tis, mis or icepop, or max_staleness 0")
        if self.dynamic_sampling is not None:
            raise ValueError(f"{staleness} samples the next iteration's prompts before this one is scored, but "
                             "dynamic_sampling decides how many prompts an iteration takes from its scores: unset "
                             "one of them")
        return self

    @model_validator(mode="after")
    def _can_continue_across_syncs(self) -> PPOConfig:
        """`rollout.partial` continues episodes sampled ahead between their turns."""
        if not self.rollout.partial:
            return self
        if not self.rollout.max_staleness:
            raise ValueError("rollout.partial continues the episodes sampled ahead across a weight sync; with "
                             "rollout.max_staleness 0 none is in flight at a sync: set max_staleness 1 or more")
        if self.environment is None:
            raise ValueError("rollout.partial continues episodes between their turns, and a single turn is one "
                             "request the sync waits for anyway: set an environment, or partial false")
        return self

    @model_validator(mode="after")
    def _environment_runs_here(self) -> PPOConfig:
        """Episodes step their environment on the process that samples them, sharded only in rounds
        (every process takes each round's decode steps); `env:` prompts come from an environment server."""
        fetched = [name for name, source in (("prompts", self.prompts), ("evaluation.prompts", self.evaluation.prompts))
                   if source.path.startswith("env:")]
        if fetched and (self.environment is None or self.environment.server is None):
            raise ValueError(f"{fetched[0]}: `env:` is an environment server's dataset: set environment.server")
        if self.environment is None:
            return self
        if self.rollout.max_staleness and self.environment.rollout is not None:
            raise ValueError("environment.rollout with rollout.max_staleness above 0: episodes sampled ahead run on a "
                             "thread of their own, and a rollout function's sampling would draw from the trainer's "
                             "random stream there, so no run would repeat: use tools, a factory or a server, or "
                             "max_staleness 0")
        if self.launch.sharded and self.environment.schedule == "continuous":
            raise ValueError("environment.schedule continuous: a sharded policy samples collectively, every process "
                             "the same decode steps (the SFT baseline's episodes too, on any rollout_engine), which "
                             "episodes taking turns on their own cannot keep: use schedule rounds, or launch with DDP")
        return self

    @property
    def uses_critic(self) -> bool:
        """Only GAE learns a value function; the other estimators take baselines from the scores."""
        return self.critic is not None

    @property
    def kl_in_loss(self) -> bool:
        """GRPO keeps the reward the score alone and puts beta's KL into the loss."""
        return self.advantage_estimator == "grpo"

    @property
    def clip_low(self) -> float:
        """The policy ratio's lower clip epsilon: the ratio's lower bound is 1 - it."""
        return self.clip_range if isinstance(self.clip_range, float | int) else self.clip_range[0]

    @property
    def clip_high(self) -> float:
        """The policy ratio's upper clip epsilon: the ratio's upper bound is 1 + it."""
        return self.clip_range if isinstance(self.clip_range, float | int) else self.clip_range[1]

    @property
    def group_std_normalize(self) -> bool:
        """`grpo`: divide by the group's score std as well as subtracting its mean (false: Dr. GRPO)."""
        return self.group_normalization in ("std", "std+batch")

    @property
    def group_batch_normalize(self) -> bool:
        """`grpo`, `rloo`: whiten the group advantages over the whole batch (as REINFORCE++-baseline does)."""
        return "batch" in self.group_normalization

    @property
    def response_tokens(self) -> int:
        """Tokens after the prompt a sequence holds at most: `environment.episode_tokens`, else `response_length`."""
        return self.sampling.response_length if self.environment is None else self.environment.episode_tokens

    @property
    def aggregation_length(self) -> int:
        """Dr. GRPO's constant length (`seq-mean-token-sum-norm`): the generation budget, `sampling.response_length`."""
        return self.sampling.response_length

    @property
    def freeze_policy_iterations(self) -> int:
        """The critic's warm-up iterations (0 without a critic; `auto` resolved by `_warm_up`)."""
        if self.critic is None:
            return 0
        warm_up = self.critic.freeze_policy_iterations
        return _warm_up(self.critic.kind, self.num_iterations) if warm_up == "auto" else warm_up


def _default_critic(reward: Any) -> dict:
    """`critic: auto` under GAE: from the reward model, or from the policy where the reward has no model term."""
    try:
        terms = reward if isinstance(reward, RewardTermsConfig) else RewardTermsConfig.model_validate(reward or {})
    except ValidationError:
        return {}  # the reward section's own error is the one reported
    return {} if terms.uses_model else {"kind": "policy"}


def _warm_up(kind: str, num_iterations: int) -> int:
    """`critic.freeze_policy_iterations: auto`: a tenth of the run where the value head starts untrained.
    An untrained head's values make the first updates' advantages noise: in episodes on the demo's
    tool world they turned the policy away from the tool within ten iterations on 2 of 3 seeds
    (docs/environments.md, "PPO's critic")."""
    return int(num_iterations * WARM_UP_SHARE) if kind in ("policy", "shared", "detached") else 0


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce++-baseline")
"""Advantage estimators whose baseline is the other responses to the same prompt."""
GROUP_SIZE = 4
"""`samples_per_prompt: auto` for a group estimator (docs/methods.md; docs/performance.md)."""
KL_COEF = {"grpo": 0.2, "distill": 0.0}
"""`kl.init_coef: auto` where an estimator needs other than 0.05 (`distill`: no KL to the SFT policy, as published)."""
WARM_UP_SHARE = 0.1
"""`critic.freeze_policy_iterations: auto`: the share of iterations an untrained value head learns alone."""
