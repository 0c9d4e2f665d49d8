"""The demo's tool with a real API's latency (configs/tools-latency.yaml): `slow_tools(row)` gives the
`preferences` tool of `rlhf.demo.tools`, answering after 0.1-2 s. Its own module, so the world's
fingerprint (its builder's and its tool's source) is not changed by it."""

from __future__ import annotations

import json
import random
import time
import zlib
from collections.abc import Callable

from rlhf.demo.tools import liked_text


def slow_tools(row: dict) -> list[Callable]:
    """`environment.tools`: `preferences`, answering as `rlhf.demo.tools.tools` does after a delay drawn
    from a stream seeded by the record's conversation and the call's number, so a rerun waits as long."""
    answer = liked_text(row["liked"])
    delays = random.Random(zlib.crc32(json.dumps(row["messages"], sort_keys=True).encode()))

    def preferences(subject: str) -> str:
        """Look up which adjectives this user likes to hear about a subject.

        Args:
            subject: the thing the user asked about.
        """
        time.sleep(delays.uniform(0.1, 2.0))
        return answer

    return [preferences]
