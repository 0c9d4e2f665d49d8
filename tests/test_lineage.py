"""Which upstream runs a stage run alone starts from (`flows.records.lineage.upstream_runs`), on an
experiment of runs held in a list: two pipelines of different models, two configs of the same
model, reruns, named runs and named pairs that do not belong together."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from flows.records.lineage import StageRecord, upstream_runs
from rlhf import tracking
from rlhf.config import config_hash, load_config

TINY = load_config("configs/tiny.yaml")
GPT2 = load_config("configs/tiny.yaml", {"sft.model": "/models/gpt2", "sft.max_prompt_length": 48})
"""Another model (another tokenizer); its reward section is the tiny config's."""
SHORT_SFT = load_config("configs/tiny.yaml", {"sft.max_steps": 2})
"""The same model with another SFT section; the same reward section."""
OTHER_REWARD = load_config("configs/tiny.yaml", {"reward.learning_rate": 1e-4})
"""The same SFT section with another reward section."""


@dataclass
class Experiment:
    """What `upstream_runs` reads of an MLflow experiment, as a list of runs."""

    experiment: str = "rlhf"
    runs: list = field(default_factory=list)
    clock: itertools.count = field(default_factory=lambda: itertools.count(1_763_900_000_000, 60_000))

    def finished(self, stage, tags=None):
        wanted = {tracking.TAG_STAGE: stage} | (tags or {})
        found = [r for r in self.runs if r.info.status == "FINISHED"
                 and all(r.data.tags.get(k) == v for k, v in wanted.items())]
        return sorted(found, key=lambda r: r.info.start_time, reverse=True)

    def get(self, run_id):
        return next((r for r in self.runs if r.info.run_id == run_id), None)

    def run(self, name: str, tags: dict[str, str], status: str = "FINISHED"):
        run = SimpleNamespace(info=SimpleNamespace(run_id=f"a{len(self.runs):031x}", run_name=name, status=status,
                                                   start_time=next(self.clock)),
                              data=SimpleNamespace(tags=tags))
        self.runs.append(run)
        return run

    def pipeline(self, label: str, cfg, config_file: str, stages=("sft", "reward"), sft=None,
                 overrides: str = "{}") -> dict[str, SimpleNamespace]:
        """A pipeline run `label` and its stage runs; `sft`: the SFT run its reward run starts from instead."""
        parent = self.run(f"{config_file} · {label}", {tracking.TAG_CONFIG_FILE: config_file,
                                                        tracking.TAG_OVERRIDES: overrides})
        made = {}
        for stage in stages:
            tags = {tracking.TAG_STAGE: stage, tracking.TAG_PIPELINE: parent.info.run_id,
                    tracking.TAG_CONFIG_HASH: config_hash(getattr(cfg, stage))}
            upstream = made.get("sft", sft)
            if stage in ("reward", "dpo"):
                tags[tracking.TAG_UPSTREAM + "sft"] = upstream.info.run_id
            if stage == "ppo":
                tags |= {tracking.TAG_UPSTREAM + "sft": upstream.info.run_id,
                         tracking.TAG_UPSTREAM + "reward": made["reward"].info.run_id}
            made[stage] = self.run(f"{stage} · {label}", tags)
        return made


def resolve(stage, cfg, runs, given=None, records=None, any_config=False) -> dict[str, str]:
    """{upstream stage: run name}."""
    resolved = upstream_runs(stage, records or {}, given or {}, cfg, runs, any_config)
    return {name: chosen.run.info.run_name for name, chosen in resolved.chosen.items()}


def record(stage, run) -> StageRecord:
    return StageRecord(stage=stage, run_id=run.info.run_id, checkpoint_uri="", config_hash="", data_digest="",
                       checkpoint_digest="", metrics={})


def test_inside_one_pipeline_a_stage_alone_starts_from_the_latest_runs():
    runs = Experiment()
    first = runs.pipeline("demo", TINY, "configs/tiny.yaml")
    assert resolve("reward", TINY, runs) == {"sft": "sft · demo"}
    assert resolve("dpo", TINY, runs) == {"sft": "sft · demo"}
    assert resolve("ppo", TINY, runs) == {"reward": "reward · demo", "sft": "sft · demo"}
    runs.pipeline("rerun", TINY, "configs/tiny.yaml", stages=("reward",), sft=first["sft"])  # rlhf/reward again
    assert resolve("ppo", TINY, runs) == {"reward": "reward · rerun", "sft": "sft · demo"}
    runs.run("reward · failed", {tracking.TAG_STAGE: "reward", tracking.TAG_CONFIG_HASH: config_hash(TINY.reward),
                                 tracking.TAG_UPSTREAM + "sft": first["sft"].info.run_id}, status="FAILED")
    assert resolve("ppo", TINY, runs) == {"reward": "reward · rerun", "sft": "sft · demo"}
    # the stages of a pipeline run start from that run's own records
    second = runs.pipeline("second", TINY, "configs/tiny.yaml")
    records = {stage: record(stage, run) for stage, run in second.items()}
    resolved = upstream_runs("ppo", records, {}, TINY, runs)
    assert resolved.run_ids == {"reward": second["reward"].info.run_id, "sft": second["sft"].info.run_id}
    assert resolved.describe() == ("reward run `reward · second` (this pipeline run); "
                                   "SFT run `sft · second` (this pipeline run)")


def test_ppo_whose_reward_is_functions_alone_starts_from_an_sft_run_and_no_reward_run():
    functions = load_config("configs/tiny.yaml", {"ppo.reward.terms": [
        {"name": "subject", "function": "rlhf.demo.rewards:names_the_subject"}]})
    runs = Experiment()
    runs.pipeline("sft-only", TINY, "configs/tiny.yaml", stages=("sft",))
    with pytest.raises(LookupError, match="needs a finished reward run"):
        resolve("ppo", TINY, runs)
    assert resolve("ppo", functions, runs) == {"sft": "sft · sft-only"}
    newer = runs.pipeline("newer", TINY, "configs/tiny.yaml")  # with a reward run, which PPO leaves alone
    assert upstream_runs("ppo", {}, {}, functions, runs).describe() == "SFT run `sft · newer` (latest with this config)"
    named = upstream_runs("ppo", {}, {"sft": newer["sft"].info.run_id, "reward": newer["reward"].info.run_id},
                          functions, runs)
    assert named.run_ids == {"sft": newer["sft"].info.run_id}


def test_two_models_and_two_configs_in_one_experiment_each_config_gets_its_own_coherent_pair():
    runs = Experiment()
    runs.pipeline("demo", TINY, "configs/tiny.yaml")
    runs.pipeline("gpt2", GPT2, "configs/gpt2.yaml")  # another model, newer; the same reward section
    runs.pipeline("short", SHORT_SFT, "configs/tiny.yaml", overrides='{"sft.max_steps": 2}')  # newer still
    for cfg, label in ((TINY, "demo"), (GPT2, "gpt2"), (SHORT_SFT, "short")):
        assert resolve("ppo", cfg, runs) == {"reward": f"reward · {label}", "sft": f"sft · {label}"}, label
        assert resolve("reward", cfg, runs) == {"sft": f"sft · {label}"}, label
        assert resolve("dpo", cfg, runs) == {"sft": f"sft · {label}"}, label
    # a reward run of another reward section from the demo's SFT run: for that config only
    runs.pipeline("other-reward", OTHER_REWARD, "configs/tiny.yaml", stages=("reward",),
                  sft=runs.finished("sft", {tracking.TAG_CONFIG_HASH: config_hash(TINY.sft)})[0])
    assert resolve("ppo", TINY, runs) == {"reward": "reward · demo", "sft": "sft · demo"}
    assert resolve("ppo", OTHER_REWARD, runs) == {"reward": "reward · other-reward", "sft": "sft · demo"}


def test_the_reasons_say_which_runs_and_why():
    runs = Experiment()
    runs.pipeline("mature-goose", TINY, "configs/tiny.yaml")
    assert upstream_runs("ppo", {}, {}, TINY, runs).describe() == (
        "reward run `reward · mature-goose` (latest with this config); SFT run `sft · mature-goose` (its own upstream)")
    assert (upstream_runs("dpo", {}, {}, TINY, runs).describe()
            == "SFT run `sft · mature-goose` (latest with this config)")
    assert upstream_runs("sft", {}, {}, TINY, runs).describe() == ""


def test_a_named_run_brings_its_partner_along_lineage():
    runs = Experiment()
    demo = runs.pipeline("demo", TINY, "configs/tiny.yaml")
    gpt2 = runs.pipeline("gpt2", GPT2, "configs/gpt2.yaml")
    runs.pipeline("short", SHORT_SFT, "configs/tiny.yaml")
    # the reward run named: its own SFT run, whatever the config says
    given = {"reward": gpt2["reward"].info.run_id}
    assert resolve("ppo", TINY, runs, given) == {"reward": "reward · gpt2", "sft": "sft · gpt2"}
    assert upstream_runs("ppo", {}, given, TINY, runs).describe() == (
        "reward run `reward · gpt2` (given); SFT run `sft · gpt2` (its own upstream)")
    # the SFT run named: the latest reward run with this config trained from it
    runs.pipeline("again", TINY, "configs/tiny.yaml", stages=("reward",), sft=demo["sft"])
    given = {"sft": demo["sft"].info.run_id}
    assert resolve("ppo", TINY, runs, given) == {"sft": "sft · demo", "reward": "reward · again"}
    assert resolve("ppo", SHORT_SFT, runs, given) == {"sft": "sft · demo", "reward": "reward · again"}
    # a named pair that belongs together: exactly those
    given = {"sft": demo["sft"].info.run_id, "reward": demo["reward"].info.run_id}
    assert resolve("ppo", GPT2, runs, given) == {"reward": "reward · demo", "sft": "sft · demo"}
    # a named SFT run no reward run was trained from (with this config)
    with pytest.raises(LookupError) as refused:
        resolve("ppo", OTHER_REWARD, runs, {"sft": demo["sft"].info.run_id})
    message = str(refused.value)
    assert f"trained from SFT run `sft · demo` ({demo['sft'].info.run_id})" in message
    assert config_hash(OTHER_REWARD.reward) in message and "`reward · again`" in message
    assert f"Run rlhf/reward with this config first with upstream.sft_run_id {demo['sft'].info.run_id}" in message


def test_a_named_pair_that_does_not_belong_together_is_refused_naming_both_runs():
    runs = Experiment()
    demo = runs.pipeline("demo", TINY, "configs/tiny.yaml")
    gpt2 = runs.pipeline("gpt2", GPT2, "configs/gpt2.yaml")
    given = {"sft": demo["sft"].info.run_id, "reward": gpt2["reward"].info.run_id}
    with pytest.raises(LookupError) as refused:
        resolve("ppo", TINY, runs, given)
    message = str(refused.value)
    assert message.startswith(f"stage ppo: reward run `reward · gpt2` ({gpt2['reward'].info.run_id}) was trained from "
                              f"SFT run `sft · gpt2` ({gpt2['sft'].info.run_id}), not from SFT run `sft · demo` "
                              f"({demo['sft'].info.run_id}), given as upstream.sft_run_id")
    assert "Pass only upstream.reward_run_id" in message and "set reward.model" in message
    # an SFT run of this pipeline run with a reward run named that was not trained from it
    with pytest.raises(LookupError, match="not from SFT run `sft · demo` .*, from this pipeline run"):
        resolve("ppo", TINY, runs, {"reward": gpt2["reward"].info.run_id}, records={"sft": record("sft", demo["sft"])})
    # a separate reward model (reward.model): the pair is the user's to choose
    separate = load_config("configs/tiny.yaml", {"reward.model": "/models/judge"})
    resolved = upstream_runs("ppo", {}, given, separate, runs)
    assert resolved.run_ids == {"reward": gpt2["reward"].info.run_id, "sft": demo["sft"].info.run_id}
    assert "reward.model makes the reward model a separate model" in resolved.describe()


def test_named_runs_that_do_not_exist_or_are_of_another_stage_are_refused():
    runs = Experiment()
    demo = runs.pipeline("demo", TINY, "configs/tiny.yaml")
    with pytest.raises(LookupError, match=f"upstream.sft_run_id {'0' * 32}: no such run"):
        resolve("reward", TINY, runs, {"sft": "0" * 32})
    with pytest.raises(LookupError, match="is not an sft run: `reward · demo` is a reward run"):
        resolve("dpo", TINY, runs, {"sft": demo["reward"].info.run_id})
    with pytest.raises(LookupError, match="upstream.reward_run_id .* no such run"):
        resolve("ppo", TINY, runs, {"reward": "f" * 32})


def test_when_no_run_fits_the_refusal_names_the_hash_the_nearest_runs_and_what_to_do():
    runs = Experiment()
    with pytest.raises(LookupError) as refused:
        resolve("reward", TINY, runs)
    assert str(refused.value) == (
        f"stage reward needs a finished sft run made with this config's sft section (rlhf.config_hash "
        f"{config_hash(TINY.sft)}); none is in experiment 'rlhf'. Run rlhf/sft with this config first, or pass "
        f"upstream.sft_run_id; upstream.any_config takes the latest run whatever its config")
    runs.pipeline("gpt2", GPT2, "configs/gpt2.yaml")
    runs.pipeline("short", SHORT_SFT, "configs/tiny.yaml", overrides='{"sft.max_steps": 2}')
    with pytest.raises(LookupError) as refused:
        resolve("dpo", TINY, runs)
    message = str(refused.value)
    assert (f"rlhf.config_hash {config_hash(TINY.sft)}); none of the 2 finished sft runs in experiment 'rlhf' is"
            in message)
    lines = message.splitlines()
    assert lines[1].startswith("  - `sft · short` (configs/tiny.yaml with overrides {\"sft.max_steps\": 2}, 2025-")
    assert lines[1].endswith(f"UTC, sft section {config_hash(SHORT_SFT.sft)[:12]})")
    assert lines[2].startswith("  - `sft · gpt2` (configs/gpt2.yaml, ")
    assert lines[3].startswith("Run rlhf/sft with this config first, or pass upstream.sft_run_id")
    with pytest.raises(LookupError) as refused:
        resolve("ppo", TINY, runs)
    message = str(refused.value)
    assert (f"needs a finished reward run made with this config's reward section (rlhf.config_hash "
            f"{config_hash(TINY.reward)}) from an SFT run made with its sft section (rlhf.config_hash "
            f"{config_hash(TINY.sft)})") in message
    assert f"from SFT run `sft · gpt2` (sft section {config_hash(GPT2.sft)[:12]})" in message
    assert ("Run rlhf/reward with this config first (rlhf/full for both stages), or pass upstream.reward_run_id"
            in message)


def test_any_config_takes_the_latest_runs_whatever_their_config_and_keeps_the_pair_together():
    runs = Experiment()
    demo = runs.pipeline("demo", TINY, "configs/tiny.yaml")
    runs.pipeline("gpt2", GPT2, "configs/gpt2.yaml")
    runs.pipeline("again", TINY, "configs/tiny.yaml", stages=("reward",), sft=demo["sft"])
    assert resolve("dpo", TINY, runs, any_config=True) == {"sft": "sft · gpt2"}
    assert resolve("ppo", GPT2, runs, any_config=True) == {"reward": "reward · again", "sft": "sft · demo"}
    assert upstream_runs("ppo", {}, {}, GPT2, runs, any_config=True).describe() == (
        "reward run `reward · again` (latest whatever its config, as upstream.any_config asks); "
        "SFT run `sft · demo` (its own upstream)")
    assert resolve("ppo", GPT2, runs) == {"reward": "reward · gpt2", "sft": "sft · gpt2"}  # off by default


def test_the_run_form_says_the_rule_and_offers_the_escape_hatch_off_by_default():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import rlhf

    schema = parameter_schema(rlhf.fn).model_dump_for_openapi()
    fields = schema["definitions"]["UpstreamRuns"]["properties"]
    assert "for PPO, the SFT run its reward run was trained from" in fields["sft_run_id"]["description"]
    assert "made with this config's reward section" in fields["reward_run_id"]["description"]
    assert "the pair is refused" in fields["reward_run_id"]["description"]
    assert fields["any_config"]["default"] is False and "whatever config" in fields["any_config"]["description"]
    assert "belong together" in schema["properties"]["upstream"]["description"]
