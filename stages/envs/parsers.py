"""An assistant turn's text as a structured message: its reasoning, its answer and its tool calls, in
the convention of the model's family (`environment.tool_parser`).

A parser is `text -> AssistantTurn`. It never raises: whatever the policy writes is at worst a
malformed call, answered with the reason (`AssistantTurn.calls` holds the reason as text). The
conventions, each as the family's models write a call:

- hermes (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- qwen3_coder (Qwen3.5/3.6/3.8, Nemotron-3): `<tool_call><function=NAME><parameter=K>V</parameter>...`
- llama3_json (Llama-3.1, 3.2): `{"name": ..., "parameters": {...}}`, calls joined by `;`
- mistral (v0.3 and later): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]NAME[ARGS]{...}`
- harmony (gpt-oss): a `commentary` message `to=functions.NAME` whose body is the JSON arguments
- deepseek (V3, V3.1, R1): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a json fence, or V3.1's form
- glm (GLM-4.5): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`
- pythonic (LFM2): `<|tool_call_start|>[name(k='v')]<|tool_call_end|>`

Reasoning is the text before `</think>` (the opening `<think>` may be the generation prompt's), or
gpt-oss's `analysis` channel. `auto` is the tokenizer's `response_template` through transformers'
`parse_response` where it has one, else the convention the chat template writes (`detect_parser`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from stages.common.errors import StageUserError


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict

    def message(self) -> dict:
        """The call as chat templates take it in an assistant message's `tool_calls`."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class AssistantTurn:
    """One assistant turn, parsed: what the environment receives and the transcript records."""

    text: str
    """The turn as sampled, decoded with its special tokens (the end-of-turn token not)."""
    content: str
    """The answer: the text without its reasoning and its calls."""
    reasoning: str | None = None
    """The reasoning block's text; None where the turn has none."""
    calls: list[ToolCall | str] = field(default_factory=list)
    """The turn's calls in order: well-formed ones, or a malformed one's reason as text."""

    @property
    def calls_tools(self) -> bool:
        """Whether the turn calls (or tries to call) a tool: then it is not the episode's answer."""
        return bool(self.calls)

    def message(self) -> dict:
        """The turn as a chat message: `content`, `reasoning_content` and the well-formed `tool_calls`."""
        message = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        well_formed = [call.message() for call in self.calls if isinstance(call, ToolCall)]
        if well_formed:
            message["tool_calls"] = well_formed
        return message


def turn_body(turn: AssistantTurn) -> dict:
    """The model's turn as an environment server receives it (`stages.envs.remote.served`): its text,
    answer, reasoning and calls (a malformed call as its reason's text), and the OpenAI-style message."""
    calls = [dataclasses.asdict(call) if isinstance(call, ToolCall) else call for call in turn.calls]
    return {"text": turn.text, "content": turn.content, "reasoning": turn.reasoning, "calls": calls,
            "message": turn.message()}


def turn_of_body(body: dict) -> AssistantTurn:
    """A turn as `turn_body` sent it, on the server's side. A call object without its name or arguments
    is a malformed body (ValueError: the server answers 400), not a missing key (404 there: "unknown episode")."""
    calls = []
    for index, call in enumerate(body.get("calls", [])):
        if isinstance(call, dict) and not {"name", "arguments"} <= call.keys():
            raise ValueError(f"call {index} of the turn has keys {sorted(call)}; {CALL_SHAPE}")
        calls.append(ToolCall(call["name"], call["arguments"]) if isinstance(call, dict) else str(call))
    return AssistantTurn(text=body.get("text", ""), content=body.get("content", ""), reasoning=body.get("reasoning"),
                         calls=calls)


ToolParser = Callable[[str], AssistantTurn]
"""The assistant turn's text -> its structured message."""

CALL_SHAPE = 'a call must be {"name": <tool>, "arguments": {...}}'


def _call(name: object, arguments: object) -> ToolCall | str:
    """A call from its parts, or the reason it is malformed."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as e:
            return f"the call's arguments are not JSON: {type(e).__name__}"
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return CALL_SHAPE
    if not re.fullmatch(r"[\w.:/\-]{1,128}", name.strip()):
        return f"{name.strip()[:40]!r} is not a tool's name"
    try:  # what a tool, a server or a transcript is sent: strict JSON, UTF-8
        json.dumps(arguments, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, TypeError, UnicodeEncodeError, RecursionError) as e:
        return f"the call's arguments are not strict JSON (NaN or infinity, a lone surrogate, a Python value): " \
               f"{type(e).__name__}"
    return ToolCall(name.strip(), arguments)


def _json_call(body: str, arguments_key: str = "arguments") -> ToolCall | str:
    """A call written as a JSON object `{"name", <arguments_key>}`."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return f"the call is not JSON: {e.msg}"
    except (ValueError, RecursionError) as e:  # a 5,000-digit integer, 3,000 nested brackets
        return f"the call is not JSON: {type(e).__name__}"
    if not isinstance(call, dict):
        return CALL_SHAPE
    return _call(call.get("name"), call.get(arguments_key, call.get("arguments", {})))


def _value(text: str) -> object:
    """An XML-style parameter's value: JSON where it parses as JSON (numbers, lists), else the text."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest): the text before `</think>` (the opening tag dropped), or None and the
    text where the turn has no closed reasoning block; an unclosed `<think>` is all reasoning."""
    if "</think>" in text:
        before, _, after = text.partition("</think>")
        return before.split("<think>", 1)[-1].strip("\n"), after.lstrip("\n")
    if text.lstrip().startswith("<think>"):
        return text.lstrip()[len("<think>"):].strip("\n"), ""
    return None, text


def split_turn(text: str) -> AssistantTurn:
    """A turn read for its reasoning alone (`split_reasoning`: the `</think>` convention), no calls:
    what a single response without tools is read with where its family has nothing more particular."""
    reasoning, answer = split_reasoning(text)
    return AssistantTurn(text, answer, reasoning)


def reasoning_parser(tokenizer) -> ToolParser:
    """How a single response's reasoning is read in the model family's convention: the tokenizer's
    response template where it has one, gpt-oss's channels (`harmony`), else `split_turn`. Never
    raises (`never_raising`); a response without reasoning reads as having none."""
    if getattr(tokenizer, "response_template", None) is not None:
        return never_raising(response_template_parser(tokenizer))
    if detect_parser(getattr(tokenizer, "chat_template", None) or "") == "harmony":
        return never_raising(harmony)
    return never_raising(split_turn)


def without_special_tokens(tokenizer, text: str) -> str:
    """`text` with the tokenizer's special tokens taken out, as `decode(skip_special_tokens=True)` would."""
    for token in tokenizer.all_special_tokens:
        text = text.replace(token, "")
    return text


class _Scan:
    """Forward searches in one text, each marker's next place kept: a text of many openers and no closer
    costs one pass per marker, not one per opener, so every parser here runs in time linear in the turn
    (a backtracking regex such as `<a>(.*?)</a>` scans to the end once per `<a>`: quadratic)."""

    def __init__(self, text: str):
        self.text = text
        self.seen: dict[str, tuple[int, int]] = {}
        """marker -> (from where it was looked for, where it was found or -1)."""

    def find(self, marker: str, at: int) -> int:
        """The first `marker` at or after `at`, or -1."""
        since, found = self.seen.get(marker, (len(self.text) + 1, -1))
        if at < since or (found != -1 and found < at):
            since, found = at, self.text.find(marker, at)
            self.seen[marker] = (since, found)
        return found

    def head(self, opener: str, at: int) -> tuple[str, int] | None:
        """The first `opener NAME>` at or after `at` whose NAME holds no `>` or newline: (NAME, the place
        after its `>`); None where there is none."""
        while (opened := self.find(opener, at)) != -1:
            start = opened + len(opener)
            closing, newline = self.find(">", start), self.find("\n", start)
            if closing == -1:
                return None
            if newline == -1 or closing < newline:
                return self.text[start:closing], closing + 1
            at = newline  # every opener before that newline meets it before a `>` too
        return None


def _blocks(text: str, start: str, end: str) -> tuple[str, list[tuple[str, bool]]]:
    """The text outside `start ... end` blocks, and each block's body with whether it was closed (an
    unclosed one runs to the end of the text)."""
    scan, outside, found, at = _Scan(text), [], [], 0
    while (opened := scan.find(start, at)) != -1:
        outside.append(text[at:opened])
        body = opened + len(start)
        closed = scan.find(end, body)
        if closed == -1:
            found.append((text[body:], False))
            at = len(text)
            break
        found.append((text[body:closed], True))
        at = closed + len(end)
    outside.append(text[at:])
    return "".join(outside).strip(), found


def _enclosed(text: str, opener: str, closer: str) -> list[str]:
    """The bodies of `opener ... closer` pairs in order, each closed by the first `closer` after it."""
    scan, found, at = _Scan(text), [], 0
    while (opened := scan.find(opener, at)) != -1:
        closed = scan.find(closer, opened + len(opener))
        if closed == -1:
            break
        found.append(text[opened + len(opener):closed])
        at = closed + len(closer)
    return found


def _tagged(start: str, end: str, body: Callable[[str], ToolCall | str]) -> ToolParser:
    """A parser for calls written as `start BODY end` blocks, each body read by `body`."""

    def parse(text: str) -> AssistantTurn:
        reasoning, rest = split_reasoning(text)
        content, found = _blocks(rest, start, end)
        calls = [body(b) if closed else f"the call is not closed with {end}" for b, closed in found]
        return AssistantTurn(text, content, reasoning, calls)

    return parse


def _coder_body(body: str) -> ToolCall | str:
    """`<function=NAME><parameter=K>V</parameter>...</function>` (a value's newlines next to its tags dropped)."""
    scan = _Scan(body)
    function = scan.head("<function=", 0)
    if function is None:
        return "the call must be <function=NAME><parameter=KEY>VALUE</parameter></function>"
    name, at = function
    end = scan.find("</function>", at)
    inner = _Scan(body[at:] if end == -1 else body[at:end])
    parameters, at = {}, 0
    while (parameter := inner.head("<parameter=", at)) is not None:
        key, start = parameter
        start += inner.text.startswith("\n", start)
        closed = inner.find("</parameter>", start)
        if closed == -1:
            break
        value = inner.text[start:closed]
        parameters[key.strip()] = _value(value[:-1] if value.endswith("\n") else value)
        at = closed + len("</parameter>")
    return _call(name, parameters)


def _glm_body(body: str) -> ToolCall | str:
    """`NAME<arg_key>K</arg_key><arg_value>V</arg_value>...`."""
    name = body.split("<arg_key>", 1)[0]
    keys, values = _enclosed(body, "<arg_key>", "</arg_key>"), _enclosed(body, "<arg_value>", "</arg_value>")
    if len(keys) != len(values):
        return "every <arg_key> needs its <arg_value>"
    return _call(name, {k.strip(): _value(v) for k, v in zip(keys, values, strict=True)})


def _unfenced(text: str) -> str:
    """A code fence's body (```` ```json ... ``` ````, either fence optional), spaces around it dropped."""
    body = text.strip()
    if body.startswith("```"):
        body = body[3:].removeprefix("json")
    return body.removesuffix("```").strip()


def _deepseek_body(body: str) -> ToolCall | str:
    """V3's `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` or V3.1's `NAME<｜tool▁sep｜>{...}`."""
    head, sep, tail = body.partition("<｜tool▁sep｜>")
    if not sep:
        return "the call must be NAME<｜tool▁sep｜>ARGUMENTS"
    if head.strip() == "function":  # V3: the name on the first line, the arguments in a json fence
        name, _, arguments = tail.partition("\n")
        return _call(name, _unfenced(arguments))
    return _call(head, tail)


def _pythonic_body(body: str) -> ToolCall | str | list[ToolCall | str]:
    """`[name(k='v'), other(n=1)]`: Python call syntax with literal arguments."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"the call is not a Python call list: {type(e).__name__}"
    calls = tree.elts if isinstance(tree, ast.List) else [tree]
    parsed: list[ToolCall | str] = []
    for call in calls:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            parsed.append("a call must be name(key=value, ...)")
            continue
        try:
            parsed.append(_call(call.func.id, {k.arg: ast.literal_eval(k.value) for k in call.keywords}))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as e:
            parsed.append(f"the call's arguments are not literals: {type(e).__name__}")
    return parsed


def pythonic(text: str) -> AssistantTurn:
    reasoning, rest = split_reasoning(text)
    content, found = _blocks(rest, "<|tool_call_start|>", "<|tool_call_end|>")
    calls: list[ToolCall | str] = []
    for body, closed in found:
        parsed = _pythonic_body(body) if closed else "the call is not closed with <|tool_call_end|>"
        calls.extend(parsed if isinstance(parsed, list) else [parsed])
    return AssistantTurn(text, content, reasoning, calls)


def llama3_json(text: str) -> AssistantTurn:
    """A turn that is a JSON call (after `<|python_tag|>`, or starting with `{"name"`), calls joined by `;`."""
    reasoning, rest = split_reasoning(text)
    body = rest.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not tagged and not re.match(r'\{\s*"name"', body):
        return AssistantTurn(text, rest.strip(), reasoning)
    return AssistantTurn(text, "", reasoning, [_json_call(part, "parameters") for part in _json_objects(body)])


def _json_objects(body: str) -> list[str]:
    """`{...}; {...}` as its objects' texts (a `;` inside a string left alone)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return parts + [body[at:]]  # the rest is one malformed call
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return parts or [body]


def mistral(text: str) -> AssistantTurn:
    """`[TOOL_CALLS] [{...}, ...]` (v0.3), or `[TOOL_CALLS]NAME[ARGS]{...}` per call (v11 and later)."""
    reasoning, rest = split_reasoning(text)
    content, marker, calls_text = rest.partition("[TOOL_CALLS]")
    if not marker:
        return AssistantTurn(text, rest.strip(), reasoning)
    if "[ARGS]" in calls_text:
        calls = [_call(*part.split("[ARGS]", 1)) if "[ARGS]" in part else "the call needs [ARGS]"
                 for part in calls_text.split("[TOOL_CALLS]")]
        return AssistantTurn(text, content.strip(), reasoning, calls)
    try:
        listed = json.loads(calls_text)
    except (ValueError, RecursionError) as e:
        return AssistantTurn(text, content.strip(), reasoning, [f"the calls are not a JSON list: {type(e).__name__}"])
    listed = listed if isinstance(listed, list) else [listed]
    calls = [_call(c.get("name"), c.get("arguments", {})) if isinstance(c, dict) else CALL_SHAPE for c in listed]
    return AssistantTurn(text, content.strip(), reasoning, calls or [CALL_SHAPE])


HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
"""What ends a harmony message's body (or the end of the text)."""


def _harmony_messages(text: str) -> list[tuple[str, str]]:
    """gpt-oss's messages as (header, body): a header (after an optional `<|start|>assistant`) up to
    `<|message|>`, the body up to the message's end token or the end of the text."""
    scan, messages, at = _Scan(text), [], 0
    while (opened := scan.find("<|message|>", at)) != -1:
        header = text[at:opened].removeprefix("<|start|>assistant")
        start = opened + len("<|message|>")
        ends = [(found, end) for end in HARMONY_ENDS if (found := scan.find(end, start)) != -1]
        if not ends:
            body = text[start:]
            messages.append((header, body[:-1] if body.endswith("\n") else body))
            break
        found, end = min(ends)
        messages.append((header, text[start:found]))
        at = found + len(end)
    return messages


def harmony(text: str) -> AssistantTurn:
    """gpt-oss's channels: `analysis` is reasoning, `final` the answer, a `commentary` message
    addressed `to=functions.NAME` a call (its body the JSON arguments)."""
    reasoning, content, calls = [], [], []
    for header, body in _harmony_messages(text):
        recipient = re.search(r"to=functions\.([^\s<]+)", header)
        if recipient is not None:
            calls.append(_call(recipient.group(1), body))
        elif "<|channel|>analysis" in header:
            reasoning.append(body)
        else:
            content.append(body)
    if not reasoning and not content and not calls:
        return AssistantTurn(text, text.strip())
    return AssistantTurn(text, "\n".join(content).strip(), "\n".join(reasoning) if reasoning else None, calls)


def deepseek(text: str) -> AssistantTurn:
    """Calls between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`; the list's markers are not the answer."""
    turn = _tagged("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _deepseek_body)(text)
    content = turn.content.replace("<｜tool▁calls▁begin｜>", "").replace("<｜tool▁calls▁end｜>", "").strip()
    return dataclasses.replace(turn, content=content)


def hermes(text: str) -> AssistantTurn:
    return _tagged("<tool_call>", "</tool_call>", _json_call)(text)


PARSERS: dict[str, ToolParser] = {
    "hermes": hermes,
    "qwen3_coder": _tagged("<tool_call>", "</tool_call>", _coder_body),
    "llama3_json": llama3_json,
    "mistral": mistral,
    "harmony": harmony,
    "deepseek": deepseek,
    "glm": _tagged("<tool_call>", "</tool_call>", _glm_body),
    "pythonic": pythonic,
}
"""The built-in conventions by name: `environment.tool_parser` besides `auto` and `module:function`."""

DETECTED = (  # the first marker a chat template writes for a call decides its convention (None: none of ours)
    ("<|channel|>", "harmony"),
    ("<|tool_call>", None),  # Gemma 4's `call:NAME{...}`
    ("<atem:invoke", None),  # Muse's XML invocations
    ("tool▁call▁begin", "deepseek"),
    ("<arg_key>", "glm"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call_start|>", "pythonic"),
    ("<|tool_list_start|>", "pythonic"),  # LFM2, whose calls are the assistant's text
    ('"parameters": ', "llama3_json"),
    ("<|python_tag|>", "llama3_json"),
)


def detect_parser(chat_template: str | None) -> str | None:
    """The convention a chat template writes tool calls in, by its markers; None where none of ours is."""
    return next((name for marker, name in DETECTED if chat_template and marker in chat_template), None)


def never_raising(parse: ToolParser) -> ToolParser:
    """`parse`, made total: a parser that raises reads the turn as one malformed call, with the reason."""

    def parse_safely(text: str) -> AssistantTurn:
        try:
            turn = parse(text)
            if not isinstance(turn, AssistantTurn):
                raise TypeError(f"the tool parser returned {type(turn).__name__}, not an AssistantTurn")
            return turn
        except Exception as e:  # noqa: BLE001 - whatever the policy wrote, it must not stop the stage
            return AssistantTurn(text, "", None, [f"the turn could not be parsed: {type(e).__name__}: {str(e)[:200]}"])

    return parse_safely


def bounded(parse: ToolParser, max_chars: int) -> ToolParser:
    """`parse` on turns of at most `max_chars` characters (`environment.max_turn_chars`); a longer turn raises,
    so that `never_raising` reads it as one malformed call with the reason, unparsed. Our parsers take linear
    time (tests/test_parser_time.py); this bounds the ones we did not write: a `module:function` parser, or
    transformers' parser of a tokenizer's response template."""

    def parse_bounded(text: str) -> AssistantTurn:
        if len(text) > max_chars:
            raise ValueError(f"the turn has {len(text)} characters, over environment.max_turn_chars ({max_chars}): "
                             "not parsed")
        return parse(text)

    return parse_bounded


def response_template_parser(tokenizer) -> ToolParser:
    """transformers' `parse_response` on the tokenizer's own `response_template`, the turn read after
    the template's generation prompt (which may open the reasoning block itself)."""
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}], tokenize=False,
                                           add_generation_prompt=True)

    def parse(text: str) -> AssistantTurn:
        message = tokenizer.parse_response(text, prefix=prefix)
        calls = [_call(c.get("function", c).get("name"), c.get("function", c).get("arguments", {}))
                 for c in message.get("tool_calls") or []]
        reasoning = message.get("reasoning_content", message.get("thinking"))
        return AssistantTurn(text, message.get("content") or "", reasoning, calls)

    return parse


def tool_parser(name: str, tokenizer, model: str, import_function: Callable[[str], Callable],
                max_chars: int) -> tuple[ToolParser, str]:
    """The parser `environment.tool_parser` names, on turns of at most `max_chars` characters (`bounded`), and
    the convention's name (for the run's tags): `auto` reads the tokenizer's response template, else the chat
    template's markers; a template that renders no structured calls (the assistant's text as is) gets Hermes,
    the demo's convention."""
    parse, name = _named_parser(name, tokenizer, model, import_function)
    return never_raising(bounded(parse, max_chars)), name


def _named_parser(name: str, tokenizer, model: str,
                  import_function: Callable[[str], Callable]) -> tuple[ToolParser, str]:
    if name == "auto":
        if getattr(tokenizer, "response_template", None) is not None:
            return response_template_parser(tokenizer), "response_template"
        template = tokenizer.chat_template or ""
        detected = detect_parser(template)
        if not any(marker in template for marker, _ in DETECTED) and "tool_calls" not in template:  # text as is
            return hermes, "hermes (auto: the chat template renders no structured calls)"
        if detected is None:
            raise StageUserError(
                f"environment.tool_parser: auto found no tool-call convention in the chat template of {model} "
                f"(known: {', '.join(PARSERS)}); name one, or `module:function` for your own parser")
        name = detected
    if name in PARSERS:
        return PARSERS[name], name
    return import_function(name), name
