"""The sandbox as users name it: run code (`run_python`, `run_shell`), a reward function (`tests_pass`, for
`ppo.reward.terms`) and a tool (`python_tools`, for `ppo.environment.tools`). docs/sandbox.md.

    run_python("print(1 + 1)").stdout == "2\\n"
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from stages.sandbox.local import Limits, SandboxResult, run

DEFAULT = Limits()
_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def run_python(code: str, limits: Limits = DEFAULT, stdin: str = "") -> SandboxResult:
    """Run Python `code` in the sandbox."""
    return run("python", code, limits, stdin)


def run_shell(command: str, limits: Limits = DEFAULT, stdin: str = "") -> SandboxResult:
    """Run a `/bin/sh` script in the sandbox."""
    return run("shell", command, limits, stdin)


def code_of(response: str) -> str:
    """The code in a response: its first fenced block (```python ... ```), else the whole text."""
    fenced = _FENCED.search(response)
    return fenced.group(1) if fenced else response


def tests_pass(prompts: list[list[dict]], responses: list[str], tests: list[str], **columns: list) -> list[float]:
    """A reward function (`reward.terms`, `reward.columns: [tests]`): 1 where the response's code, followed by
    its record's `tests` (asserts), runs to exit 0 in the sandbox, else 0. The runs go on side by side (each
    is a process of its own). Other declared columns are taken and not read."""
    programs = [code_of(response) + "\n\n" + test for response, test in zip(responses, tests, strict=True)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        return [1.0 if result.ok else 0.0 for result in pool.map(run_python, programs)]


def python_tools(row: dict) -> list[Callable]:
    """The sandbox as a tool (`environment.tools: stages.sandbox.code:python_tools`): `run_python`."""

    def run_python_code(code: str) -> str:
        """Run Python code and see how it ended, its standard output and its standard error.

        Args:
            code: the Python program to run.
        """
        return run_python(code).text()

    return [run_python_code]
