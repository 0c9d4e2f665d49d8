"""Rewards from Python functions: the terms of the RL stage's `reward` section that name `module:function`.

A reward function is called on the main process, once per batch of responses:

    function(prompts, responses, **columns) -> one float (or None) per response

    prompts     list[list[dict]]  the chat messages each response answers ({"role", "content"})
    responses   list[str]         the responses, decoded without special tokens
    columns     list each         every column of `reward.columns`, the prompt records' values in the same order

It returns a sequence as long as `responses` of real numbers, or None where it gives no reward
(the term then adds nothing to that response's score; how many were None is logged). What is
refused, with `RewardFunctionError` naming the term, the function and, where it applies, the batch
and the row: a function that cannot be imported or does not take those arguments (checked before
any stage runs), an answer of the wrong length, a value that is not a number, NaN or infinite; a
function that raises stops the stage naming the prompt it raised on, and the last full-state
checkpoint is kept, so the stage resumes from it.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf.sections.ppo import PPOConfig
from rlhf.sections.reward_terms import RewardTerm
from stages.common.errors import StageUserError
from stages.common.user_code import imported_function, on_import_path


class RewardFunctionError(StageUserError):
    """A reward function could not be used, or gave what a reward cannot be."""


@dataclass(frozen=True)
class RewardFunction:
    """A function term, imported and checked."""

    term: RewardTerm
    call: Callable
    columns: tuple[str, ...]
    """The prompt columns it receives by name (`reward.columns`)."""

    def describe(self) -> str:
        return f"reward term {self.term.name!r} ({self.term.function})"


def load_reward_functions(section: PPOConfig) -> list[RewardFunction]:
    """Every function term of `section.reward`, imported (from the project, or `section.paths` first) and
    checked to take `(prompts, responses, **columns)`."""
    on_import_path(section.paths)
    terms = section.reward
    return [_load(term, tuple(terms.columns)) for term in terms.functions]


def _load(term: RewardTerm, columns: tuple[str, ...]) -> RewardFunction:
    described = f"reward term {term.name!r} ({term.function})"
    call = imported_function(term.function, described, RewardFunctionError, "ppo.paths")
    try:
        inspect.signature(call).bind([], [], **{column: [] for column in columns})
    except TypeError as e:
        wanted = ", ".join(["prompts", "responses", *columns])
        raise RewardFunctionError(f"{described}: it must take ({wanted}) (the columns by name), but its signature "
                                  f"is {inspect.signature(call)}: {e}") from None
    except ValueError:  # a builtin without a signature: checked when called
        pass
    return RewardFunction(term, call, columns)


def source_digests(section: PPOConfig) -> dict[str, str]:
    """Each function term's name -> digest of the source file that defines it: part of the RL
    stage's cache key, so editing a reward function reruns the stage and nothing before it."""
    digests = {}
    for function in load_reward_functions(section):
        try:
            source = inspect.getsourcefile(function.call)
        except TypeError:
            source = None
        content = Path(source).read_bytes() if source and Path(source).is_file() else function.term.function.encode()
        digests[function.term.name] = hashlib.sha256(content).hexdigest()
    return digests


def reward_values(function: RewardFunction, prompts: list[list[dict]], responses: list[str],
                  columns: dict[str, list], batch: int | str) -> list[float | None]:
    """`function` on one batch (`batch`: the iteration, or which evaluation, for messages), its answer
    checked: one real, finite number or None per response."""
    given = {name: columns[name] for name in function.columns}
    try:
        answer = function.call(prompts, responses, **given)
    except Exception as e:  # noqa: BLE001 - a user's function: name it and the prompt it failed on
        row = _failing_row(function, prompts, responses, given)
        where = f" on row {row} (prompt {_prompt_text(prompts[row])!r})" if row is not None else ""
        raise RewardFunctionError(f"{function.describe()} raised in batch {batch}{where}: "
                                  f"{type(e).__name__}: {e}") from e
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence) and not hasattr(answer, "__len__"):
        raise RewardFunctionError(f"{function.describe()} returned {type(answer).__name__} in batch {batch}; "
                                  "it must return one float (or None) per response")
    answer = list(answer)
    if len(answer) != len(responses):
        raise RewardFunctionError(f"{function.describe()} returned {len(answer)} values for {len(responses)} responses "
                                  f"in batch {batch}")
    values: list[float | None] = []
    for row, value in enumerate(answer):
        if value is None:
            values.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"{function.describe()}: batch {batch}, row {row} (prompt "
                                      f"{_prompt_text(prompts[row])!r}): {value!r} is not a number")
        if not math.isfinite(float(value)):
            raise RewardFunctionError(f"{function.describe()}: batch {batch}, row {row} (prompt "
                                      f"{_prompt_text(prompts[row])!r}): {float(value)} is not finite")
        values.append(float(value))
    return values


def _failing_row(function: RewardFunction, prompts: list[list[dict]], responses: list[str],
                 columns: dict[str, list]) -> int | None:
    """The first row the function raises on alone (None when every row passes alone)."""
    for row in range(len(responses)):
        try:
            function.call(prompts[row:row + 1], responses[row:row + 1],
                          **{name: values[row:row + 1] for name, values in columns.items()})
        except Exception:  # noqa: BLE001
            return row
    return None


def _prompt_text(messages: list[dict]) -> str:
    text = messages[-1]["content"] if messages else ""
    return text if len(text) <= 120 else text[:117] + "..."
