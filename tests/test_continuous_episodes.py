"""When episodes take their turns (`environment.schedule`, `stages.envs.loop`). Continuously, each
episode takes its next turn as soon as its environment answered, so a slow tool holds only its own
episode; where nothing is slow the episodes are the rounds' own; and a turn drawn from its episode's
own stream does not depend on which episodes share its batch. In rounds on a sharded policy, a
process whose episodes ended steps on a placeholder while another's sample."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from rlhf.config import with_overrides
from rlhf.sections.environment import EnvironmentConfig
from stages.engines.sampler import Generation
from stages.envs.loop import episode_runner
from stages.runtime.models import left_padded_ids
from tests.helpers import AUTO_RESOLVED, GATE, TOOL_TEMPLATE, WAIT_S

CALL = '<tool_call>{"name":"f"}</tool_call>'
class ByEpisode:
    """A scripted engine that answers each episode by its own script, turn by turn, from any thread
    (`concurrent`: as a server does). It records each call's (episode, turn)s and opens the gate once
    every episode but the slow one has sampled its last scripted turn."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], concurrent: bool):
        self.tokenizer, self.scripts, self.concurrent = tokenizer, scripts, concurrent
        self.calls: list[list[tuple[str, int]]] = []
        self.done: set[str] = set()
        self.lock = threading.Lock()

    def most(self, value: int) -> int:
        return value

    def generate_ids(self, prompts: list[list[int]], sampling) -> Generation:
        rows, called = [], []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            name = next(name for name in self.scripts if f"the {name} cat" in text)
            turn = text.count("<|assistant|>") - 1  # the generation prompt of every turn so far, this one's too
            script = self.scripts[name]
            rows.append(self.tokenizer(script[turn], add_special_tokens=False)["input_ids"]
                        + [self.tokenizer.eos_token_id])
            called.append((name, turn))
            if turn == len(script) - 1 and name != "slow":
                with self.lock:
                    self.done.add(name)
                    if self.done >= set(self.scripts) - {"slow"}:
                        GATE.set()
        with self.lock:
            self.calls.append(called)
        width = max(len(r) for r in rows)
        batch = left_padded_ids(prompts, self.tokenizer.pad_token_id, torch.device("cpu"))
        return Generation(queries=batch["input_ids"], query_mask=batch["attention_mask"],
                          responses=torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows]))


@pytest.fixture()
def chat_tokenizer(tokenizer):
    mine = copy.deepcopy(tokenizer)
    mine.chat_template = TOOL_TEMPLATE
    return mine


def _rows(names):
    return [{"messages": [{"role": "user", "content": f"Describe the {name} cat."}]} for name in names]


def _run(tokenizer, engine, names, **settings):
    config = EnvironmentConfig(tools="tests.helpers:gated_tools", episode_tokens=200, **settings)
    return episode_runner(config, tokenizer, "test-model", [tokenizer.eos_token_id], 48).run(engine, _rows(names), 1.0)


@pytest.mark.parametrize("concurrent", [False, True], ids=["batched-here", "server"])
def test_a_slow_tool_holds_only_its_own_episode(chat_tokenizer, concurrent):
    """Three episodes call the tool, then answer. The slow episode's tool answers only after both fast
    episodes have sampled their answers: continuously they do, so it answers in time, and its own
    answer is the last turn sampled."""
    GATE.clear()
    scripts = {name: [CALL, "It is warm."] for name in ("slow", "quick", "swift")}
    engine = ByEpisode(chat_tokenizer, scripts, concurrent)
    slow, quick, swift = _run(chat_tokenizer, engine, scripts, schedule="continuous", concurrent_episodes=3)
    assert slow.messages[2]["content"] == "in time"
    assert all(e.status == "ok" and e.turns == 2 for e in (slow, quick, swift))
    answers = [name for call in engine.calls for name, turn in call if turn == 1]
    assert answers[-1] == "slow" and sorted(answers) == ["quick", "slow", "swift"]


def test_in_rounds_a_slow_tool_holds_every_episode(chat_tokenizer):
    """The same episodes in rounds: the second round waits for every tool, the slow one included, so
    the gate never opens before its tool gives up; all three answers are sampled in one call."""
    GATE.clear()
    WAIT_S["s"] = 0.5
    try:
        scripts = {name: [CALL, "It is warm."] for name in ("slow", "quick", "swift")}
        engine = ByEpisode(chat_tokenizer, scripts, concurrent=False)
        slow, *_ = _run(chat_tokenizer, engine, scripts, schedule="rounds", concurrent_episodes=3)
    finally:
        WAIT_S["s"] = 30.0
    assert slow.messages[2]["content"] == "late"
    assert engine.calls[1] == [("slow", 1), ("quick", 1), ("swift", 1)]


@pytest.mark.parametrize("concurrent", [False, True], ids=["batched-here", "server"])
def test_where_nothing_is_slow_the_episodes_are_the_rounds_own(chat_tokenizer, concurrent):
    """Episodes of different lengths (two calls, one call, a malformed call, an answer at once, one
    that runs out of turns): continuously they have the rounds' segments, statuses, rewards and messages."""
    GATE.set()
    scripts = {"calm": [CALL, CALL, "It is calm."], "warm": [CALL, "It is warm."],
               "odd": ["<tool_call>{oops</tool_call>", "It is odd."], "kind": ["It is kind."],
               "busy": [CALL, CALL, CALL, CALL, CALL]}
    rounds = _run(chat_tokenizer, ByEpisode(chat_tokenizer, scripts, False), scripts, schedule="rounds")
    continuous = _run(chat_tokenizer, ByEpisode(chat_tokenizer, scripts, concurrent), scripts,
                      schedule="continuous", concurrent_episodes=2)
    assert [e.status for e in rounds] == ["ok", "ok", "ok", "ok", "truncated"]
    for a, b in zip(rounds, continuous, strict=True):
        assert a.segments == b.segments and a.status == b.status and a.messages == b.messages
        assert a.tool_calls == b.tool_calls and a.answer == b.answer


def test_a_turn_drawn_from_its_own_stream_is_the_same_whatever_shares_its_batch(trained):
    """`Sampling.seeds` on transformers' decode loop: a prompt's response with its seed is the same
    alone, beside another prompt, or after it; without seeds the draws come from the shared stream."""
    from stages.engines.sampler import HFSampler, Sampling
    from stages.runtime.models import load_causal_lm, load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(trained["sft"], padding_side="left")
    model = load_causal_lm(trained["sft"], tokenizer).eval()
    sampler = HFSampler(model=model, tokenizer=tokenizer, stop_ids=stop_token_ids(model), compact=True)
    a, b = (tokenizer(p, add_special_tokens=False)["input_ids"] for p in trained["prompts"]["prompt"].head(2))

    def response(generation: Generation, row: int) -> list[int]:
        return [t for t in generation.responses[row].tolist() if t != tokenizer.pad_token_id]

    alone = response(sampler.generate_ids([a], Sampling(24, 1.0, seeds=(11,))), 0)
    beside = sampler.generate_ids([a, b], Sampling(24, 1.0, seeds=(11, 12)))
    after = sampler.generate_ids([b, a], Sampling(24, 1.0, seeds=(12, 11)))
    assert response(beside, 0) == alone == response(after, 1)
    assert response(beside, 1) == response(after, 0)
    torch.manual_seed(0)
    shared = [response(sampler.generate_ids([a, a], Sampling(24, 1.0)), row) for row in (0, 1)]
    assert shared[0] != shared[1]  # one stream: the two rows draw different numbers


def test_ppo_trains_in_continuous_episodes_on_the_tool_world(tools_trained, tmp_path):
    """The stage with `schedule: continuous` on the demo's tool world: turns, tool calls and the
    evaluation's figures as in rounds, and a rerun with the same seed repeats them."""
    from tests.helpers import run_ppo

    cfg, trained = tools_trained
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {
        "advantage_estimator": "grpo", "samples_per_prompt": 2,
        "environment": {"schedule": "continuous", "concurrent_episodes": 4}})
    first = run_ppo(ppo, trained, tmp_path / "first")
    again = run_ppo(ppo, trained, tmp_path / "again")
    last = first.history[-1]
    assert last["rollout/turns"] >= 1 and "eval/tool_call_rate" in first.metrics
    assert [row["rollout/tool_calls"] for row in first.history] == [row["rollout/tool_calls"] for row in again.history]


def test_in_rounds_a_process_whose_episodes_ended_steps_on_a_placeholder_while_another_samples(chat_tokenizer):
    """A sharded policy samples collectively (`Sampler.most`, an all-reduce there): here the other
    process still has episodes for two more rounds after this one's answered at once. This process
    takes those two rounds' decode calls on a placeholder row, under the others' budget, and its own
    episode is what it would have been alone."""
    GATE.set()
    scripts = {"kind": ["It is kind."]}

    class Sharded(ByEpisode):
        other = [90, 60, 30]  # the other process's roomiest episode, round by round

        def most(self, value: int) -> int:
            return max(value, self.other.pop(0) if self.other else 0)

    alone = _run(chat_tokenizer, ByEpisode(chat_tokenizer, scripts, False), scripts, schedule="rounds")
    engine = Sharded(chat_tokenizer, scripts, False)
    together = _run(chat_tokenizer, engine, scripts, schedule="rounds")
    assert [len(call) for call in engine.calls] == [1, 1, 1]
    assert together[0].segments == alone[0].segments and together[0].status == "ok"


def test_each_turn_keeps_its_version_and_an_episodes_staleness_is_its_oldest_turns():
    """Hand-worked: episodes trained from v3. A single turn by v2: staleness 1. An episode continued
    across two syncs (turns by v1, v2, v3): staleness 2, of mixed versions; its context segment's
    version (0, never sampled) counts for nothing. The iteration: largest 2, mean (1 + 2 + 0) / 3 = 1,
    mixed share 1/3."""
    from stages.envs.ahead import staleness_figures
    from stages.envs.episode import Episode, Segment

    def turn(version: int) -> Segment:
        return Segment(ids=[5, 3], trainable=True, version=version)

    prompt, context = Segment(ids=[1, 2], trainable=False), Segment(ids=[7], trainable=False)
    single = Episode(segments=[prompt, turn(2)])
    continued = Episode(segments=[prompt, turn(1), context, turn(2), context, turn(3)])
    fresh = Episode(segments=[prompt, turn(3)])
    assert staleness_figures([single, continued, fresh], trained=3) == {
        "rollout/staleness": 2.0, "rollout/staleness_mean": 1.0, "rollout/mixed_version_share": 1 / 3}


def test_the_servers_gate_holds_a_reload_until_the_requests_in_flight_are_answered_and_new_ones_after_it():
    """`VLLMSampler`'s gate: a sync (`closed`) waits for the request in flight; a request sent while
    it is closed waits until it reopens, so no response is drawn across a reload."""
    from stages.engines.vllm_server import Gate

    gate, events = Gate(), []
    in_flight, answer = threading.Event(), threading.Event()

    def request(name: str, hold: threading.Event | None = None) -> None:
        with gate.request():
            events.append(f"{name} sent")
            in_flight.set()
            if hold is not None:
                hold.wait(5)
            events.append(f"{name} answered")

    def sync() -> None:
        with gate.closed():
            events.append("reload")
            late.start()
            time.sleep(0.2)  # the late request is held back meanwhile
            events.append("reloaded")

    first = threading.Thread(target=request, args=("first", answer))
    late = threading.Thread(target=request, args=("late",))
    first.start()
    in_flight.wait(5)
    syncing = threading.Thread(target=sync)
    syncing.start()
    time.sleep(0.2)
    assert events == ["first sent"]  # the sync waits for the request in flight
    answer.set()
    for thread in (first, syncing, late):
        thread.join(5)
    assert events == ["first sent", "first answered", "reload", "reloaded", "late sent", "late answered"]
