"""PPO sampling on a real vLLM server (vLLM's CPU build, from `make vllm-env`): what it samples is what
the trainer computes, its weights follow every update, a resumed run ends where an uninterrupted one
does, and nothing of it outlives the stage, even when the stage's process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf.config import load_config, with_overrides
from rlhf.sections.base import REPO_ROOT, VLLMConfig, vllm_python
from tests.helpers import AUTO_RESOLVED, killed_and_resumed, ppo_inputs, processes, ray_launch, run_ppo, vllm_servers

pytestmark = pytest.mark.multiprocess  # a vLLM server is a process of its own

if not vllm_python(VLLMConfig()).exists():
    pytest.skip(f"no vLLM environment at {VLLMConfig().python}: `make vllm-env` builds it (.ci/run does; "
                "these tests skip only where that build failed)", allow_module_level=True)


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    """The tiny world with 2 attention heads of 32 (vLLM's CPU build refuses the default 4 of 16), and
    its SFT and reward checkpoints."""
    from rlhf.demo.world import build_world
    from stages.runtime.models import load_tokenizer
    from tests.helpers import train_upstream, world_frames

    cfg = load_config("configs/tiny.yaml", {"demo.num_heads": 2, "ppo.rollout_engine": "vllm"})
    world = build_world(tmp_path_factory.mktemp("worlds"), cfg.demo)
    frames = world_frames(world, load_tokenizer(str(world / "model")))
    sft, reward = train_upstream(cfg, world, frames, tmp_path_factory.mktemp("trained"))
    return cfg, {"sft": sft, "reward": reward, "prompts": frames["prompts"], "eval_prompts": frames["prompts_eval"],
                 "frames": frames}


def _process_group_alive(group: int) -> list[str]:
    """The command lines of the processes still in process group `group`."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                alive.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue
    return alive


def _listening(socket_path: str) -> bool:
    """Whether a Unix socket listens at `socket_path` (/proc/net/unix: state 01, unconnected, with the flag
    __SO_ACCEPTCON)."""
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[7] == socket_path and fields[3] == "00010000":
            return True
    return False


@pytest.fixture
def started(monkeypatch) -> list:
    """Every `VLLMSampler` the test starts."""
    from stages.engines.vllm_server import VLLMSampler

    samplers, real_start = [], VLLMSampler.start.__func__

    def recording(cls, *args, **kwargs):
        samplers.append(real_start(cls, *args, **kwargs))
        return samplers[-1]

    monkeypatch.setattr(VLLMSampler, "start", classmethod(recording))
    return samplers


def _stopped(sampler) -> bool:
    """No server process left on the sampler's folder, nothing listening on its socket, the folder removed."""
    return (sampler.served is None and not sampler.folder.exists() and not _listening(sampler.endpoint.socket)
            and not vllm_servers(str(sampler.folder)))


def test_grpo_on_a_vllm_server_samples_what_the_trainer_computes_and_stops_it_after(servable, tmp_path, started,
                                                                                  monkeypatch):
    cfg, trained = servable
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {"advantage_estimator": "grpo", "samples_per_prompt": 4})
    import stages.engines.vllm_process as vllm_process

    seen = []  # while it runs, the server listens on a Unix socket in a folder only this user may enter
    real_reload = vllm_process.HTTPEndpoint.reload

    def reload(endpoint):
        folder = Path(endpoint.socket).parent
        seen.append((_listening(endpoint.socket), oct(folder.stat().st_mode & 0o777)))
        return real_reload(endpoint)

    monkeypatch.setattr(vllm_process.HTTPEndpoint, "reload", reload)
    result = run_ppo(ppo, trained, tmp_path / "out")
    assert seen and set(seen) == {(True, "0o700")}, seen

    assert len(started) == 1
    assert [row["rollout/vllm_logprob_gap_max"] < 1e-4 for row in result.history] == [True] * ppo.num_iterations
    assert all(row["time/weight_sync"] > 0 for row in result.history)  # the folder written and reloaded each time
    assert all(abs(row["rollout/engine_importance_weight"] - 1) < 1e-4 for row in result.history)
    assert result.history[-1]["rollout/kl"] != 0  # the policy moved, and the server sampled the moved policy
    assert 0 < result.metrics["eval/eos_rate"] <= 1  # end tokens come back as tokens of the response
    assert (tmp_path / "out" / "vllm.log").exists()
    assert _stopped(started[0])


@pytest.fixture(scope="module")
def tool_world(tmp_path_factory):
    """The tiny tool world with 2 attention heads of 32, and its SFT checkpoint."""
    from tests.helpers import tools_upstream

    return tools_upstream(tmp_path_factory.mktemp("tools"), **{"demo.num_heads": 2, "ppo.rollout_engine": "vllm"})


def test_episodes_sample_their_turns_on_the_vllm_server_from_token_ids(tool_world, tmp_path, started):
    """Multi-turn episodes on the tool world: every turn sampled on the server from the context's token
    ids; what it samples is what the trainer computes on the model's own tokens; the server stopped after."""
    cfg, trained = tool_world
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED)
    result = run_ppo(ppo, trained, tmp_path / "out")
    assert len(started) == 1 and _stopped(started[0])
    assert all(row["rollout/vllm_logprob_gap_max"] < 1e-4 for row in result.history)
    assert all(row["rollout/turns"] >= 1 for row in result.history) and "eval/tool_call_rate" in result.metrics
    assert result.history[-1]["rollout/kl"] != 0


def test_an_agent_programs_chains_sample_on_the_server_ahead_and_train_on_what_it_sampled(tool_world, tmp_path,
                                                                                          started):
    """An agent program (`environment.agent`) served by the vLLM server, sampled one update ahead: each
    episode drafts, then answers again on a fresh context (a rewritten history). Where the server's
    weights were the trainer's (the first rollout, staleness 0), the trainer's passes over the second
    chain, packed on the episode's row, give the log-probs the server gave when it sampled on that
    context alone; later rollouts are one update old."""
    cfg, trained = tool_world
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {
        "num_iterations": 3, "rollout": {"max_staleness": 1}, "sampling.response_length": 48,
        "environment": {"tools": None, "agent": "tests.helpers:refining_agent", "episode_tokens": 160}})
    result = run_ppo(ppo, trained, tmp_path / "out")
    assert len(started) == 1 and _stopped(started[0])
    assert all(row["rollout/failed_share"] == 0 for row in result.history)
    assert all(row["rollout/rewritten_contexts"] > 0 for row in result.history)
    assert [row["rollout/staleness"] for row in result.history] == [0.0, 1.0, 1.0]
    assert result.history[0]["rollout/vllm_logprob_gap_max"] < 1e-4


def test_episodes_sampled_ahead_keep_their_bound_and_a_resumed_run_loses_and_repeats_none(tool_world, tmp_path):
    """`rollout.max_staleness: 2` with episodes: whole episodes, tool calls included, are sampled on
    the server's thread while the trainer updates; each is at most 2 updates old, and the full-state
    checkpoint keeps the episodes in flight, so a run killed after it samples the same tokens as an
    uninterrupted one (each episode's turns are seeded from the trainer's stream, and the server is
    synced to the same weights) and ends at its weights. Not to the bit: 8 episodes in flight, the
    server batches their turns as they arrive, and vLLM's log-probs of a token (which the importance
    weights take) differ in their last bits with what shares its batch (seen in CI: a few weights
    one float32 step apart)."""
    cfg, trained = tool_world
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {
        "num_iterations": 6, "checkpoint_every": 3, "rollout": {"max_staleness": 2},
        "environment": {"schedule": "continuous", "concurrent_episodes": 8}})
    reference, resumed = killed_and_resumed(ppo, trained, tmp_path)
    # rollouts 1-3 are submitted at iteration 1 and sampled by v0; rollout k > 3 at iteration k - 2 by v_{k-3}
    assert [row["rollout/staleness"] for row in resumed.history] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert all(row["rollout/staleness_mean"] == row["rollout/staleness"] for row in resumed.history)
    assert all(row["rollout/mixed_version_share"] == 0 for row in resumed.history)  # whole episodes: one version
    assert all(row["rollout/turns"] >= 1 for row in resumed.history)
    assert (tmp_path / "interrupted" / "state" / "sampled_ahead_rank0.safetensors").exists()
    assert [row["rollout/score"] for row in resumed.history] == [row["rollout/score"] for row in reference.history]
    assert [row["rollout/tool_calls"] for row in resumed.history] == [row["rollout/tool_calls"]
                                                                      for row in reference.history]
    whole = load_file(tmp_path / "whole" / "checkpoint" / "model.safetensors")
    interrupted = load_file(tmp_path / "interrupted" / "checkpoint" / "model.safetensors")
    assert whole.keys() == interrupted.keys()
    gap = max((whole[k] - interrupted[k]).abs().max().item() for k in whole)
    assert gap < 1e-5, gap  # measured here: 6e-8, one float32 step of a weight near 1


def test_partial_rollouts_continue_episodes_across_a_sync_under_the_new_weights(tool_world, tmp_path, monkeypatch):
    """`rollout.partial`: the sync after the first update does not wait for the episodes sampled ahead;
    their environment's answers are held until the server has the new weights (`SyncGated`), so their
    next turns are sampled by v1 while their first were by v0. Each trainable segment keeps its
    version: the iteration's share of episodes spanning two versions is above 0, the first
    iteration's is 0, and the staleness bound holds."""
    from stages.engines.vllm_server import VLLMSampler
    from stages.rl.rollout import Rollouts
    from tests import helpers

    cfg, trained = tool_world
    real_records, real_sync = Rollouts.records_of, VLLMSampler.sync
    monkeypatch.setattr(Rollouts, "records_of", lambda self, k: [{**row, "ahead_of_sync": k == 2}
                                                                  for row in real_records(self, k)])

    def sync(sampler, policy, version):
        if version >= 1:  # the first update's weights only once a turn of the rollout sampled ahead is back:
            helpers.GATED.wait(timeout=120)  # a trainer quicker than the server's first turns (seen in CI)
        real_sync(sampler, policy, version)  # would otherwise load v1 before any of them, and no episode
        helpers.SYNCED.set()  # would span two versions

    monkeypatch.setattr(VLLMSampler, "sync", sync)
    helpers.SYNCED.clear()
    helpers.GATED.clear()
    helpers.SYNC_GATED_CALLS["n"] = 0
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {
        "num_iterations": 3, "rollout": {"max_staleness": 1, "partial": True},
        "environment": {"tools": None, "factory": "tests.helpers:SyncGated", "schedule": "continuous",
                        "concurrent_episodes": 16}})
    history = run_ppo(ppo, trained, tmp_path / "out").history
    assert helpers.SYNC_GATED_CALLS["n"] > 0
    assert [row["rollout/staleness"] <= 1 for row in history] == [True] * 3
    assert history[0]["rollout/mixed_version_share"] == 0
    assert history[1]["rollout/mixed_version_share"] > 0  # the gated episodes: a turn by v0, the next by v1
    assert 0 < history[1]["rollout/staleness_mean"] <= 1


def test_dynamic_sampling_and_the_policy_loss_options_sample_on_the_vllm_server(servable, tmp_path, started):
    """DAPO's dynamic sampling takes its extra rounds from the server, and the loss options (GSPO's
    ratio, clip-higher) combine with the engine's importance-sampling correction."""
    cfg, trained = servable
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {
        "advantage_estimator": "grpo", "samples_per_prompt": 4, "dynamic_sampling": {"max_rounds": 3},
        "ratio_level": "sequence", "loss_aggregation": "seq-mean-token-mean", "clip_range": [0.2, 0.28],
        "reward": {"terms": [{"name": "on_subject", "function": "rlhf.demo.rewards:names_the_subject"}]}})
    result = run_ppo(ppo, trained, tmp_path / "out")
    assert len(started) == 1  # one server for every round of every iteration
    assert all(1 <= row["rollout/sampling_rounds"] <= 3 for row in result.history)
    assert any(row["rollout/filtered_share"] > 0 for row in result.history), "no tied group: nothing was filtered"
    assert all(abs(row["rollout/engine_importance_weight"] - 1) < 1e-4 for row in result.history)
    assert result.history[-1]["rollout/kl"] != 0
    assert _stopped(started[0])


def test_a_sharded_policy_is_streamed_to_the_server_and_sampled_by_bothprocesses(servable, tmp_path):
    """Two FSDP2 processes: the first starts the server, both write their shards of the policy into
    the served folder (`save_streamed`) and both send their own prompts."""
    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.ppo import train_ppo

    cfg, trained = servable
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {"launch": {"num_processes": 2,
                                                              "accelerate_config": "configs/accelerate/fsdp.yaml"}})
    inputs = ppo_inputs(trained)
    result = call_stage(train_ppo, ppo, inputs, tmp_path / "out", Reporting(), Determinism(num_threads=1))
    assert result.tags["rlhf.held_as"] == "fsdp2 x 2"
    assert all(row["rollout/vllm_logprob_gap_max"] < 1e-4 for row in result.history)
    assert result.history[-1]["rollout/kl"] != 0
    # and GRPO sampling ahead: each process keeps its own rollouts in flight, the sync waits for both
    ahead = with_overrides(ppo, {"advantage_estimator": "grpo", "samples_per_prompt": 4,
                                 "rollout": {"max_staleness": 1}})
    result = call_stage(train_ppo, ahead, inputs, tmp_path / "ahead", Reporting(), Determinism(num_threads=1))
    assert [row["rollout/staleness"] for row in result.history] == [0.0, 1.0, 1.0]
    assert all(row["train/initial_ratio_deviation"] < 1e-4 for row in result.history)


def test_the_reward_stages_normalisation_and_dpos_evaluation_sample_on_vllm_too(servable, tmp_path, started):
    from stages.dpo import DPOInputs, train_dpo
    from stages.reward import RewardInputs, train_reward

    cfg, trained = servable
    frames = trained["frames"]
    reward = train_reward(cfg.reward.model_copy(update={"max_steps": 2, "rollout_engine": "vllm"}),
                          RewardInputs(model_location=trained["sft"], policy_location=trained["sft"],
                                       train=frames["preferences"],
                                       evaluation=frames["preferences_eval"],
                                       normalization_prompts=frames["prompts_eval"]), tmp_path / "reward")
    assert reward.metrics["normalization/reference_std_raw"] > 0  # scores of responses the server sampled
    assert "Application startup complete" in (tmp_path / "reward" / "vllm.log").read_text()
    dpo = train_dpo(cfg.dpo.model_copy(update={"max_steps": 2, "rollout_engine": "vllm"}),
                    DPOInputs(trained["sft"], frames["preferences"], frames["preferences_eval"],
                              frames["prompts_eval"]),
                    tmp_path / "dpo")
    assert 0 <= dpo.metrics["eval/eos_rate"] <= 1 and "eval/kl" in dpo.metrics
    assert "Application startup complete" in (tmp_path / "dpo" / "vllm.log").read_text()
    assert len(started) == 2 and all(_stopped(sampler) for sampler in started)


MASKED = {"correction": {"kind": "mis", "bounds": [0.98, 1.02]}}
"""`rollout.correction` masking the tokens whose ratio leaves [0.98, 1.02] (`mis`), the REINFORCE++ case's."""


@pytest.mark.parametrize("estimator, changes", [
    ("gae", {"lora": {"r": 4}, "reward": {"terms": [
        {"name": "reward_model"}, {"name": "on_subject", "function": "rlhf.demo.rewards:names_the_subject"}]}}),
    ("rloo", {"samples_per_prompt": 4}),
    ("reinforce++", {"rollout": MASKED}),
])
def test_sampling_ahead_trains_on_rollouts_one_update_old_weighted_to_the_server(servable, tmp_path, started,
                                                                                estimator, changes):
    """`rollout.max_staleness: 1`: iteration k's rollout was sampled by the server while iteration
    k-1 trained, with the weights before that update; the trainer recomputes the old log-probs under
    the weights it updates from, so the ratio starts at 1 and the importance weights carry the lag.
    With `rollout.correction.kind: mis` (REINFORCE++'s case): nothing is masked at iteration 0 (the
    server sampled with the trainer's weights); afterwards the lag moves some tokens' ratio outside
    the bounds, and those, and only those, are masked, none truncated."""
    cfg, trained = servable
    rollout = {"max_staleness": 1, **changes.get("rollout", {})}
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | changes | {"advantage_estimator": estimator, "rollout": rollout})
    result = run_ppo(ppo, trained, tmp_path / "out")
    history = result.history
    assert [row["rollout/staleness"] for row in history] == [0.0, 1.0, 1.0]
    assert all(row["train/initial_ratio_deviation"] < 1e-4 for row in history)  # old log-probs: the update's start
    assert history[0]["rollout/vllm_logprob_gap_max"] < 1e-4  # sampled by the weights it trains from
    assert all(row["rollout/vllm_logprob_gap"] > 10 * history[0]["rollout/vllm_logprob_gap"] for row in history[1:])
    assert all(row["rollout/engine_importance_weight_std"] > 10 * history[0]["rollout/engine_importance_weight_std"]
               for row in history[1:])
    assert all(row["time/generate"] > 0 and "time/sampling_wait" in row for row in history)
    assert "eval/kl" in history[1]  # the midway evaluation sampled on the server between iterations
    assert len(started) == 1 and _stopped(started[0])
    if rollout.get("correction") == MASKED["correction"]:
        assert history[0]["rollout/engine_masked_share"] == 0.0
        assert all(0 < row["rollout/engine_masked_share"] < 1 for row in history[1:])
        assert all(row["rollout/engine_importance_weight_capped"] == 0.0 for row in history)
        assert all(row["rollout/engine_ratio_p05"] <= row["rollout/engine_ratio_p50"] <= row["rollout/engine_ratio_p95"]
                   for row in history)


def test_a_failure_while_the_server_samples_ahead_leaves_no_server_and_no_sampling_thread(servable, tmp_path, started,
                                                                                           monkeypatch):
    import threading

    import stages.ppo

    cfg, trained = servable
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {"rollout": {"max_staleness": 1}})
    real_update, calls = stages.ppo.ppo_update, []

    def failing_update(*args, **kwargs):  # iteration 2's update, with iteration 3's rollout submitted to the server
        calls.append(True)
        if len(calls) == 2:
            raise RuntimeError("the update failed")
        return real_update(*args, **kwargs)

    monkeypatch.setattr(stages.ppo, "ppo_update", failing_update)
    with pytest.raises(RuntimeError, match="the update failed"):
        run_ppo(ppo, trained, tmp_path / "out")
    assert len(started) == 1 and _stopped(started[0])
    deadline = time.monotonic() + 30
    while any(t.name.startswith("rlhf-sampling-ahead") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the sampling thread outlived the failed stage"
        time.sleep(0.2)


def test_a_killed_and_resumed_vllm_run_sampling_ahead_ends_at_the_uninterrupted_runs_weights(servable, tmp_path):
    """vLLM's sampling is repeatable here with a fixed seed per request (the seeds come from the
    trainer's random stream, which the full-state checkpoint keeps), and the rollout sampled ahead
    of the checkpoint is checkpointed with it, so resuming ends where an uninterrupted run does."""
    cfg, trained = servable
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {"num_iterations": 6, "checkpoint_every": 3,
                                                   "rollout": {"max_staleness": 1}})
    reference, resumed = killed_and_resumed(ppo, trained, tmp_path)
    assert [row["rollout/staleness"] for row in resumed.history] == [0.0] + [1.0] * 5
    assert (tmp_path / "interrupted" / "state" / "sampled_ahead_rank0.safetensors").exists()
    assert [row["rollout/score"] for row in resumed.history] == [row["rollout/score"] for row in reference.history]
    a = (tmp_path / "whole" / "checkpoint" / "model.safetensors").read_bytes()
    b = (tmp_path / "interrupted" / "checkpoint" / "model.safetensors").read_bytes()
    assert a == b


KILLED = """
import pickle, sys
from tests.helpers import park_after_first_checkpoint, run_ppo

park_after_first_checkpoint(sys.argv[2])
ppo, trained, out = pickle.load(open(sys.argv[1], "rb"))
run_ppo(ppo, trained, out)
"""


def test_a_stage_killed_with_sigkill_mid_ppo_leaves_no_vllm_process_and_its_rerun_resumes(servable, tmp_path):
    import pickle

    from stages.common.reporting import Reporting

    cfg, trained = servable
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {"num_iterations": 4, "checkpoint_every": 2,
                                                   "rollout": {"max_staleness": 1}})  # a rollout in flight when killed
    arguments, parked = tmp_path / "arguments.pkl", tmp_path / "parked"
    arguments.write_bytes(pickle.dumps((ppo, trained, tmp_path / "out")))
    scope = f"RLHF_TEST_SCOPE={tmp_path}"  # in the environment of the stage and all it starts
    stage = subprocess.Popen([sys.executable, "-c", KILLED, str(arguments), str(parked)], cwd=REPO_ROOT,
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=os.environ | dict([scope.split("=", 1)]))
    deadline = time.monotonic() + 600
    with _watched(scope) as seen:
        while not parked.exists():
            assert stage.poll() is None, "the stage ended before its third iteration"
            assert time.monotonic() < deadline, "PPO did not reach its third iteration within 600 s"
            time.sleep(0.5)
    (server,) = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _is_child_server(int(pid), stage.pid)]
    group = int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[2])
    served = Path(Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0--model\0")[1].split(b"\0")[0].decode())
    assert served.is_dir() and _process_group_alive(group)
    os.killpg(stage.pid, signal.SIGKILL)  # the stage's process, not the server's own group
    stage.wait()
    deadline = time.monotonic() + 60
    while _process_group_alive(group):
        assert time.monotonic() < deadline, f"vLLM processes outlived the killed stage: {_process_group_alive(group)}"
        time.sleep(0.5)
    # the policy the killed stage served is removed from shared memory by its janitor, which outlives the stage,
    # with vLLM's shared-memory files
    while served.exists() or _leaked(seen):
        assert time.monotonic() < deadline, f"the killed stage's shared memory outlived it: {served}, {_leaked(seen)}"
        time.sleep(0.5)

    messages = []
    resumed = run_ppo(ppo, trained, tmp_path / "out", Reporting(warning=messages.append))
    assert "resumed from the full-state checkpoint after iteration 2" in messages[0]
    assert len(resumed.history) == 4


def _is_child_server(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return int(stat[1]) == parent and b"vllm.entrypoints.openai.api_server" in cmdline


def _shared_memory(path: Path) -> Path | None:
    """The entry of shared memory `path` lies in, where it is one a test checks: a served policy's
    folder, or one of vLLM's shared-memory files (its engine's message queues and semaphores, which a
    killed engine cannot unlink itself); None for anything else."""
    from stages.engines.vllm_process import SERVED_PREFIX

    for root in (Path("/dev/shm"), Path("/tmp")):
        if path.is_relative_to(root) and path != root:
            entry = root / path.relative_to(root).parts[0]
            served = entry.name.startswith(SERVED_PREFIX)
            if served or root.name == "shm" and entry.name.startswith(("psm_", "sem.mp-")):
                return entry
    return None


def _held(environment: str | None = None) -> set[Path]:
    """The `_shared_memory` entries that a live process maps or has open (given `environment`, such as
    "RLHF_HOME=/tmp/x": only the processes whose environment holds it)."""
    held = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if environment is not None and environment.encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            paths = {line[line.index("/"):] for line in (proc / "maps").read_text().splitlines() if "/" in line}
            paths |= {os.readlink(fd) for fd in (proc / "fd").iterdir()}
        except OSError:
            continue
        held |= {entry for path in paths if (entry := _shared_memory(Path(path))) is not None}
    return held


@contextmanager
def _watched(environment: str) -> Iterator[set[Path]]:
    """Every `_shared_memory` entry that the processes holding `environment` map or have open, sampled
    every 0.5 s while the block runs: what a leak check may blame on this test, and not on a test
    running beside it (whose killed processes may leave their own files)."""
    seen: set[Path] = set()
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.update(_held(environment))
            done.wait(0.5)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


def _owner_alive(folder: Path) -> bool:
    try:
        return Path(f"/proc/{int((folder / 'owner').read_text())}").exists()
    except (OSError, ValueError):
        return False


def _leaked(seen: set[Path]) -> set[Path]:
    """What of `seen` (a `_watched` block's) is still there with no live process holding it: a served
    folder whose owner has died, a queue or semaphore that no process maps or has open."""
    assert seen, "the watch saw no shared memory of the test's processes: it would check nothing"
    held = _held()
    return {entry for entry in seen if entry.exists() and entry not in held and not _owner_alive(entry)}


def _ray_vllm(cfg, address: str, **launch):
    return with_overrides(cfg.ppo, AUTO_RESOLVED | {"launch": ray_launch(address, ray_placement="SPREAD", **launch),
                                                    "num_iterations": 3, "checkpoint_every": 1})


def test_on_a_ray_gang_the_server_is_an_actor_on_rank_0s_node_and_nothing_of_it_is_left(servable, ray_cluster,
                                                                                        tmp_path):
    """Ranks on two Ray nodes, the server an actor beside rank 0: both ranks sample through it, its
    weights follow every update, and the stage leaves no server, actor or served folder."""
    import json

    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.ppo import train_ppo

    cfg, trained = servable
    mine = ray_cluster.environment  # this cluster's processes, not those of a test beside this one
    inputs = ppo_inputs(trained)
    with _watched(mine) as seen:
        result = call_stage(train_ppo, _ray_vllm(cfg, ray_cluster), inputs, tmp_path / "out", Reporting(),
                            Determinism(num_threads=1))
    assert len({n["node"] for n in json.loads(result.tags["rlhf.launch.nodes"])}) == 2
    assert all(row["rollout/vllm_logprob_gap_max"] < 1e-4 for row in result.history)
    assert result.history[-1]["rollout/kl"] != 0  # the policy moved, and the server sampled the moved policy
    assert "vLLM" in (tmp_path / "out" / "vllm.log").read_text()  # written on rank 0's node by the actor's server
    assert not vllm_servers(environment=mine) and not _leaked(seen)
    assert not processes("ray::ServerActor", environment=mine)  # the actor ended with the server (Ray titles it so)
    assert not processes("VLLM::", environment=mine)  # and so did vLLM's engine processes


def test_on_a_ray_gang_a_killed_rank_0_takes_its_server_and_served_folder_with_it(servable, ray_cluster, tmp_path):
    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.launch.job import LaunchError
    from tests.stand_in_stages import RankKilledOnce, ppo_with_a_rank_killed_once

    cfg, trained = servable
    inputs = ppo_inputs(trained)
    killed = RankKilledOnce(inputs, rank=0, marker=tmp_path / "killed")
    mine = ray_cluster.environment
    with _watched(mine) as seen, pytest.raises(LaunchError, match=r"rank 0 \(node [0-9a-f]{12}, [0-9.]+, pid \d+\)"):
        call_stage(ppo_with_a_rank_killed_once, _ray_vllm(cfg, ray_cluster), killed, tmp_path / "out", Reporting(),
                   Determinism(num_threads=1))
    assert killed.marker.exists()
    deadline = time.monotonic() + 60

    def left() -> list:
        return [*vllm_servers(environment=mine), *_leaked(seen), *processes("ray::ServerActor", environment=mine),
                *processes("VLLM::", environment=mine)]

    while left():
        assert time.monotonic() < deadline, f"left after the gang failed: {left()}"
        time.sleep(0.5)
