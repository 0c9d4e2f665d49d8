"""`rlhf serve-env`'s cost per request on loopback: the demo's tool world served in its own process, driven by
the trainer's own client (`stages.envs.remote.served.EnvironmentServer`, one kept-alive connection pool).

    python -m bench.serve_env            (about half a minute)

Each of `--episodes` episodes is a reset, a tool call's step, the final answer's step and a close, timed
request by request from the client's side (what a turn of a served episode waits for beyond the tool itself).
Prints median and 90th percentile per route and writes `bench/results/serve-env-<date>.json`. A benchmark,
not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
ROW = {"messages": [{"role": "user", "content": "Describe the cat."}], "liked": "warm calm kind"}
CALL = {"content": "", "calls": [{"name": "preferences", "arguments": {"subject": "cat"}}]}
ANSWER = {"content": "A warm, calm, kind cat.", "calls": []}


def main(argv: list[str] | None = None) -> int:
    from rlhf.sections.environment import EnvironmentServerConfig
    from stages.envs.remote.served import EnvironmentServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--label", default="", help="a word saved with the numbers (before, after...)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-env", "--kind", "ours", "--tools",
                               "rlhf.demo.tools:tools", "--port", str(port)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, server)
        client = EnvironmentServer(EnvironmentServerConfig(url=url))
        times: dict[str, list[float]] = {"reset": [], "step": [], "close": []}

        def timed(route: str, body: dict) -> dict:
            started = time.perf_counter()
            answer = client.request("POST", f"/{route}", body)
            times[route].append(time.perf_counter() - started)
            return answer

        for _ in range(args.episodes):
            episode = timed("reset", {"row": ROW})["episode"]
            timed("step", {"episode": episode, "turn": 0, "assistant": CALL})
            timed("step", {"episode": episode, "turn": 1, "assistant": ANSWER})
            timed("close", {"episode": episode})
    finally:
        server.terminate()
        server.wait(10)
    rows = {route: _quantiles(np.array(seconds) * 1000) for route, seconds in times.items()}
    for route, row in rows.items():
        print(f"{route}: {row} (ms: median, p90)")
    out = args.out or REPO / "bench" / "results" / f"serve-env-{args.label or 'latency'}-{datetime.date.today()}.json"
    out.write_text(json.dumps({"episodes": args.episodes, "label": args.label,
                               "machine": platform.processor() or platform.machine(), "results_ms": rows}, indent=2))
    print(f"wrote {out}")
    return 0


def _wait(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            httpx.get(url + "/health", timeout=2).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"rlhf serve-env did not answer on {url}")


def _quantiles(ms: np.ndarray) -> dict:
    return {"median": round(float(np.median(ms)), 3), "p90": round(float(np.percentile(ms, 90)), 3)}


if __name__ == "__main__":
    sys.exit(main())
