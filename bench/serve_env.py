"""`rlhf serve-env`'s cost per request on loopback: the demo's tool world served in its own process, driven by
the trainer's own client (`stages.envs.remote.served.EnvironmentServer`, one kept-alive connection pool).

    python -m bench.serve_env                                  (about half a minute)
    python -m bench.serve_env --kind verifiers --at-once 16    (the world written for verifiers, as PPO drives it)

Each of `--episodes` episodes is a reset, a tool call's step, the final answer's step and a close, timed
request by request from the client's side (what a turn of a served episode waits for beyond the tool itself).
`--kind verifiers` serves examples/verifiers/tools_world (`make env-verifiers`); `--at-once` episodes run
side by side on threads, as the trainer's `environment.server.max_concurrent` does. Prints median and 90th
percentile per route, and the episodes' wall seconds per 64 (a rollout's worth), and writes
`bench/results/serve-env-<date>.json`. A benchmark, not a test: nothing here asserts.
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
from concurrent.futures import ThreadPoolExecutor
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
    parser.add_argument("--kind", choices=["ours", "verifiers"], default="ours")
    parser.add_argument("--at-once", type=int, default=1, help="episodes side by side (as max_concurrent)")
    parser.add_argument("--label", default="", help="a word saved with the numbers (before, after...)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    served = ["--module", "tools_world", "--path", "examples/verifiers"] if args.kind == "verifiers" else \
        ["--tools", "rlhf.demo.tools:tools"]
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-env", "--kind", args.kind, *served,
                               "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, server)
        client = EnvironmentServer(EnvironmentServerConfig(url=url, kind=args.kind, max_concurrent=args.at_once))
        times: dict[str, list[float]] = {"reset": [], "step": [], "close": []}

        def timed(route: str, body: dict) -> dict:
            started = time.perf_counter()
            answer = client.request("POST", f"/{route}", body)
            times[route].append(time.perf_counter() - started)
            return answer

        def one(_: int) -> None:
            episode = timed("reset", {"row": ROW})["episode"]
            timed("step", {"episode": episode, "turn": 0, "assistant": CALL})
            timed("step", {"episode": episode, "turn": 1, "assistant": ANSWER})
            timed("close", {"episode": episode})

        one(0)  # the server's first episode (imports, pools) is not what a run's episodes cost
        for seconds in times.values():
            seconds.clear()
        started = time.perf_counter()
        with ThreadPoolExecutor(args.at_once) as episodes:
            list(episodes.map(one, range(args.episodes)))
        wall = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(10)
    rows = {route: _quantiles(np.array(seconds) * 1000) for route, seconds in times.items()}
    for route, row in rows.items():
        print(f"{route}: {row} (ms: median, p90)")
    per_rollout = round(wall / args.episodes * 64, 3)
    print(f"{args.episodes} episodes, {args.at_once} at once: {wall:.2f} s, {per_rollout} s per 64")
    name = f"serve-env-{args.kind}-{args.label or 'latency'}-{datetime.date.today()}.json"
    out = args.out or REPO / "bench" / "results" / name
    out.write_text(json.dumps({"episodes": args.episodes, "label": args.label, "kind": args.kind,
                               "at_once": args.at_once, "seconds_per_64_episodes": per_rollout,
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
