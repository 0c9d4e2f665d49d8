"""The demo's code world (`demo.task: code`): a user asks for a one-line Python function ("Write f(x)
that returns x plus 3."); the assistant answers with its code (`def f(x):\\n    return x + 3`). Each
prompt record carries its `tests` (two asserts), which a reward function runs in the sandbox
(`stages.sandbox.code:tests_pass`). The SFT demonstrations are right `correct_rate` of the time and
otherwise take a wrong operator or constant, so an SFT policy writes the format and RL can learn the rest.

`gold_code_score` is the hidden gold: it never runs the answer, it reads it (a strict pattern) and
computes it on inputs the tests do not show: 1 where it is right on all of them, 0 where it is wrong,
-1 where it is not a function of that form at all. Imports nothing of the project: the world builder uses it.
"""

from __future__ import annotations

import math
import random
import re

OPERATIONS = {"plus": "+", "minus": "-", "times": "*"}
CONSTANTS = range(1, 100)
PROMPT_TEMPLATES = ("Write f(x) that returns x {} {}.", "Write a Python function f(x) that gives x {} {}.",
                    "Define f(x) as x {} {}.", "Give me f(x) returning x {} {}.")
PROMPT_ENDINGS = ("", " Please.", " Be brief.")
TEST_INPUTS = (2, 5)
"""The inputs the record's `tests` assert on: what the policy and its reward see."""
GOLD_INPUTS = (-3, 0, 1, 4, 7, 10)
"""The inputs the gold function checks: none of them in the tests."""
_ASKED = re.compile(r"x (plus|minus|times) (\d+)\.")
_ANSWER = re.compile(r"\s*def f\(x\):\n    return x ([+\-*]) (\d+)\s*")


def asked(prompt: str) -> tuple[str, int]:
    """The operator symbol and constant a code-world prompt asks for: "... x plus 3." -> ("+", 3)."""
    found = _ASKED.search(prompt)
    if found is None:
        raise ValueError(f"not a code-world prompt: {prompt!r}")
    return OPERATIONS[found.group(1)], int(found.group(2))


def _apply(symbol: str, x: int, k: int) -> int:
    return x + k if symbol == "+" else x - k if symbol == "-" else x * k


def code_text(symbol: str, k: int) -> str:
    """The answer that defines f(x) = x <symbol> k, exactly as the demonstrations write it."""
    return f"def f(x):\n    return x {symbol} {k}"


def asserts_for(symbol: str, k: int) -> str:
    """A prompt record's `tests`: asserts on `TEST_INPUTS`."""
    return "\n".join(f"assert f({x}) == {_apply(symbol, x, k)}" for x in TEST_INPUTS)


def gold_code_score(prompt: str, response: str) -> float:
    """Hidden quality of an answer: 1 if it defines the asked function (right on every `GOLD_INPUTS`), 0 if it
    defines another of the same form, -1 if it is not `def f(x):` returning `x <op> <integer>`."""
    written = _ANSWER.fullmatch(response)
    if written is None:
        return -1.0
    symbol, k = asked(prompt)
    theirs, their_k = written.group(1), int(written.group(2))
    right = all(_apply(theirs, x, their_k) == _apply(symbol, x, k) for x in GOLD_INPUTS)
    return 1.0 if right else 0.0


def _prompt(rng: random.Random) -> str:
    return (rng.choice(PROMPT_TEMPLATES).format(rng.choice(list(OPERATIONS)), rng.choice(CONSTANTS))
            + rng.choice(PROMPT_ENDINGS))


def _answer(rng: random.Random, prompt: str, correct_rate: float) -> str:
    """The demonstrated answer: right `correct_rate` of the time, else a wrong operator or constant."""
    symbol, k = asked(prompt)
    if rng.random() >= correct_rate:
        if rng.random() < 0.5:
            symbol = rng.choice([s for s in OPERATIONS.values() if s != symbol])
        else:
            k = rng.choice([c for c in CONSTANTS if c != k])
    return code_text(symbol, k)


def code_records(cfg, unique) -> dict[str, list[dict]]:
    """The code world's data sets from `cfg` (`DemoWorldConfig`), records made distinct by `unique` (the world
    builder's): SFT prompt-response pairs, preference pairs labelled by a Bradley-Terry coin on the gold,
    and prompts with their `tests`, no held-out prompt also in training."""
    rng = random.Random(f"code:{cfg.seed}")
    sft = unique(rng, cfg.n_sft + cfg.n_sft_eval, lambda: _sft_record(rng, cfg),
                 lambda r: (r["prompt"], r["response"]))
    pairs = unique(rng, cfg.n_pairs + cfg.n_pairs_eval, lambda: _pair(rng, cfg), lambda r: tuple(r.values()))
    every = [t.format(op, k) + e for t in PROMPT_TEMPLATES for op in OPERATIONS for k in CONSTANTS
             for e in PROMPT_ENDINGS]
    if cfg.n_prompts + cfg.n_prompts_eval > len(every):
        raise ValueError(f"the code world has {len(every)} distinct prompts; "
                         f"{cfg.n_prompts + cfg.n_prompts_eval} were asked for")
    prompts = [{"prompt": p, "tests": asserts_for(*asked(p))}
               for p in rng.sample(every, cfg.n_prompts + cfg.n_prompts_eval)]
    return {"sft": sft[: cfg.n_sft], "sft_eval": sft[cfg.n_sft:],
            "preferences": pairs[: cfg.n_pairs], "preferences_eval": pairs[cfg.n_pairs:],
            "prompts": prompts[: cfg.n_prompts], "prompts_eval": prompts[cfg.n_prompts:]}


def _sft_record(rng: random.Random, cfg) -> dict:
    prompt = _prompt(rng)
    return {"prompt": prompt, "response": _answer(rng, prompt, cfg.correct_rate)}


def _pair(rng: random.Random, cfg) -> dict:
    """Two answers of different gold, the better chosen with the labelling coin's probability."""
    prompt = _prompt(rng)
    while True:
        a, b = _answer(rng, prompt, 0.5), _answer(rng, prompt, 0.5)
        ga, gb = gold_code_score(prompt, a), gold_code_score(prompt, b)
        if ga != gb:
            break
    p_a = 1.0 / (1.0 + math.exp(-(ga - gb) / cfg.label_temperature))
    chosen, rejected = (a, b) if rng.random() < p_a else (b, a)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
