"""Environments behind HTTP (`environment.server`, `rlhf serve-env`): an episode on a served
environment is the in-process one, token for token; a step asked again gets its answer again; a
server that restarted has its episodes replayed; a slow, malformed or dead server costs an episode
or nothing, never the run; the demo's tool world written as a verifiers environment trains."""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from rlhf.config import with_overrides
from rlhf.sections.environment import EnvironmentConfig, EnvironmentServerConfig
from servers.env_server import EpisodeServer, OursServed
from stages.envs.answering import Batched, OneByOne
from stages.envs.loop import episode_runner
from stages.envs.parsers import AssistantTurn, ToolCall
from stages.envs.remote.served import (
    EnvironmentServer,
    EpisodeRequestFailed,
    ServedEpisode,
    served_environment,
    server_problems,
)
from tests import helpers
from tests.helpers import AUTO_RESOLVED, SLOW_STEP_S, TOOL_TEMPLATE, Scripted, serve_env, stop_process

REPO = Path(__file__).resolve().parent.parent
CALL = '<tool_call>{"name":"f"}</tool_call>'
ROW = {"messages": [{"role": "user", "content": "Describe the cat."}]}
CAT = {"messages": [{"role": "user", "content": "Describe my cat."}], "liked": "warm calm kind"}
CAT_SCRIPT = ['<tool_call>{"name": "preferences", "arguments": {"subject": "cat"}}</tool_call>',
              "The cat is warm and calm."]
"""A demo-world episode and the model's turns in it: a call of the tool, then an answer both rules score (2.0)."""
IN_PROCESS = EnvironmentConfig(tools="rlhf.demo.tools:tools", episode_tokens=300)
pytestmark = pytest.mark.multiprocess
VERIFIERS = REPO / ".env-verifiers" / ".installed"


@pytest.fixture()
def chat_tokenizer(tokenizer):
    mine = copy.deepcopy(tokenizer)
    mine.chat_template = TOOL_TEMPLATE
    return mine


@pytest.fixture(scope="module")
def faults_server():
    """`tests.helpers:served_faults` served by `rlhf serve-env` in its own process."""
    process, url = serve_env("--kind", "ours", "--factory", "tests.helpers:served_faults")
    yield url
    stop_process(process)


def _served(url: str, **settings) -> EnvironmentConfig:
    return EnvironmentConfig(server=EnvironmentServerConfig(url=url, **settings), episode_tokens=300)


def _runner(tokenizer, settings: EnvironmentConfig, turn_tokens: int = 48):
    return episode_runner(settings, tokenizer, "test-model", [tokenizer.eos_token_id], turn_tokens)


def test_an_episode_on_a_served_environment_is_the_in_process_one(chat_tokenizer, faults_server):
    """The same scripted turns against the tools in the trainer's process and served: the same ids
    (prompt, the model's turns, the tool's answers as the template's delta), rewards and transcript."""
    script = [CALL, "The cat is warm."]
    here = _runner(chat_tokenizer, EnvironmentConfig(tools="tests.helpers:scripted_tools", episode_tokens=200))
    served = _runner(chat_tokenizer, _served(faults_server))
    [a] = here.run(Scripted(chat_tokenizer, script), [ROW], 1.0)
    [b] = served.run(Scripted(chat_tokenizer, script), [ROW], 1.0)
    assert b.status == a.status == "ok" and b.tool_calls == a.tool_calls == 1
    assert [(s.ids, s.trainable, s.reward) for s in b.segments] == [(s.ids, s.trainable, s.reward) for s in a.segments]
    assert b.messages == a.messages and b.answer == a.answer
    assert httpx.get(faults_server).json()["episodes"] == 0  # closed once over


def test_a_rounds_requests_go_as_one_batch_and_a_batch_answers_each_item_as_alone(chat_tokenizer):
    """`rounds` on a server that takes batches: four episodes of two turns cost four requests (the resets,
    each round's steps, the closes), not sixteen, and are the episodes of one request each; in a batch an
    unknown episode is a 404 of its own, a turn out of order a 400, the others answered."""
    server = EpisodeServer(("127.0.0.1", 0), OursServed(None, "tests.helpers:served_faults", [], {}), None, 600.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        batched = _runner(chat_tokenizer, _served(url))
        assert isinstance(batched.answering, Batched)
        script = [CALL, "The cat is warm."]
        before = server.counters()["requests"]
        a = batched.run(Scripted(chat_tokenizer, script), [ROW] * 4, 1.0)
        assert server.counters()["requests"] - before == 4 and not server.episodes
        b = replace(batched, answering=OneByOne(4)).run(Scripted(chat_tokenizer, script), [ROW] * 4, 1.0)
        assert [e.status for e in a] == [e.status for e in b] == ["ok"] * 4
        assert [[(s.ids, s.reward) for s in e.segments] for e in a] == [[(s.ids, s.reward) for s in e.segments]
                                                                           for e in b]
        client = EnvironmentServer(EnvironmentServerConfig(url=url))
        [started] = client.batch("/reset_many", [ROW], 1)
        turn = {"content": "A cat.", "calls": []}
        steps = [{"episode": "gone", "turn": 0, "assistant": turn}, {"episode": started["episode"], "turn": 5,
                                                                    "assistant": turn},
                 {"episode": started["episode"], "turn": 0, "assistant": turn}]
        results = client.request("POST", "/step_many", {"steps": steps, "timeout_s": 10})["results"]
        assert [r["status"] for r in results] == [404, 400, 200] and results[2]["answer"]["done"]
        lost, refused, answer = client.batch("/step_many", steps, 2)  # as the runner reads them
        assert lost is None and isinstance(refused, EpisodeRequestFailed) and answer["done"]
    finally:
        server.shutdown()
        server.server_close()


class _Sleepy:
    """A served environment whose every step takes `STEP_S`, counting the steps under way at once."""

    serves, name, STEP_S = "ours", "sleepy", 0.4

    def __init__(self):
        self.lock, self.now, self.most, self.steps = threading.Lock(), 0, 0, 0

    def dataset(self, split: str) -> None:
        return None

    def start(self, row: dict):
        return None, [{"role": "user", "content": "Wait."}], None

    def step(self, handle, assistant: dict):
        with self.lock:
            self.now, self.steps = self.now + 1, self.steps + 1
            self.most = max(self.most, self.now)
        time.sleep(self.STEP_S)
        with self.lock:
            self.now -= 1
        return SimpleNamespace(messages=None, reward=1.0, done=True, restart=False)

    def end(self, handle) -> None:
        pass


def test_every_batch_together_takes_the_servers_threads_and_a_batch_with_none_free_is_refused():
    """Batches' items run on the server's batch threads, as many as its connections (two here) for every
    batch together: two batches at once never step more than two episodes side by side, whatever their
    `at_once`; the second, with no thread free within its `timeout_s`, answers each item 503 (counted),
    steps nothing, and its items go through once sent again. An item not begun by its batch's time
    never begins (503)."""
    from servers.guarded import Caps

    sleepy = _Sleepy()
    server = EpisodeServer(("127.0.0.1", 0), sleepy, None, 600.0, Caps(max_connections=2))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = EnvironmentServer(EnvironmentServerConfig(url=f"http://127.0.0.1:{server.server_port}"))
        episodes = [e["episode"] for e in client.batch("/reset_many", [ROW] * 7, 7)]
        steps = [{"episode": e, "turn": 0, "assistant": {"content": "Done.", "calls": []}} for e in episodes]
        first = threading.Thread(target=lambda: client.request("POST", "/step_many", {
            "steps": steps[:4], "at_once": 4, "timeout_s": 30}))
        first.start()
        time.sleep(0.1)  # the first batch's items hold both threads now
        late = client.request("POST", "/step_many", {"steps": steps[4:6], "at_once": 2, "timeout_s": 0.2})
        first.join()
        assert [r["status"] for r in late["results"]] == [503, 503]
        assert (sleepy.most, sleepy.steps) == (2, 4)
        assert server.info()["refused"]["batch_threads"] == 1
        # One thread, three items, half a step's time: the first is under way (504, and it goes on), the
        # next two never begin (503: the client sends them again alone).
        short = client.request("POST", "/step_many", {"steps": steps[4:], "at_once": 1,
                                                       "timeout_s": 0.5 * _Sleepy.STEP_S})["results"]
        assert [r["status"] for r in short] == [504, 503, 503]
        time.sleep(3 * _Sleepy.STEP_S)
        assert sleepy.steps == 5
        assert all(r["done"] for r in client.batch("/step_many", steps[5:], 2))  # turn 0 still theirs: never stepped
    finally:
        server.shutdown()
        server.server_close()


def test_episodes_spread_over_worker_processes_and_a_dead_worker_fails_only_its_own(monkeypatch):
    """`--workers 2`: a new episode starts in the worker process holding the fewest and is answered
    there (a `counter` episode counts the steps of its own process); a worker that dies mid-step fails
    that step and its episodes' later calls (422, naming the worker), while the other worker's
    episodes go on and new episodes start there. Closing an episode of the dead worker is no error.
    What the environment raises crosses as itself where it is Python's own (a TypeError: 400), else by
    its name and message (422), even where it would not unpickle."""
    import functools

    from servers.spread import Spread

    monkeypatch.setenv("RLHF_TEST_DIE_AFTER_STEPS", "3")  # each worker dies in its third step
    spread = Spread(functools.partial(OursServed, None, "tests.helpers:served_faults", [], {}), 2)
    server = EpisodeServer(("127.0.0.1", 0), spread, None, 600.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = EnvironmentServer(EnvironmentServerConfig(url=f"http://127.0.0.1:{server.server_port}"))
        counting = {**ROW, "fault": "counter"}
        a, b = (client.request("POST", "/reset", {"row": counting})["episode"] for _ in range(2))

        def step(episode: str, turn: int) -> str:
            answer = client.request("POST", "/step", {"episode": episode, "turn": turn,
                                                      "assistant": {"content": "Go on.", "calls": []}})
            return answer["messages"][0]["content"]

        raising = client.request("POST", "/reset", {"row": {**ROW, "fault": "raise"}})["episode"]  # worker 0's
        with pytest.raises(EpisodeRequestFailed, match="HTTP 422.*TwoArgumentError: the environment failed"):
            step(raising, 0)
        with pytest.raises(EpisodeRequestFailed, match="HTTP 400.*TypeError"):
            client.request("POST", "/step", {"episode": a, "turn": 0, "assistant": {"calls": 5}})
        with pytest.raises(EpisodeRequestFailed, match=r"HTTP 400.*call 0 of the turn has keys \['name'\]"):
            client.request("POST", "/step", {"episode": a, "turn": 0, "assistant": {"calls": [{"name": "f"}]}})
        client.request("POST", "/close", {"episode": raising})
        assert [step(a, 0), step(b, 0), step(a, 1)] == ["1", "1", "2"]  # in one process: 1, 2, 3
        [pid_a, pid_b] = [w.process.pid for w in spread.workers]
        with pytest.raises(EpisodeRequestFailed, match=f"HTTP 422.*worker process 0 \\(pid {pid_a}\\) exited"):
            step(a, 2)  # worker 0's third step: it dies in it
        with pytest.raises(EpisodeRequestFailed, match="HTTP 422.*worker process 0"):
            step(a, 2)
        c = client.request("POST", "/reset", {"row": counting})["episode"]
        assert step(c, 0) == "2"  # the live worker's second step
        with pytest.raises(EpisodeRequestFailed, match=f"HTTP 422.*worker process 1 \\(pid {pid_b}\\) exited"):
            step(b, 1)
        with pytest.raises(EpisodeRequestFailed, match="HTTP 422.*every worker process exited"):
            client.request("POST", "/reset", {"row": counting})
        assert all(client.request("POST", "/close", {"episode": e}) == {} for e in (a, b, c))
        assert server.info()["failed"] == 5 and server.info()["episodes"] == 0
    finally:
        server.shutdown()
        server.server_close()
        spread.close()


def test_a_step_asked_again_is_answered_again_and_a_lost_episode_is_replayed():
    """A step sent twice (a retry after a lost answer) is one step; a server that forgot the episode
    (restarted) gets it replayed and goes on; a replay answered differently fails the episode."""
    server = EpisodeServer(("127.0.0.1", 0), OursServed(None, "tests.helpers:served_faults", [], {}), None, 600.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = EnvironmentServer(EnvironmentServerConfig(url=f"http://127.0.0.1:{server.server_port}"))
        call = AssistantTurn(text=CALL, content="", calls=[ToolCall("f", {})])
        episode = ServedEpisode(client)
        episode.reset(ROW)
        first = episode.step(call)
        again = client.request("POST", "/step", {"episode": episode.episode, "turn": 0,
                                                 "assistant": {"calls": [], "content": "other"}})
        assert again == {"messages": first.messages, "reward": first.reward, "done": first.done, "restart": False}
        assert episode.retries == 0
        server.episodes.clear()  # the server restarted
        assert episode.step(call) == first and len(episode.history) == 2
        assert episode.retries == 1  # the replay, counted once (`rollout/environment_retries`)
        counting = ServedEpisode(client)
        counting.reset({**ROW, "fault": "counter"})
        counting.step(call)
        server.episodes.clear()
        with pytest.raises(EpisodeRequestFailed, match="turn 0 was answered differently"):
            counting.step(call)
    finally:
        server.shutdown()
        server.server_close()


def test_a_served_environment_may_rewrite_the_history(chat_tokenizer):
    """A step answered with `restart` crosses the protocol: the episode goes on in a second chain."""
    server = EpisodeServer(("127.0.0.1", 0), OursServed(None, "tests.helpers:served_faults", [], {}), None, 600.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = _served(f"http://127.0.0.1:{server.server_port}")
        [episode] = _runner(chat_tokenizer, settings, 48).run(Scripted(chat_tokenizer, [CALL, "A cat."]),
                                                              [{**ROW, "fault": "rewrite"}], 1.0)
        assert episode.status == "ok" and episode.rewritten_contexts == 1, episode.error
        assert "Summary: a cat." in chat_tokenizer.decode(episode.segments[2].ids)
    finally:
        server.shutdown()
        server.server_close()


def test_episodes_a_stopped_client_left_open_are_let_go_once_idle():
    """A cancelled run never closes its episodes: the server lets them go after `idle_s`, with no new request."""
    server = EpisodeServer(("127.0.0.1", 0), OursServed(None, "tests.helpers:served_faults", [], {}), None, 1.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        for _ in range(3):
            ServedEpisode(EnvironmentServer(EnvironmentServerConfig(url=url))).reset(ROW)  # never closed
        assert httpx.get(url).json()["episodes"] == 3
        deadline = time.monotonic() + 10.0
        while httpx.get(url).json()["episodes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(url).json()["episodes"] == 0
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_does_not_answer_or_serves_another_kind_is_refused_before_any_stage(faults_server):
    url = f"http://127.0.0.1:{helpers.free_port()}"
    [problem] = server_problems(_served(url))
    assert url in problem and "does not answer" in problem and "rlhf serve-env" in problem
    [problem] = server_problems(_served(faults_server, kind="verifiers"))
    assert "serves 'ours', not a verifiers environment" in problem
    assert server_problems(_served(faults_server)) == [] and server_problems(None) == []


def test_a_slow_server_fails_its_episode_and_keeps_the_others_waiting_no_longer_than_the_timeout(
        chat_tokenizer, faults_server):
    rows = [ROW, {**ROW, "fault": "slow"}, ROW, ROW]
    runner = _runner(chat_tokenizer, _served(faults_server, timeout_s=2.0))
    start = time.monotonic()
    episodes = runner.run(Scripted(chat_tokenizer, [CALL, "The cat is warm."]), rows, 1.0)
    took = time.monotonic() - start
    assert [e.status for e in episodes] == ["ok", "failed", "ok", "ok"], [e.error for e in episodes]
    assert "no answer within 2 s" in episodes[1].error
    assert took < SLOW_STEP_S, f"the round waited {took:.1f} s for the slow episode"  # not its whole step


def test_malformed_messages_fail_their_episode_not_the_run(chat_tokenizer, faults_server):
    episodes = _runner(chat_tokenizer, _served(faults_server)).run(
        Scripted(chat_tokenizer, [CALL, "The cat is warm."]), [{**ROW, "fault": "malformed"}, ROW], 1.0)
    assert [e.status for e in episodes] == ["failed", "ok"]
    assert "message 0 is not a chat message with a role" in episodes[0].error


def _tools_ppo(cfg, **changes):
    return with_overrides(cfg.ppo, AUTO_RESOLVED | {"num_iterations": 4, "evaluation": {"every": None}} | changes)


def test_ppo_on_a_server_killed_mid_run_and_restarted_ends_as_the_in_process_run(tools_trained, tmp_path):
    """The server dies in the middle of a step during PPO and is back 2 s later on the same port: the
    episodes it held are replayed, none fails, and the run ends with the in-process run's figures."""
    from tests.helpers import run_ppo

    cfg, trained = tools_trained
    environment = {"tools": None, "factory": "tests.helpers:served_faults"}  # the rest: the tiny tool world's
    here = run_ppo(_tools_ppo(cfg, environment=environment), trained, tmp_path / "here")
    port = str(helpers.free_port())
    command = ("--kind", "ours", "--factory", "tests.helpers:served_faults", "--port", port)
    died, url = serve_env(*command, environment={"RLHF_TEST_DIE_AFTER_STEPS": "6"})
    restarted = []

    def restart() -> None:
        died.wait()
        time.sleep(2.0)
        restarted.append(serve_env(*command)[0])

    watcher = threading.Thread(target=restart, daemon=True)
    watcher.start()
    try:
        served = {"tools": None, "server": {"url": url, "backoff_s": 0.25, "max_retries": 12}}
        result = run_ppo(_tools_ppo(cfg, environment=served), trained, tmp_path / "served")
    finally:
        watcher.join(timeout=200 if died.poll() is not None else 0)
        for process in restarted:
            stop_process(process)
    assert died.returncode == 1 and restarted, "the server was not killed mid-run and restarted"
    assert all(row["rollout/failed_share"] == 0 for row in result.history)
    assert sum(row["rollout/environment_retries"] for row in result.history) > 0  # the restart, seen
    assert all(row["rollout/environment_retries"] == 0 for row in here.history)
    assert [row["rollout/tool_calls"] for row in result.history] == [row["rollout/tool_calls"] for row in here.history]
    assert result.metrics == here.metrics


@pytest.mark.skipif(not VERIFIERS.exists(), reason="the verifiers environment is not built: `make env-verifiers`")
def test_the_tool_world_written_for_verifiers_is_the_in_process_world_and_trains(chat_tokenizer, tools_trained,
                                                                                   tmp_path):
    """The demo's tool world as a verifiers environment (examples/verifiers/tools_world), served: a
    scripted episode gets the tool's answer and the world's two rules' score as its last reward, as
    the in-process tools and reward functions give; then GRPO on it trains, no episode failing."""
    from rlhf.demo.rewards import names_the_subject, uses_liked_adjectives
    from tests.helpers import run_ppo

    process, url = serve_env("--kind", "verifiers", "--module", "tools_world", "--path", "examples/verifiers")
    try:
        row, script = CAT, CAT_SCRIPT
        [a] = _runner(chat_tokenizer, IN_PROCESS, 150).run(Scripted(chat_tokenizer, script), [row], 1.0)
        [b] = _runner(chat_tokenizer, _served(url, kind="verifiers"), 150).run(Scripted(chat_tokenizer, script), [row],
                                                                                1.0)
        assert a.status == b.status == "ok" and a.tool_calls == 1
        assert [s.ids for s in b.segments] == [s.ids for s in a.segments]
        expected = uses_liked_adjectives([row["messages"]], [a.answer], ["warm calm kind"])[0] + \
            names_the_subject([row["messages"]], [a.answer])[0]
        assert b.segments[-1].reward == pytest.approx(expected) and expected == 2.0

        cfg, trained = tools_trained
        served = {"tools": None, "server": {"url": url, "kind": "verifiers"}}
        result = run_ppo(_tools_ppo(cfg, environment=served, num_iterations=3, reward={"terms": [],
                                                                                        "columns": ["liked"]}),
                         trained, tmp_path / "verifiers")
        assert all(row["rollout/failed_share"] == 0 for row in result.history)
        assert any(row["rollout/tool_calls"] > 0 for row in result.history)
        assert any(row["rollout/environment_reward"] != 0 for row in result.history)  # the environment's score
        assert all(row["rollout/score"] == 0 for row in result.history)  # and no other
        # The bridge's sockets are its pools', as many as the episodes at once, not one more per episode (it
        # once leaked two per episode): a second batch of 16 episodes after a first adds none.
        descriptors = []
        for _ in range(2):
            batch = _runner(chat_tokenizer, _served(url, kind="verifiers"), 150).run(
                Scripted(chat_tokenizer, script), [row] * 16, 1.0)
            assert all(episode.status == "ok" for episode in batch)
            descriptors.append(len(list(Path(f"/proc/{process.pid}/fd").iterdir())))
        assert descriptors[1] <= descriptors[0] + 2, descriptors
    finally:
        stop_process(process)


@pytest.mark.skipif(not VERIFIERS.exists(), reason="the verifiers environment is not built: `make env-verifiers`")
def test_an_environments_own_prompts_are_the_stages_validated_by_our_contract(chat_tokenizer, tools_trained,
                                                                             tmp_path):
    """`prompts: {path: "env:"}`: the verifiers environment's tasks, fetched into a file and validated
    as any prompt file (its `liked` column kept); unset without a server, it is refused. The server
    spreads its episodes over two processes (`--workers 2`): the dataset is one worker's, and episodes
    answered by either are the in-process world's."""
    from rlhf.sections.base import DataSource
    from schemas.validate import load_validated
    from stages.envs.remote.served import env_source
    from stages.runtime.models import load_tokenizer

    cfg, trained = tools_trained
    world = Path(trained["sft"]).parent.parent / "worlds"
    prompts = next(world.rglob("prompts.jsonl"))
    config = json.dumps({"taskset": {"prompts": str(prompts)}})
    process, url = serve_env("--kind", "verifiers", "--module", "tools_world", "--path", "examples/verifiers",
                             "--config", config, "--workers", "2")
    try:
        settings = _served(url, kind="verifiers")
        row, script = CAT, CAT_SCRIPT
        [a] = _runner(chat_tokenizer, IN_PROCESS, 150).run(Scripted(chat_tokenizer, script), [row], 1.0)
        spread = _runner(chat_tokenizer, settings, 150).run(Scripted(chat_tokenizer, script), [row] * 4, 1.0)
        assert [[s.ids for s in b.segments] for b in spread] == [[s.ids for s in a.segments]] * 4
        assert [b.segments[-1].reward for b in spread] == [2.0] * 4
        fetched = env_source(DataSource(path="env:"), settings, tmp_path)
        assert Path(fetched.path).parent == tmp_path and env_source(DataSource(path="env:"), settings, tmp_path) == \
            fetched  # named by its content
        data = load_validated(fetched.path, "prompt", tokenizer=load_tokenizer(trained["sft"]), columns=("liked",))
        given = [json.loads(line) for line in prompts.read_text().splitlines()]
        assert list(data.frame["liked"]) == [r["liked"] for r in given]
        assert [json.loads(m)[-1]["content"] for m in data.frame["prompt_messages"]] == [r["prompt"] for r in given]
        with pytest.raises(EpisodeRequestFailed, match="no 'eval' dataset"):
            EnvironmentServer(settings.server).request("GET", "/dataset?split=eval", None)
    finally:
        stop_process(process)
    with pytest.raises(ValueError, match="`env:` is an environment server's dataset: set environment.server"):
        with_overrides(cfg.ppo, {"prompts": {"path": "env:"}})


def test_a_server_with_a_token_refuses_requests_without_it(monkeypatch):
    server = EpisodeServer(("127.0.0.1", 0), OursServed(None, "tests.helpers:served_faults", [], {}), "s3cret", 600.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        [problem] = server_problems(_served(url))
        assert "HTTP 401" in problem
        [unset] = server_problems(_served(url, api_key_env="ENV_TOKEN"))
        assert "ENV_TOKEN (environment.server.api_key_env) is not set" in unset
        with pytest.raises(EpisodeRequestFailed, match="HTTP 401"):
            ServedEpisode(EnvironmentServer(EnvironmentServerConfig(url=url))).reset(ROW)
        monkeypatch.setenv("ENV_TOKEN", "s3cret")
        assert server_problems(_served(url, api_key_env="ENV_TOKEN")) == []
        episode = ServedEpisode(EnvironmentServer(EnvironmentServerConfig(url=url, api_key_env="ENV_TOKEN")))
        assert episode.reset(ROW) == ROW["messages"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_token_over_plain_http_to_another_host_is_warned_of():
    def served(url: str, **settings) -> EnvironmentServer:
        [server] = served_environment(_served(url, **settings))
        return server

    token = {"api_key_env": "ENV_TOKEN"}
    assert "sent over plain http to envs.example" in served("http://envs.example:8400", **token).exposed_token()
    assert served("https://envs.example:8400", **token).exposed_token() is None
    assert served("http://127.0.0.1:8400", **token).exposed_token() is None
    assert served("http://envs.example:8400").exposed_token() is None  # no token, nothing to read
    assert served_environment(None) == []
