"""The memory plan (`stages.memory.plan`, `rlhf plan`): model shapes read off configs on the meta device,
adapter counts as peft makes them, the verdicts the issue names for an 8B model, and the plan
against what a tiny PPO run actually holds."""

from __future__ import annotations

import json

import pytest
import yaml

from bench.memory import state_bytes
from bench.published import PUBLISHED, PUBLISHED_PARAMETERS, write_config
from flows.cli import main as cli
from rlhf.config import PipelineConfig, load_config, with_overrides
from rlhf.sections.base import LoRAConfig, PolicyLoRAConfig
from stages.memory.phases import Counts, Device, Target
from stages.memory.plan import AUTO_MARGIN, plan, plan_stage, ranks_per_node, resolve_micro_batches, resolved_values
from stages.memory.shapes import GIB, model_shape, reward_shape
from tests.helpers import ppo_inputs

GPU_80GB = ["--device-memory", str(80e9 / GIB), "--device-kind", "gpu"]


def test_shapes_from_configs_alone_match_the_published_parameter_counts(tmp_path):
    for name in PUBLISHED:
        shape = model_shape(str(write_config(tmp_path / name, name)))  # config.json only: no weights to read
        assert shape.parameters == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.01), name
    llama = model_shape(str(tmp_path / "Llama-3-8B"))
    assert (llama.layers, llama.hidden, llama.intermediate, llama.kv_width, llama.vocab) == (32, 4096, 14336, 1024,
                                                                                           128256)
    assert llama.head_parameters == 128256 * 4096
    # Qwen2.5-0.5B ties its output head to the embeddings: the reward model drops no weights of its own.
    qwen = model_shape(str(tmp_path / "Qwen2.5-0.5B"))
    assert qwen.head_parameters == 0 and reward_shape(qwen).parameters == qwen.parameters + qwen.hidden


@pytest.mark.parametrize("family", ["demo", "gpt2", "neox"])
def test_adapter_and_parameter_counts_are_what_the_built_models_hold(family, world, tmp_path):
    """The plan counts the adapters the stages build (`with_lora`): on the policy with its output head
    (the default), without it, on listed modules; on the reward model, whose score head trains whole."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from stages.runtime.lora import with_lora
    from tests.model_families import build_family

    location = str(world / "model") if family == "demo" else str(build_family(family, tmp_path))
    shape = model_shape(location)
    assert shape.parameters == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(location).parameters())
    for lora in (PolicyLoRAConfig(), LoRAConfig(r=1),
                 LoRAConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj", "c_fc",
                                                 "dense_h_to_4h"])):
        policy = with_lora(AutoModelForCausalLM.from_pretrained(location), lora, "CAUSAL_LM")
        assert shape.lora_parameters(lora) == sum(p.numel() for p in policy.parameters() if p.requires_grad)
        reward = with_lora(AutoModelForSequenceClassification.from_pretrained(location, num_labels=1), lora, "SEQ_CLS")
        score = shape.hidden  # the score head, trained whole
        assert shape.lora_parameters(lora, classifier=True) + score == sum(
            p.numel() for p in reward.parameters() if p.requires_grad)


def _llama3_8b_config(tmp_path, **ppo) -> str:
    """A pipeline config whose policy and reward model are Llama-3-8B shaped (read from config.json alone)."""
    model = write_config(tmp_path / "llama-3-8b", "Llama-3-8B")
    data = {"path": str(tmp_path / "data.jsonl")}
    lengths = {"max_prompt_length": 512, "max_length": 1024, "batch_size": 4, "train_data": data, "eval_data": None}
    config = {"demo": None, "sft": {"model": str(model)} | lengths,
              "reward": lengths | {"normalization_prompts": data},
              "ppo": {"prompts": data, "evaluation": {"prompts": data}, "max_prompt_length": 512,
                      "sampling": {"response_length": 512, "micro_batch_size": 16}, "rollout_batch_size": 512,
                      "micro_batch_size": 2} | ppo,
              "dpo": lengths | {"evaluation": {"prompts": data}}}
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(64)))
    path = tmp_path / f"llama3-8b-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_an_8b_ppo_fits_one_80gb_gpu_only_with_lora_and_eight_with_fsdp(tmp_path, capsys):
    full = _llama3_8b_config(tmp_path)
    assert cli(["plan", full, "--stages", "ppo", *GPU_80GB]) == 1
    out = capsys.readouterr().out
    assert "### ppo (one process)" in out and "DOES NOT FIT" in out
    assert "it would fit with: " in out and "shard over" in out  # names the knobs

    lora = _llama3_8b_config(tmp_path, lora={"r": 8}, critic={"kind": "reward-lora"}, frozen_dtype="bfloat16",
                             gradient_checkpointing=True)
    assert cli(["plan", lora, "--stages", "ppo", "--json", *GPU_80GB]) == 0
    planned = json.loads(capsys.readouterr().out)["stages"]["ppo"]
    assert planned["fits"] and planned["predicted_peak_gib"] < 80e9 / GIB
    # One copy of the reward model's weights: the critic is adapters and a head on them.
    assert [m["name"] for m in planned["models"]] == ["policy", "reward model + critic"]
    assert planned["models"][1]["trained_parameters"] < 0.01 * planned["models"][1]["parameters"]

    sharded = _llama3_8b_config(tmp_path, gradient_checkpointing=True,
                                launch={"num_processes": 8, "accelerate_config": "configs/accelerate/fsdp.yaml"})
    assert cli(["plan", sharded, "--stages", "ppo", "--json", *GPU_80GB]) == 0
    planned = json.loads(capsys.readouterr().out)["stages"]["ppo"]
    assert planned["fits"] and planned["sharded"] and planned["processes"] == 8
    # --processes plans the same config on another process count, with its engine.
    assert cli(["plan", sharded, "--stages", "ppo", "--json", "--processes", "2", *GPU_80GB]) == 1
    assert not json.loads(capsys.readouterr().out)["stages"]["ppo"]["fits"]


def test_every_stage_of_an_8b_pipeline_fits_eight_gpus_sharded_with_micro_batches_chosen(tmp_path):
    """Full fine-tuning, every stage FSDP2 over 8 GPUs of 80 GB, no micro-batch size set: each `auto`
    size resolves to the largest that fits with the margin, and every stage fits."""
    cfg = load_config(_llama3_8b_config(tmp_path, sampling={"response_length": 512}, micro_batch_size="auto"))
    shapes = {"policy": model_shape(cfg.sft.model)}
    fsdp = {"launch": {"num_processes": 8, "accelerate_config": "configs/accelerate/fsdp.yaml"},
            "gradient_checkpointing": True}
    cfg = cfg.model_validate(cfg.model_dump() | {stage: getattr(cfg, stage).model_dump() | fsdp
                                                  for stage in ("sft", "reward", "ppo", "dpo")})
    assert (cfg.ppo.micro_batch_size == cfg.ppo.sampling.micro_batch_size
            == cfg.reward.normalization_micro_batch_size == "auto")
    gpu = Device("cuda", 80e9)
    eight_gpus = Target(gpu, Counts(64, 64, 64))
    result = plan(cfg, ["sft", "reward", "ppo", "dpo"], shapes, eight_gpus)
    assert all(result.verdicts.values()), {s: p.peak / GIB for s, p in result.stages.items()}
    chosen = result.micro_batches
    assert set(chosen) == {"reward", "ppo", "dpo"} and chosen["ppo"]["sharded_sampling"] == "whole"
    assert (isinstance(chosen["ppo"]["sampling.micro_batch_size"], int)
            and isinstance(chosen["ppo"]["micro_batch_size"], int))
    # The largest that fits: the next size up does not fit within the margin.
    ppo = result.stages["ppo"]
    assert ppo.peak <= AUTO_MARGIN * gpu.memory
    doubled = with_overrides(cfg.ppo, {"sampling.micro_batch_size": 2 * chosen["ppo"]["sampling.micro_batch_size"],
                                       "micro_batch_size": chosen["ppo"]["micro_batch_size"],
                                       "sharded_sampling": "whole"})
    assert plan_stage(cfg, "ppo", shapes, eight_gpus, section=doubled).peak > AUTO_MARGIN * gpu.memory
    one_gpu = plan(cfg, ["sft"], shapes, Target(gpu, Counts(64, 64, 64), processes=1))
    assert not one_gpu.verdicts["sft"]  # 16 bytes per parameter: 128 GB before activations


def _llama3_70b_pipeline(tmp_path, every: dict, **sections) -> PipelineConfig:
    """Every stage of a Llama-3-70B pipeline (config.json alone) with `every`'s settings, and each
    section's own on top."""
    model = write_config(tmp_path / "llama-3-70b", "Llama-3-70B")
    data = {"path": str(tmp_path / "data.jsonl")}
    lengths = {"max_prompt_length": 512, "max_length": 1024, "batch_size": 4, "train_data": data, "eval_data": None}
    config = {"demo": None, "sft": {"model": str(model)} | lengths, "reward": lengths | {"normalization_prompts": data},
              "ppo": {"prompts": data, "evaluation": {"prompts": data}, "max_prompt_length": 512,
                      "sampling": {"response_length": 512}, "rollout_batch_size": 512},
              "dpo": lengths | {"evaluation": {"prompts": data}}}
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(64)))
    for stage in ("sft", "reward", "ppo", "dpo"):
        config[stage] |= every | sections.get(stage, {})
    path = tmp_path / "llama-3-70b.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(str(path))


def test_70b_fits_8_gpus_with_lora_and_32_with_full_fine_tuning_offloaded(tmp_path):
    """Llama-3-70B, no micro-batch size set: LoRA everywhere and the `reward-lora` critic (frozen
    weights bf16) over 8 GPUs of 80 GB; full fine-tuning over 32, whose PPO and DPO fit only with the
    shards in host memory (configs/accelerate/fsdp-offload.yaml), which the plan then counts there."""
    gpus, stages = Target(Device("cuda", 80e9), Counts(64, 64, 64)), ["sft", "reward", "ppo", "dpo"]

    def launch(n, engine="fsdp"):
        return {"launch": {"num_processes": n, "accelerate_config": f"configs/accelerate/{engine}.yaml"},
                "gradient_checkpointing": True}

    lora = _llama3_70b_pipeline(tmp_path / "lora", launch(8) | {"lora": {"r": 8}},
                                ppo={"critic": {"kind": "reward-lora"}, "frozen_dtype": "bfloat16"},
                                dpo={"frozen_dtype": "bfloat16"})
    shapes = {"policy": model_shape(lora.sft.model)}
    result = plan(lora, stages, shapes, gpus)
    assert all(result.verdicts.values()), {s: p.peak / GIB for s, p in result.stages.items()}

    full = _llama3_70b_pipeline(tmp_path / "full", launch(32), ppo={"frozen_dtype": "bfloat16"})
    result = plan(full, stages, shapes, gpus)
    assert result.verdicts["sft"] and result.verdicts["reward"]
    assert not result.verdicts["ppo"] and not result.verdicts["dpo"]  # the shards, gradients and AdamW alone: 69.6 GiB
    offloaded = _llama3_70b_pipeline(tmp_path / "offloaded", launch(32, "fsdp-offload"),
                                     ppo={"frozen_dtype": "bfloat16"})
    result = plan(offloaded, stages, shapes, gpus)
    assert all(result.verdicts.values()), {s: p.peak / GIB for s, p in result.stages.items()}
    assert result.nodes == {stage: [8, 8, 8, 8] for stage in stages}  # four nodes of 8 GPUs
    ppo = result.stages["ppo"]
    assert all(h.weights == h.optimizer == 0 and h.host > 0 for h in ppo.held)
    assert "gradients" not in ppo.phases["update"]
    # Offloading only the frozen models: the reference and reward model move to host memory, nothing else.
    frozen_only = plan_stage(full, "ppo", shapes, gpus, section=with_overrides(full.ppo, {"offload_frozen": True}))
    moved = {h.name for h in frozen_only.held if h.host > 0}
    assert moved == {"reference", "reward model"}
    assert frozen_only.peak < plan_stage(full, "ppo", shapes, gpus).peak
    # On the CPU the host memory is the device's: nothing moves.
    cpu = plan_stage(offloaded, "ppo", shapes, Target(Device("cpu", 4e12), gpus.counts))
    assert all(h.host == 0 for h in cpu.held)


def test_a_gang_packs_onto_nodes_and_a_cpu_nodes_memory_holds_only_its_own_processes(tiny_config, world):
    assert ranks_per_node(32, 8) == [8, 8, 8, 8]
    assert ranks_per_node(16, 8, beside_rank0=2) == [6, 8, 2]  # vLLM's 2 tensor-parallel GPUs beside rank 0
    assert ranks_per_node(3, None) == [3]  # one machine
    shapes = {"policy": model_shape(str(world / "model"))}
    peak = plan_stage(tiny_config, "ppo", shapes, Target(Device("cpu", 16 * GIB), processes=2)).peak
    machine = Target(Device("cpu", 1.5 * peak), processes=2)  # room for one process's peak, not two
    assert not plan(tiny_config, ["ppo"], shapes, machine).verdicts["ppo"]
    spread = plan(tiny_config, ["ppo"], shapes, machine, per_node=1)
    assert spread.nodes == {"ppo": [1, 1]} and spread.verdicts["ppo"]


def test_auto_micro_batches_are_all_at_once_where_everything_fits(tiny_config, world):
    """On the tiny world (and the demo's) every `auto` size resolves to all at once, and sharded
    sampling to the whole policy gathered: the runs compute what they computed before `auto`."""
    shapes = {"policy": model_shape(str(world / "model"))}
    for stage in ("reward", "ppo", "dpo"):
        section = getattr(tiny_config, stage)
        resolved = resolve_micro_batches(stage, section, shapes, Target(Device("cpu", 16 * GIB), Counts(16, 16, 16)))
        chosen = resolved_values(stage, section, resolved)
        assert chosen.pop("sharded_sampling", "whole") == "whole" and set(chosen.values()) == {None}, stage


def test_the_plan_counts_the_state_a_tiny_ppo_run_holds(tiny_config, trained, tmp_path, monkeypatch):
    """Weights, gradients and AdamW state counted from the tensors after the first update against
    the plan's `state_bytes`, for a full and a LoRA policy with each critic that loads a model."""
    import stages.ppo
    from stages.ppo import train_ppo

    shapes = {"policy": model_shape(trained["sft"])}
    real_update = stages.ppo.ppo_update
    for run, changes in enumerate(({"critic.kind": "reward"}, {"lora": LoRAConfig(), "critic.kind": "shared"})):
        held: dict[str, int] = {}

        def update(learner, batch, iteration, held=held):  # this run's `held`, bound now
            figures = real_update(learner, batch, iteration)
            if not held:
                models = learner.models
                held["bytes"] = state_bytes([*models.trained_modules(), models.reference, models.scorer.model],
                                            learner.optimizer, models.trainable())
            return figures

        monkeypatch.setattr(stages.ppo, "ppo_update", update)
        cfg = with_overrides(tiny_config.ppo, {"num_iterations": 1, "evaluation.every": None} | changes)
        train_ppo(cfg, ppo_inputs(trained),
                  tmp_path / str(run))
        pipeline = tiny_config.model_copy(update={"ppo": cfg})
        predicted = plan(pipeline, ["ppo"], shapes, Target(Device("cpu", 24 * GIB), Counts(8, 8, 8))).stages["ppo"]
        assert predicted.state_bytes() == pytest.approx(held["bytes"], rel=0.25), changes


def _tensor_storages() -> dict[int, int]:
    import gc

    import torch

    return {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and not o.is_meta and not _traced(o)}


def _traced(tensor) -> bool:
    """A fake or functional tensor torch.compile's tracing left in its caches (a compiled test earlier in the
    same worker): it holds no memory, and has no data pointer to read."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(tensor, FakeTensor | FunctionalTensor)


def test_a_stage_run_in_process_leaves_none_of_its_tensors_behind(tiny_config, world, tokenizer, tmp_path):
    """A finished stage's models sit in reference cycles; on a GPU their memory would stay allocated under
    the next stage until Python's cyclic collector happened to run (seen on an H100, issue 60)."""
    import gc

    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.sft import train_sft
    from tests.helpers import sft_inputs

    section = with_overrides(tiny_config.sft, {"max_steps": 2, "eval_steps": 100, "num_samples": 1})
    inputs = sft_inputs(world, tokenizer)
    before = _tensor_storages()
    gc.disable()  # only call_stage may collect
    try:
        call_stage(train_sft, section, inputs, tmp_path, Reporting(), Determinism())
        left = {ptr: size for ptr, size in _tensor_storages().items() if ptr not in before}
    finally:
        gc.enable()
    assert sum(left.values()) == 0, f"{len(left)} tensors, {sum(left.values())} bytes left behind"


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_gradients_and_activations_that_never_coincide_are_not_added(tiny_config, world, stage):
    """Without accumulation the trainer's gradients are gone (None) before each forward and backward
    frees activations as it makes gradients: the training phase counts the larger of the two. With two
    micro-batches accumulated the first's gradients sit beside the second's activations: both count."""
    shapes, gpu = {"policy": model_shape(str(world / "model"))}, Target(Device("cuda", 80e9))
    section = getattr(tiny_config, stage)
    apart = plan_stage(tiny_config, stage, shapes, gpu,
                       section=with_overrides(section, {"gradient_accumulation_steps": 1}))
    together = plan_stage(tiny_config, stage, shapes, gpu,
                          section=with_overrides(section, {"gradient_accumulation_steps": 2}))
    gradients, activations = together.phases["training"]["gradients"], together.phases["training"]["activations"]
    assert gradients > 0 and activations > 0
    assert "gradients" not in apart.phases["training"]
    assert apart.phases["training"]["activations"] == max(gradients, activations)
    added = together.phase_total("training") - apart.phase_total("training")
    assert added == pytest.approx(min(gradients, activations))
