"""The tools world (`demo.task: tools`) and SFT on its multi-turn transcripts: a gold that needs the
tool, a prefix-preserving template, loss on the assistant's turns alone, row-level refusals."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from transformers import AutoTokenizer

from rlhf.demo.locations import DemoWorldConfig
from rlhf.demo.rewards import ADJECTIVES as REWARD_ADJECTIVES
from rlhf.demo.rewards import uses_liked_adjectives
from rlhf.demo.tools import call_text, tools
from rlhf.demo.world import (
    ADJECTIVES,
    SUBJECTS,
    TOOLS_CHAT_TEMPLATE,
    build_records,
    build_world,
    gold_tool_score,
    judge_evaluation,
    mean_gold_reward,
)
from schemas.errors import DataContractError
from schemas.validate import LengthBudget, load_validated
from stages.sft import SFTInputs, TranscriptTemplateError, build_trainer, encode_transcript, train_sft

TOOLS = DemoWorldConfig(task="tools", n_sft=64, n_sft_eval=16, n_pairs=64, n_pairs_eval=16, n_prompts=16,
                        n_prompts_eval=8)
BUDGET = LengthBudget(64, 96)


@pytest.fixture(scope="module")
def tools_world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("tools-world"), TOOLS)


@pytest.fixture(scope="module")
def tools_tokenizer(tools_world):
    from stages.runtime.models import load_tokenizer

    return load_tokenizer(str(tools_world / "model"))


def _rows(world, name: str) -> list[dict]:
    return [json.loads(line) for line in (world / f"{name}.jsonl").read_text().splitlines()]


def _transcripts(world) -> list[list[dict]]:
    return [r["messages"] for name in ("sft", "sft_eval") for r in _rows(world, name)]


def test_the_tools_world_needs_its_tool(tools_world):
    prompts = _rows(tools_world, "prompts") + _rows(tools_world, "prompts_eval")
    assert all(set(r) == {"prompt", "liked"} for r in prompts)
    assert all(len(set(r["liked"].split())) == 3 and set(r["liked"].split()) <= set(ADJECTIVES) for r in prompts)
    rows = _rows(tools_world, "sft") + _rows(tools_world, "sft_eval")
    calling = [r for r in rows if any(m["role"] == "tool" for m in r["messages"])]
    assert 0.3 < len(calling) / len(rows) < 0.7  # tool_call_rate 0.5
    for row in calling:
        user, call, answer, final = row["messages"]
        assert (user["role"], call["role"], answer["role"], final["role"]) == ("user", "assistant", "tool", "assistant")
        assert answer == {"role": "tool", "name": "preferences", "content": "likes: " + ", ".join(row["liked"].split())}
        asked = next(s for s in SUBJECTS if re.search(rf"\b{s}\b", user["content"]))
        assert call["content"] == call_text(asked)
        assert set(final["content"].lower().rstrip(".").replace(",", "").split()) & set(ADJECTIVES) \
            <= set(row["liked"].split())  # the answer uses only what the tool said
    assert all(len(r["messages"]) == 2 for r in rows if r not in calling)
    # The pairs and prompts are the describe world's.
    describe = build_records(TOOLS.model_copy(update={"task": "describe"}))
    assert _rows(tools_world, "preferences") == describe["preferences"]
    assert [r["prompt"] for r in prompts] == [r["prompt"] for r in describe["prompts"] + describe["prompts_eval"]]


def test_the_tools_worlds_tokenizer_has_the_tool_role_and_markers(tools_world):
    tokenizer = AutoTokenizer.from_pretrained(tools_world / "model")
    assert tokenizer.chat_template == TOOLS_CHAT_TEMPLATE
    for marker in ("<|tool|>", "<tool_call>", "</tool_call>"):
        (marker_id,) = tokenizer(marker, add_special_tokens=False)["input_ids"]
        assert marker_id in tokenizer.all_special_ids
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How is the cat?"}, {"role": "assistant", "content": call_text("cat")},
         {"role": "tool", "name": "preferences", "content": "warm, calm, kind"}], tokenize=False,
        add_generation_prompt=True)
    assert rendered == ('<s><|user|>How is the cat?<|assistant|><tool_call>{"name": "preferences", "arguments": '
                        '{"subject": "cat"}}</tool_call></s><|tool|>warm, calm, kind<|assistant|>')


def test_the_template_is_prefix_preserving_over_every_transcript(tools_world, tools_tokenizer):
    def render(messages, generation_prompt):
        return tools_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    checked = 0
    for messages in _transcripts(tools_world):
        for k in range(1, len(messages)):
            if messages[k - 1]["role"] == "assistant":
                assert render(messages[:k + 1], True).startswith(render(messages[:k], False))
                checked += 1
            if messages[k]["role"] == "assistant":
                assert render(messages[:k + 1], False).startswith(render(messages[:k], True))
    assert checked > 0


def test_sft_learns_the_assistant_turns_alone(tools_world, tools_tokenizer):
    frame = load_validated(str(tools_world / "sft.jsonl"), "sft", tokenizer=tools_tokenizer, budget=BUDGET).frame
    assert "messages" in frame.columns
    eos = tools_tokenizer.eos_token
    tool_turns = 0
    for conversation in frame["messages"]:
        messages = json.loads(conversation)
        ids, mask = encode_transcript(tools_tokenizer, messages)
        full = tools_tokenizer.apply_chat_template(messages, tokenize=False)
        assert ids == tools_tokenizer(full, add_special_tokens=False)["input_ids"]  # the deltas add up to the render
        learned = tools_tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert learned == "".join(m["content"] + eos for m in messages if m["role"] == "assistant")
        context = tools_tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
        for m in messages:
            if m["role"] == "tool":
                tool_turns += 1
                assert m["content"] in context
                assert m["content"] not in learned.replace(eos, "|")  # nothing of the tool's answer is learned
        assert "<|tool|>" not in learned and "<|assistant|>" not in learned and "<|user|>" not in learned
    assert tool_turns > 0


def test_a_template_that_rewrites_earlier_turns_is_refused(tools_world, tools_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tools_world / "model")
    # Closes only the last assistant turn: earlier turns render differently once another message follows.
    closed = "{{ message['content'] }}{{ eos_token }}"
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE.replace(
        closed, "{{ message['content'] }}{% if loop.last %}{{ eos_token }}{% endif %}")
    assert tokenizer.chat_template != TOOLS_CHAT_TEMPLATE
    messages = next(m for m in _transcripts(tools_world) if len(m) == 4)
    with pytest.raises(TranscriptTemplateError, match="my-template chat template is not prefix-preserving"):
        encode_transcript(tokenizer, messages, "my-template")


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_malformed_transcripts_get_row_level_errors(tmp_path):
    user = {"role": "user", "content": "How is the cat?"}
    call = {"role": "assistant", "content": call_text("cat")}
    tool = {"role": "tool", "name": "preferences", "content": "warm, calm, kind"}
    final = {"role": "assistant", "content": "The cat is warm."}
    rows = [
        {"messages": [user, call, tool, final]},  # fine
        {"messages": [user, tool, final]},  # a tool's answer with no call before it
        {"messages": [user, call, {"role": "narrator", "content": "x"}, final]},
        {"messages": [user, call, tool]},  # no final answer
        {"messages": [{"role": "assistant", "content": "Hi!"}, user, call, tool, final]},  # no user before the first
        {"messages": [user, call, dict(tool, name=3), final]},
    ]
    with pytest.raises(DataContractError) as caught:
        load_validated(_write(tmp_path / "transcripts.jsonl", rows), "sft")
    report = caught.value.report()
    assert sorted(p.row for p in caught.value.problems) == [2, 3, 4, 5, 6]
    for line in ("line 2, column 'messages': message 2 is a tool's answer that follows no assistant turn",
                 "line 3, column 'messages': message 3 has unknown role 'narrator'",
                 "line 4, column 'messages': conversation does not end with an assistant reply",
                 "line 5, column 'messages': message 1 is an assistant turn with no user turn before it",
                 "line 6, column 'messages': message 3: a tool message's name must be a string"):
        assert line in report, report


def test_the_transcript_contract_checks_the_kept_conversations():
    from schemas.contracts import SFTTranscript

    good = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    frame = pd.DataFrame({"messages": [good, "not json", json.dumps([{"role": "user", "content": "hi"}])]},
                         index=pd.Index([1, 2, 3], name="row"))
    with pytest.raises(Exception) as caught:
        SFTTranscript.validate(frame, lazy=True)
    assert sorted(caught.value.failure_cases["index"]) == [2, 3]


def test_single_reply_chat_data_keeps_its_form(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    frame = load_validated(_write(tmp_path / "chat.jsonl", rows), "sft").frame
    assert list(frame.columns) == ["prompt", "prompt_messages", "response"]


def test_sft_trains_on_tools_world_transcripts(tools_world, tools_tokenizer, tiny_config, tmp_path):
    cfg = tiny_config.sft.model_copy(update={"max_steps": 3, "max_prompt_length": BUDGET.max_prompt_length,
                                             "max_length": BUDGET.max_length, "eval_steps": 3})
    train = load_validated(str(tools_world / "sft.jsonl"), "sft", tokenizer=tools_tokenizer, budget=BUDGET).frame
    evaluation = load_validated(str(tools_world / "sft_eval.jsonl"), "sft", tokenizer=tools_tokenizer,
                                budget=BUDGET).frame
    inputs = SFTInputs(str(tools_world / "model"), train, evaluation)
    trainer = build_trainer(cfg, inputs, tmp_path / "built")
    row = next(i for i, m in enumerate(train["messages"]) if '"tool"' in m)
    batch = trainer.data_collator([trainer.train_dataset[row]])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    _, mask = encode_transcript(tools_tokenizer, json.loads(train.iloc[row]["messages"]))
    assert [label != -100 for label in labels] == [bool(m) for m in mask]
    assert [label for label in labels if label != -100] == [i for i, m in zip(ids, mask, strict=True) if m]
    result = train_sft(cfg, inputs, tmp_path / "trained")
    assert result.metrics["train/steps"] == 3
    assert result.metrics["eval/loss"] < result.metrics["eval/loss_untrained"]


def test_gold_tool_score_on_hand_worked_cases():
    prompt, liked = "Describe the cat.", "warm calm kind"
    assert gold_tool_score(prompt, liked, "The cat is warm and kind.") == 3.0  # 2 liked + right subject
    assert gold_tool_score(prompt, liked, "The cat is warm and lovely.") == 1.0  # lovely is pleasant but not liked
    assert gold_tool_score(prompt, liked, "The dog is calm, calm.") == 0.0  # liked once, another subject
    assert gold_tool_score(prompt, "cold rude ugly", "The cat is cold and rude.") == 3.0  # tastes differ
    long = "The cat is " + " ".join(["warm"] * 10) + "."  # 13 words: 3 over budget
    assert gold_tool_score(prompt, liked, long) == 2.0 - 1.5
    assert gold_tool_score(prompt, liked, "The cat is.") == 0.0  # no adjective at all: -1, the subject +1
    table = pd.DataFrame({"prompt_messages": [json.dumps([{"role": "user", "content": prompt}])] * 2,
                          "policy_response": ["The cat is warm.", "The cat is kind and calm."],
                          "sft_response": ["The cat is bad.", "The cat is kind and calm."],
                          "liked": [liked, liked]})
    judged = judge_evaluation(table)
    assert judged["eval/gold_reward"] == (2.0 + 3.0) / 2 and judged["eval/gold_reward_sft"] == (0.0 + 3.0) / 2
    assert judged["eval/gold_win_rate"] == 0.75  # one win, one tie
    assert mean_gold_reward(list(table["prompt_messages"]), list(table["policy_response"]), [liked, liked]) == 2.5
    assert mean_gold_reward(list(table["prompt_messages"]), list(table["policy_response"]),
                            ["cold rude ugly"] * 2) == ((-1.0 + 1.0) + (-2.0 + 1.0)) / 2
    assert mean_gold_reward(list(table["prompt_messages"]), ["The cat is cold."] * 2) == 0.0  # describe gold


def test_the_tool_and_the_verifiable_reward():
    (preferences,) = tools({"liked": "warm calm kind"})
    assert preferences.__name__ == "preferences" and preferences("cat") == "likes: warm, calm, kind"
    assert call_text("cat") == '<tool_call>{"name": "preferences", "arguments": {"subject": "cat"}}</tool_call>'
    assert REWARD_ADJECTIVES == set(ADJECTIVES)  # the user's copy is the world's list
    assert uses_liked_adjectives([[{"role": "user", "content": "Describe the cat."}]] * 3,
                                 ["The cat is warm and kind.", "The cat is warm and cold.", "The cat."],
                                 ["warm calm kind"] * 3) == [2.0, 0.0, -1.0]
