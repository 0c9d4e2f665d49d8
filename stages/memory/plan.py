"""Will it fit? The memory a stage needs on each process, predicted from the models' configs alone.

Each model is built from its `config.json` on the meta device (`stages.memory.shapes`: the real
shapes, no weights read: a 70B config plans in seconds); for every stage `stages.memory.phases` walks
the phases the stage's code goes through and takes the largest. This module gives the verdict against
a device: `plan` (every stage of a pipeline), the micro-batch sizes `auto` resolves to
(`with_micro_batches`), the knobs that would make a stage fit (`what_fits`), and the table and JSON
that `rlhf plan` and the flow's pre-flight check show. The plan is a prediction, not an allocator
trace: it leaves out allocator fragmentation and transient buffers smaller than a layer; docs/scaling.md
has how it compares with measurement."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from rlhf.config import PipelineConfig
from rlhf.sections.base import LaunchConfig, LoRAConfig, PolicyLoRAConfig, StageName, TrainedStage
from stages.memory.phases import (
    Counts,
    Device,
    PPOShapes,
    StagePlan,
    Target,
    plan_ppo,
    plan_trainer_stage,
    this_device,
)
from stages.memory.shapes import GIB, RUNTIME_GIB, ModelShape, model_shape, reward_shape

FSDP_CONFIG = "configs/accelerate/fsdp.yaml"



def plan_stage(cfg: PipelineConfig, stage: StageName, shapes: dict[str, ModelShape], target: Target,
               section=None) -> StagePlan:
    """`stage`'s plan for `target` with `section` (default: the config's) and the models in `shapes`
    (`policy`, `reward` where the reward model is its own, PPO's `teacher`)."""
    section = section or getattr(cfg, stage)
    if auto_fields(stage, section, target.counts, target.processes):
        section = resolve_micro_batches(stage, section, shapes, target)
    if stage == "ppo":
        return plan_ppo(section, PPOShapes.of(section, shapes), target)
    policy = shapes["policy"]
    model = reward_shape(shapes.get("reward", policy)) if stage == "reward" else policy
    return plan_trainer_stage(stage, section, policy, model, target)


# --- micro-batches chosen for the device ------------------------------------------------------------------------

AUTO_MARGIN = 0.9
"""An `auto` micro-batch is the largest whose plan needs at most this share of the device's memory:
the rest for what the plan leaves out (allocator fragmentation, small transient buffers)."""


def _halvings(total: int) -> list[int]:
    """The powers of two below `total`, largest first: micro-batch sizes to try after all at once."""
    sizes, size = [], 1
    while size < total:
        sizes.append(size)
        size *= 2
    return sizes[::-1]


def auto_fields(stage: StageName, section, counts: Counts, processes: int | None = None) -> list[tuple[str, list]]:
    """(dotted field, candidate values, most memory first) for each of the stage's memory settings set
    to `auto`: PPO's `sharded_sampling`, then the micro-batch sizes, whose first candidate, None, is
    all at once (what a config without micro-batches does)."""
    fields = []
    n = processes or section.launch.num_processes
    if stage == "ppo" and section.sharded_sampling == "auto":  # first: the faster way, where it fits
        fields.append(("sharded_sampling", ["whole", "per_layer"]))
    if stage == "ppo" and section.sampling.micro_batch_size == "auto":
        evaluated = (counts.ppo_eval_prompts or 64) * section.evaluation.samples_per_prompt
        sampled_at_once = max(section.rollout_batch_size // n, evaluated)
        fields.append(("sampling.micro_batch_size", [None, *_halvings(sampled_at_once)]))
    if stage == "ppo" and section.micro_batch_size == "auto":
        minibatch = section.rollout_batch_size // (section.num_minibatches * n)
        fields.append(("micro_batch_size", [None, *(d for d in range(minibatch - 1, 0, -1) if minibatch % d == 0)]))
    if stage == "dpo" and section.sampling.micro_batch_size == "auto":
        evaluated = (counts.dpo_eval_prompts or 64) * section.evaluation.samples_per_prompt
        fields.append(("sampling.micro_batch_size", [None, *_halvings(evaluated)]))
    if stage == "reward" and section.normalization_micro_batch_size == "auto":
        sequences = (counts.reward_normalization_prompts or 64) * section.normalization_samples
        fields.append(("normalization_micro_batch_size", [None, *_halvings(sequences)]))
    return fields


def resolve_micro_batches(stage: StageName, section, shapes: dict[str, ModelShape], target: Target):
    """`section` with every `auto` micro-batch size resolved: each the largest of its candidates
    (`auto_fields`) whose plan fits the target's device with `AUTO_MARGIN`, the others at their smallest
    while it is chosen, in `auto_fields`' order; the smallest where none fits (the plan then says so).
    Explicit sizes are kept as they are."""
    from rlhf.config import with_overrides

    fields = auto_fields(stage, section, target.counts, target.processes)
    if not fields:
        return section
    section = with_overrides(section, {name: candidates[-1] for name, candidates in fields})
    for name, candidates in fields:
        for value in candidates[:-1]:
            trial = with_overrides(section, {name: value})
            if target.device.fits(plan_stage(None, stage, shapes, target, trial), AUTO_MARGIN):
                section = trial
                break
    return section


def resolved_values(stage: StageName, section, resolved) -> dict[str, int | str | None]:
    """What `resolve_micro_batches` chose, by the names in the section (`sampling.micro_batch_size`)."""
    return {name: functools.reduce(getattr, name.split("."), resolved)
            for name, _ in auto_fields(stage, section, Counts(), section.launch.num_processes)}


def with_micro_batches(stage: StageName, section, counts: Counts, policy_location: str,
                       reward_location: str | None = None, reporting=None):
    """What a stage calls first: `section` with its `auto` micro-batch sizes resolved on the device
    present (`this_device`) from its models' configs (the policy, and the reward model where the
    stage has one) and its data's counts; each process resolves the same. The chosen sizes go to
    `reporting.params` as `auto.<field>`. A section without `auto` is returned as it is."""
    if not auto_fields(stage, section, counts):
        return section
    shapes = {"policy": model_shape(policy_location, section.trust_remote_code)}
    if reward_location is not None:
        shapes["reward"] = model_shape(reward_location, section.trust_remote_code)
    resolved = resolve_micro_batches(stage, section, shapes, Target(this_device(), counts))
    if reporting is not None:
        reporting.params({f"auto.{name}": value for name, value in resolved_values(stage, section, resolved).items()})
    return resolved


# --- what would make it fit ---------------------------------------------------------------------------------


def knobs(stage: StageName, section: TrainedStage) -> list[tuple[str, dict]]:
    """Settings that cut a stage's memory without changing what it computes much, cheapest first:
    (what to write in the config, the section fields it sets)."""
    found: list[tuple[str, dict]] = []
    if stage == "ppo":
        minibatch = section.rollout_batch_size // (section.num_minibatches * section.launch.num_processes)
        micro = section.micro_batch_size or minibatch
        if section.sampling.micro_batch_size is None or section.sampling.micro_batch_size > micro:
            # As many sequences without gradients at once as the update takes with them.
            found.append((f"ppo.sampling.micro_batch_size: {micro}",
                          {"sampling": section.sampling.model_copy(update={"micro_batch_size": micro})}))
        if micro > 1:
            found.append((f"{stage}.micro_batch_size: 1", {"micro_batch_size": 1}))
    elif section.batch_size > 1:
        found.append((f"{stage}.batch_size: 1 with gradient_accumulation_steps: "
                      f"{section.batch_size * section.gradient_accumulation_steps}",
                      {"batch_size": 1, "gradient_accumulation_steps": section.batch_size *
                       section.gradient_accumulation_steps}))
    if not section.gradient_checkpointing:
        found.append((f"{stage}.gradient_checkpointing: true", {"gradient_checkpointing": True}))
    if stage == "dpo" and (section.sampling.micro_batch_size or 2) > 1:
        found.append(("dpo.sampling.micro_batch_size: 1",
                      {"sampling": section.sampling.model_copy(update={"micro_batch_size": 1})}))
    if stage in ("ppo", "dpo") and section.frozen_dtype != "bfloat16":  # auto is float32 unless the stage runs bf16
        found.append((f"{stage}.frozen_dtype: bfloat16", {"frozen_dtype": "bfloat16"}))
    if stage == "ppo" and not section.offload_frozen:  # acts only when sharded, on a GPU
        found.append(("ppo.offload_frozen: true", {"offload_frozen": True}))
    if stage == "ppo" and section.sharded_sampling == "whole":  # acts only when sharded: see `sharding_over`
        found.append(("ppo.sharded_sampling: per_layer", {"sharded_sampling": "per_layer"}))
    if stage == "ppo" and section.uses_critic and section.critic.kind == "reward":
        found.append(("ppo.critic.kind: reward-lora",
                      {"critic": section.critic.model_copy(update={"kind": "reward-lora"})}))
    if section.lora is None:
        found.append((f"{stage}.lora: {{}}", {"lora": PolicyLoRAConfig() if stage == "ppo" else LoRAConfig()}))
    return found


def sharding_over(n: int) -> tuple[str, dict]:
    return (f"shard over {n} processes (launch: {{num_processes: {n}, accelerate_config: {FSDP_CONFIG}}})",
            {"launch": LaunchConfig(num_processes=n, accelerate_config=FSDP_CONFIG)})


def what_fits(section: TrainedStage, stage: StageName, shapes: dict[str, ModelShape], target: Target,
              max_processes: int = 64, most: int = 5) -> list[str]:
    """Ways to bring the stage under the target's device memory, cheapest first: the fewest knobs
    (sharding counts as one, at the fewest processes that fit), and at each count the knobs in
    `knobs`' order; at most `most` ways, from the smallest count that has any and the next. Each way
    is planned at its section's own process count (the target's is not kept: sharding sets it)."""
    import itertools

    options = knobs(stage, section)
    shardings = [sharding_over(n) for n in (2, 4, 8, 16, 32, 64) if n <= max_processes]
    target = replace(target, processes=None)

    def fits(chosen) -> bool:
        updates = {k: v for _, fields in chosen for k, v in fields.items()}
        changed = section.model_copy(update=updates)
        return target.device.fits(plan_stage(None, stage, shapes, target, section=changed))

    found: list[tuple[frozenset[str], int, str]] = []  # (knobs, processes, the way as written)

    def add(chosen, processes: int) -> None:
        names = frozenset(name for name, _ in chosen)
        if not any(earlier <= names and n <= processes for earlier, n, _ in found):  # not a cheaper way plus more
            found.append((names, processes, ", ".join(name for name, _ in chosen)))

    first = None
    for size in range(1, len(options) + 2):
        if first is not None and size > first + 1:
            break
        for chosen in itertools.combinations(options, size):
            if fits(chosen):
                add(chosen, 1)
        for chosen in itertools.combinations(options, size - 1):
            for n, sharding in zip((2, 4, 8, 16, 32, 64), shardings, strict=False):
                if fits(chosen + (sharding,)):
                    add(chosen + (sharding,), n)
                    break
        if found and first is None:
            first = size
    return [way for _, _, way in found[:most]]


# --- the whole config ------------------------------------------------------------------------------------


NODE_GPUS = 8
"""Processes a GPU node holds when the plan is not told otherwise (`rlhf plan --processes-per-node`):
the 8-GPU node docs/scaling.md plans 8B and 70B on."""


def ranks_per_node(processes: int, per_node: int | None, beside_rank0: int = 0) -> list[int]:
    """How many of a gang's `processes` each node holds, packed as Ray's `PACK` and `accelerate launch`
    on N nodes place them: full nodes of `per_node`, rank 0's keeping `beside_rank0` of its slots for
    the vLLM server (its tensor-parallel GPUs). One node when `per_node` is None."""
    if per_node is None:
        return [processes]
    counts, left, room = [], processes, max(per_node - beside_rank0, 1)
    while left > 0:
        counts.append(min(room, left))
        left, room = left - counts[-1], per_node
    return counts


def vllm_gpus(section, device: Device) -> int:
    """GPUs a stage's vLLM server takes beside rank 0 (none on a CPU, where they take turns on the cores)."""
    if device.kind != "cuda" or getattr(section, "rollout_engine", "hf") != "vllm":
        return 0
    return section.vllm.tensor_parallel_size


@dataclass(kw_only=True, frozen=True)
class Plan:
    device: Device
    stages: dict[str, StagePlan]
    verdicts: dict[str, bool]
    fixes: dict[str, list[str]]
    micro_batches: dict[str, dict[str, int | None]] = field(default_factory=dict)
    """Per stage, the `auto` micro-batch sizes resolved for this device (None: all at once)."""
    nodes: dict[str, list[int]] = field(default_factory=dict)
    """Per stage, the processes each node holds (`ranks_per_node`), rank 0's node first."""

    def message(self, stage: str) -> str:
        """Why a stage does not fit, and what would make it fit."""
        plan = self.stages[stage]
        on_node = max(self.nodes.get(stage) or [plan.processes])
        need = plan.peak * (on_node if self.device.kind == "cpu" else 1)
        text = (f"{stage}: predicted peak {plan.peak / GIB:.1f} GiB per process ({plan.peak_phase})"
                + (f", {need / GIB:.1f} GiB for {on_node} processes on a node" if need != plan.peak else "")
                + f", over {self.device.describe()}")
        ways = self.fixes.get(stage) or []
        if ways:
            text += "; it would fit with: " + " | ".join(ways)
        else:
            text += "; no combination of LoRA, bf16 frozen models, gradient checkpointing, micro-batches and " \
                    "sharding over up to 64 processes makes it fit"
        return text


def model_shapes(cfg: PipelineConfig, resolve=lambda location: location) -> dict[str, ModelShape]:
    """The policy's shape (`sft.model`) and, when the config names them, the reward model's and PPO's teacher's."""
    shapes = {"policy": model_shape(resolve(cfg.sft.model), cfg.sft.trust_remote_code)}
    if cfg.reward.model:
        shapes["reward"] = model_shape(resolve(cfg.reward.model), cfg.reward.trust_remote_code)
    if cfg.ppo.teacher:
        shapes["teacher"] = model_shape(resolve(cfg.ppo.teacher.model), cfg.ppo.trust_remote_code)
    return shapes


def plan(cfg: PipelineConfig, stages: list[str], shapes: dict[str, ModelShape], target: Target,
         per_node: int | None = None) -> Plan:
    """Every stage's plan for `target` (nodes of `per_node` processes; default: `NODE_GPUS` on a GPU,
    one machine on the CPU), whether it fits, and for those that do not, what would."""
    device = target.device
    per_node = per_node or (NODE_GPUS if device.kind == "cuda" else None)
    sections = {stage: resolve_micro_batches(stage, getattr(cfg, stage), shapes, target) for stage in stages}
    plans = {stage: plan_stage(cfg, stage, shapes, target, sections[stage]) for stage in stages}
    nodes = {stage: ranks_per_node(p.processes, per_node, vllm_gpus(sections[stage], device))
             for stage, p in plans.items()}
    verdicts = {stage: device.fits(p, on_node=max(nodes[stage])) for stage, p in plans.items()}
    fixes = {stage: what_fits(sections[stage], stage, shapes, target) for stage, ok in verdicts.items() if not ok}
    chosen = {stage: resolved_values(stage, getattr(cfg, stage), sections[stage]) for stage in stages}
    return Plan(device=device, stages=plans, verdicts=verdicts, fixes=fixes,
                micro_batches={stage: values for stage, values in chosen.items() if values}, nodes=nodes)


def _count_text(n: int) -> str:
    return next(f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                if n >= scale or scale == 1)


def plan_table(result: Plan) -> str:
    """The plan as Markdown: per stage, the models held and each part of the peak, in GiB per process."""
    lines = [f"Device: {result.device.describe()}", ""]
    for stage, p in result.stages.items():
        verdict = "fits" if result.verdicts[stage] else "DOES NOT FIT"
        engine = f"FSDP2 over {p.processes}" if p.sharded else (f"DDP x {p.processes}" if p.processes > 1
                                                                else "one process")
        nodes = result.nodes.get(stage) or [p.processes]
        if len(nodes) > 1:
            engine += f" on {len(nodes)} nodes: {', '.join(map(str, nodes))} processes"
        lines += [f"### {stage} ({engine}): peak {p.peak / GIB:.2f} GiB per process in {p.peak_phase}: {verdict}",
                  "", "| model | parameters | held as | weights (GiB) | gradients | optimizer | gathered |",
                  "|---|---|---|---|---|---|---|"]
        for h in p.held:
            lines.append(f"| {h.name} | {_count_text(h.parameters)} ({_count_text(h.trained)} trained) | {h.how} | "
                         f"{h.weights / GIB:.2f} | {h.gradients / GIB:.2f} | {h.optimizer / GIB:.2f} | "
                         f"{h.gathered / GIB:.2f} |")
        lines += ["", "| phase | on top of the resident models (GiB) | total |", "|---|---|---|"]
        for phase, items in p.phases.items():
            parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in items.items())
            lines.append(f"| {phase} | {parts} | {p.phase_total(phase) / GIB:.2f} |")
        lines += ["", f"Resident (models, optimizer, runtime {RUNTIME_GIB} GiB): {p.resident / GIB:.2f} GiB"]
        if result.micro_batches.get(stage):
            chosen = ", ".join(f"{stage}.{name} {'all at once' if value is None else value}"
                               for name, value in result.micro_batches[stage].items())
            lines.append(f"- micro-batches chosen for this device (`auto`): {chosen}")
        lines += [f"- {note}" for note in p.notes]
        if not result.verdicts[stage]:
            lines.append(f"- {result.message(stage)}")
        lines.append("")
    return "\n".join(lines)


def plan_json(result: Plan) -> dict:
    """The plan as plain data (`rlhf plan --json`)."""
    return {"device": {"kind": result.device.kind, "memory_gib": result.device.memory / GIB},
            "stages": {stage: {
                "processes": p.processes, "processes_per_node": result.nodes.get(stage) or [p.processes],
                "sharded": p.sharded, "fits": result.verdicts[stage],
                "predicted_peak_gib": p.peak / GIB, "peak_phase": p.peak_phase,
                "state_gib": p.state_bytes() / GIB, "resident_gib": p.resident / GIB,
                "models": [{"name": h.name, "parameters": h.parameters, "trained_parameters": h.trained,
                            "held_as": h.how, "weights_gib": h.weights / GIB, "gradients_gib": h.gradients / GIB,
                            "optimizer_gib": h.optimizer / GIB, "gathered_gib": h.gathered / GIB,
                            "host_gib": h.host / GIB} for h in p.held],
                "phases": {phase: {k: v / GIB for k, v in items.items()} | {"total": p.phase_total(phase) / GIB}
                           for phase, items in p.phases.items()},
                "notes": p.notes, "fixes": result.fixes.get(stage, []),
                "micro_batches": result.micro_batches.get(stage, {})}
                for stage, p in result.stages.items()}}
