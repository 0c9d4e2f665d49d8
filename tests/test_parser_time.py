"""Every built-in parser of the policy's text (`stages.envs.parsers.PARSERS`) runs in time linear in the
turn and never raises, on turns written to hurt: each convention's markers repeated, unclosed, nested
and interleaved, long plain text, long runs of spaces, and lone surrogates. A backtracking regex such as
`<a>(.*?)</a>` scans to the end once per `<a>`: gpt-oss's parser took 8.3 s on 39,000 characters of
plain text (issue 91). Each turn is timed at 20,000 and 200,000 characters (the parsing thread's CPU
time, which a loaded machine does not inflate): the larger must take under 0.5 s, and under 40 times the
smaller (linear growth is 10 times; quadratic, 100). Then `hypothesis` generates turns from those markers
and any text (surrogates, control characters and space runs among it): no parser raises on any, and each,
repeated to both sizes, passes the same bounds (derandomized: the same examples on every run, so that CI
is not decided by a draw)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.envs.parsers import PARSERS
from tests.helpers import cpu_seconds

UNITS = [
    "The cat is warm and calm. ", " ", "\n", "\ud800 lone surrogate ",
    "<tool_call>", "</tool_call>", "<tool_call><function=f>", "<parameter=x>", "<function=", "<parameter=x>\n1",
    "<arg_key>", "<arg_value>", "<arg_key>k</arg_key>", "<tool_call>f<arg_key>",
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json  ", "<｜tool▁sep｜>", "```",
    "<|start|>assistant<|channel|>commentary to=functions.f", "<|message|>", "<|channel|>analysis", "<|end|>",
    "<think>", "</think>", '<|python_tag|>{"name": "f", ', "{", "[", "[TOOL_CALLS]", "[TOOL_CALLS]f[ARGS]{",
    "<|tool_call_start|>[f(", "<|tool_call_start|>[f(x=1)]<|tool_call_end|>",
]
"""What a hostile turn repeats: one unit, or all of them interleaved."""


def turns(size: int) -> dict[str, str]:
    """Turns of `size` characters, by what they repeat; and some closed around an open interior."""
    repeated = {unit: (unit * (size // len(unit) + 1))[:size] for unit in UNITS}
    interleaved = {"all interleaved": ("".join(UNITS) * (size // len("".join(UNITS)) + 1))[:size]}
    closed = {
        "qwen3_coder's open parameters, closed call": f"<tool_call><function=f>{'<parameter=x>' * (size // 13)}"
                                                      "</tool_call>",
        "glm's open keys, closed call": f"<tool_call>f{'<arg_key>' * (size // 9)}</tool_call>",
        "deepseek's spaces in a fence": f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json{' ' * size}x"
                                        "<｜tool▁call▁end｜>",
        "harmony's headers without a message": "<|channel|>analysis" * (size // 19),
    }
    return repeated | interleaved | closed


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_parser_never_raises_and_takes_linear_time(name):
    parse = PARSERS[name]
    small, large = turns(20_000), turns(200_000)
    slow = {}
    for what in small:
        # the parser itself, not its never-raising wrapper: it must not raise either
        short, long = cpu_seconds(parse, small[what], repeats=2), cpu_seconds(parse, large[what])
        if long > 0.5 or long > 40 * short + 0.05:
            slow[what] = (round(short, 4), round(long, 4))
    assert not slow, f"{name}: seconds at 20k and 200k characters: {slow}"


PIECES = st.one_of(st.sampled_from(UNITS), st.text(max_size=40),
                   st.text(st.characters(codec=None, categories=["Cs", "Co", "Cc", "Zs"]), max_size=8))
"""A generated turn's pieces: markers of every convention, any text, and surrogates, control and space runs."""
GENERATED = st.lists(PIECES, min_size=1, max_size=60).map("".join)


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(turn=GENERATED)
def test_a_parser_never_raises_on_generated_turns(name, turn):
    """Markers nested, unclosed, repeated and interleaved with any text: the parser answers, never raises."""
    PARSERS[name](turn)


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(unit=GENERATED.filter(bool))
def test_a_parser_takes_linear_time_on_generated_turns_repeated(name, unit):
    """A generated turn repeated to 20,000 and 200,000 characters: under 0.5 s, and growing linearly."""
    parse = PARSERS[name]
    small, large = (unit * (20_000 // len(unit) + 1))[:20_000], (unit * (200_000 // len(unit) + 1))[:200_000]
    short, long = cpu_seconds(parse, small, repeats=2), cpu_seconds(parse, large)
    assert long <= 0.5 and long <= 40 * short + 0.05, f"{name}: {short:.4f} s at 20k, {long:.4f} s at 200k"
