"""Configuration: YAML + dotted overrides, refused early with the offending field named."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pydantic
import pytest

from flows.cli import main as cli
from rlhf.config import ConfigError, config_hash, flatten, load_config, with_overrides
from rlhf.sections.ppo import PPOConfig


@pytest.mark.parametrize("path", sorted(str(p.relative_to(Path(__file__).resolve().parent.parent))
                                         for p in (Path(__file__).resolve().parent.parent / "configs").glob("*.yaml")))
def test_every_shipped_config_loads(path):
    """What `--param config_file=configs/<name>.yaml` names: each one a valid config (its
    functions are imported when its stage starts)."""
    assert load_config(path).experiment


def test_demo_config_loads_and_overrides_apply():
    cfg = load_config("configs/demo.yaml", {"sft.learning_rate": 1e-4, "sft.train_data.path": "data/x.jsonl"})
    assert cfg.sft.learning_rate == 1e-4 and cfg.sft.train_data.path == "data/x.jsonl"
    assert cfg.sft.eval_data.path == "demo:sft_eval"
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.sft.learning_rate = 1.0


@pytest.mark.parametrize("overrides,field", [
    ({"sft.bogus": 1}, "sft: unknown key 'bogus'"),
    ({"sft.learning_rate": 0}, "sft.learning_rate"),
    ({"sft.batch_size": -2}, "sft.batch_size"),
    ({"sft.max_prompt_length": 200}, "max_prompt_length (200) must be below max_length"),
    ({"demo": None}, "refers to the demo world"),
    ({"sft.train_data.format": "xml"}, "sft.train_data.format"),
    ({"ppo.num_minibatches": 3}, "num_minibatches (3) must divide rollout_batch_size"),
    ({"ppo.learning_rate": -1e-5}, "ppo.learning_rate"),
])
def test_bad_configs_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match="invalid config") as caught:
        load_config("configs/demo.yaml", overrides)
    assert field in str(caught.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("sft: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_hash_and_params_cover_every_field():
    a = load_config("configs/demo.yaml").sft
    b = load_config("configs/demo.yaml", {"sft.seed": 1}).sft
    assert config_hash(a) != config_hash(b)
    longer_wait = a.model_copy(update={"launch": a.launch.model_copy(update={"timeout_seconds": 7200})})
    assert config_hash(longer_wait) == config_hash(a)  # cannot change the result: the stage's work is resumed
    on_ray = a.model_copy(update={"launch": a.launch.model_copy(update={"engine": "ray", "max_failures": 1})})
    assert config_hash(on_ray) == config_hash(a)  # the same processes elsewhere compute the same
    ppo = load_config("configs/demo.yaml").ppo
    offloaded = ppo.model_copy(update={"offload_frozen": True})  # frozen models compute the same from host memory
    assert config_hash(offloaded) == config_hash(ppo)
    params = flatten(a)
    assert params["train_data.path"] == "demo:sft" and params["max_steps"] == "null"
    # three nested sections (two DataSources of three fields, launch of eight) flatten to fourteen keys
    assert len(params) == len(a.model_fields) + 11
    assert params["launch.num_processes"] == "1"


def test_config_reference_documents_every_field(capsys):
    assert cli(["config-reference"]) == 0
    table = capsys.readouterr().out
    for key in ("`sft.learning_rate`", "`demo.seed`", "`experiment`", "`sft.train_data`"):
        assert key in table
    assert not [line for line in table.splitlines() if line.endswith("|  |")]  # every field described


def test_docs_config_reference_matches_the_code(tmp_path):
    """docs/config.md is exactly what `rlhf config-reference` generates now (regenerated in memory, compared)."""
    import difflib

    from flows.cli import CONFIG_REFERENCE, config_reference

    expected = config_reference()
    committed = (Path(__file__).resolve().parent.parent / CONFIG_REFERENCE).read_text()
    diff = list(difflib.unified_diff(committed.splitlines(), expected.splitlines(), CONFIG_REFERENCE, "generated",
                                     lineterm="", n=0))
    assert not diff, (f"{CONFIG_REFERENCE} is stale: regenerate it with `.venv/bin/rlhf config-reference --write "
                      f"{CONFIG_REFERENCE}`\n" + "\n".join(diff[:40]))
    assert cli(["config-reference", "--write", str(tmp_path / "config.md")]) == 0
    assert (tmp_path / "config.md").read_text() == expected


PPO_SETTINGS = 145
"""The ppo section's settings (`rlhf.config_guide.leaves`): 149 on 2026-11-28, 140 after the merges of
docs/config.md's "Merged settings", 141 with `rollout.correction` (kind, level, bounds), which took the
place of `vllm.importance_sampling` and its cap, 143 with `environment.schedule` and
`environment.concurrent_episodes` (which was a server's `max_concurrent` alone), 144 with
`rollout.partial` (episodes sampled ahead continued across a weight sync), 145 with
`environment.max_turn_chars` (issue 91: no setting bounded what a parser we did not write is given;
`max_tool_output_chars` cuts a tool's answer, which is kept, not a turn, which is read). A smoke detector: a
new capability merges what says the same first."""


def test_the_ppo_section_does_not_grow_its_settings_back():
    from rlhf.config_guide import leaves

    found = leaves(PPOConfig)
    assert found <= PPO_SETTINGS, (f"the ppo section holds {found} settings, over {PPO_SETTINGS}: merge what two "
                                   "fields say twice (rlhf.sections.base._Frozen.MERGED says where it went)")


def test_config_show_puts_the_settings_most_people_change_first_on_top(capsys):
    from rlhf.config_guide import FIRST

    assert len(FIRST["ppo"]) == 20
    assert cli(["config", "show", "configs/tools.yaml", "--first"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shown = [line[2:].split()[0] for line in lines[2:]]
    assert shown == list(FIRST["ppo"])
    assert any(line.startswith("* advantage_estimator") and "'grpo'" in line for line in lines)  # differs: marked
    assert cli(["config", "show", "configs/tools.yaml"]) == 0
    everything = capsys.readouterr().out
    assert "\nppo.kl:\n" in everything and "\nppo.environment:\n" in everything  # the rest, by section
    assert "(lora unset)" in everything


def test_a_merged_setting_is_refused_saying_where_it_went(tiny_config):
    with pytest.raises(ValueError, match=r"clip_range_high was merged: clip_range: \[low, high\]"):
        with_overrides(tiny_config.ppo, {"clip_range_high": 0.28})
    with pytest.raises(ValueError, match=r"cpu_cores was merged: vllm.devices"):
        with_overrides(tiny_config.ppo, {"vllm.cpu_cores": "1"})
    from rlhf.config_guide import merged

    found = dict(merged())
    assert "ppo.reward.terms[].remote.on_failure" in found and "ppo.environment.turn_tokens" in found


def test_prefect_yaml_defines_the_deployments_of_the_one_flow():
    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parent.parent / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"full", "sft", "reward", "ppo", "dpo", "distill"}
    assert {d["entrypoint"] for d in deployments.values()} == {"flows/pipeline.py:rlhf"}
    assert deployments["full"]["parameters"]["stages"] == ["sft", "reward", "ppo"]
    assert {name: d["parameters"]["stages"] for name, d in deployments.items() if name not in ("full", "distill")} \
        == {name: [name] for name in ("sft", "reward", "ppo", "dpo")}
    distill = deployments["distill"]["parameters"]  # SFT, then the RL stage with the teacher: no reward stage
    assert distill["stages"] == ["sft", "ppo"]
    cfg = load_config(distill["config_file"])
    assert cfg.ppo.advantage_estimator == "distill" and cfg.ppo.teacher.model.startswith("models:/")
    assert not cfg.ppo.reward.uses_model


def test_distillation_settings_are_refused_where_they_cannot_act():
    with pytest.raises(ConfigError, match="advantage_estimator 'distill' learns from a teacher"):
        load_config("configs/tiny.yaml", {"ppo.advantage_estimator": "distill"})
    with pytest.raises(ConfigError, match="reward.terms: give at least one term .* or an environment server"):
        load_config("configs/tiny.yaml", {"ppo.reward": {"terms": []}})
    beside = load_config("configs/tiny.yaml", {"ppo.teacher.model": "demo:model"})  # beside the reward model
    assert beside.ppo.reward.uses_model and beside.ppo.advantage_estimator == "gae"
    pure = load_config("configs/tiny.yaml", {"ppo.advantage_estimator": "distill", "ppo.teacher.model": "demo:model"})
    assert (pure.ppo.reward.terms, pure.ppo.kl.init_coef, pure.ppo.critic, pure.ppo.samples_per_prompt) == (
        [], 0.0, None, 1)


@pytest.mark.parametrize("name", ["ddp", "zero2", "two-nodes", "fsdp", "two-nodes-fsdp"])
def test_shipped_accelerate_configs_load_in_accelerate(name):
    from accelerate.commands.config.config_args import load_config_from_file

    from stages.launch.local import launch_command

    path = f"configs/accelerate/{name}.yaml"
    assert load_config_from_file(path).num_processes > 1
    cfg = load_config("configs/tiny.yaml", {"sft.launch": {"num_processes": 2, "accelerate_config": path}})
    command = launch_command(Path("spec"), cfg.sft.launch)
    assert command[command.index("--config_file") + 1].endswith(path)
    assert ("--main_process_port" in command) == (not name.startswith("two-nodes"))  # nodes share the configured port
    assert cfg.sft.launch.sharded == name.endswith("fsdp")
    if name.endswith("fsdp"):  # accelerate reads FSDP2 with per-layer units from it
        fsdp = load_config_from_file(path).fsdp_config
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert load_config("configs/tiny.yaml", {"ppo.launch": {"num_processes": 2, "accelerate_config": path}})


@pytest.mark.parametrize("overrides, message", [
    ({"sft.launch.accelerate_config": "configs/accelerate/nope.yaml"}, "not found"),
    ({"ppo.launch.accelerate_config": "configs/accelerate/zero2.yaml"}, "PPO runs on DDP"),
    ({"ppo.launch.num_processes": 3}, "x launch.num_processes (3) must divide rollout_batch_size"),
    ({"sft.launch.accelerate_config": "tests/data/accelerate/fsdp1.yaml"}, "the stages shard with FSDP2"),
    ({"sft.launch.accelerate_config": "tests/data/accelerate/zero3.yaml"}, "parameter sharding here is FSDP2"),
    ({"sft.launch.accelerate_config": "tests/data/accelerate/fsdp-size-wrap.yaml"}, "a unit per decoder layer"),
])
def test_launch_settings_that_cannot_run_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.yaml", overrides)


def test_vllm_rollouts_are_refused_where_they_cannot_run(tmp_path):
    # the demo model's heads (64 / 4 = 16 wide) are not served by vLLM's CPU build; 2 heads of 32 are
    with pytest.raises(ConfigError,
                       match=re.escape("demo model's attention heads are 16 wide") + ".*demo.num_heads: 2"):
        load_config("configs/tiny.yaml", {"ppo.rollout_engine": "vllm", "ppo.vllm.python": sys.executable})
    assert load_config("configs/tiny.yaml", {"ppo.rollout_engine": "vllm", "ppo.vllm.python": sys.executable,
                                             "demo.num_heads": 2}).ppo.rollout_engine == "vllm"
    # no vLLM environment where the config points
    with pytest.raises(ConfigError, match=re.escape(f"no vLLM environment at {tmp_path}/python") + ".*make vllm-env"):
        load_config("configs/tiny.yaml", {"ppo.rollout_engine": "vllm", "ppo.vllm.python": str(tmp_path / "python"),
                                          "demo.num_heads": 2})
    assert load_config("configs/tiny.yaml", {"ppo.vllm.python": str(tmp_path / "python")})  # unused with hf


_AHEAD = {"ppo.rollout_engine": "vllm", "ppo.vllm.python": sys.executable, "demo.num_heads": 2,
          "ppo.rollout.max_staleness": 1}


@pytest.mark.parametrize("overrides, message", [
    ({"ppo.rollout_engine": "hf"}, "the trained model samples itself, in the trainer's own processes"),
    ({"ppo.rollout.correction": {"kind": "none"}}, "without them the update is biased"),
    ({"ppo.advantage_estimator": "grpo", "ppo.dynamic_sampling": {"max_rounds": 2}},
     "dynamic_sampling decides how many prompts an iteration takes from its scores"),
])
def test_sampling_ahead_is_refused_where_it_cannot_hold(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.yaml", _AHEAD | overrides)
    cfg = load_config("configs/tiny.yaml", _AHEAD | {"ppo.advantage_estimator": "rloo", "ppo.lora": {"r": 4}})
    assert cfg.ppo.rollout.max_staleness == 1  # with the other estimators, LoRA, functions and the KL controller


def test_a_checkpoint_with_heads_vllm_cannot_serve_is_refused_before_a_server_starts():
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.common.errors import StageUserError
    from stages.engines.vllm_server import check_servable

    def model(heads: int):
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=heads, num_key_value_heads=heads))

    with pytest.raises(StageUserError, match="attention heads are 16 wide"):
        check_servable(model(4), on_gpu=False)
    check_servable(model(2), on_gpu=False)
    check_servable(model(4), on_gpu=True)  # vLLM's FlashAttention takes any multiple of 8 up to 256


def test_a_config_without_the_demo_world_needs_no_dpo_section_until_it_has_one():
    own = {f"{section}.{field}.path": "data/x.jsonl" for section, field in (
        ("sft", "train_data"), ("sft", "eval_data"), ("reward", "train_data"), ("reward", "eval_data"),
        ("reward", "normalization_prompts"), ("ppo", "prompts"), ("ppo", "evaluation.prompts"))}
    own |= {"demo": None, "sft.model": "some/model"}
    assert load_config(None, own).dpo.train_data.path == "demo:preferences"  # unused unless DPO runs
    with pytest.raises(ConfigError, match="'demo:preferences_eval' refers to the demo world"):
        load_config(None, own | {"dpo.train_data.path": "data/pairs.jsonl"})


@pytest.mark.parametrize("overrides, message", [
    ({"ppo.kl_budget": 8}, "ppo: unknown key 'kl_budget'"),  # a key that moved into a section (evaluation.kl_budget)
    ({"ppo.critic.vf_coeff": 0.5}, "ppo.critic: unknown key 'vf_coeff'"),
    ({"dpo.eval_samples_per_prompt": 2}, "dpo: unknown key 'eval_samples_per_prompt'"),
    ({"ppo.reward.terms": [{"name": "rm", "weigth": 2}]}, "ppo.reward.terms.0: unknown key 'weigth'"),
    ({"registy": {}}, "(top level): unknown key 'registy'"),
])
def test_an_unknown_key_is_refused_naming_its_section(overrides, message):
    with pytest.raises(ConfigError, match="invalid config") as caught:
        load_config("configs/tiny.yaml", overrides)
    assert str(caught.value).splitlines()[1:] == [f"  {message}"]  # the one error, by the section it is in


def test_a_critic_section_applies_with_gae_only():
    assert load_config("configs/tiny.yaml").ppo.critic.kind == "reward"  # the default critic, unwritten
    grpo = load_config("configs/tiny.yaml", {"ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 2})
    assert grpo.ppo.critic is None
    with pytest.raises(ConfigError, match="'grpo' learns no critic"):
        load_config("configs/tiny.yaml", {"ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 2,
                                          "ppo.critic.kind": "shared"})
    # A changed estimator takes its own critic (none) unless the change gives one.
    assert with_overrides(load_config("configs/tiny.yaml").ppo, {"advantage_estimator": "rloo",
                                                                 "samples_per_prompt": 2}).critic is None



def test_the_repository_root_is_the_checkout_wherever_the_config_modules_sit():
    """Relative config paths, the stack's state and the vLLM environment are found from REPO_ROOT: a module
    moved one folder deeper must not move the root with it."""
    from rlhf.sections.base import REPO_ROOT

    assert REPO_ROOT == Path(__file__).resolve().parent.parent
    assert (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "scripts" / "ray_cluster.sh").is_file()
