"""The template matrix: every chat template trl ships that has a tool role runs a scripted episode
(a call, a second call, an answer, with reasoning where the family thinks) through the real episode
loop, on a tokenizer of the template's family: Llama-3's for the Llama templates, else Qwen2's byte-
level BPE with the template's own special tokens added (the family's markers as single tokens).

Accepted: the trainable tokens are exactly the turns the model sampled, no tool text among them,
each tool answer enters as the template renders it in the conversation itself (the observation's
text is found verbatim in the template's own rendering of the structured conversation), and the
episode's answer is the last turn without its reasoning. Refused: at the probe, with the reason.
The table `EXPECTED` is docs/environments.md's."""

from __future__ import annotations

import re
from importlib.resources import files

import pytest
import torch

from rlhf.sections.environment import EnvironmentConfig
from stages.common.errors import StageUserError
from stages.engines.sampler import Generation
from stages.envs.loop import episode_runner
from stages.runtime.models import left_padded_ids, load_tokenizer
from tests import helpers

TEMPLATES = files("trl") / "chat_templates"
WITH_TOOLS = sorted(p.name.removesuffix(".jinja") for p in TEMPLATES.iterdir()
                    if p.name.endswith(".jinja") and "tool" in p.read_text(encoding="utf-8"))
REASONING = "I should look it up."
ANSWER = "The cat is warm and calm."
ARGS = '{"subject": "cat"}'

CALLS = {  # one call to `f(subject="cat")` in each convention
    "hermes": '<tool_call>\n{"name": "f", "arguments": ' + ARGS + '}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=f>\n<parameter=subject>\ncat\n</parameter>\n</function>\n</tool_call>",
    "llama3_json": '{"name": "f", "parameters": ' + ARGS + '}',
    "mistral": '[TOOL_CALLS] [{"name": "f", "arguments": ' + ARGS + '}]',
    "harmony": "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>" + ARGS,
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n" + ARGS
                + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "glm": "<tool_call>f\n<arg_key>subject</arg_key>\n<arg_value>cat</arg_value>\n</tool_call>",
    "pythonic": "<|tool_call_start|>[f(subject='cat')]<|tool_call_end|>",
}
STOPS = ("<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>", "<|END_OF_TURN_TOKEN|>", "<|eot|>", "<turn|>", "<|end|>")
"""A turn's end token, the first of these the template writes (gpt-oss and GLM end a call otherwise)."""


def _special_tokens(template: str) -> list[str]:
    """The template's markers: `<|...|>`, `<｜...｜>` and Gemma's half-open `<|turn>` / `<turn|>`."""
    found = re.findall(r"<\|[\w.\-]+\|>|<｜[^｜<>]+｜>|<\|[a-z_\"]+>|<[a-z_\"]+\|>", template)
    return sorted(set(found) - {"<|python_tag|>"} | ({"<|python_tag|>"} if "<|python_tag|>" in template else set()))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    from tests.model_families import build_family

    parent = tmp_path_factory.mktemp("families")
    return {name: build_family(name, parent) for name in ("qwen2", "llama3")}


def _tokenizer(families, name: str):
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    family = "llama3" if name.startswith("llama3") else "qwen2"
    tokenizer = load_tokenizer(str(families[family]), chat_template=template)
    if family == "qwen2":
        tokenizer.add_special_tokens({"additional_special_tokens": _special_tokens(template)},
                                     replace_extra_special_tokens=False)
    return tokenizer


class Scripted:
    """An engine that answers each turn with fixed ids, whatever the context (recording the contexts)."""

    concurrent = False

    def __init__(self, turns: list[list[int]], pad_id: int):
        self.turns, self.pad_id, self.prompts = turns, pad_id, []

    def most(self, value: int) -> int:
        return value

    def generate_ids(self, prompts, sampling) -> Generation:
        self.prompts.append([list(p) for p in prompts])
        ids = self.turns[len(self.prompts) - 1]
        batch = left_padded_ids(prompts, self.pad_id, torch.device("cpu"))
        return Generation(queries=batch["input_ids"], query_mask=batch["attention_mask"],
                          responses=torch.tensor([ids] * len(prompts)))


def _script(tokenizer, parser: str, opened_think: bool, thinks: bool) -> tuple[list[str], list[str]]:
    """The three turns' texts and the stop token each ends with."""
    template = tokenizer.chat_template
    think = (f"{REASONING}\n</think>\n\n" if opened_think else f"<think>\n{REASONING}\n</think>\n\n") if thinks else ""
    if parser == "harmony":
        analysis = f"<|channel|>analysis<|message|>{REASONING}<|end|>"
        final = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
        return [analysis + CALLS["harmony"]] * 2 + [analysis + final], ["<|call|>", "<|call|>", "<|return|>"]
    if parser == "glm":
        return [think + CALLS["glm"]] * 2 + [think + ANSWER], ["<|observation|>", "<|observation|>", "<|user|>"]
    stop = next(s for s in STOPS if s in template) if parser != "deepseek" else "<｜end▁of▁sentence｜>"
    return [think + CALLS[parser]] * 2 + [think + ANSWER], [stop] * 3


REFUSED = {"gemma4": "auto found no tool-call convention", "diffusion_gemma": "auto found no tool-call convention",
           "muse_glimmer": "auto found no tool-call convention"}
"""Templates refused (by name prefix) and why: their call conventions (Gemma 4's `call:NAME{...}`,
Muse's XML invocations) have no parser of ours; `environment.tool_parser: module:function` runs them."""
ROW = {"messages": [{"role": "user", "content": "Describe the cat."}]}


def _opened_think(tokenizer) -> bool:
    """Whether the generation prompt opens the reasoning block itself (the model writes only its end)."""
    prompt = tokenizer.apply_chat_template(ROW["messages"], tokenize=False, add_generation_prompt=True)
    return prompt.rstrip().endswith("<think>")


@pytest.mark.parametrize("name", WITH_TOOLS)
def test_a_scripted_episode_on_every_shipped_template(families, name):
    from stages.envs.parsers import detect_parser

    tokenizer = _tokenizer(families, name)
    config = EnvironmentConfig(tools="tests.helpers:scripted_tools", max_turns=4, episode_tokens=2048)
    refused = next((reason for prefix, reason in REFUSED.items() if name.startswith(prefix)), None)
    parser = detect_parser(tokenizer.chat_template) or "hermes"
    thinks = "<think>" in tokenizer.chat_template or parser == "harmony"
    texts, stops = _script(tokenizer, parser, _opened_think(tokenizer), thinks)
    stop_ids = [tokenizer.convert_tokens_to_ids(s) for s in dict.fromkeys(stops)]
    if refused is not None:
        with pytest.raises(StageUserError, match=refused):
            episode_runner(config, tokenizer, name, stop_ids, 256)
        return
    runner = episode_runner(config, tokenizer, name, stop_ids, 256)
    assert runner.parser_name == parser
    turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(s)]
             for t, s in zip(texts, stops, strict=True)]
    engine = Scripted(turns, tokenizer.pad_token_id or 0)
    [episode] = runner.run(engine, [ROW], 1.0)
    assert (episode.status, episode.turns, episode.tool_calls, episode.error) == ("ok", 3, 2, None)
    assert episode.answer.strip() == ANSWER
    call = {"type": "function", "function": {"name": "f", "arguments": {"subject": "cat"}}}
    for turn in (episode.messages[1], episode.messages[3]):  # each call read in the family's convention
        assert turn["tool_calls"] == [call] and turn["content"] == "", (name, turn)
    assert episode.reasoning_tokens == (3 * len(tokenizer(REASONING, add_special_tokens=False)["input_ids"])
                                        if thinks else 0)
    # Token in, token out: the trainable tokens are the sampled turns exactly; no tool text among them.
    trainable = [s.ids for s in episode.segments if s.trainable]
    assert trainable == turns
    assert helpers.TOOL_ANSWER not in tokenizer.decode([i for ids in trainable for i in ids])
    # Each context is the last one, the turn as sampled and the observation; the first is the prompt's rendering.
    tools = runner.make(ROW).schemas()
    assert engine.prompts[0][0] == tokenizer(runner.chat.render(ROW["messages"], tools),
                                             add_special_tokens=False)["input_ids"]
    observations = [s for s in episode.segments[1:] if not s.trainable]
    assert engine.prompts[1][0] == engine.prompts[0][0] + turns[0] + observations[0].ids
    assert engine.prompts[2][0] == engine.prompts[1][0] + turns[1] + observations[1].ids
    # Each observation is the tool's answer as the template renders it in the structured conversation itself,
    # right after the turn's end token (the template's glue kept: Qwen's newline after <|im_end|>).
    for observation, upto, stop in zip(observations, (3, 5), stops, strict=False):
        text = tokenizer.decode(observation.ids)
        assert helpers.TOOL_ANSWER in text
        assert stop + text in runner.chat.render(episode.messages[:upto], tools), name


def test_the_answer_is_scored_without_its_reasoning_unless_asked(families):
    """Qwen3 (thinking): the reward terms see the last turn's answer, its reasoning block only with
    `reward.sees_reasoning`; each turn is recorded as a structured message and in the transcript."""
    from stages.envs.episode import transcript

    tokenizer = _tokenizer(families, "qwen3")
    config = EnvironmentConfig(tools="tests.helpers:scripted_tools", max_turns=4, episode_tokens=2048)
    texts, stops = _script(tokenizer, "hermes", False, True)
    turns = [tokenizer(t + s, add_special_tokens=False)["input_ids"]
             for t, s in zip(texts[1:], stops[1:], strict=True)]
    for sees, answer in ((False, ANSWER), (True, f"<think>\n{REASONING}\n</think>\n\n{ANSWER}")):
        runner = episode_runner(config, tokenizer, "qwen3", [tokenizer.convert_tokens_to_ids("<|im_end|>")], 256,
                                sees)
        [episode] = runner.run(Scripted(turns, tokenizer.pad_token_id), [ROW], 1.0)
        assert episode.status == "ok" and episode.answer == answer
        call = {"type": "function", "function": {"name": "f", "arguments": {"subject": "cat"}}}
        assert episode.messages[1] == {"role": "assistant", "content": "", "reasoning_content": REASONING,
                                       "tool_calls": [call]}
        assert f'[assistant] (thinking) {REASONING} -> f({{"subject": "cat"}})' in transcript(episode)


def test_auto_reads_a_tokenizers_response_template_and_survives_what_it_raises(families):
    """A tokenizer that ships a `response_template` is parsed by transformers' `parse_response`, after
    the generation prompt that opens Qwen3.5's reasoning block; the nested call that makes
    `parse_response` raise (RecursionError) is a malformed call, not a crash."""
    from stages.envs.parsers import ToolCall, tool_parser

    tokenizer = _tokenizer(families, "qwen3_5_think")
    tokenizer.response_template = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {"reasoning_content": {"open": "<think>", "close": "</think>"},
                   "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True},
                   "content": {}}}
    parse, name = tool_parser("auto", tokenizer, "qwen3_5_think", import_function=None, max_chars=10_000)
    assert name == "response_template"
    turn = parse(f'{REASONING}\n</think>\n\nLet me see.<tool_call>{{"name": "f", "arguments": {ARGS}}}</tool_call>')
    assert turn.reasoning.strip() == REASONING and turn.content.strip() == "Let me see."
    assert turn.calls == [ToolCall("f", {"subject": "cat"})]
    nested = parse(f"{REASONING}\n</think>\n\n" + '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 3000
                   + "]" * 3000 + "}}</tool_call>")
    assert len(nested.calls) == 1 and "RecursionError" in nested.calls[0]
    long = parse(f"{REASONING}\n</think>\n\n" + "x" * 10_000)  # over max_turn_chars: not parsed, one malformed call
    assert long.calls == ["the turn could not be parsed: ValueError: the turn has 10031 characters, over "
                          "environment.max_turn_chars (10000): not parsed"], long.calls
