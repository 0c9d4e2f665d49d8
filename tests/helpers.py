"""Helpers the tests (and the launch stress benchmark) share; test files import from here, never from each other."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from fastapi import FastAPI, Request

DATA = Path(__file__).parent / "data"
"""Hand-written data files: `good/` that each contract accepts, `bad/` that each refuses."""
BAD = DATA / "bad"
GOOD = DATA / "good"

BAD_CASES = [
    # file, kind, expected lines of the report (each must appear)
    ("sft_missing_column.jsonl", "sft", ["column 'response': missing column"]),
    ("sft_null.jsonl", "sft", ["line 2, column 'prompt': missing value (null)"]),
    ("sft_blank.jsonl", "sft", ["line 2, column 'response': must not be blank"]),
    ("sft_wrong_type.jsonl", "sft", ["line 2, column 'prompt': must be a string"]),
    ("pairs_identical.jsonl", "preference", ["line 2: chosen is identical to rejected"]),
    ("sft_malformed_line.jsonl", "sft", ["line 2: malformed JSON"]),
    ("sft_bad_encoding.jsonl", "sft", ["line 2: not valid UTF-8"]),
    ("sft_empty.jsonl", "sft", ["file: empty file"]),
    ("sft_duplicate.jsonl", "sft", ["line 3: duplicate of line 1"]),
    ("pairs_chat_unknown_role.jsonl", "preference", ["line 1, column 'chosen': message 2 has unknown role 'narrator'"]),
    ("pairs_chat_no_final_reply.jsonl", "preference",
     ["line 1, column 'rejected': conversation does not end with an assistant reply"]),
    ("pairs_hh_prompts_differ.jsonl", "preference", ["line 1: chosen and rejected continue different prompts"]),
    ("pairs_not_a_list.json", "preference", ["file: expected a JSON list of objects"]),
    ("sft_not_an_object.jsonl", "sft", ["line 2: expected a JSON object, got list"]),
    ("pairs_margin_not_number.jsonl", "preference", ["line 1, column 'margin': wrong type"]),
    ("prompts_blank.jsonl", "prompt", ["line 2, column 'prompt': must not be blank"]),
]

# The demo world's datasets, with the contract each is validated against.
DATASETS = {"sft": "sft", "sft_eval": "sft", "preferences": "preference", "preferences_eval": "preference",
            "prompts": "prompt", "prompts_eval": "prompt"}


AUTO_RESOLVED = {"micro_batch_size": None, "sampling.micro_batch_size": None, "sharded_sampling": "whole"}
"""PPO's `auto` settings as they resolve where everything fits: what a test hands the stage's parts
(`train_ppo` itself resolves `auto`, `stages.memory.plan.with_micro_batches`)."""


def dataset(world: Path, tokenizer, name: str, budget: tuple[int, int] = (32, 64),
            prompt_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """One demo-world dataset, validated under a length budget (prompt, total tokens): the tiny config's by
    default; prompts keep `prompt_columns` (`ppo.reward.columns`)."""
    from schemas.validate import LengthBudget, load_validated

    kind = DATASETS[name]
    return load_validated(str(world / f"{name}.jsonl"), kind, tokenizer=tokenizer, budget=LengthBudget(*budget),
                          columns=prompt_columns if kind == "prompt" else ()).frame


def world_frames(world: Path, tokenizer, budget: tuple[int, int] = (32, 64),
                 prompt_columns: tuple[str, ...] = ()) -> dict[str, pd.DataFrame]:
    """Every demo-world dataset, as `dataset` validates it."""
    return {name: dataset(world, tokenizer, name, budget, prompt_columns) for name in DATASETS}


def close(a: float, b: float, rel: float = 0.005) -> bool:
    """Equal up to float reduction order: the tolerance of the one- against several-process tests."""
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-3)


def sft_inputs(world: Path, tokenizer, model_location: str | None = None):
    """The tiny world's demonstrations, from its base model (or `model_location`)."""
    from stages.sft import SFTInputs

    return SFTInputs(model_location or str(world / "model"), dataset(world, tokenizer, "sft"),
                     dataset(world, tokenizer, "sft_eval"))


def reward_inputs(world: Path, tokenizer, trained: dict):
    """The tiny world's preference pairs, from the session's SFT checkpoint."""
    from stages.reward import RewardInputs

    return RewardInputs(model_location=trained["sft"], policy_location=trained["sft"],
                        train=dataset(world, tokenizer, "preferences"),
                        evaluation=dataset(world, tokenizer, "preferences_eval"),
                        normalization_prompts=dataset(world, tokenizer, "prompts_eval"))


def ppo_inputs(trained: dict, reward: bool = True, teacher: str | None = None):
    """The PPO stage's inputs from the session's checkpoints and prompts (`reward` False: no reward model)."""
    from stages.ppo import PPOInputs

    return PPOInputs(sft_location=trained["sft"], reward_location=trained["reward"] if reward else None,
                     prompts=trained["prompts"], eval_prompts=trained["eval_prompts"], teacher_location=teacher)


def run_ppo(cfg, trained: dict, out: Path, reporting=None):
    """PPO in this process from the session's SFT and reward checkpoints."""
    from stages.common.reporting import Reporting
    from stages.ppo import train_ppo

    inputs = ppo_inputs(trained)
    return train_ppo(cfg, inputs, out, reporting or Reporting())


def killed_and_resumed(cfg, trained: dict, tmp_path: Path, mid_swap: bool = False):
    """An uninterrupted run in `tmp_path/whole`, and a run in `tmp_path/interrupted` killed at iteration
    4 (after its checkpoint at 3), then rerun to the end: (uninterrupted result, resumed result).
    `mid_swap`: killed instead between the two renames of a later save (`write_atomically`), which leaves
    the checkpoint at 3 aside (`state.old`) and the new one staged (`state.tmp`), not in place."""
    from stages.common.reporting import Reporting

    reference = run_ppo(cfg, trained, tmp_path / "whole")

    class Killed(Exception):
        pass

    def die_after_four(figures, iteration):
        if iteration == 4:
            raise Killed

    with pytest.raises(Killed):
        run_ppo(cfg, trained, tmp_path / "interrupted", Reporting(metrics=die_after_four))
    state = tmp_path / "interrupted" / "state"
    assert json.loads((state / "loop.json").read_text())["iteration"] == 3
    if mid_swap:
        state.rename(state.with_name("state.old"))
        (state.with_name("state.tmp")).mkdir()
        (state.with_name("state.tmp") / "policy.safetensors").write_bytes(b"torn")
    messages = []
    resumed = run_ppo(cfg, trained, tmp_path / "interrupted", Reporting(warning=messages.append))
    assert "resumed from the full-state checkpoint after iteration 3" in messages[0]
    return reference, resumed


def train_upstream(cfg, world: Path, frames: dict[str, pd.DataFrame], root: Path) -> tuple[str, str]:
    """Tiny SFT (40 steps) and reward (30 steps) checkpoints, the upstream of the PPO and DPO tests; their paths."""
    from stages.reward import RewardInputs, train_reward
    from stages.sft import SFTInputs, train_sft

    sft = train_sft(cfg.sft.model_copy(update={"max_steps": 40}),
                    SFTInputs(str(world / "model"), frames["sft"], frames["sft_eval"]), root / "sft")
    reward = train_reward(cfg.reward.model_copy(update={"max_steps": 30}),
                          RewardInputs(model_location=str(sft.checkpoint), policy_location=str(sft.checkpoint),
                                       train=frames["preferences"],
                                       evaluation=frames["preferences_eval"],
                                       normalization_prompts=frames["prompts_eval"]), root / "reward")
    return str(sft.checkpoint), str(reward.checkpoint)


TOOL_ANSWER = "warm, calm, kind"
"""What `scripted_tools`' one tool answers (a test may change it)."""


def scripted_tools(row: dict) -> list:
    """`environment.tools` for the scripted-engine tests: one tool, `f`, whose name is short."""

    def f(subject: str = "") -> str:
        """Which adjectives this user likes.

        Args:
            subject: the thing the user asked about.
        """
        return TOOL_ANSWER

    return [f]


AGENT_TOOLS = [{"type": "function", "function": {"name": "f", "description": "Which adjectives this user likes.",
                                                 "parameters": {"type": "object", "properties": {}}}}]
"""The scripted agent's one tool, as an OpenAI SDK user declares it."""


async def scripted_agent(row: dict, client):
    """`environment.agent` for the scripted-engine tests: a plain openai-SDK loop over the tool `f`
    (answering `TOOL_ANSWER`) until a turn calls nothing; a reward of 1, 0.5 on the first turn, and
    the turns it saw as a column. A record's `behaviour` makes it misbehave: `raise`, `sleep` (past its
    time), `silent` (ends without asking), `rewrite` (a fresh conversation, a summary, for its second request)."""
    import asyncio

    from stages.envs.agent import AgentResult

    behaviour = row.get("behaviour")
    if behaviour == "silent":
        return 0.0
    messages, turns = list(row["messages"]), 0
    while True:
        completion = await client.chat.completions.create(model="policy", messages=messages, tools=AGENT_TOOLS)
        message, turns = completion.choices[0].message, turns + 1
        if behaviour == "raise":
            raise RuntimeError("the agent's own bug")
        if behaviour == "sleep":
            await asyncio.sleep(60)
        if not message.tool_calls:
            return AgentResult(reward=1.0, turn_rewards=(0.5,), columns={"agent_turns": turns})
        if behaviour == "rewrite":
            messages = [{"role": "user", "content": "Summary: the user asked about a cat."}]
            continue
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id, "content": TOOL_ANSWER} for call in message.tool_calls]


async def refining_agent(row: dict, client) -> float:
    """`environment.agent` for the PPO test of rewritten histories: a draft, then a fresh context (the
    question and the draft, to improve) for the final answer: every episode that drafts in full has a
    second chain, whatever the policy writes."""
    draft = await client.chat.completions.create(model="policy", messages=row["messages"])
    question, text = row["messages"][-1]["content"], draft.choices[0].message.content
    fresh = [*row["messages"][:-1], {"role": "user", "content": f"{question}\nImprove this draft: {text}"}]
    await client.chat.completions.create(model="policy", messages=fresh)
    return 0.0  # the reward is the config's terms on the final answer


GATE = threading.Event()
"""`gated_tools`' gate (tests/test_continuous_episodes.py opens it once every fast episode has answered)."""
WAIT_S = {"s": 30.0}
"""How long the slow tool waits for the gate before it answers `late` (a test may shorten it)."""


def gated_tools(row: dict) -> list:
    """`environment.tools`: one tool, `f`; in the slow episode it answers only once the gate opens."""
    slow = "slow" in row["messages"][0]["content"]

    def f(subject: str = "") -> str:
        """Which adjectives this user likes.

        Args:
            subject: the thing the user asked about.
        """
        if slow:
            return "in time" if GATE.wait(timeout=WAIT_S["s"]) else "late"
        return TOOL_ANSWER

    return [f]


SYNCED = threading.Event()
"""Set by tests/test_vllm.py's partial-rollout test once the server took the first update's weights."""
SYNC_GATED_CALLS = {"n": 0}
"""How many of `SyncGated`'s answers waited for `SYNCED`."""
GATED = threading.Event()
"""Set by `SyncGated` once a gated episode's first turn is back (sampled before the sync): the test's
sync waits for it, so the new weights never arrive before any such turn was sampled."""


class SyncGated:
    """`environment.factory`: an environment that answers the model's first turn with "Go on." and
    ends after its second; in an episode whose record is marked `ahead_of_sync` (the rollout sampled
    ahead while the first update trains), its answer comes only once `SYNCED` is set, so the
    episode's second turn is sampled by the new weights."""

    def __init__(self, row: dict):
        self.gated, self.turns = bool(row.get("ahead_of_sync")), 0

    def reset(self, row: dict) -> list[dict]:
        return list(row["messages"])

    def step(self, turn) -> tuple:
        self.turns += 1
        if self.turns > 1:
            return None, 0.0, True
        if self.gated:
            SYNC_GATED_CALLS["n"] += 1
            GATED.set()
            SYNCED.wait(timeout=120)
        return [{"role": "user", "content": "Go on."}], 0.0, False


def one_turn_episode(row: dict, engine, tokenizer):
    """`environment.rollout` for the tests: a whole episode by hand, one sampled turn after the prompt."""
    from stages.engines.sampler import Sampling
    from stages.envs.episode import Episode, Segment

    prompt = tokenizer(tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    sampled = engine.generate_ids([prompt], Sampling(8)).responses[0].tolist()
    answer = [i for i in sampled if i != tokenizer.pad_token_id]
    return Episode(segments=[Segment(ids=prompt, trainable=False), Segment(ids=answer, trainable=True, reward=0.5)],
                   answer=tokenizer.decode(answer, skip_special_tokens=True))


TOOLS_OVERRIDES = {
    "demo.task": "tools",
    "sft.max_prompt_length": 64,  # a transcript's conversation before its last answer
    "sft.max_length": 96,
    "ppo.environment": {"tools": "rlhf.demo.tools:tools", "max_turns": 3, "episode_tokens": 64},
    "ppo.sampling.response_length": 24,  # each turn's budget
    "ppo.reward": {"terms": [{"name": "liked", "function": "rlhf.demo.rewards:uses_liked_adjectives"}],
                   "columns": ["liked"]},
    "ppo.advantage_estimator": "grpo",
    "ppo.samples_per_prompt": 2,
}
"""The tiny config on the demo's tool world (`configs/tools.yaml` shrunk): GRPO in multi-turn episodes."""


def tools_upstream(root: Path, **overrides) -> tuple:
    """The tiny tool world and an SFT checkpoint trained (40 steps) on its transcripts: (config, the
    `trained` dict `run_ppo` takes, with no reward model)."""
    from rlhf.config import load_config
    from rlhf.demo.world import build_world
    from stages.runtime.models import load_tokenizer
    from stages.sft import SFTInputs, train_sft

    cfg = load_config("configs/tiny.yaml", TOOLS_OVERRIDES | overrides)
    world = build_world(root / "worlds", cfg.demo)
    frames = world_frames(world, load_tokenizer(str(world / "model")), (64, 96), tuple(cfg.ppo.reward.columns))
    sft = train_sft(cfg.sft.model_copy(update={"max_steps": 40}),
                    SFTInputs(str(world / "model"), frames["sft"], frames["sft_eval"]), root / "sft")
    return cfg, {"sft": str(sft.checkpoint), "reward": None, "prompts": frames["prompts"],
                 "eval_prompts": frames["prompts_eval"], "frames": frames}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster(str):
    """The `ray_cluster` fixture's cluster: its address (what `ray_launch` takes), and its nodes, which a
    test may lose and bring back."""

    def __new__(cls, address: str, env: dict[str, str]):
        cluster = super().__new__(cls, address)
        cluster.env = env
        return cluster

    @property
    def environment(self) -> str:
        """The entry of its processes' environment (Ray's workers and actors among them) that tells them
        from another cluster's: what `processes(environment=...)` takes."""
        return f"RLHF_HOME={self.env['RLHF_HOME']}"

    def lose_node(self, name: str = "worker") -> None:
        """SIGKILL a node's whole session (its raylet and every process under it), as a machine's loss would."""
        import os
        import signal

        pid_file = Path(self.env["RLHF_HOME"]) / "ray" / f"{name}.pid"
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        pid_file.unlink()

    def bring_back(self) -> None:
        """`scripts/ray_cluster.sh up`: a lost worker node joins again."""
        import subprocess

        from rlhf.sections.base import REPO_ROOT

        up = subprocess.run([str(REPO_ROOT / "scripts" / "ray_cluster.sh"), "up"], env=self.env, capture_output=True,
                            text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr


def ray_launch(address: str, **settings):
    """A two-process Ray launch, FSDP2, on the cluster at `address`."""
    from rlhf.sections.base import LaunchConfig

    return LaunchConfig(engine="ray", num_processes=2, accelerate_config="configs/accelerate/fsdp.yaml",
                        ray_address=address, **settings)


def processes(*needles: str, environment: str | None = None) -> list[str]:
    """The command lines (Ray's process titles among them) of the processes whose own holds every one of
    `needles` and, given `environment` (an entry such as "RLHF_HOME=/tmp/x"), whose environment holds it:
    the processes of one test's stack or cluster, not those of a test running beside it. A scope that no
    process on the machine holds is refused: it would hide every process, leftovers included."""
    found, scope_seen = [], environment is None
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if environment is not None:
                if environment.encode() not in (proc / "environ").read_bytes().split(b"\0"):
                    continue
                scope_seen = True
            text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(needle in text for needle in needles):
            found.append(text)
    assert scope_seen, f"no process holds {environment} in its environment: that scope would hide every process"
    return found


def vllm_servers(served_folder_prefix: str = "rlhf-vllm-", environment: str | None = None) -> list[str]:
    """The command lines of the vLLM servers running on a served folder whose path contains
    `served_folder_prefix` (and whose environment holds `environment`, as `processes` reads it)."""
    return processes("vllm.entrypoints.openai.api_server", served_folder_prefix, environment=environment)


def park_after_first_checkpoint(marker: str) -> None:
    """In a child process that runs PPO: park the run inside the iteration after its first
    full-state checkpoint, touching `marker`, so a test's SIGKILL lands mid-iteration with a
    checkpoint to resume from, whatever the machine's speed (polling for the checkpoint raced with
    the run finishing on fast machines)."""
    import stages.ppo
    import stages.rl.rollout

    saved, real_save_state, real_rollout = [], stages.ppo.save_state_everywhere, stages.rl.rollout.rollout

    def save_state(*args, **kwargs):
        saved.append(True)
        return real_save_state(*args, **kwargs)

    def rollout(*args, **kwargs):
        if saved:
            Path(marker).touch()
            time.sleep(3600)
        return real_rollout(*args, **kwargs)

    stages.ppo.save_state_everywhere, stages.rl.rollout.rollout = save_state, rollout


# --- PPO's gradient, as the update accumulates it (tests/test_ppo_gradients.py, tests/test_packing.py) ---


def ppo_gradients(models, accelerator, actor_critic, batch, advantages, returns, cfg,
                  counted=None) -> dict[str, torch.Tensor]:
    """The trained parameters' gradients after accumulating this process's whole rollout as one minibatch."""
    from stages.rl.update import accumulate_gradients

    for parameter in models.trainable():
        parameter.grad = None
    trainer = ppo_trainer(cfg, accelerator, models, actor_critic)
    accumulate_gradients(trainer, ppo_episodes(cfg, batch, advantages, returns, counted),
                         torch.arange(len(batch.responses)), iteration=1)
    from stages.rl.ppo_models import ActorCritic

    # A sharded gradient is gathered whole (collective) to compare it with the one-process gradient.
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in ActorCritic(models).named_parameters() if p.requires_grad}


def ppo_trainer(cfg, accelerator, models, actor_critic, optimizer=None, scheduler=None):
    """What the update reads of a learner; no optimizer where only gradients are wanted."""
    from stages.rl.update import Learner

    return Learner(cfg=cfg, accelerator=accelerator, models=models, actor_critic=actor_critic, optimizer=optimizer,
                   scheduler=scheduler, scaler=torch.amp.GradScaler("cpu", enabled=False))


def prompt_rows(prompts: list[str]) -> list[dict]:
    """Rendered prompts as episodes' records (each its own user message)."""
    return [{"prompt": p, "messages": [{"role": "user", "content": p}]} for p in prompts]


def single_turn_rollout(models, sampler, prompts: list[str], sampling, timings: dict | None = None, sampled=None):
    """`rollout` of one response per rendered prompt; `sampled`: `Generation`s sampled earlier, one per
    chunk, handed back by a source instead of sampling (as a source that samples ahead does)."""
    from stages.rl.rollout import rollout, single_turn

    source = single_turn(models)
    if sampled is not None:
        source = HandedBack(source, list(sampled))
    return rollout(models, sampler, source, prompt_rows(prompts), sampling, {} if timings is None else timings)


class HandedBack:
    """An episode source that hands back `Generation`s sampled earlier, in order, read as `reading`'s single turns."""

    def __init__(self, reading, generations):
        self.reading, self.generations = reading, generations
        self.max_failed_share = 1.0

    def generation(self, sampler, rows, sampling, device, timings):
        return self.reading.batch(self.generations.pop(0), rows)


def ppo_scoring(cfg, models, functions=(), remotes=()):
    """The reward's terms of a single-turn run on one process: the reward model `models` holds, and
    `functions` and `remotes` (none by default)."""
    from accelerate import Accelerator

    from stages.rl.scoring import Scoring

    return Scoring(cfg=cfg, accelerator=Accelerator(cpu=True), models=models, functions=list(functions),
                   remotes=list(remotes), prompts_as_sampled=True)


def plain_scores(reward: torch.Tensor, dropped: torch.Tensor | None = None, **terms: torch.Tensor):
    """`Scores` of a rollout whose reward is `reward` as is (no reward model), `terms` by name, `dropped`
    where a server never scored (none by default)."""
    from stages.rewards.scoring import Scores

    dropped = torch.zeros(len(reward), dtype=torch.bool) if dropped is None else dropped
    return Scores(terms=terms, reward=reward, reported=reward, dropped=dropped, raw={})


def ppo_episodes(cfg, batch, advantages, returns, counted=None):
    """What the update reads of an iteration's episodes (no scores or KL figures): a `TrainingBatch`."""
    from stages.rl.batch import KLWeights, TrainingBatch

    return TrainingBatch.of(batch, scores=plain_scores(torch.zeros(len(batch.responses))),
                            kl=torch.zeros_like(batch.logprobs), advantages=advantages,
                            returns=torch.zeros_like(advantages) if returns is None else returns,
                            engine_weights=torch.ones_like(batch.trainable),
                            counted=batch.trainable if counted is None else counted,
                            kl_weights=KLWeights(beta=0.0, in_reward=0.0, in_loss=cfg.kl.loss_coef))


def ppo_gradient_setup(tiny_config, trained, critic="reward", lora=False, **overrides):
    """A rollout of 8 of the tiny trained models' prompts, its GAE advantages (whitened) and returns, and the
    policy (and critic adapters) moved a step away from it: what the gradient tests accumulate."""
    from rlhf.config import with_overrides
    from rlhf.sections.base import LoRAConfig
    from stages.common.tensors import masked_whiten
    from stages.math.ppo_math import gae, kl_estimate, token_rewards
    from stages.rl.ppo_models import load_models
    from stages.rl.rollout import policy_sampler
    cfg = with_overrides(tiny_config.ppo, AUTO_RESOLVED | {"rollout_batch_size": 8, "num_minibatches": 1,
                                                           "sampling.response_length": 16, "critic.kind": critic,
                                                           "lora": LoRAConfig() if lora else None} | overrides)
    torch.manual_seed(0)
    models = load_models(cfg, trained["sft"], trained["reward"])
    prompts = trained["prompts"].head(8)
    batch = single_turn_rollout(models, policy_sampler(models), list(prompts["prompt"]), cfg.sampling)
    batch = replace(batch, messages=[json.loads(m) for m in prompts["prompt_messages"]])
    scoring = ppo_scoring(cfg, models)
    scores = scoring.scores_of(scoring.raw_scores(batch, {}), batch, {}, {})  # on the checkpoint's own normalisation
    lengths = batch.mask.sum(1)
    assert lengths.min() < lengths.max(), "responses of equal length would not tell the normalisations apart"
    rewards = token_rewards(scores.reward, kl_estimate(batch.logprobs, batch.ref_logprobs) * batch.mask, 0.05,
                            batch.mask)
    advantages, returns = gae(rewards, batch.values, batch.mask, 1.0, 0.95)
    # A step away from the rollout policy, so ratios differ from 1 and some tokens are clipped; and from
    # the critic's fresh adapters, whose B = 0 would leave their A without a gradient.
    with torch.no_grad():
        for parameter in models.policy.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
        for parameter in getattr(models.critic, "adapters", torch.nn.Module()).parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return cfg, models, batch, masked_whiten(advantages, batch.mask), returns


def judge_app(answer: str = "I'd say 7 out of 10.") -> tuple[FastAPI, list[dict]]:
    """An OpenAI-compatible judge that answers every chat request with `answer`, and the requests it was asked."""
    asked: list[dict] = []
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny-judge", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> dict:
        asked.append(await request.json())
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}

    return app, asked


def scoring_app() -> tuple[FastAPI, list[str | None]]:
    """A scoring server as a `remote` term of kind `score` reads one (a score in [0, 1] from each response's
    length), and the `Authorization` header of each batch it was sent."""
    authorized: list[str | None] = []
    app = FastAPI()

    @app.get("/score")
    async def ready() -> dict:
        return {"ok": True}

    @app.post("/score")
    async def score(request: Request) -> dict:
        authorized.append(request.headers.get("authorization"))
        return {"scores": [len(response) % 5 / 4 for response in (await request.json())["responses"]]}

    return app, authorized


@contextmanager
def served_in_thread(app, host: str = "127.0.0.1") -> Iterator[str]:
    """`app` (ASGI) served by uvicorn on a thread of this process, on a free port of `host`: its base URL.
    Another loopback address (127.0.0.2) is this machine to the socket but not to a client's `LOOPBACK`."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://{host}:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_until_healthy(process, url: str, timeout_s: float, log=lambda: "") -> None:
    """Until `url` (a server's health route) answers 200: failing with `log()` if `process` exits
    first, or when `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"{process.args[:3]} exited ({process.returncode}) while starting:\n{log()}"
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer within {timeout_s:g} s:\n{log()}"
        time.sleep(0.3)


class SandboxDown:
    """An environment (`environment.factory: tests.helpers:sandbox_down`) that cannot start, nor step: every
    episode fails whatever the policy writes (a turn cut off before it ends would never reach `step`, and
    how many are cut depends on the checkpoint, which differs between CPU vendors)."""

    def reset(self, row: dict) -> list[dict]:
        raise RuntimeError("the sandbox is down")

    def step(self, turn):
        raise RuntimeError("the sandbox is down")


def sandbox_down(row: dict) -> SandboxDown:
    return SandboxDown()


def kill_points(saved: Path, target: Path) -> Iterator[str]:
    """Every state a SIGKILL during the save of `saved` (a checkpoint folder its trainer wrote file by file)
    can leave in `target`: the files written before the kill whole, the one being written not begun or cut
    in half, in the order the save wrote them (by modification time; `trainer_state.json`, which the
    trainer writes last, last). Yields a description of each, with the state in place."""
    files = sorted((path for path in saved.rglob("*") if path.is_file()),
                   key=lambda path: (path.name == "trainer_state.json", path.stat().st_mtime_ns))
    for count, current in enumerate(files):
        for cut in (False, True):
            shutil.rmtree(target, ignore_errors=True)
            for earlier in files[:count]:
                (target / earlier.relative_to(saved)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(earlier, target / earlier.relative_to(saved))
            if cut:
                (target / current.relative_to(saved)).parent.mkdir(parents=True, exist_ok=True)
                data = current.read_bytes()
                (target / current.relative_to(saved)).write_bytes(data[:len(data) // 2])
            target.mkdir(parents=True, exist_ok=True)
            yield f"{current.relative_to(saved)} {'half written' if cut else 'not begun'}"


def resumes_past_torn_saves(train, cut: Path, whole: Path, done: int, torn: int) -> tuple[list[str], object, list]:
    """A run `cut` whose trainer checkpoint is at step `done`, swept through every kill point of the save
    at step `torn` (`kill_points`, from the uninterrupted run `whole`'s): every one resumes from
    `checkpoint-{done}`. Then `train(reporting)` resumes from the last one (its trainer state half
    written, which transformers' own `get_last_checkpoint` takes) and warns that it passed it over.
    Returns (the kill points swept, the resumed run's result, the (step, metrics) it logged)."""
    from transformers.trainer_utils import get_last_checkpoint

    from stages.common.reporting import Reporting
    from stages.runtime.training import last_trainer_checkpoint

    swept = []
    for point in kill_points(whole / "trainer" / f"checkpoint-{torn}", cut / "trainer" / f"checkpoint-{torn}"):
        chosen = last_trainer_checkpoint(cut, Reporting())
        assert chosen == str(cut / "trainer" / f"checkpoint-{done}"), (point, chosen)
        swept.append(point)
    assert get_last_checkpoint(str(cut / "trainer")).endswith(f"checkpoint-{torn}")  # what a retry took before
    warnings, steps = [], []
    resumed = train(Reporting(warning=warnings.append, metrics=lambda metrics, step: steps.append((step, metrics))))
    assert any(f"checkpoint-{torn} is passed over for the resume: its trainer_state.json is missing or torn" in w
               for w in warnings), warnings
    return swept, resumed, steps


def serve_process(command: list[str]):
    """`command` (a server with `--port N`) started in a session of its own, once its /health answers."""
    import subprocess

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    port = command[command.index("--port") + 1]
    wait_until_healthy(process, f"http://127.0.0.1:{port}/health", 120, lambda: process.stdout.read())
    return process


def stop_process(process) -> None:
    """Stop a `serve_process` server and its session: SIGTERM, then SIGKILL after 30 s."""
    import os
    import signal
    import subprocess

    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class TwoArgumentError(Exception):
    """An environment's own error whose constructor takes two arguments and passes one up: it pickles,
    and does not unpickle (as many libraries' errors)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class ServedFaults:
    """`environment.factory: tests.helpers:served_faults`, served by `rlhf serve-env` for the environment
    server's fault tests: the demo world's tool for its records (with `liked`), `scripted_tools`' for
    others, and a record's `fault` column says what goes wrong:
    `slow` (every step waits `SLOW_STEP_S`), `malformed` (a step answers messages without a role) or
    `counter` (a step's answer counts the steps this process took: not the same when replayed) or
    `rewrite` (a call is answered with a rewritten history: `Step.restart`) or `raise` (a step raises
    `TwoArgumentError`).
    `RLHF_TEST_DIE_AFTER_STEPS=N` ends the server's process in the middle of its N-th step."""

    steps = 0

    def __init__(self, row: dict):
        from rlhf.demo.tools import tools
        from rlhf.sections.environment import EnvironmentConfig
        from stages.envs.environment import ToolEnvironment

        self.fault = row.get("fault")
        self.tools = ToolEnvironment(tools(row) if "liked" in row else scripted_tools(row),
                                     EnvironmentConfig(tools="tests.helpers:scripted_tools"))

    def reset(self, row: dict) -> list[dict]:
        return self.tools.reset(row)

    def schemas(self) -> list[dict]:
        return self.tools.schemas()

    def step(self, turn):
        import os

        if self.fault == "raise":
            raise TwoArgumentError(7, "the environment failed")
        type(self).steps += 1
        if type(self).steps == int(os.environ.get("RLHF_TEST_DIE_AFTER_STEPS", 0)):
            os._exit(1)  # the server dies mid-request, as a killed process does
        if self.fault == "slow":
            time.sleep(SLOW_STEP_S)
        if self.fault == "malformed":
            return [{"content": "no role"}], 0.0, False
        if self.fault == "counter":
            return [{"role": "tool", "content": str(type(self).steps)}], 0.0, False
        if self.fault == "rewrite" and turn.calls:
            from stages.envs.environment import Step

            return Step([{"role": "user", "content": "Summary: a cat. Answer now."}], 0.0, False, restart=True)
        return self.tools.step(turn)


SLOW_STEP_S = 8.0
"""How long a `slow` record's step takes (`ServedFaults`)."""


def served_faults(row: dict) -> ServedFaults:
    return ServedFaults(row)


def serve_env(*args: str, environment: dict | None = None):
    """`rlhf serve-env ARGS` on a free port of 127.0.0.1 (or `--port`'s), started in a session of its own
    once it answers, its output in a temporary file: (the process, its URL). Stop it with `stop_process`."""
    import os
    import subprocess
    import tempfile

    port = args[args.index("--port") + 1] if "--port" in args else str(free_port())
    log = tempfile.NamedTemporaryFile("w+", prefix="rlhf-serve-env-", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-env", *args,
                                *(() if "--port" in args else ("--port", port))],
                               stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env=os.environ | (environment or {}))
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(process, url + "/health", 180, lambda: Path(log.name).read_text()[-3000:])
    return process, url


TOOL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}<|system|>{{ message['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The demo template with a `tool` role (shown under the system marker: the tiny world's tokenizer has no tool one)."""


class Scripted:
    """An engine that answers every turn with fixed text, encoded once: the same ids whatever the context."""

    concurrent = False

    def most(self, value: int) -> int:
        return value

    def __init__(self, tokenizer, turns: list[str], end: bool = True):
        self.tokenizer, self.calls, self.prompts = tokenizer, 0, []
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if end else [])
                      for t in turns]

    def generate_ids(self, prompts: list[list[int]], sampling):
        from stages.engines.sampler import Generation
        from stages.runtime.models import left_padded_ids

        self.prompts.append([list(p) for p in prompts])
        ids = self.turns[self.calls][:sampling.max_new_tokens]
        self.calls += 1
        batch = left_padded_ids(prompts, self.tokenizer.pad_token_id, torch.device("cpu"))
        return Generation(queries=batch["input_ids"], query_mask=batch["attention_mask"],
                          responses=torch.tensor([ids] * len(prompts)))


def cpu_seconds(call, argument, repeats: int = 1) -> float:
    """The least CPU time this thread spent on `call(argument)` over `repeats` calls: the work itself, not the
    waits for a core that a loaded machine adds to the wall clock (a linear-time bound of 0.5 s, timed on the
    wall clock, failed at 0.5003 s beside the suite's other worker)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        call(argument)
        best = min(best, time.thread_time() - started)
    return best
