"""Multi-turn episodes (`stages.envs`): the tool-call parser, the turn loop on a scripted engine
(two valid calls, one malformed, then an answer), the template delta against a full render, the
batch the rollout builds from episodes, and the loss with tool tokens against the model's own alone."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

from rlhf.config import with_overrides
from rlhf.sections.environment import EnvironmentConfig
from stages.common.errors import StageUserError
from stages.engines.sampler import Sampling
from stages.envs.environment import ToolEnvironment
from stages.envs.episode import Episode, Segment, episode_batch, episode_figures, transcript
from stages.envs.loop import EpisodeRunner, TemplateNotAppendOnly, episode_runner
from stages.envs.parsers import ToolCall, hermes
from tests import helpers
from tests.helpers import AUTO_RESOLVED, TOOL_TEMPLATE, Scripted, plain_scores, ppo_episodes

CALL = '<tool_call>{"name":"f"}</tool_call>'
"""A short call: the tiny world's tokenizer learned no merges for JSON."""
LIKED = helpers.TOOL_ANSWER


@pytest.fixture()
def chat_tokenizer(tokenizer):
    mine = copy.deepcopy(tokenizer)
    mine.chat_template = TOOL_TEMPLATE
    return mine


def _runner(tokenizer, turn_tokens: int = 48, **settings) -> EpisodeRunner:
    config = EnvironmentConfig(tools="tests.helpers:scripted_tools", **({"episode_tokens": 200} | settings))
    return episode_runner(config, tokenizer, "test-model", [tokenizer.eos_token_id], turn_tokens)


ROW = {"messages": [{"role": "user", "content": "Describe the cat."}]}


def test_tool_calls_are_parsed_in_the_hermes_convention():
    assert hermes("The cat is warm.").calls == [] and hermes("The cat is warm.").content == "The cat is warm."
    assert hermes(CALL).calls == [ToolCall("f", {})]
    two = hermes(CALL + " and " + CALL).calls
    assert len(two) == 2 and all(isinstance(c, ToolCall) for c in two)
    assert "not JSON" in hermes("<tool_call>{oops</tool_call>").calls[0]
    assert "not closed" in hermes('<tool_call>{"name": "x"}').calls[0]
    assert "must be" in hermes('<tool_call>["x"]</tool_call>').calls[0]


def test_two_calls_a_malformed_one_and_an_answer_through_the_real_loop(chat_tokenizer):
    """The scripted engine calls twice, then malformed, then answers: four turns, the malformed one
    costs `malformed_call_reward`, each tool result is context (not trainable), the episode is ok."""
    script = [CALL, CALL, "<tool_call>{oops</tool_call>", "The cat is warm and calm."]
    engine = Scripted(chat_tokenizer, script)
    [episode] = _runner(chat_tokenizer, max_turns=6).run(engine, [ROW], 1.0)
    assert episode.status == "ok" and episode.turns == 4 and episode.tool_calls == 3
    assert [s.reward for s in episode.segments if s.trainable] == [0.0, 0.0, -1.0, 0.0]
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant",
                                                     "tool", "assistant"]
    assert episode.messages[2]["content"] == LIKED and episode.messages[6]["content"].startswith("error: ")
    assert episode.answer == "The cat is warm and calm."
    # Token in, token out: each turn's ids are exactly what the engine sampled, never re-tokenised.
    assert [s.ids for s in episode.segments if s.trainable] == engine.turns
    # verl's check: the trainable tokens decode to the model's turns alone, no tool text or marker among them.
    trainable = chat_tokenizer.decode([i for s in episode.segments if s.trainable for i in s.ids])
    assert LIKED not in trainable and "error" not in trainable and "<|system|>" not in trainable
    context = chat_tokenizer.decode([i for s in episode.segments[1:] if not s.trainable for i in s.ids])
    assert LIKED in context and "<|system|>" in context


def test_the_template_delta_equals_a_full_render_on_every_turn(chat_tokenizer):
    """Every context the engine was given is the full render of the conversation so far, tokenised,
    and so is the finished episode."""
    script = [CALL, CALL, "The cat is warm."]
    engine = Scripted(chat_tokenizer, script)
    [episode] = _runner(chat_tokenizer).run(engine, [ROW], 1.0)
    # The conversation as the template's own rendering has it: each assistant turn as the text sampled.
    as_text = [{"role": "assistant", "content": script[i // 2]} if m["role"] == "assistant" else m
               for i, m in enumerate(episode.messages)]
    episode.messages = as_text
    conversations = [as_text[:1], as_text[:3], as_text[:5]]
    for given, messages in zip(engine.prompts, conversations, strict=True):
        full = chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert given[0] == chat_tokenizer(full, add_special_tokens=False)["input_ids"]
    whole = chat_tokenizer.apply_chat_template(episode.messages, tokenize=False)
    assert [i for s in episode.segments for i in s.ids] == chat_tokenizer(whole, add_special_tokens=False)["input_ids"]


def test_a_template_that_rewrites_earlier_turns_works_and_one_whose_answers_depend_on_history_is_refused(
        chat_tokenizer):
    """A template that drops an earlier assistant turn's content once another message follows (as
    reasoning templates drop earlier thinking) runs exactly: the model's turns are never rendered
    again, each tool answer enters as the fixed base's delta. A template that numbers tool answers
    renders the next one by the history before it: refused at the probe, naming both renderings."""
    rewriting = copy.deepcopy(chat_tokenizer)
    rewriting.chat_template = TOOL_TEMPLATE.replace(
        "<|assistant|>{{ message['content'] }}{{ eos_token }}",
        "<|assistant|>{% if loop.last %}{{ message['content'] }}{% endif %}{{ eos_token }}")
    engine = Scripted(rewriting, [CALL, "The cat is warm."])
    [episode] = _runner(rewriting).run(engine, [ROW], 1.0)
    assert episode.status == "ok" and episode.turns == 2
    delta = rewriting("<|system|>" + LIKED + "<|assistant|>", add_special_tokens=False)["input_ids"]
    prompt = rewriting(rewriting.apply_chat_template([ROW["messages"][0]], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    assert engine.prompts[1][0] == prompt + engine.turns[0] + delta
    numbering = copy.deepcopy(chat_tokenizer)
    numbering.chat_template = TOOL_TEMPLATE.replace("<|system|>{{ message['content'] }}",
                                                    "<|system|>{{ loop.index }}: {{ message['content'] }}")
    with pytest.raises(TemplateNotAppendOnly, match="test-model renders a tool's answer differently the longer the "
                                                    "conversation"):
        _runner(numbering)
    no_tool_role = copy.deepcopy(chat_tokenizer)
    no_tool_role.chat_template = "{% for m in messages %}{% if m['role'] == 'tool' %}" \
                                 "{{ raise_exception('no tools') }}{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(StageUserError, match="cannot render a conversation with a tool"):
        _runner(no_tool_role)


def test_an_episode_ends_truncated_or_failed(chat_tokenizer):
    """Out of tokens mid-turn: truncated; past `max_malformed_calls`: failed; an environment that
    raises: failed, the run goes on; more calls than `max_turns`: truncated."""
    [cut] = _runner(chat_tokenizer).run(Scripted(chat_tokenizer, ["The cat is warm."], end=False), [ROW], 1.0)
    assert cut.status == "truncated" and cut.turns == 1
    bad = "<tool_call>{oops</tool_call>"
    [failed] = _runner(chat_tokenizer, max_malformed_calls=1).run(Scripted(chat_tokenizer, [bad, bad]), [ROW], 1.0)
    assert failed.status == "failed" and "2 malformed" in failed.error
    [endless] = _runner(chat_tokenizer, max_turns=2).run(Scripted(chat_tokenizer, [CALL, CALL]), [ROW], 1.0)
    assert endless.status == "truncated" and endless.turns == 2

    class Raising(ToolEnvironment):
        def step(self, text):
            raise RuntimeError("the sandbox is down")

    runner = _runner(chat_tokenizer)
    runner = EpisodeRunner(settings=runner.settings, make=lambda row: Raising([], runner.settings), rollout=None,
                           chat=runner.chat, stop_ids=runner.stop_ids, turn_tokens=runner.turn_tokens,
                           answering=runner.answering)
    [broken] = runner.run(Scripted(chat_tokenizer, [CALL]), [ROW], 1.0)
    assert broken.status == "failed" and "sandbox is down" in broken.error


def test_a_batch_of_episodes_marks_the_models_tokens_and_turn_rewards():
    """Queries left-padded, everything after the prompt right-padded; trainable on the model's
    tokens of episodes that did not fail; each turn's reward on its last token."""
    ok = Episode(segments=[Segment(ids=[1, 2], trainable=False), Segment(ids=[5, 6, 7], trainable=True, reward=-1.0),
                           Segment(ids=[8], trainable=False), Segment(ids=[9, 3], trainable=True, reward=0.5)])
    failed = Episode(segments=[Segment(ids=[1], trainable=False), Segment(ids=[5, 3], trainable=True)], status="failed")
    batch = episode_batch([ok, failed], pad_id=0, device=torch.device("cpu"))
    assert batch.queries.tolist() == [[1, 2], [0, 1]] and batch.query_mask.tolist() == [[1, 1], [0, 1]]
    assert batch.responses.tolist() == [[5, 6, 7, 8, 9, 3], [5, 3, 0, 0, 0, 0]]
    assert batch.mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert batch.trainable.tolist() == [[1, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0]]
    assert batch.turn_rewards.tolist() == [[0, 0, -1, 0, 0, 0.5], [0] * 6]
    figures = episode_figures([ok, failed], "rollout")
    assert figures["rollout/failed_share"] == 0.5 and figures["rollout/turns"] == 1.5
    assert figures["rollout/masked_tokens"] == (1 + 2) / 2  # the tool's token; all of the failed episode's
    assert "[failed]" in transcript(failed)


def _scripted_rollout(tiny_config, trained, chat_tokenizer, script, teacher_location: str | None = None, **changes):
    from stages.rl.ppo_models import load_models
    from stages.rl.rollout import rollout

    cfg = with_overrides(tiny_config.ppo, AUTO_RESOLVED | {"sampling": {"response_length": 48}} | changes)
    models = load_models(cfg, trained["sft"], trained["reward"], teacher_location=teacher_location)
    models.tokenizer = chat_tokenizer
    rows = [{"prompt": "", "messages": [{"role": "user", "content": p}]} for p in trained["prompts"]["prompt"][:2]]
    engine = Scripted(chat_tokenizer, script)
    batch = rollout(models, engine, _runner(chat_tokenizer), rows, cfg.sampling, {})
    return cfg, models, batch


def test_a_distillation_teacher_grades_the_models_own_tokens_only(tiny_config, trained, chat_tokenizer, world):
    """In an episode the teacher reads the tool's answer as context, and its log-probs (the reward's and
    the top-k loss's terms) count on the model's own tokens alone."""
    from accelerate import Accelerator

    from stages.rl.advantages import estimate, kl_weights
    from stages.rl.teacher import Teacher

    cfg, models, batch = _scripted_rollout(tiny_config, trained, chat_tokenizer, [CALL, "The cat is warm."],
                                           teacher_location=str(world / "model"),
                                           teacher={"model": str(world / "model"), "top_k": 4})
    context, own = (batch.mask - batch.trainable).bool(), batch.trainable.bool()
    marks = batch.teacher
    assert context.any() and (marks.logprobs[context] == 0).all() and (marks.logprobs[own] < 0).all()
    assert marks.bins.shape == (*batch.mask.shape, 5) and torch.isfinite(marks.bins).all()
    as_reward = with_overrides(cfg, {"teacher.top_k": None})  # the term in the reward: the advantages' dense part
    teacher = Teacher(models.teacher.model, as_reward.teacher)
    trained_batch = estimate(Accelerator(), as_reward, teacher, batch, plain_scores(torch.zeros(len(batch.texts))),
                             kl_weights(as_reward, 0.0))
    teacher_kl = teacher.kl(trained_batch.logprobs, trained_batch.teacher, trained_batch.trainable)
    assert (teacher_kl[context] == 0).all() and (teacher_kl[own] != 0).any()
    dense = teacher.dense_rewards(batch.logprobs, batch.teacher, batch.trainable)  # in the advantages, own tokens only
    assert (dense[context] == 0).all() and (trained_batch.advantages[context] == 0).all()


def test_the_rollout_keeps_every_figure_on_the_models_own_tokens(tiny_config, trained, chat_tokenizer, monkeypatch):
    """Log-probs, the reference's and the KL are zero on tool tokens; the forward pass still reads
    them as context (the answer's log-probs change when the tool's answer does)."""
    cfg, models, batch = _scripted_rollout(tiny_config, trained, chat_tokenizer, [CALL, "The cat is warm."])
    context = (batch.mask - batch.trainable).bool()
    assert context.any() and (batch.logprobs[context] == 0).all() and (batch.ref_logprobs[context] == 0).all()
    assert batch.turn_rewards is not None and batch.has_eos.all() and batch.texts == ["The cat is warm."] * 2
    monkeypatch.setattr(helpers, "TOOL_ANSWER", "cold, rude, stale")
    _, _, other = _scripted_rollout(tiny_config, trained, chat_tokenizer, [CALL, "The cat is warm."])
    last = batch.trainable[0].nonzero().flatten()[-4:]
    assert not torch.allclose(batch.logprobs[0, last], other.logprobs[0, last])


def test_the_loss_and_its_gradient_ignore_tool_tokens(tiny_config, trained, chat_tokenizer):
    """Whatever the advantages, old log-probs and values say on tool tokens, the loss and every
    gradient are those of the model's own tokens: tool tokens are in no term and no denominator."""
    from accelerate import Accelerator

    from stages.rl.ppo_models import ActorCritic
    from stages.rl.update import Learner, accumulate_gradients

    cfg, models, batch = _scripted_rollout(tiny_config, trained, chat_tokenizer, [CALL, "The cat is warm."],
                                           critic={"kind": "shared"})
    context = batch.mask - batch.trainable

    def gradients(noise: float) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        torch.manual_seed(1)
        advantages = torch.randn_like(batch.mask) * batch.trainable + noise * context
        trained_batch = ppo_episodes(cfg.model_copy(update={"kl": cfg.kl.model_copy(update={"loss_coef": 0.1})}),
                                     batch, advantages, advantages + noise * context)
        trained_batch.logprobs = batch.logprobs + noise * context
        for parameter in models.trainable():
            parameter.grad = None
        learner = Learner(cfg=cfg, accelerator=Accelerator(cpu=True), models=models, actor_critic=ActorCritic(models),
                          optimizer=None, scheduler=None, scaler=torch.amp.GradScaler("cpu", enabled=False))
        figures = accumulate_gradients(learner, trained_batch, torch.arange(len(batch.responses)), iteration=5)
        return {n: p.grad.clone() for n, p in ActorCritic(models).named_parameters() if p.requires_grad}, figures

    clean, clean_figures = gradients(0.0)
    noisy, noisy_figures = gradients(1e3)
    for name in clean:
        torch.testing.assert_close(noisy[name], clean[name], rtol=1e-5, atol=1e-7, msg=name)
    assert noisy_figures["policy_loss"] == pytest.approx(clean_figures["policy_loss"], rel=1e-5)
    assert noisy_figures["value_loss"] == pytest.approx(clean_figures["value_loss"], rel=1e-5)


# --- the PPO stage in episodes on the demo's tool world ------------------------------------------


def _tool_cfg(cfg, **changes):
    return with_overrides(cfg.ppo, AUTO_RESOLVED | changes)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_ppo_trains_in_episodes_on_the_tool_world(tools_trained, tmp_path, estimator):
    """The stage runs episodes against the demo's tool (GRPO, and GAE with a critic on the policy):
    the figures of turns and tool calls, the episode columns of the tables, the evaluation's."""
    from stages.common.reporting import Reporting
    from tests.helpers import run_ppo

    cfg, trained = tools_trained
    ppo = _tool_cfg(cfg, advantage_estimator=estimator, samples_per_prompt=2 if estimator == "grpo" else 1)
    rollouts = {}
    result = run_ppo(ppo, trained, tmp_path / estimator, Reporting(rollouts=lambda t, i: rollouts.update({i: t})))
    last = result.history[-1]
    for name in ("turns", "tool_calls", "tool_call_rate", "failed_share", "truncated_share", "masked_tokens",
                 "environment_reward", "environment_retries"):
        assert f"rollout/{name}" in last and f"eval/{name}" in result.metrics
    assert last["rollout/turns"] >= 1
    assert {"eval/tool_call_rate_sft", "eval/environment_reward_sft"} <= set(result.metrics)
    assert {"episode", "status", "liked"} <= set(rollouts[ppo.num_iterations].columns)
    assert {"policy_episode", "sft_episode", "liked"} <= set(result.evaluation.columns)
    assert "[user]" in result.evaluation["policy_episode"].iloc[0]
    assert result.tags["rlhf.tool_parser"] == "hermes (auto: the chat template renders no structured calls)"
    assert last["rollout/reasoning_tokens"] == 0  # the demo's model does not think


def test_a_killed_run_in_episodes_resumes_to_the_same_end(tools_trained, tmp_path):
    """Killed after its checkpoint at iteration 3 and rerun: the same figures and weights, to the bit."""
    from tests.helpers import killed_and_resumed

    cfg, trained = tools_trained
    ppo = _tool_cfg(cfg, num_iterations=6, checkpoint_every=3)
    reference, resumed = killed_and_resumed(ppo, trained, tmp_path)
    assert [row["rollout/tool_calls"] for row in resumed.history] == \
        [row["rollout/tool_calls"] for row in reference.history]
    assert resumed.metrics == reference.metrics
    a = (tmp_path / "whole" / "checkpoint" / "model.safetensors").read_bytes()
    b = (tmp_path / "interrupted" / "checkpoint" / "model.safetensors").read_bytes()
    assert a == b


def test_what_episodes_cannot_do_is_refused_with_the_reason(tools_trained):
    cfg, _ = tools_trained
    # Any existing Python stands for the vLLM environment: the refusal is the config's, before any server starts.
    ahead = _tool_cfg(cfg, rollout_engine="vllm", rollout={"max_staleness": 1, "partial": True},
                      vllm={"python": sys.executable})  # episodes are sampled ahead, and continued across syncs
    assert ahead.rollout.partial
    with pytest.raises(ValueError, match="rollout.partial .* rollout.max_staleness 0"):
        _tool_cfg(cfg, rollout={"partial": True})
    with pytest.raises(ValueError, match="a rollout function's sampling would draw from the trainer's"):
        _tool_cfg(cfg, rollout_engine="vllm", rollout={"max_staleness": 1}, vllm={"python": sys.executable},
                  environment={"tools": None, "rollout": "tests.helpers:one_turn_episode"})
    with pytest.raises(ValueError, match="a single turn is one request"):
        _tool_cfg(cfg, environment=None, rollout_engine="vllm", rollout={"max_staleness": 1, "partial": True},
                  vllm={"python": sys.executable})
    with pytest.raises(ValueError, match="exactly one of tools, factory, rollout, server and agent"):
        _tool_cfg(cfg, environment={"factory": "a:b"})
    with pytest.raises(ValueError, match="not 'module:function'"):
        EnvironmentConfig(tools="no-colon")
    with pytest.raises(ValueError, match="not 'module:function' nor one of .*'hermes'"):
        EnvironmentConfig(tools="a:b", tool_parser="qwen")
    # A single turn's reasoning is read too (`SingleTurn`): the reward may see it without an environment.
    assert _tool_cfg(cfg, environment=None, reward={"sees_reasoning": True}).reward.sees_reasoning


def test_a_single_turns_reasoning_is_read_in_its_familys_convention_and_kept_from_the_answer(tokenizer):
    """A thinking model's response sampled in one turn: its reasoning block is not what the reward
    terms score (unless `reward.sees_reasoning`), it is the message's `reasoning_content` and its
    tokens are counted; a response without a block is the decoded text as it was."""
    from stages.engines.sampler import Generation
    from stages.envs.episode import SingleTurn
    from stages.envs.parsers import harmony, reasoning_parser, split_turn

    texts = ["<think>Warm things are liked.</think>The cat is warm.", "The cat is warm."]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, ids))
    responses = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    generation = Generation(queries=torch.ones(2, 1, dtype=torch.long), query_mask=torch.ones(2, 1, dtype=torch.long),
                            responses=responses)
    rows = [{"prompt": "", "messages": [{"role": "user", "content": "Describe the cat."}]}] * 2
    thinking, plain = SingleTurn(tokenizer, [tokenizer.eos_token_id], reasoning_parser(tokenizer)).batch(
        generation, rows).episodes
    assert thinking.answer == "The cat is warm." and plain.answer == "The cat is warm."
    assert thinking.messages[-1]["reasoning_content"] == "Warm things are liked." and thinking.reasoning_tokens > 0
    assert "reasoning_content" not in plain.messages[-1] and plain.reasoning_tokens == 0
    seen = SingleTurn(tokenizer, [tokenizer.eos_token_id], reasoning_parser(tokenizer), sees_reasoning=True)
    assert seen.batch(generation, rows).episodes[0].answer == tokenizer.decode(ids[0], skip_special_tokens=True)
    # The family's convention: gpt-oss's channels where the template writes them, else `</think>`.
    assert reasoning_parser(tokenizer)("<think>a</think>b").reasoning == split_turn("<think>a</think>b").reasoning
    channels = type("Harmony", (), {"chat_template": "<|channel|>analysis", "response_template": None})()
    analysis = "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final<|message|>done"
    assert reasoning_parser(channels)(analysis) == harmony(analysis)


MISTRAL_TOOLS_TEMPLATE = (
    "{% set last_user = namespace(at=-1) %}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set last_user.at = loop.index0 %}{% endif %}{% endfor %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% if loop.index0 == last_user.at and tools %}"
    "[AVAILABLE_TOOLS] {{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS] {{ {'content': message['content']} | tojson }}"
    "[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
"""Mistral's v0.3 layout of tools (before the last user turn), calls and results, on the v0.1 SentencePiece
tokenizer (its markers as text)."""


@pytest.mark.parametrize("family, template", [("gpt2", "chatml"), ("llama", "mistral-tools")])
def test_the_delta_equals_a_full_render_for_real_tokenizers(tmp_path, family, template):
    """GPT-2's byte-level BPE (ChatML as text) and Mistral's SentencePiece (a tools-capable template):
    every context the engine is given is the full render of the conversation so far. For GPT-2 the ids
    are the full render's, tokenised; SentencePiece merges across the template's boundary where a
    model's turn starts ("[/INST]" then "<tool_call>" tokenise as "]<" together), so there a model
    continuing the prompt cannot sample the full render's ids, and the check is on the text."""
    from stages.runtime.models import load_tokenizer
    from tests.model_families import CHATML_TEMPLATE, build_family

    folder = build_family(family, tmp_path)
    tokenizer = load_tokenizer(str(folder), chat_template=CHATML_TEMPLATE if template == "chatml"
                               else MISTRAL_TOOLS_TEMPLATE)
    runner = _runner(tokenizer, turn_tokens=64, max_turns=4)
    engine = Scripted(tokenizer, [CALL, CALL, "The cat is warm and calm."])
    tools = runner.make(ROW).schemas()
    [episode] = runner.run(engine, [ROW], 1.0)
    assert episode.status == "ok" and episode.turns == 3
    sampled = [{"role": "assistant", "content": text} for text in (CALL, CALL, "The cat is warm and calm.")]
    as_text = [sampled.pop(0) if m["role"] == "assistant" else m for m in episode.messages]
    for [context], turn in zip(engine.prompts, (1, 3, 5), strict=True):
        full = tokenizer.apply_chat_template(as_text[:turn], tools=tools, tokenize=False,
                                             add_generation_prompt=True)
        segments = episode.segments[:turn]  # the prompt, then a turn and the tool's answer each time
        assert [i for s in segments for i in s.ids] == context
        # Decoded a segment at a time: SentencePiece's decoder spaces special tokens in a longer decode.
        assert "".join(tokenizer.decode(s.ids) for s in segments) == full, f"turn {turn}"
        if family == "gpt2":
            assert context == tokenizer(full, add_special_tokens=False)["input_ids"], f"turn {turn}"


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce++", "reinforce++-baseline"])
def test_every_estimator_gives_advantages_on_the_models_tokens_alone(tiny_config, trained, chat_tokenizer,
                                                                      estimator):
    """Each estimator on episodes with a turn reward: finite advantages on the model's tokens, zero on
    the tool's; the turn reward reaches the first turn's tokens (GAE's and REINFORCE++'s recursion
    skips the tool's tokens, the group estimators sum it into the episode's score)."""
    from accelerate import Accelerator

    from stages.rl.advantages import estimate, kl_weights

    grouped = estimator in ("grpo", "rloo", "reinforce++-baseline")
    changes = {"advantage_estimator": estimator, "samples_per_prompt": 2 if grouped else 1}
    cfg, models, batch = _scripted_rollout(tiny_config, trained, chat_tokenizer, [CALL, "The cat is warm."],
                                           **changes)
    first_turn_end = batch.trainable[0].nonzero().flatten()
    first_turn_end = first_turn_end[(first_turn_end.diff() > 1).nonzero().flatten()[0]]
    batch.turn_rewards[0, first_turn_end] = 2.0  # the first episode's call earned something
    scored = estimate(Accelerator(cpu=True), cfg, models.teacher, batch, plain_scores(torch.tensor([0.0, 0.0])),
                      kl_weights(cfg, 0.0))
    advantages = scored.advantages
    context = (batch.mask - batch.trainable).bool()
    assert torch.isfinite(advantages).all() and (advantages[context] == 0).all()
    assert advantages[0, :first_turn_end + 1].abs().sum() > 0


def test_an_environment_that_cannot_start_or_answers_wrongly_fails_its_episode_not_the_run(chat_tokenizer):
    runner = _runner(chat_tokenizer)

    class Broken(ToolEnvironment):
        def reset(self, row):
            raise KeyError("liked")

    class Wrong(ToolEnvironment):
        def step(self, text):
            return {"messages": []}

    for environment, reason in ((Broken, "KeyError"), (Wrong, "must return (messages, reward, done)")):
        mine = EpisodeRunner(settings=runner.settings, make=lambda row, e=environment: e([], runner.settings),
                             rollout=None, chat=runner.chat, stop_ids=runner.stop_ids, turn_tokens=runner.turn_tokens,
                             answering=runner.answering)
        [episode] = mine.run(Scripted(chat_tokenizer, [CALL]), [ROW], 1.0)
        assert episode.status == "failed" and reason in episode.error


def test_a_turn_asks_for_no_more_than_the_episodes_budget_leaves(chat_tokenizer):
    asked = []

    class Recording(Scripted):
        def generate_ids(self, prompts, sampling):
            asked.append(sampling.max_new_tokens)
            return super().generate_ids(prompts, sampling)

    engine = Recording(chat_tokenizer, [CALL, CALL, "The cat is warm."])
    calls = len(engine.turns[0])
    [episode] = _runner(chat_tokenizer, turn_tokens=48, episode_tokens=calls + 30).run(engine, [ROW], 1.0)
    assert asked[0] == 48 and asked[1] < 48 and episode.status == "truncated"
    assert sum(len(s.ids) for s in episode.segments[1:]) <= calls + 30


def test_the_escape_hatch_writes_whole_episodes_for_training_and_evaluation(chat_tokenizer):
    config = EnvironmentConfig(rollout="tests.helpers:one_turn_episode")
    runner = episode_runner(config, chat_tokenizer, "test-model", [chat_tokenizer.eos_token_id], 16)
    engine = Scripted(chat_tokenizer, ["The cat is warm.", "The cat is warm."])
    [episode] = runner.episodes(engine, [ROW], 1.0)  # what the evaluation's SFT baseline runs
    assert episode.turns == 1 and episode.answer == "The cat is warm."
    batch = runner.generation(engine, [ROW], Sampling(16, 1.0), torch.device("cpu"), {})  # the rollout's call
    assert batch.trainable.sum() == len(engine.turns[0]) and batch.turn_rewards.sum() == 0.5
    with pytest.raises(StageUserError, match="must return a stages.envs.episode.Episode"):
        EpisodeRunner(settings=config, make=None, rollout=lambda row, engine, tokenizer: "text", chat=runner.chat,
                      stop_ids=runner.stop_ids, turn_tokens=16, answering=runner.answering).episodes(engine, [ROW], 1.0)


def test_distillation_runs_in_episodes(tools_trained, tmp_path):
    """`distill` on the tool world, the SFT checkpoint its own teacher: at the first iteration the policy is
    the teacher, so its KL to it is 0 up to float rounding (the sampling pass against a full forward)."""
    from stages.ppo import train_ppo
    from tests.helpers import ppo_inputs

    cfg, trained = tools_trained
    ppo = _tool_cfg(cfg, advantage_estimator="distill", samples_per_prompt=1, reward={"terms": []}, num_iterations=2,
                    teacher={"model": trained["sft"]}, **{"kl.init_coef": 0.0})
    result = train_ppo(ppo, ppo_inputs(trained, reward=False, teacher=trained["sft"]), tmp_path / "run")
    first = result.history[0]
    assert abs(first["rollout/teacher_kl"]) < 1e-3 and first["rollout/turns"] >= 1
    assert "eval/teacher_kl" in result.metrics and "eval/tool_call_rate" in result.metrics


def test_a_run_whose_every_episode_fails_stops_naming_the_reason(tools_trained, tmp_path):
    """An environment that fails every episode: the stage stops at the first iteration past
    `max_failed_share`, naming the failures' reason, instead of training on nothing."""
    from stages.envs.episode import TooManyFailedEpisodes
    from tests.helpers import run_ppo

    cfg, trained = tools_trained
    ppo = _tool_cfg(cfg, num_iterations=2, environment={"factory": "tests.helpers:sandbox_down", "tools": None})
    with pytest.raises(TooManyFailedEpisodes, match=r"episodes failed, over environment.max_failed_share \(50%\); "
                                                    r"the first reasons: RuntimeError: the sandbox is down"):
        run_ppo(ppo, trained, tmp_path / "failing")


# --- nothing the policy writes or a tool does crashes or hangs the stage -------------------------------


NESTED = '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 3000 + "]" * 3000 + "}}</tool_call>"
HUGE_INTEGER = '<tool_call>{"name": "f", "arguments": {"x": ' + "7" * 5000 + "}}</tool_call>"


def test_a_nested_or_huge_call_is_a_malformed_call_in_every_convention():
    """~3,000 nested brackets (RecursionError in json) and a 5,000-digit integer (ValueError): each
    parser reads a malformed call, with its reason, and never raises; nor on truncated markers."""
    from stages.envs.parsers import PARSERS, never_raising

    assert "RecursionError" in hermes(NESTED).calls[0] and "ValueError" in hermes(HUGE_INTEGER).calls[0]
    texts = [NESTED, HUGE_INTEGER, "[TOOL_CALLS] " + "[" * 3000,
             "<|tool_call_start|>[" + "(" * 3000 + "]<|tool_call_end|>",
             '{"name": "f", "parameters": ' + "[" * 3000, "<tool_call><function=f><parameter=x>" + "7" * 5000,
             "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>" + "{" * 3000,
             "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n" + "[" * 3000 + "<｜tool▁call▁end｜>",
             "<tool_call>f<arg_key>x</arg_key>", "<tool_call>", "</think>", "<think>", ""]
    for name, parse in PARSERS.items():
        for text in texts:
            turn = never_raising(parse)(text)
            assert all(isinstance(c, str) for c in turn.calls), (name, text[:40])
            turn.message()  # and it makes a chat message


@pytest.mark.parametrize("arguments", ['{"x": NaN}', '{"x": -Infinity}', '{"x": "\\ud800"}'])
def test_a_call_whose_arguments_are_not_strict_json_is_malformed(arguments):
    """NaN, infinity and a lone surrogate parse as JSON in Python but cannot be sent as JSON or UTF-8:
    the call is malformed (that turn answered with the reason), not the episode failed sending it."""
    from stages.envs.parsers import PARSERS

    [call] = hermes(f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>').calls
    assert isinstance(call, str) and "not strict JSON" in call
    [call] = PARSERS["pythonic"]("<|tool_call_start|>[f(x={1, 2})]<|tool_call_end|>").calls  # a set
    assert isinstance(call, str) and "not strict JSON" in call


def test_the_nested_call_through_the_loop_is_answered_as_malformed(chat_tokenizer):
    """The same call sampled by the policy: answered with the reason, the episode goes on."""
    engine = Scripted(chat_tokenizer, [NESTED, "The cat is warm."])
    [episode] = _runner(chat_tokenizer, episode_tokens=20000, turn_tokens=20000).run(engine, [ROW], 1.0)
    assert episode.status == "ok" and episode.turns == 2
    assert "RecursionError" in episode.messages[2]["content"] and episode.messages[2]["role"] == "tool"


def test_a_turns_calls_run_at_once_and_a_hung_tool_times_out(chat_tokenizer):
    """Two calls that each wait for the other (a barrier of two) both answer: they ran at once. A tool
    that never returns is answered `timed out` after `tool_timeout_s`, left running on a daemon thread."""
    import threading

    from stages.envs.parsers import AssistantTurn, ToolCall

    barrier, release = threading.Barrier(2, timeout=30), threading.Event()

    def meet(subject: str = "") -> str:
        """Meets the other call."""
        barrier.wait()
        return "met"

    def hang(subject: str = "") -> str:
        """Never answers while the test runs."""
        release.wait(60)
        return "late"

    settings = EnvironmentConfig(tools="tests.helpers:scripted_tools", tool_timeout_s=0.5, max_malformed_calls=5,
                                 max_tool_output_chars=2)
    environment = ToolEnvironment([meet, hang], settings)
    step = environment.step(AssistantTurn("", "", None, [ToolCall("meet", {}), ToolCall("meet", {})]))
    assert [m["content"] for m in step.messages] == ["me... [cut: 1 more characters]"] * 2 and step.reward == 0
    step = environment.step(AssistantTurn("", "", None, [ToolCall("hang", {})]))
    assert step.messages[0]["content"].startswith("error: the tool did not answer within 0.5 s")
    assert step.reward == -1.0
    assert any(t.name == "tool-hang" and t.is_alive() and t.daemon for t in threading.enumerate())
    release.set()



def test_a_compare_judge_weighs_each_episodes_answer_against_the_sft_policys_episode(tools_trained, tmp_path):
    """A `compare` judge on episodes: each group's SFT episode is run on the same prompt (the frozen
    reference, through the same environment), and the judge is shown the policy's final answer beside
    the SFT policy's, in a drawn order."""
    from stages.common.reporting import Reporting
    from tests.helpers import judge_app, run_ppo, served_in_thread

    cfg, trained = tools_trained
    app, asked = judge_app("B, clearly")
    tables = {}
    with served_in_thread(app) as base:
        ppo = _tool_cfg(cfg, num_iterations=2, reward={
            "terms": [{"name": "liked", "function": "rlhf.demo.rewards:uses_liked_adjectives"},
                      {"name": "choice", "remote": {"url": base + "/v1", "kind": "compare"}}],
            "columns": ["liked"]})
        run_ppo(ppo, trained, tmp_path / "out", Reporting(rollouts=lambda t, i: tables.update({i: t})))
    episodes = ppo.rollout_batch_size * ppo.num_iterations
    assert len(asked) > episodes  # every episode compared once, and the evaluation's policy episodes
    for request in asked:
        text = request["messages"][0]["content"]
        assert "Response A: " in text and "Response B: " in text
    for table in tables.values():  # the judge always answers B: a win where the policy's answer was shown second
        assert set(table["reward/choice"]) <= {0.0, 1.0} and "episode" in table


@pytest.mark.multiprocess  # the sandbox's server is a process
def test_the_policys_code_runs_in_the_sandbox_as_a_tool(chat_tokenizer, tmp_path):
    """`stages.sandbox.code:python_tools` through the real loop: the call's code runs confined, and its
    answer (how it ended, stdout, stderr) is the tool message; code that reaches for the trainer's files
    gets a refusal back, not the file."""
    secret = tmp_path / "credentials"
    secret.write_text("token-123")
    code = f"print(6 * 7)\nprint(open({str(secret)!r}).read())"
    call = '<tool_call>{"name": "run_python_code", "arguments": {"code": ' + json.dumps(code) + '}}</tool_call>'
    config = EnvironmentConfig(tools="stages.sandbox.code:python_tools", episode_tokens=2000, tool_timeout_s=30,
                               max_tool_output_chars=2000)
    runner = episode_runner(config, chat_tokenizer, "test-model", [chat_tokenizer.eos_token_id], 600)
    [episode] = runner.run(Scripted(chat_tokenizer, [call, "It is 42."]), [ROW], 1.0)
    assert episode.status == "ok" and episode.tool_calls == 1
    answer = episode.messages[2]["content"]
    assert answer.startswith("exit 1\nstdout:\n42\n") and "PermissionError" in answer and "token-123" not in answer
