"""The RL stage's config section, `ppo`: the advantage estimator and its critic, the KL penalty and
its control, the reward's terms (the reward model and Python functions), the warnings, and the
evaluations. Every field has a one-line docstring (the README's configuration reference)."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from rlhf.config_common import (
    DataSource,
    EvaluationConfig,
    LoRAConfig,
    PolicyLoRAConfig,
    SampledStage,
    SamplingConfig,
    TrainedStage,
    _Frozen,
    _refuse_moved,
)


class PPOEvaluationConfig(EvaluationConfig):
    """PPO's evaluations: at the end, and every `every` iterations."""

    every: PositiveInt | None = 10
    """Evaluate every this many iterations as well as at the end, so `eval/*` are curves; unset: at the end only (the SFT baseline is sampled once either way)."""


class CriticConfig(_Frozen):
    """The value function GAE learns (`advantage_estimator: gae`; the other estimators have none)."""

    kind: Literal["reward", "reward-lora", "policy", "shared", "detached"] = "reward"
    """A separate critic initialised from the reward model (`reward`; needs the policy's tokenizer), LoRA adapters and a value head on the reward model's own frozen weights, which score with the adapters off (`reward-lora`: one copy of the reward model instead of two), a separate critic initialised from the SFT policy with a fresh value head (`policy`: the default where the reward has no reward-model term), a value head on the policy's body (`shared`), or that head with its loss kept off the body (`detached`); docs/performance.md has the comparison."""
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
    """With `reward` or `reward-lora`: apply the reward normalisation fitted on the first rollouts to the critic's head as well, so its first values are on the scale of the normalised scores it learns to predict."""
    freeze_policy_iterations: int = Field(0, ge=0)
    """Warm-up: for this many first iterations only the critic learns (no policy loss; a shared value head reads the body without training it), so the policy's first update meets informed values (OpenRLHF's `freezing_actor_steps`)."""


class KLConfig(_Frozen):
    """PPO's KL to the reference: the penalty, its coefficient's control, and an optional loss term.

    `rollout/kl` is the `estimator`'s per-token KL summed over each rollout response; it is what the
    reward's penalty takes, what the adaptive controller steers to `target`, and what each
    iteration's budget check (`evaluation.kl_budget`) reads. The loss term is always k3 (its
    gradient is unbiased on the policy's own samples); `eval/kl` is always k1 (the log-ratio)."""

    estimator: Literal["k1", "k3"] = "k1"
    """Per-token KL estimator of the reward's penalty and of `rollout/kl`: k1 the log-ratio, k3 (ratio - 1) - log-ratio (never negative)."""
    init_coef: NonNegativeFloat | Literal["auto"] = "auto"
    """Initial (or fixed) coefficient beta: of the per-token KL penalty in the reward, or with `grpo` of the k3 KL loss term. `auto`: 0.05, and 0.2 with `grpo`, whose loss term averages over tokens and needs the larger beta for the same KL (demo: 0.05 reaches KL 25, 0.2 4.75)."""
    target: PositiveFloat | None = 6.0
    """Adaptive control target for `rollout/kl` (Ziegler et al.); unset keeps beta fixed."""
    horizon: PositiveFloat = 10000.0
    """Adaptive control horizon, in episodes."""
    loss_coef: float = Field(0.0, ge=0)
    """c3: weight of a k3 KL(pi || ref) term in the loss, besides the penalty in the reward (with `grpo`, besides beta's own loss term)."""


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
    """Warn when max |ratio - 1| before an iteration's first update exceeds this (rollout and training compute different policies); unset: 1e-3 in fp32, 5e-2 in 16 bits (autocast, or a LoRA policy's bf16 weights), whose rounding alone reaches ~4e-3 on the demo model."""


class RewardTerm(_Frozen):
    """One term of the RL stage's reward: the reward model handed down by the reward stage, or a Python function."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """How the term is logged (`rollout/reward/<name>`) and shown in the samples table."""
    weight: float = 1.0
    """Its weight in the score the stage uses: the weighted sum of every term."""
    function: str | None = None
    """`module:function`, importable from the project or from `reward.paths`: called on the main process with each batch's prompts (`prompts`: chat messages), `responses` (texts) and the prompt records' declared extra columns (`reward.columns`, by name), it returns one float, or None for "no reward", per response. Unset: the reward model, normalised as the stage normalises it."""


class OverlongConfig(_Frozen):
    """DAPO's soft overlong penalty, a reward term (`overlong`): 0 for a response up to `buffer`
    tokens short of `sampling.response_length`, then falling linearly to -1 at the limit."""

    buffer: PositiveInt = 4
    """L_cache: the last this many tokens before the length limit, over which the penalty falls from 0 to -1."""
    weight: PositiveFloat = 1.0
    """Its weight in the score (DAPO's penalty factor)."""


class DynamicSamplingConfig(_Frozen):
    """DAPO's dynamic sampling: prompt groups whose rewards are all equal carry no signal for a group
    baseline; drop them and sample more prompts until the batch is full of groups that differ."""

    max_rounds: PositiveInt = 4
    """Sampling rounds an iteration may take, its first included; a batch still not full then is filled with dropped groups, with a warning."""


class RolloutConfig(_Frozen):
    """When rollouts are sampled relative to the updates that train on them."""

    max_staleness: int = Field(0, ge=0)
    """Updates a rollout may lag behind the policy it trains: 0 samples each iteration's rollout with the weights it trains from (synchronous); 1 has the vLLM server sample iteration k+1's rollouts with the weights of iteration k-1 while the trainer updates on iteration k's (one step off-policy, `rollout/staleness`), corrected by `vllm.importance_sampling` against old log-probs the trainer recomputes under the weights it updates from; larger values keep more rollouts sampled ahead. Needs `rollout_engine: vllm`."""


class RewardTermsConfig(_Frozen):
    """What the RL stage's score is: the weighted sum of its terms."""

    terms: list[RewardTerm] = [RewardTerm(name="reward_model")]
    """The terms; at most one is the reward model (no `function`). With none, no reward model takes part: the pipeline needs no reward stage (`stages: [sft, ppo]`)."""
    paths: list[str] = []
    """Folders put in front of the import path to find `function` terms (absolute, or relative to the directory the pipeline runs in)."""
    columns: list[str] = []
    """Extra columns of the `prompts` records (e.g. a verifiable task's `answer`) that every record must have and the functions receive, by name, a list per batch."""
    overlong: OverlongConfig | None = None
    """DAPO's soft overlong penalty as a term named `overlong` (`rollout/reward/overlong`); unset: none."""

    @model_validator(mode="after")
    def _terms_are_distinct(self) -> RewardTermsConfig:
        names = [term.name for term in self.terms]
        if not names:
            raise ValueError("reward.terms: give at least one term (the reward model, or a function)")
        if len(set(names)) < len(names):
            raise ValueError(f"reward.terms: names must differ, got {names}")
        if self.overlong is not None and OVERLONG_TERM in names:
            raise ValueError(f"reward.terms: {OVERLONG_TERM!r} is the name of reward.overlong's term; rename yours")
        if sum(term.function is None for term in self.terms) > 1:
            raise ValueError("reward.terms: at most one term is the reward model (a term without `function`)")
        for term in self.terms:
            if term.function is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", term.function):
                raise ValueError(f"reward.terms[{term.name}].function: {term.function!r} is not 'module:function'")
        return self

    @property
    def uses_model(self) -> bool:
        """Whether a reward model scores (a term without `function`)."""
        return any(term.function is None for term in self.terms)

    @property
    def functions(self) -> list[RewardTerm]:
        return [term for term in self.terms if term.function is not None]

    @property
    def weights(self) -> dict[str, float]:
        """Each term's weight by name, the overlong penalty's included: what the score sums."""
        overlong = {OVERLONG_TERM: self.overlong.weight} if self.overlong is not None else {}
        return {term.name: term.weight for term in self.terms} | overlong


class PPOConfig(TrainedStage, SampledStage):
    """PPO fine-tuning of the SFT policy against the frozen reward model (and the critic-free estimators GRPO, RLOO, REINFORCE++)."""

    prompts: DataSource = DataSource(path="demo:prompts")
    """Prompts for rollouts, cycled in a seeded shuffled order."""
    reward: RewardTermsConfig = RewardTermsConfig()
    """The score: the reward model's, Python functions', or a weighted sum of both."""
    lora: PolicyLoRAConfig | None = None
    """Train LoRA adapters on the policy instead of all its weights (by default on every linear layer, the output head included); the reference is the policy with its adapters disabled, and the hand-off checkpoint has them merged."""
    sampling: SamplingConfig = SamplingConfig()
    """How rollouts and evaluations sample."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling ahead of the updates (asynchronous rollouts on the vLLM server)."""
    old_logprobs: Literal["auto", "sampling", "recompute"] = "auto"
    """Where rollout log-probs and values come from: the sampling pass, a second forward, or auto (sampling in fp32, recompute in 16 bits: under bf16 autocast, or a LoRA policy whose own weights are bf16 by `frozen_dtype`)."""
    num_iterations: PositiveInt = 100
    """PPO iterations (rollout, score, update)."""
    rollout_batch_size: PositiveInt = 64
    """Responses per iteration, over all processes together: `rollout_batch_size / samples_per_prompt` prompts, each answered `samples_per_prompt` times."""
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce++", "reinforce++-baseline"] = "gae"
    """How a response's tokens get their advantages: GAE with a critic (`gae`), or critic-free from the scores alone: group-normalised (`grpo`, its KL to the reference a k3 loss term weighted by beta), leave-one-out (`rloo`), or discounted returns with the per-token KL reward whitened over the batch (`reinforce++`; `reinforce++-baseline` subtracts each prompt's mean score first). README, "Choosing a method"."""
    samples_per_prompt: PositiveInt | Literal["auto"] = "auto"
    """Responses sampled for each prompt per iteration (a group); `grpo`, `rloo` and `reinforce++-baseline` need at least 2. `auto`: 1 for `gae` and `reinforce++`, `GROUP_SIZE` (4) for the group estimators."""
    group_std_normalize: bool = True
    """With `grpo` only: divide by the group's score std as well as subtracting its mean; false is Dr. GRPO (mean only)."""
    group_batch_normalize: bool = False
    """With `grpo` and `rloo`: whiten the group advantages over the whole batch (every process's tokens), REINFORCE++-baseline's normalisation; with `group_std_normalize: false` it keeps Dr. GRPO's unbiased group baseline on one scale per batch."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """Drop prompt groups whose scores are all equal and sample more prompts until the batch is full (DAPO); needs samples_per_prompt of 2 or more. Unset: off."""
    num_ppo_epochs: PositiveInt = 4
    """Passes over each iteration's rollouts."""
    num_minibatches: PositiveInt = 4
    """Optimizer steps per epoch; the rollout batch is split into this many shuffled minibatches."""
    micro_batch_size: PositiveInt | Literal["auto"] | None = "auto"
    """Sequences per forward pass inside a process's minibatch (gradients accumulate). `auto`: the largest divisor of the minibatch that the memory plan fits on the device present, resolved at launch; null: all of it."""
    learning_rate: PositiveFloat = 1e-5
    """Peak AdamW learning rate of policy and critic."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of optimizer steps with a linearly rising learning rate; then linear decay to zero."""
    clip_range: PositiveFloat = 0.2
    """Policy ratio clip epsilon: the ratio is clipped to [1 - clip_range, 1 + clip_range] (the upper bound `clip_range_high` when set)."""
    clip_range_high: PositiveFloat | None = None
    """Upper policy ratio clip epsilon, DAPO's clip-higher (0.28 with clip_range 0.2 in the paper): more room for unlikely tokens to rise; unset: clip_range (symmetric)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The importance ratio the policy loss clips: per token (PPO), or per sequence, the geometric mean of its token ratios (`sequence`: GSPO, whose paper clips it at 3e-4 and 4e-4), with any advantage estimator."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """How the policy loss (and the KL loss term) averages over a minibatch: every token alike (`token-mean`, DAPO's and TRL's default), the mean over responses of each one's token mean (`seq-mean-token-mean`, GRPO as published) or token sum (`seq-mean-token-sum`), or the token sum over a constant length (`seq-mean-token-sum-norm`, Dr. GRPO)."""
    loss_aggregation_length: PositiveInt | None = None
    """With `seq-mean-token-sum-norm`: the constant length each response's token sum is divided by; unset: sampling.response_length."""
    mask_truncated_responses: bool = False
    """Leave responses cut off at sampling.response_length without an end token out of every loss term (DAPO's overlong filtering, TRL's `mask_truncated_completions`); they still count in their group's baseline."""
    entropy_coef: float = Field(0.0, ge=0)
    """c2: weight of the entropy bonus."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount (GAE and REINFORCE++ returns)."""
    critic: CriticConfig | None | Literal["auto"] = "auto"
    """The critic GAE learns; `auto`: the default critic with `gae` (`kind: policy` where the reward has no reward-model term), none with the critic-free estimators (which refuse one)."""
    kl: KLConfig = KLConfig()
    """The KL to the reference: penalty, control, loss term."""
    missing_eos_score: float | None = -3.0
    """Score given to responses cut off at `sampling.response_length` without a reply-end token, instead of the reward model's; unset: the reward model scores them as they are (no end token appended)."""
    score_clip: PositiveFloat | None = None
    """Clip normalised scores to [-score_clip, score_clip]."""
    ref_refresh_every: PositiveInt | None = None
    """Copy the policy into the reference every this many iterations; unset never does. Not with `lora` (the reference is the policy without its adapters)."""
    checkpoint_every: PositiveInt = 25
    """Full-state checkpoint (for resuming) every this many iterations."""
    sample_every: PositiveInt = 10
    """Log a table of (prompt, response, score) samples every this many iterations."""
    num_logged_samples: PositiveInt = 8
    """Rows in each samples table."""
    evaluation: PPOEvaluationConfig = PPOEvaluationConfig()
    """The evaluations against the SFT policy on held-out prompts."""
    warnings: WarningsConfig = WarningsConfig()
    """When a run warns."""
    frozen_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the frozen reference and reward models are held in (with `lora`, the policy's own frozen weights, which are the reference); bfloat16 halves their memory."""
    offload_frozen: bool = False
    """With a sharded launch: the reference's and reward model's shards held in host memory, each layer copied to the device when its forward gathers it (as verl offloads its reference); the accelerate config's `fsdp_offload_params: true` (configs/accelerate/fsdp-offload.yaml) offloads every model, the trained ones' gradients and optimizer state included."""
    sharded_sampling: Literal["whole", "per_layer", "auto"] = "auto"
    """With a sharded launch (FSDP2): gather the whole policy once per rollout for sampling (`whole`: one full copy while sampling, fastest), or gather each layer at every decode step (`per_layer`: least memory, one all-gather per layer per token); `auto`: `whole` where the memory plan fits it on the device present, else `per_layer`, resolved at launch; docs/scaling.md has the figures."""
    refit_normalization: bool = True
    """Refit the reward normalisation (gain, bias) on the first iteration's rollouts, so PPO's scores start at mean 0, std 1 under its own sampling settings."""

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
        """Moved keys refused; `auto` fields take the value their advantage estimator needs; explicit values stay as given."""
        if not isinstance(data, dict):
            return data
        data = _refuse_moved(data, PPO_MOVED, "ppo")
        estimator = data.get("advantage_estimator", "gae")
        if data.get("samples_per_prompt", "auto") == "auto":
            data = data | {"samples_per_prompt": GROUP_SIZE if estimator in GROUP_ESTIMATORS else 1}
        if data.get("critic", "auto") == "auto":
            data = data | {"critic": (_default_critic(data.get("reward")) if estimator == "gae" else None)}
        kl = data.get("kl", {})
        if isinstance(kl, dict) and kl.get("init_coef", "auto") == "auto":
            data = data | {"kl": kl | {"init_coef": KL_COEF.get(estimator, 0.05)}}
        return data

    @model_validator(mode="after")
    def _batches_divide(self) -> PPOConfig:
        processes = self.launch.num_processes
        if self.rollout_batch_size % (self.samples_per_prompt * processes):
            factors = f"samples_per_prompt ({self.samples_per_prompt})"
            if processes > 1:
                factors += f" x launch.num_processes ({processes})"
            raise ValueError(f"{factors} must divide rollout_batch_size ({self.rollout_batch_size}): each process "
                             "samples whole groups of responses")
        if self.advantage_estimator in GROUP_ESTIMATORS and self.samples_per_prompt < 2:
            raise ValueError(f"advantage_estimator {self.advantage_estimator!r} compares responses to the same prompt: "
                             "set samples_per_prompt to 2 or more")
        if self.critic is not None and self.advantage_estimator != "gae":
            raise ValueError(f"critic: advantage_estimator {self.advantage_estimator!r} learns no critic; leave the "
                             "critic section out (or set it to null)")
        if self.critic is None and self.advantage_estimator == "gae":
            raise ValueError("critic: advantage_estimator 'gae' learns a value function; give it a critic section "
                             "(or leave it out for the default)")
        if self.rollout_batch_size % (self.num_minibatches * processes):
            factors = f"num_minibatches ({self.num_minibatches})"
            if processes > 1:
                factors += f" x launch.num_processes ({processes})"
            raise ValueError(f"{factors} must divide rollout_batch_size ({self.rollout_batch_size})")
        if self.offload_frozen and not self.launch.sharded:
            raise ValueError("offload_frozen: frozen models are offloaded shard by shard, so it needs a sharded launch "
                             "(launch.accelerate_config: configs/accelerate/fsdp.yaml and num_processes above 1)")
        if self.launch.accelerate_settings().get("distributed_type", "MULTI_GPU") not in ("MULTI_GPU", "NO", "FSDP"):
            raise ValueError("ppo.launch.accelerate_config: PPO runs on DDP (distributed_type MULTI_GPU) or FSDP2 "
                             "(configs/accelerate/fsdp.yaml); DeepSpeed is for the SFT, reward and DPO stages (PPO's "
                             "optimizer and scheduler step outside DeepSpeed's engine)")
        if not self.reward.uses_model and self.critic is not None and self.critic.kind in ("reward", "reward-lora"):
            raise ValueError(f"critic.kind {self.critic.kind!r} starts from the reward model, but reward.terms has no "
                             "reward-model term (a term without `function`): use critic.kind 'policy', 'shared' or "
                             "'detached', or a critic-free advantage_estimator (grpo, rloo, reinforce++)")
        if self.lora is not None and self.ref_refresh_every is not None:
            raise ValueError("ref_refresh_every cannot act with lora: the reference is the policy with its adapters "
                             "disabled, so there is no copy to refresh; unset one of them")
        if self.critic is not None and self.critic.freeze_policy_iterations >= self.num_iterations:
            raise ValueError(f"critic.freeze_policy_iterations ({self.critic.freeze_policy_iterations}) leaves no "
                             f"iteration of num_iterations ({self.num_iterations}) to train the policy")
        if self.clip_range_high is not None and self.clip_range_high < self.clip_range:
            raise ValueError(f"clip_range_high ({self.clip_range_high}) is below clip_range ({self.clip_range}): "
                             "clip-higher raises the upper bound; set clip_range for a symmetric clip")
        if self.loss_aggregation_length is not None and self.loss_aggregation != "seq-mean-token-sum-norm":
            raise ValueError("loss_aggregation_length is the constant of loss_aggregation 'seq-mean-token-sum-norm' "
                             f"(Dr. GRPO); with {self.loss_aggregation!r} it cannot act: unset it")
        if self.group_batch_normalize and self.advantage_estimator not in ("grpo", "rloo"):
            raise ValueError(f"group_batch_normalize cannot act with advantage_estimator {self.advantage_estimator!r}: "
                             "it whitens grpo's and rloo's group advantages over the batch (gae and the reinforce++ "
                             "estimators whiten over the batch already)")
        if self.dynamic_sampling is not None and self.samples_per_prompt < 2:
            raise ValueError("dynamic_sampling drops prompt groups whose responses all score the same, so it needs "
                             f"groups: set samples_per_prompt to 2 or more (it is {self.samples_per_prompt})")
        if self.reward.overlong is not None and self.reward.overlong.buffer >= self.sampling.response_length:
            raise ValueError(f"reward.overlong.buffer ({self.reward.overlong.buffer}) must be shorter than "
                             f"sampling.response_length ({self.sampling.response_length})")
        if self.rollout.max_staleness:
            self._can_sample_ahead()
        minibatch = self.rollout_batch_size // (self.num_minibatches * processes)
        if isinstance(self.micro_batch_size, int) and minibatch % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide the minibatch ({minibatch})")
        return self

    def _can_sample_ahead(self) -> None:
        """What `rollout.max_staleness` above 0 cannot combine with, and why."""
        staleness = f"rollout.max_staleness ({self.rollout.max_staleness})"
        if self.rollout_engine != "vllm":
            raise ValueError(f"{staleness} samples on the vLLM server while the trainer updates; with rollout_engine "
                             f"{self.rollout_engine!r} the trained model samples itself, in the trainer's own processes, "
                             "so there is nothing to overlap: set rollout_engine: vllm, or max_staleness 0")
        if self.vllm.importance_sampling is None:
            raise ValueError(f"{staleness} trains on rollouts an older policy sampled, which only "
                             "vllm.importance_sampling's weights (pi_trainer / pi_vllm) correct; without them the "
                             "update is biased: set vllm.importance_sampling to token or sequence, or max_staleness 0")
        if self.dynamic_sampling is not None:
            raise ValueError(f"{staleness} samples the next iteration's prompts before this one is scored, but "
                             "dynamic_sampling decides how many prompts an iteration takes from its scores: unset "
                             "one of them")

    @property
    def uses_critic(self) -> bool:
        """Only GAE learns a value function; the other estimators take baselines from the scores."""
        return self.critic is not None

    @property
    def kl_in_loss(self) -> bool:
        """GRPO keeps the reward the score alone and puts beta's KL into the loss."""
        return self.advantage_estimator == "grpo"

    @property
    def clip_high(self) -> float:
        """The policy ratio's upper clip epsilon."""
        return self.clip_range if self.clip_range_high is None else self.clip_range_high

    @property
    def aggregation_length(self) -> int:
        """Dr. GRPO's constant length (`seq-mean-token-sum-norm`)."""
        return self.loss_aggregation_length or self.sampling.response_length

    @property
    def freeze_policy_iterations(self) -> int:
        """The critic's warm-up iterations (0 without a critic)."""
        return 0 if self.critic is None else self.critic.freeze_policy_iterations


PPO_MOVED = {
    "response_length": "sampling.response_length", "temperature": "sampling.temperature",
    "micro_rollout_batch_size": "sampling.micro_batch_size",
    "eval_prompts": "evaluation.prompts", "eval_seed": "evaluation.seed",
    "eval_samples_per_prompt": "evaluation.samples_per_prompt", "eval_every": "evaluation.every",
    "kl_budget": "evaluation.kl_budget",
    "kl_estimator": "kl.estimator", "init_kl_coef": "kl.init_coef", "target_kl": "kl.target",
    "kl_horizon": "kl.horizon", "kl_loss_coef": "kl.loss_coef",
    "critic_lora": "critic.lora", "vf_coef": "critic.vf_coef", "clip_range_value": "critic.clip_range_value",
    "lam": "critic.lam", "whiten_rewards": "critic.whiten_rewards", "normalize_critic": "critic.normalize",
    "freeze_policy_iterations": "critic.freeze_policy_iterations",
    "warn_eos_rate": "warnings.eos_rate", "warn_length_drift": "warnings.length_drift",
    "warn_length_collapse": "warnings.length_collapse", "warn_ratio_max": "warnings.ratio_max",
    "warn_initial_ratio_deviation": "warnings.initial_ratio_deviation",
}


def _default_critic(reward: Any) -> dict:
    """`critic: auto` under GAE: started from the reward model, or from the policy where the reward has no model term."""
    try:
        terms = reward if isinstance(reward, RewardTermsConfig) else RewardTermsConfig.model_validate(reward or {})
    except ValidationError:
        return {}  # the reward section's own error is the one reported
    return {} if terms.uses_model else {"kind": "policy"}


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce++-baseline")
OVERLONG_TERM = "overlong"
"""The name of `reward.overlong`'s term."""
GROUP_SIZE = 4
KL_COEF = {"grpo": 0.2}
