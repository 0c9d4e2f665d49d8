"""A user's own Python named in the config as `module:function` (reward functions, environments):
their folders put on the import path, the function imported, and a clear error naming what failed."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from stages.common.errors import StageUserError


def on_import_path(folders: list[str]) -> None:
    """Put `folders` (absolute, or relative to the working directory) in front of the import path, in order."""
    for folder in reversed(folders):
        location = str(Path(folder).resolve())
        if location not in sys.path:
            sys.path.insert(0, location)


def imported_function(location: str, described: str, error: type[StageUserError], paths_field: str) -> Callable:
    """The callable `module:function` names; `error` names `described` and what went wrong."""
    module_name, attribute = location.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - whatever importing user code raises, the message names it
        raise error(f"{described}: cannot import {module_name!r}: {type(e).__name__}: {e} "
                    f"(is its folder in {paths_field}?)") from None
    call = getattr(module, attribute, None)
    if not callable(call):
        raise error(f"{described}: module {module_name!r} has no function {attribute!r}")
    return call
