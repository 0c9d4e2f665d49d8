"""Agent programs as environments (`environment.agent`, `stages.envs.agent`): an unmodified openai-SDK
loop trains through the policy's endpoint, token in and token out; its reward, turn rewards and columns
land on the episode; a program that rewrites its history goes on in a second chain of its episode; a
program that raises, takes too long or never asks fails its episode, not the run; and the endpoint
serves only the run's token and live episodes, on loopback."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from rlhf.sections.environment import EnvironmentConfig
from stages.envs.agent import AgentEndpoint, Relay
from stages.envs.episode import transcript
from stages.envs.loop import episode_runner
from tests.helpers import TOOL_ANSWER, TOOL_TEMPLATE, Scripted

CALL = '<tool_call>{"name":"f"}</tool_call>'
ROW = {"messages": [{"role": "user", "content": "Describe the cat."}]}


@pytest.fixture()
def chat_tokenizer(tokenizer):
    """The tool template, with the request's tools' names in front of the conversation."""
    mine = copy.deepcopy(tokenizer)
    tools = "{% for tool in tools or [] %}<|system|>{{ tool['function']['name'] }}{% endfor %}"
    mine.chat_template = tools + TOOL_TEMPLATE
    return mine


def _run(tokenizer, script: list[str], rows: list[dict], **settings):
    config = EnvironmentConfig(agent="tests.helpers:scripted_agent", **({"episode_tokens": 200} | settings))
    runner = episode_runner(config, tokenizer, "test-model", [tokenizer.eos_token_id], 48)
    engine = Scripted(tokenizer, script)
    try:
        return runner.run(engine, rows, 1.0), engine
    finally:
        runner.close()


def test_an_openai_sdk_agent_trains_through_the_endpoint_token_in_token_out(chat_tokenizer):
    """The agent's first request is the prompt (its tools in the template), the policy's call comes back
    in OpenAI's form, the tool's answer it appends is the next context, and its reward lands on the last
    turn, its turn reward on the first, its column beside the record's."""
    [episode], engine = _run(chat_tokenizer, [CALL, "The cat is warm and calm."], [ROW])
    assert episode.status == "ok", episode.error
    assert episode.turns == 2 and episode.tool_calls == 1
    assert [s.reward for s in episode.segments if s.trainable] == [0.5, 1.0]
    assert [s.ids for s in episode.segments if s.trainable] == engine.turns  # the sampled ids, never re-encoded
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.messages[2] == {"role": "tool", "content": TOOL_ANSWER, "name": "f"}  # named by its call's id
    context = chat_tokenizer.decode([i for s in episode.segments[1:] if not s.trainable for i in s.ids])
    assert TOOL_ANSWER in context and TOOL_ANSWER not in chat_tokenizer.decode(engine.turns[0])
    assert chat_tokenizer.decode(episode.prompt_ids).startswith("<|system|>f<s>")  # the request's tools, rendered
    assert episode.answer == "The cat is warm and calm."


def test_a_failing_agent_fails_its_episode_and_the_others_go_on(chat_tokenizer):
    """The program that sleeps after the policy's turn is failed once `tool_timeout_s` passes without its
    next request; the others' steps run meanwhile (agent episodes step 16 at once)."""
    rows = [ROW] + [{**ROW, "behaviour": b} for b in ("raise", "silent", "sleep")]
    script = [CALL, "The cat is warm.", "The cat is calm."]
    episodes, _ = _run(chat_tokenizer, script, rows, tool_timeout_s=2.0, max_turns=3)
    assert [e.status for e in episodes] == ["ok", "failed", "failed", "failed"], [e.error for e in episodes]
    errors = [e.error for e in episodes[1:]]
    assert "raised RuntimeError: the agent's own bug" in errors[0]
    assert "ended before asking the policy anything" in errors[1]
    assert "neither asked the policy again nor returned within environment.tool_timeout_s (2 s)" in errors[2]


def test_an_agent_that_rewrites_its_history_goes_on_in_a_second_chain(chat_tokenizer):
    """The program's second request is a fresh conversation (a summary): the episode goes on in a new
    chain, that context rendered whole and the policy's next turn sampled on it alone; the batch marks
    where the chain starts, the figures count it, and the rewards land as for any episode."""
    from stages.envs.episode import episode_batch, episode_figures

    [episode], engine = _run(chat_tokenizer, [CALL, "The cat is warm."], [{**ROW, "behaviour": "rewrite"}])
    assert episode.status == "ok", episode.error
    assert [(s.trainable, s.starts_chain) for s in episode.segments] == [
        (False, False), (True, False), (False, True), (True, False)]
    chain = episode.segments[2].ids
    assert engine.prompts[1] == [chain]  # the second turn saw the new context alone
    text = chat_tokenizer.decode(chain)
    assert text.startswith("<|system|>f") and "Summary: the user asked about a cat." in text
    assert "Describe the cat." not in text
    assert [s.reward for s in episode.segments if s.trainable] == [0.5, 1.0]
    batch = episode_batch([episode], chat_tokenizer.pad_token_id, torch.device("cpu"))
    assert batch.restarts.nonzero().tolist() == [[0, len(episode.segments[1].ids)]]
    assert batch.trainable[0].sum() == sum(len(s.ids) for s in episode.segments if s.trainable)
    assert episode_figures([episode], "rollout")["rollout/rewritten_contexts"] == 1.0
    assert "[context] (the history rewritten: 1 messages from here on)" in transcript(episode)


def test_the_endpoint_serves_only_the_runs_token_and_live_episodes_on_loopback():
    """401 without the run's token, 404 for an episode not live (on its path, or named as the model on the
    shared URL), 400 naming the reason for a body that is not a JSON object of messages (never a 500)."""
    endpoint = AgentEndpoint()
    try:
        assert endpoint.url.startswith("http://127.0.0.1:")
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        path = f"{endpoint.url}/episodes/unknown/v1/chat/completions"
        assert httpx.post(path, json=body).status_code == 401
        assert httpx.post(path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        token = {"Authorization": f"Bearer {endpoint.token}"}
        assert httpx.post(path, json=body, headers=token).status_code == 404
        endpoint.live["live"] = Relay()
        path = f"{endpoint.url}/episodes/live/v1/chat/completions"
        for bad in (b"{not json", b"\xff\xfe", b"[1, 2]", b'{"messages": "hi"}', b'{"messages": [1]}',
                    b'{"messages": [], "n": 2}'):
            answer = httpx.post(path, content=bad, headers=token | {"Content-Type": "application/json"})
            reason = answer.json()["error"]["message"]
            assert answer.status_code == 400 and reason.startswith(("the body is not JSON", "a JSON object")), bad
        shared = f"{endpoint.shared_url}/chat/completions"
        assert httpx.post(shared, json=body | {"model": "live"}).status_code == 401
        assert httpx.post(shared, json=body, headers=token).status_code == 404  # "policy" is no episode
        endpoint.live["live"].replies.put_nowait(None)  # an episode already over: 410, so the model reached it
        assert httpx.post(shared, json=body | {"model": "live"}, headers=token).status_code == 410
    finally:
        endpoint.close()


@pytest.mark.parametrize("program", ["tools_agent:run", "sdk_agent:run", "compacting_agent:run",
                                     "tests.helpers:refining_agent"])
def test_ppo_trains_the_worked_agents_on_the_tool_world(tools_trained, tmp_path, program):
    """The stage on the tiny tool world with each worked agent of examples/agents as its environment (a
    plain openai-SDK loop, the OpenAI Agents SDK's `Runner`, and a loop that compacts its context after
    each tool round), and a program that answers again on a fresh context: episodes call the tool
    through the program, the reward terms score its final answers, the fresh contexts train as second
    chains (the tiny policy's calls are rarely well-formed, so the compacting agent seldom compacts
    here), and the endpoint is gone once the stage ends."""
    import threading

    from rlhf.config import with_overrides
    from rlhf.sections.base import REPO_ROOT
    from tests.helpers import AUTO_RESOLVED, run_ppo

    cfg, trained = tools_trained
    ppo = with_overrides(cfg.ppo, AUTO_RESOLVED | {
        "paths": [str(REPO_ROOT / "examples" / "agents")], "samples_per_prompt": 2,
        "environment": {"tools": None, "agent": program, "episode_tokens": 160},
        "sampling.response_length": 48})  # room for a whole call and a turn after it, so contexts get compacted
    result = run_ppo(ppo, trained, tmp_path)
    last = result.history[-1]
    assert last["rollout/failed_share"] == 0 and last["rollout/turns"] >= 1
    rewritten = max(row["rollout/rewritten_contexts"] for row in result.history)
    if program == "tests.helpers:refining_agent":
        assert rewritten > 0 and max(row["rollout/turns"] for row in result.history) > 1
    else:
        assert max(row["rollout/tool_calls"] for row in result.history) > 0
        assert rewritten == 0 or program == "compacting_agent:run"
    assert "eval/tool_call_rate" in result.metrics
    assert not [t for t in threading.enumerate() if t.name == "agent-endpoint"]
