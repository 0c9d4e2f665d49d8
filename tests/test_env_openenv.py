"""`environment.server.kind: openenv` (`stages.envs.remote.openenv_client`) against a real OpenEnv server: the
example environment (`examples/openenv_lookup`) served by openenv-core 0.3.0 in its own environment
(`make env-openenv`). One episode through `OpenEnvEpisode`, eight at once, a malformed call, a server
that is not there, one killed mid-episode, one at capacity; and, on a scripted websocket server of this
process, a text action and the answers the protocol does not allow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from rlhf.sections.environment import EnvironmentServerConfig
from stages.envs.environment import Step
from stages.envs.parsers import AssistantTurn, ToolCall
from stages.envs.remote.openenv_client import OpenEnvEpisode
from stages.envs.remote.served import EnvironmentServer, EnvironmentServerError, EpisodeRequestFailed
from tests.helpers import free_port, stop_process, wait_until_healthy

REPO = Path(__file__).resolve().parent.parent
OPENENV = REPO / ".env-openenv"

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not (OPENENV / ".installed").exists(),
                       reason="OpenEnv is not installed in .env-openenv (`make env-openenv`)"),
]

MESSAGES = [{"role": "user", "content": "What is the secret?"}]
ANSWER = AssistantTurn(text="done", content="done")


def lookup(key: str = "secret") -> AssistantTurn:
    return AssistantTurn(text=f"<tool_call>lookup {key}</tool_call>", content="",
                         calls=[ToolCall("lookup", {"key": key})])


class LookupServer:
    """The example server in a process of its own (a session, to kill it whole), on one port throughout."""

    def __init__(self, log: Path, max_envs: int = 16):
        self.port, self.log, self.max_envs = free_port(), log, max_envs
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [str(OPENENV / "bin" / "python"), "-m", "uvicorn", "examples.openenv_lookup.server:app",
                   "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log, "a") as log:  # a file, not a pipe: a full pipe would stall the server
            self.process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            env=dict(os.environ, OPENENV_LOOKUP_MAX_ENVS=str(self.max_envs)))
        wait_until_healthy(self.process, self.url + "/health", 60, self.log.read_text)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def config(self, **overrides) -> EnvironmentServerConfig:
        return EnvironmentServerConfig(**{"url": self.url, "kind": "openenv", "timeout_s": 10.0, "max_retries": 2,
                                          "backoff_s": 0.05, **overrides})


@pytest.fixture(scope="module")
def lookup_server(tmp_path_factory):
    server = LookupServer(tmp_path_factory.mktemp("openenv") / "server.log")
    server.start()
    yield server
    stop_process(server.process)


def test_one_episode_looks_its_secret_up_and_ends_on_its_answer(lookup_server):
    server = EnvironmentServer(lookup_server.config())
    episode = OpenEnvEpisode(server)
    assert isinstance(episode, OpenEnvEpisode)
    row = {"messages": MESSAGES, "secret": "amber-7", "seed": np.int64(3)}  # a frame's row: numpy values
    assert episode.reset(row) == MESSAGES
    (tool,) = episode.schemas()
    assert tool["type"] == "function" and tool["function"]["name"] == "lookup"
    assert tool["function"]["description"].startswith("Look a key up")
    assert tool["function"]["parameters"]["required"] == ["key"]

    assert episode.step(lookup()) == Step([{"role": "tool", "name": "lookup", "content": "amber-7"}], 1.0, False)
    wrong = episode.step(lookup("colour"))
    assert wrong.reward == 0.0 and not wrong.done
    assert wrong.messages[0]["content"].startswith("error: ") and "no key 'colour'" in wrong.messages[0]["content"]
    two = episode.step(AssistantTurn(text="", content="", calls=[ToolCall("lookup", {"key": "secret"})] * 2))
    assert two == Step([{"role": "tool", "name": "lookup", "content": "amber-7"}] * 2, 2.0, False)
    assert episode.step(ANSWER) == Step(None, 0.0, True)
    episode.close()
    episode.close()  # twice: nothing happens
    server.close()


def test_eight_episodes_at_once_keep_their_secrets_apart(lookup_server):
    server = EnvironmentServer(lookup_server.config())
    asked = []
    request = server.request
    server.request = lambda *args: asked.append(args[1]) or request(*args)
    together = threading.Barrier(8, timeout=30)

    def one(at: int) -> tuple[Step, Step]:
        episode = OpenEnvEpisode(server)
        episode.reset({"messages": MESSAGES, "secret": f"secret-{at}"})
        together.wait()  # every session open at once
        try:
            return episode.step(lookup()), episode.step(lookup())
        finally:
            episode.close()

    with ThreadPoolExecutor(8) as pool:
        steps = list(pool.map(one, range(8)))
    for at, (first, second) in enumerate(steps):
        assert first == second == Step([{"role": "tool", "name": "lookup", "content": f"secret-{at}"}], 1.0, False)
    assert asked == ["/schema"]  # the action schema asked once for all episodes
    server.close()


def test_a_malformed_call_is_answered_without_a_request(lookup_server):
    episode = OpenEnvEpisode(EnvironmentServer(lookup_server.config()))
    episode.reset({"messages": MESSAGES, "secret": "kept"})
    sent = []
    exchanged = episode._exchanged
    episode._exchanged = lambda message, where: sent.append(message) or exchanged(message, where)
    reason = "the call is not JSON: Expecting value"
    assert episode.step(AssistantTurn(text="<tool_call>{", content="", calls=[reason])) == \
        Step([{"role": "tool", "name": "", "content": f"error: {reason}"}], 0.0, False)
    assert sent == []
    mixed = episode.step(AssistantTurn(text="", content="", calls=[reason, ToolCall("lookup", {"key": "secret"})]))
    assert mixed == Step([{"role": "tool", "name": "", "content": f"error: {reason}"},
                          {"role": "tool", "name": "lookup", "content": "kept"}], 1.0, False)
    assert len(sent) == 1
    episode.close()


def test_a_server_that_is_not_running_is_refused_by_name():
    url = f"http://127.0.0.1:{free_port()}"
    cfg = EnvironmentServerConfig(url=url, kind="openenv", max_retries=1, backoff_s=0.01)
    with pytest.raises(EnvironmentServerError, match=url):
        EnvironmentServer(cfg).check(timeout=2.0)
    with pytest.raises(EpisodeRequestFailed, match="after 2 tries"):
        OpenEnvEpisode(EnvironmentServer(cfg)).reset({"messages": MESSAGES})


def test_a_full_server_is_waited_for(tmp_path):
    full = LookupServer(tmp_path / "server.log", max_envs=1)
    full.start()
    try:
        server = EnvironmentServer(full.config(max_retries=6, backoff_s=0.2))
        first, second = OpenEnvEpisode(server), OpenEnvEpisode(server)
        first.reset({"messages": MESSAGES, "secret": "first"})
        closing = threading.Timer(0.5, first.close)
        closing.start()
        second.reset({"messages": MESSAGES, "secret": "second"})  # CAPACITY_REACHED until the first closes
        closing.join()
        assert second.retries >= 1 and first.retries == 0
        assert second.step(lookup()).messages[0]["content"] == "second"
        second.close()
    finally:
        stop_process(full.process)


def test_a_killed_server_fails_the_open_episode_and_a_restarted_one_serves_new_ones(lookup_server):
    server = EnvironmentServer(lookup_server.config())
    episode = OpenEnvEpisode(server)
    episode.reset({"messages": MESSAGES, "secret": "before"})
    assert episode.step(lookup()).messages[0]["content"] == "before"
    lookup_server.kill()
    try:
        with pytest.raises(EpisodeRequestFailed):
            episode.step(lookup())
        episode.close()  # never raises
    finally:
        lookup_server.start()
    again = OpenEnvEpisode(server)
    again.reset({"messages": MESSAGES, "secret": "after"})
    assert again.step(lookup()) == Step([{"role": "tool", "name": "lookup", "content": "after"}], 1.0, False)
    again.close()


# A scripted server (websockets in this process): a text environment, and answers the protocol does not allow.

TEXT_ACTION = {"title": "EchoAction", "type": "object", "required": ["message"],
               "properties": {"message": {"type": "string"}, "metadata": {"type": "object"}}}
BAD_ANSWERS = {
    "reward": ({"type": "observation", "data": {"observation": {}, "reward": "high", "done": False}}, "not a finite"),
    "nan": ('{"type": "observation", "data": {"observation": {}, "reward": NaN, "done": false}}', "not a finite"),
    "done": ({"type": "observation", "data": {"observation": {}, "reward": 1.0}}, "done must be"),
    "error": ({"type": "error", "data": {"message": "boom", "code": "EXECUTION_ERROR"}}, "EXECUTION_ERROR: boom"),
    "json": ("not json", "not JSON"),
    "shape": ({"type": "state", "data": {}}, "not an observation"),
}


@contextmanager
def scripted_server():
    """A text environment on /ws (`GET /schema` its text action): reset(mode=...) picks its answers, the
    echo env's (`echoed` and `length`; reward 0.5, done on "bye"), one of BAD_ANSWERS to every step, or
    none ("silent")."""
    from websockets.sync.server import serve

    def http(connection, request):
        if request.path == "/schema":
            return connection.respond(200, json.dumps({"action": TEXT_ACTION}))
        return None

    def session(socket):
        mode = None
        for frame in socket:
            message = json.loads(frame)
            if message["type"] == "close":
                return
            if message["type"] == "reset":
                mode = message["data"].get("mode")
                answer = {"observation": {"messages": [{"role": "user", "content": "say something"}]},
                          "reward": None, "done": False}
            elif mode == "silent":
                continue
            elif mode in BAD_ANSWERS:
                bad = BAD_ANSWERS[mode][0]
                socket.send(bad if isinstance(bad, str) else json.dumps(bad))
                continue
            else:
                said = message["data"]["message"]
                answer = {"observation": {"echoed": said, "length": len(said)}, "reward": 0.5, "done": said == "bye"}
            socket.send(json.dumps({"type": "observation", "data": answer}))

    with serve(session, "127.0.0.1", 0, process_request=http) as served:
        thread = threading.Thread(target=served.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{served.socket.getsockname()[1]}"
        finally:
            served.shutdown()
            thread.join(timeout=10)


def test_a_text_environment_gets_the_turns_content_and_answers_as_the_user():
    with scripted_server() as url:
        server = EnvironmentServer(EnvironmentServerConfig(url=url, kind="openenv", timeout_s=5.0))
        episode = OpenEnvEpisode(server)
        assert episode.reset({"messages": MESSAGES}) == [{"role": "user", "content": "say something"}]
        assert episode.schemas() is None
        assert episode.step(AssistantTurn(text="hi", content="hi")) == \
            Step([{"role": "user", "content": "hi"}], 0.5, False)  # its one string field
        assert episode.step(AssistantTurn(text="", content="", calls=[ToolCall("lookup", {})])) == \
            Step([{"role": "tool", "name": "lookup", "content": "error: the environment has no tools; answer in text"}],
                 0.0, False)
        assert episode.step(AssistantTurn(text="bye", content="bye")) == Step(None, 0.5, True)
        episode.close()


@pytest.mark.parametrize("mode", sorted(BAD_ANSWERS))
def test_an_answer_the_protocol_does_not_allow_fails_the_episode(mode):
    with scripted_server() as url:
        episode = OpenEnvEpisode(EnvironmentServer(EnvironmentServerConfig(url=url, kind="openenv", timeout_s=5.0)))
        episode.reset({"messages": MESSAGES, "mode": mode})
        with pytest.raises(EpisodeRequestFailed, match=BAD_ANSWERS[mode][1]):
            episode.step(AssistantTurn(text="hi", content="hi"))
        episode.close()


def test_a_server_that_does_not_answer_in_time_fails_the_episode():
    with scripted_server() as url:
        episode = OpenEnvEpisode(EnvironmentServer(EnvironmentServerConfig(url=url, kind="openenv", timeout_s=0.5)))
        episode.reset({"messages": MESSAGES, "mode": "silent"})
        start = time.monotonic()
        with pytest.raises(EpisodeRequestFailed, match="no answer within 0.5 s"):
            episode.step(AssistantTurn(text="hi", content="hi"))
        assert time.monotonic() - start < 3
        episode.close()
