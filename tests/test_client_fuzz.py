"""Every client of a server (a remote reward, a judge, an environment server) fed answers `hypothesis`
generates, through a mock transport: any status, and bodies that are bytes, any JSON, JSON of nearly the
right shape, or the hostile ones (a 5,000-digit number, 5,000 nested brackets, NaN, a lone surrogate).
Whatever arrives, the client gives valid values or a failed request, which `on_failure` and
`max_failed_share` (rewards) or the episode's failure (environments) handle; it never raises anything
else. Derandomized: the same examples on every run."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlhf.sections.environment import EnvironmentServerConfig
from rlhf.sections.reward_terms import RewardTerm
from stages.envs.parsers import AssistantTurn, ToolCall
from stages.envs.remote.served import EnvironmentServer, EpisodeRequestFailed, ServedEpisode
from stages.rewards.remote import RemoteReward

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
JSONISH = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4), max_leaves=12)
HOSTILE = ['{"scores": [' + "1" * 5000 + "]}", "[" * 5000 + "]" * 5000, '{"scores": [NaN, Infinity]}', '"\\ud800"',
           '{"choices": [{"message": {"content": "7"}}]}', '{"choices": [{"message": {"content": "\\ud800 7"}}]}',
           '{"episode": "e", "messages": [{"role": "user", "content": "\\ud800"}]}', "", "null", "{}"]
STATUSES = st.sampled_from([200, 200, 200, 200, 201, 204, 301, 400, 401, 404, 409, 422, 429, 500, 502, 503])
PROMPTS = [[{"role": "user", "content": f"prompt {i}"}] for i in range(6)]
RESPONSES = [f"response {i}" for i in range(6)]


def bodies(shaped: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """Answer bodies: raw bytes, any JSON, JSON nearly of the protocol's shape, or a hostile one."""
    return st.one_of(st.binary(max_size=64), JSONISH.map(json.dumps), shaped.map(json.dumps),
                     st.sampled_from(HOSTILE)).map(lambda b: b if isinstance(b, bytes) else b.encode("utf-8",
                                                                                                 "surrogatepass"))


SCORES = st.fixed_dictionaries({"scores": st.lists(LEAVES | st.floats(), min_size=0, max_size=8)})
JUDGED = st.fixed_dictionaries({"choices": st.lists(st.fixed_dictionaries(
    {"message": st.fixed_dictionaries({"content": JSONISH | st.from_regex(r"\A(Score: )?-?[0-9]{1,3}(\.[0-9])?\Z")})}),
    max_size=2)})
EPISODE = st.fixed_dictionaries({}, optional={
    "episode": st.text(max_size=6) | JSONISH, "tools": JSONISH,
    "messages": JSONISH | st.lists(st.fixed_dictionaries({"role": JSONISH, "content": JSONISH}), max_size=3),
    "reward": JSONISH, "done": JSONISH, "restart": JSONISH})


def with_hostile(arguments):
    """The test run on each hostile body answered with 200 first (`arguments(body)`: the test's arguments),
    whatever hypothesis draws after."""
    def decorate(test):
        for body in HOSTILE:
            test = example(**arguments(body.encode("utf-8", "surrogatepass")))(test)
        return test

    return decorate


ONE_ANSWER = lambda body: {"status": 200, "body": body}  # noqa: E731 - named for the decorators below


class Answers:
    """A mock transport's answers, in order (the last one again once they run out)."""

    def __init__(self, answers: list[tuple[int, bytes]]):
        self.answers = list(answers)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        status, body = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return httpx.Response(status, content=body, headers={"Content-Type": "application/json"})


@pytest.fixture()
def answered(monkeypatch):
    """Every `httpx.AsyncClient` made while the test runs answers through `answered.by` (an `Answers`)."""
    original = httpx.AsyncClient

    class Mocked(original):
        def __init__(self, **kwargs):
            super().__init__(transport=httpx.MockTransport(lambda request: Mocked.by(request)), **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", Mocked)
    return Mocked


def _checked(outcome, rows: int) -> None:
    assert len(outcome.values) == rows
    for row, value in enumerate(outcome.values):
        assert (value is None) == (row in outcome.failures), (row, value, outcome.failures)
        assert value is None or (isinstance(value, float) and math.isfinite(value)), value


@SETTINGS
@with_hostile(ONE_ANSWER)
@given(status=STATUSES, body=bodies(SCORES))
def test_a_scoring_servers_answer_is_scores_or_a_failed_request(answered, status, body):
    answered.by = Answers([(status, body)])
    remote = RemoteReward(RewardTerm(name="served", remote={"url": "http://scores.test/score", "max_retries": 0,
                                                            "backoff_s": 0.01, "batch_size": 6}))
    _checked(remote.score(PROMPTS, RESPONSES, [True] * 6, 0), 6)


@SETTINGS
@with_hostile(ONE_ANSWER)
@given(status=STATUSES, body=bodies(JUDGED))
def test_a_judges_answer_is_a_score_or_a_failed_request(answered, status, body):
    answered.by = Answers([(status, body)])
    remote = RemoteReward(RewardTerm(name="judge", remote={"url": "http://judge.test/v1", "kind": "judge",
                                                           "max_retries": 0, "backoff_s": 0.01,
                                                           "extra_body": {"model": "m"}}))
    _checked(remote.score(PROMPTS, RESPONSES, [True] * 6, 0), 6)


@SETTINGS
@with_hostile(lambda body: {"answers": [(200, body)]})
@given(answers=st.lists(st.tuples(STATUSES, bodies(EPISODE)), min_size=1, max_size=4))
def test_an_environment_servers_answer_is_a_step_or_a_failed_episode(answers):
    server = EnvironmentServer(EnvironmentServerConfig(url="http://env.test", max_retries=0, backoff_s=0.01))
    server._client = httpx.Client(transport=httpx.MockTransport(Answers(answers)))
    episode = ServedEpisode(server)
    try:
        messages = episode.reset({"messages": [{"role": "user", "content": "Describe the cat."}]})
        assert all(isinstance(m, dict) and isinstance(m["role"], str) for m in messages)
        step = episode.step(AssistantTurn(text="call", content="", calls=[ToolCall("f", {})]))
        assert math.isfinite(step.reward) and isinstance(step.done, bool) and isinstance(step.restart, bool)
    except EpisodeRequestFailed:
        pass  # the episode fails, alone
    finally:
        server.close()
