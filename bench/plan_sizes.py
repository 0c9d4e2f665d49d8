"""The sizes table: the fewest 80 GB GPUs the memory plan says each method needs, for the published
shapes of Qwen2.5 and Llama-3 (configs only: nothing is downloaded, nothing trains).

    python -m bench.plan_sizes              (or: make plan-sizes)

Every method is planned with the same work (`COMMON`: bf16 autocast, gradient checkpointing,
512-token prompts and responses, 512 rollouts per PPO iteration over all GPUs, micro-batch sizes
`auto`: the largest that fit each GPU count) and, on more than one GPU, FSDP2 (`configs/accelerate/fsdp.yaml`)
over 1, 2, 4, ... 64 GPUs; the policy and the reward model have the same shape. Prints a Markdown
table (docs/scaling.md holds it) and each cell's peak phase.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.published import PUBLISHED, write_config

GPU_BYTES = 80e9
COUNTS = (1, 2, 4, 8, 16, 32, 64)

COMMON = {
    "precision": "bf16-mixed", "gradient_checkpointing": True, "frozen_dtype": "bfloat16",
    "launch": {"num_processes": 1, "accelerate_config": "configs/accelerate/fsdp.yaml"},
}
PPO = COMMON | {"max_prompt_length": 512, "sampling": {"response_length": 512}, "rollout_batch_size": 512,
                "num_minibatches": 4, "evaluation": {"samples_per_prompt": 1}}
TRAINER = {k: v for k, v in COMMON.items() if k != "frozen_dtype"} | {
    "max_prompt_length": 512, "max_length": 1024, "batch_size": 2}

METHODS: dict[str, tuple[str, dict]] = {
    "PPO, full (critic: reward)": ("ppo", PPO | {"critic": {"kind": "reward"}}),
    "PPO, LoRA policy + LoRA critic": ("ppo", PPO | {"lora": {"r": 8}, "critic": {"kind": "reward-lora"}}),
    "GRPO, full (8 per prompt)": ("ppo", PPO | {"advantage_estimator": "grpo", "samples_per_prompt": 8}),
    "DPO, full": ("dpo", TRAINER | {"sampling": {"response_length": 512},
                                     "evaluation": {"samples_per_prompt": 1}, "frozen_dtype": "bfloat16"}),
    "DPO, LoRA": ("dpo", TRAINER | {"sampling": {"response_length": 512},
                                     "evaluation": {"samples_per_prompt": 1}, "frozen_dtype": "bfloat16",
                                     "lora": {"r": 8}}),
}
"""Each method: the stage it runs and that stage's settings."""


def fewest_gpus(model: str, stage: str, settings: dict, folder: Path) -> tuple[int | None, str, float]:
    """The fewest GPUs (FSDP2 above one) on which `stage` fits; its peak phase and GiB per GPU there."""
    from rlhf.config import load_config
    from stages.memory.phases import Counts, Device, Target
    from stages.memory.plan import plan
    from stages.memory.shapes import GIB, model_shape

    location = str(write_config(folder / model, model))
    data = {"path": str(folder / "data.jsonl")}
    sources = {"sft": {"model": location, "train_data": data, "eval_data": None},
               "reward": {"train_data": data, "eval_data": None, "normalization_prompts": data},
               "ppo": {"prompts": data, "evaluation": {"prompts": data}},
               "dpo": {"train_data": data, "eval_data": None, "evaluation": {"prompts": data}}}
    sources[stage] = {key: (sources[stage].get(key, {}) | value if isinstance(value, dict) else value)
                      for key, value in (sources[stage] | settings).items()}
    cfg = load_config(None, {"demo": None} | sources)
    shapes = {"policy": model_shape(location)}
    for n in COUNTS:
        # Sharded PPO samples from the whole policy gathered, or, where that copy does not fit, layer by layer (`auto`).
        planned = plan(cfg, [stage], shapes, Target(Device("cuda", GPU_BYTES), Counts(64, 64, 64), processes=n))
        if planned.verdicts[stage]:
            per_layer = planned.micro_batches.get(stage, {}).get("sharded_sampling") == "per_layer" and n > 1
            stage_plan = planned.stages[stage]
            return n, stage_plan.peak_phase + (", sampling per layer" if per_layer else ""), stage_plan.peak / GIB
    return None, "", 0.0


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "data.jsonl").write_text('{"prompt": "hello"}\n')
        print("| model | " + " | ".join(METHODS) + " |")
        print("|---|" + "---|" * len(METHODS))
        details = []
        for model in PUBLISHED:
            cells = []
            for method, (stage, settings) in METHODS.items():
                n, phase, peak = fewest_gpus(model, stage, settings, folder)
                cells.append("over 64" if n is None else str(n))
                details.append(f"{model}, {method}: " + ("does not fit 64" if n is None else
                                                          f"{n} GPU(s), peak {peak:.1f} GiB per GPU in {phase}"))
            print(f"| {model} | " + " | ".join(cells) + " |")
        print()
        print("\n".join(f"- {line}" for line in details))


if __name__ == "__main__":
    main()
