"""`rlhf serve-env`: an environment served over HTTP on our protocol (`stages.envs.remote.served` is its client).

    rlhf serve-env --kind ours --tools rlhf.demo.tools:tools          our tool-calling environment
    rlhf serve-env --kind ours --factory my_env:make                   any `Environment` factory
    rlhf serve-env --kind verifiers --module my_taskset [--config '{...}']
                                                                        a verifiers environment, run from
                                                                        its own virtual environment (.env-verifiers)

It imports nothing but the standard library until it loads what it serves, so it runs in any
environment: `--kind verifiers` re-executes it with `.env-verifiers/bin/python` (`make env-verifiers`).
Episodes are kept by id; a step names its turn's number, so a step sent again (a client's retry after
a lost answer) gets the same answer, not a second step. A round's resets, steps or closes may come as
one request (`POST /reset_many`, `/step_many`, `/close_many`): each item is answered as its own request
would be, the items side by side on threads of the server's, `--max-connections` of them for every batch
together (a batch that gets none within its `timeout_s`, or an item not begun by then, is answered 503).
An episode idle for `--idle-s` is let go. `--workers N` spreads the episodes over N processes, each
loading what is served (`servers.spread`): a Python environment's work on N cores, not one.
A step whose environment raises answers HTTP 422 with the reason (the client fails that episode);
an unknown episode 404 (the client replays it: the server restarted). Binds 127.0.0.1 by default;
`--api-key-env VAR` requires `Authorization: Bearer $VAR` on every request (`servers.auth`); beyond this
machine without one it refuses to start unless `--insecure`. What clients may hold is bounded:
connections, time and bodies by `servers.guarded` (each request logged in one line on stderr), episodes
by `EpisodeCaps`; `GET /` gives the counters (episodes held, started, failed; requests refused by cause).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from servers.auth import CHALLENGE, UNAUTHORIZED, authorized, server_token
from servers.guarded import Caps, GuardedHandler, GuardedServer, Refused
from servers.spread import Spread

PROTOCOL = "rlhf-env/1"
REPO = Path(__file__).resolve().parents[1]
VENVS = {"verifiers": REPO / ".env-verifiers"}
"""The virtual environment each kind's server runs from (`make env-verifiers`); `ours` runs in the project's."""


class Served(Protocol):
    """What the server serves, whatever its kind: episodes started from a record and stepped by turns."""

    serves: str
    name: str

    def dataset(self, split: str) -> list[dict] | None:
        """The environment's own prompt records (`messages` and columns); None: it has none."""

    def start(self, row: dict) -> tuple[Any, list[dict], list[dict] | None]:
        """A new episode of `row`: its handle, the conversation the model answers first, the tools' schemas."""

    def step(self, handle: Any, assistant: dict) -> Any:
        """The answer to the model's turn (`turn_body`'s fields): a `stages.envs.environment.Step` (messages,
        reward, done, restart; imported only by what is served, so this module loads on the standard library)."""

    def end(self, handle: Any) -> None:
        """The episode is let go."""


@dataclass(kw_only=True)
class _Held:
    """An episode the server holds for a client: the environment's handle, the turns it answered and the
    last answer (sent again to a turn asked again), when it was last used, and its lock. The trainer's
    own record of the episode is `stages.envs.loop.Running`."""

    handle: Any
    turns: int = 0
    last: dict | None = None
    """The answer to turn `turns - 1`, sent again where that turn is asked again."""
    client: str = ""
    """The address of the client that started it (`EpisodeCaps.max_client_episodes`)."""
    touched: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, kw_only=True)
class EpisodeCaps:
    """How many episodes the server holds, for one client and in all; past either, `POST /reset` is refused
    (429 for the client's cap, 503 for the server's) until some are closed or let go when idle."""

    max_episodes: int = 4096
    """Episodes held at once, every client's."""
    max_client_episodes: int = 1024
    """Episodes held at once for one client address."""


DEFAULT_CAPS, DEFAULT_EPISODE_CAPS = Caps(), EpisodeCaps()
BATCH_TIMEOUT_S = 600.0
"""Seconds a batch's items have by default (the body's `timeout_s`, the client's per-request timeout, says else)."""


class EpisodeServer(GuardedServer):
    """Our protocol over `Served`, each connection on a thread of its own, within `Caps` and `EpisodeCaps`."""

    def __init__(self, address: tuple[str, int], served: Served, token: str | None, idle_s: float,
                 caps: Caps = DEFAULT_CAPS, episode_caps: EpisodeCaps = DEFAULT_EPISODE_CAPS):
        self.served, self.token, self.idle_s, self.episode_caps = served, token, idle_s, episode_caps
        self.episodes: dict[str, _Held] = {}
        self._swept = time.monotonic()
        super().__init__(address, _Handler, caps)
        self.batch_threads = threading.BoundedSemaphore(caps.max_connections)
        """Threads for batches' items, every batch's together: as many as the connections the server takes."""
        self.routes: dict[str, Callable[[dict, str], dict]] = {
            "/reset": self.reset, "/step": self.step, "/close": self.close_episode,
            "/reset_many": lambda body, client: self.batch(self.reset, "rows", "row", body, client),
            "/step_many": lambda body, client: self.batch(self.step, "steps", None, body, client),
            "/close_many": lambda body, client: self.batch(self.close_episode, "episodes", None, body, client)}

    def info(self) -> dict:
        """What is served, and its counters: episodes held, started and failed; requests, and refused by cause."""
        with self.lock:
            held = {"episodes": len(self.episodes), "started": self.counts["started"],
                    "failed": self.counts["failed"]}
        return {"protocol": PROTOCOL, "serves": self.served.serves, "name": self.served.name, "batches": True} \
            | held | self.counters()

    def answer(self, route: Callable[[dict, str], dict], body: dict, client: str) -> tuple[int, dict]:
        """`route`'s answer to `body` with its HTTP status: 200, or why it was refused or failed (429/503 past
        the episode caps, 404 an unknown episode, 400 a malformed body, 422 the served environment raised)."""
        try:
            return 200, route(body, client)
        except Refused as e:
            self.count(f"refused:{e.cause}")
            return e.status, {"error": str(e)}
        except KeyError as e:
            return 404, {"error": str(e.args[0])}
        except (ValueError, TypeError, RecursionError) as e:
            return 400, {"error": f"{type(e).__name__}: {e}"}
        except Exception as e:  # noqa: BLE001 - the served environment raised: this episode's request fails
            self.count("failed")
            return 422, {"error": f"{type(e).__name__}: {e}"}

    def batch(self, route: Callable[[dict, str], dict], key: str, field: str | None, body: dict, client: str) -> dict:
        """Each item of `body[key]` answered as its own request to `route` would be (`field`: the key its body
        puts it under), `at_once` of them side by side (all, unsaid) on the server's batch threads, each by the
        body's `timeout_s`, counted from its arrival (one under way by then: 504, and it goes on, a turn asked
        again gets its answer; one not begun: 503, and it never begins; no thread free by then: every item 503):
        {"results": [{"status": 200, "answer": {...}} or {"status": n, "error": why}, ...]}."""
        items, timeout_s = body.get(key), body.get("timeout_s", BATCH_TIMEOUT_S)
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise ValueError(f"a batch takes a list of objects as {key!r}")
        at_once = body.get("at_once", max(len(items), 1))
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"a batch's timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not isinstance(at_once, int) or isinstance(at_once, bool) or at_once < 1:
            raise ValueError(f"a batch's at_once must be a positive integer, got {at_once!r}")
        if not items:
            return {"results": []}
        deadline = time.monotonic() + timeout_s  # one for the whole batch: waiting for threads counts
        lanes = self._lanes(min(at_once, len(items)), timeout_s)
        if not lanes:
            self.count("refused:batch_threads")
            busy = {"error": f"all {self.caps.max_connections} of the server's batch threads stayed busy for "
                             f"{timeout_s:g} s; send the items again"}
            return {"results": [{"status": 503, **busy} for _ in items]}
        bodies = [{field: item} if field else item for item in items]
        answers = _Batch(self, route, bodies, client, deadline).run(lanes, timeout_s)
        return {"results": [{"status": status, "answer": answer} if status == 200 else {"status": status, **answer}
                            for status, answer in answers]}

    def _lanes(self, wanted: int, timeout_s: float) -> int:
        """Threads for one batch's items, taken from the server's `max_connections` of them (every batch's
        together): one, waiting up to `timeout_s`, then as many more as are free, up to `wanted`; 0: none
        came free in time."""
        if not self.batch_threads.acquire(timeout=timeout_s):
            return 0
        taken = 1
        while taken < wanted and self.batch_threads.acquire(blocking=False):
            taken += 1
        return taken

    def reset(self, body: dict, client: str) -> dict:
        row = body.get("row")
        if not isinstance(row, dict):
            raise ValueError("POST /reset takes {\"row\": {...}}")
        self._room_for(client)
        handle, messages, tools = self.served.start(row)
        episode = uuid.uuid4().hex
        with self.lock:
            self.episodes[episode] = _Held(handle=handle, client=client)
            self.counts["started"] += 1
        return {"episode": episode, "messages": messages, "tools": tools}

    def _room_for(self, client: str) -> None:
        caps = self.episode_caps
        with self.lock:
            held = len(self.episodes)
            mine = sum(e.client == client for e in self.episodes.values()) if held >= caps.max_client_episodes else 0
        if held >= caps.max_episodes:
            raise Refused(503, "episodes", f"the server holds {held} episodes, its most (--max-episodes): close "
                                           "some, or wait for idle ones to be let go")
        if mine >= caps.max_client_episodes:
            raise Refused(429, "client_episodes", f"{client} holds {mine} episodes, the most for one client "
                                                  "(--max-client-episodes)")

    def step(self, body: dict, client: str) -> dict:
        episode, turn, assistant = self._episode(body), body.get("turn"), body.get("assistant")
        if not isinstance(turn, int) or not isinstance(assistant, dict):
            raise ValueError("POST /step takes {\"episode\": id, \"turn\": n, \"assistant\": {...}}")
        with episode.lock:
            episode.touched = time.monotonic()
            if turn == episode.turns - 1 and episode.last is not None:
                return episode.last  # the client asks again for an answer it lost
            if turn != episode.turns:
                raise ValueError(f"turn {turn} is not this episode's next ({episode.turns})")
            step = self.served.step(episode.handle, assistant)
            episode.last, episode.turns = {"messages": step.messages, "reward": step.reward, "done": step.done,
                                           "restart": step.restart}, turn + 1
            return episode.last

    def close_episode(self, body: dict, client: str) -> dict:
        with self.lock:
            episode = self.episodes.pop(str(body.get("episode")), None)
        if episode is not None:
            self.served.end(episode.handle)
        return {}

    def _episode(self, body: dict) -> _Held:
        with self.lock:
            episode = self.episodes.get(str(body.get("episode")))
        if episode is None:
            raise KeyError(f"unknown episode {body.get('episode')!r} (ended, idle past {self.idle_s:g} s, or this "
                           "server restarted)")
        return episode

    def tick(self, now: float) -> None:
        """`_sweep` every half `idle_s` (at most a minute): a cancelled run's episodes, held mid-turn (a
        verifiers rollout waits on its model), are let go with no new request."""
        if now - self._swept >= min(60.0, self.idle_s / 2):
            self._swept = now
            self._sweep()

    def _sweep(self) -> None:
        """Episodes idle past `idle_s` let go (a client that stopped without closing them)."""
        now = time.monotonic()
        with self.lock:
            idle = [key for key, e in self.episodes.items() if now - e.touched > self.idle_s]
            gone = [self.episodes.pop(key) for key in idle]
        for episode in gone:
            try:
                self.served.end(episode.handle)
            except Exception as e:  # noqa: BLE001 - the sweep goes on (it runs on the server's watchdog)
                print(f"serve-env: letting an idle episode go failed: {type(e).__name__}: {e}", file=sys.stderr)


class _Batch:
    """One batch's items answered on threads of the server's (`EpisodeServer.batch_threads`): each thread
    takes the next item not yet begun until none is left or the batch's deadline has passed, then gives
    its thread back; so an item that hangs holds one thread, not its batch's."""

    def __init__(self, server: EpisodeServer, route: Callable[[dict, str], dict], bodies: list[dict], client: str,
                 deadline: float):
        self.server, self.route, self.bodies, self.client, self.deadline = server, route, bodies, client, deadline
        self.answers: list[tuple[int, dict] | None] = [None] * len(bodies)
        self.begun = self.ended = 0
        self.closed = False
        """Set at the deadline: no item begins after it."""
        self.changed = threading.Condition()

    def run(self, lanes: int, timeout_s: float) -> list[tuple[int, dict]]:
        """Every item's (status, answer): its own, 504 for one under way at the deadline (it goes on: a turn
        asked again gets its answer), 503 for one not begun by then (it never begins; the client sends it
        again alone)."""
        started = 0
        try:
            for _ in range(lanes):
                threading.Thread(target=self._lane, name="batch", daemon=True).start()
                started += 1
        finally:
            for _ in range(lanes - started):  # threads that could not start give their place back
                self.server.batch_threads.release()
        with self.changed:
            self.changed.wait_for(lambda: self.ended == len(self.bodies),
                                  timeout=max(0.0, self.deadline - time.monotonic()))
            self.closed, begun, answers = True, self.begun, list(self.answers)
        late = (504, {"error": f"not answered within {timeout_s:g} s"})
        unbegun = (503, {"error": f"not begun within {timeout_s:g} s; send it again"})
        return [answer or (late if index < begun else unbegun) for index, answer in enumerate(answers)]

    def _lane(self) -> None:
        try:
            while True:
                with self.changed:
                    if self.closed or self.begun == len(self.bodies) or time.monotonic() >= self.deadline:
                        return
                    index, self.begun = self.begun, self.begun + 1
                answer = self.server.answer(self.route, self.bodies[index], self.client)
                with self.changed:
                    self.answers[index] = answer
                    self.ended += 1
                    self.changed.notify_all()
        finally:
            self.server.batch_threads.release()


class _Handler(GuardedHandler):
    server: EpisodeServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.arrived()
        if not self._authorized():
            return
        url = urlsplit(self.path)
        if url.path in ("/", "/health"):
            return self.send_json(200, self.server.info())
        if url.path == "/dataset":
            split = parse_qs(url.query).get("split", ["train"])[0]
            try:
                rows = self.server.served.dataset(split)
            except Exception as e:  # noqa: BLE001 - the served environment's own data could not be read
                return self.send_json(422, {"error": f"{type(e).__name__}: {e}"})
            if rows is None:
                return self.send_json(404, {"error": f"{self.server.served.name} has no {split!r} dataset"})
            return self.send_json(200, {"rows": rows})
        self.send_json(404, {"error": f"no route GET {url.path}"})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        route = self.server.routes.get(urlsplit(self.path).path)
        if not self._authorized():
            return
        try:
            raw = self.body()
            if route is None:
                return self.send_json(404, {"error": f"no route POST {urlsplit(self.path).path}"})
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except Refused as e:
            return self.refuse(e)
        except (ValueError, RecursionError) as e:
            return self.send_json(400, {"error": f"{type(e).__name__}: {e}"})
        self.send_json(*self.server.answer(route, body, self.client_address[0]))

    def _authorized(self) -> bool:
        if authorized(self.server.token, self.headers.get("Authorization")):
            return True
        self.server.count("refused:unauthorized")
        self.close_connection = True  # a POST's body is left unread
        self.send_json(401, {"error": UNAUTHORIZED}, CHALLENGE | {"Connection": "close"})
        return False


class OursServed:
    """One of our environments (`environment.tools` or `environment.factory`), served: the tools'
    calls run here, as in the trainer's process."""

    serves = "ours"

    def __init__(self, tools: str | None, factory: str | None, paths: list[str], settings: dict):
        from rlhf.sections.environment import EnvironmentConfig
        from stages.common.user_code import on_import_path
        from stages.envs.answering import checked_step  # imported now, not in the first request's time
        from stages.envs.environment import environment_factory
        from stages.envs.parsers import turn_of_body

        on_import_path(paths)
        self.make, _ = environment_factory(EnvironmentConfig(tools=tools, factory=factory, **settings))
        self.name = tools or factory or ""
        self.checked_step, self.turn_of_body = checked_step, turn_of_body

    def dataset(self, split: str) -> list[dict] | None:
        return None

    def start(self, row: dict) -> tuple[Any, list[dict], list[dict] | None]:
        environment = self.make(row)
        messages = list(environment.reset(row))
        tools = environment.schemas() if hasattr(environment, "schemas") else None
        return environment, messages, tools

    def step(self, handle: Any, assistant: dict) -> Any:
        return self.checked_step(handle.step(self.turn_of_body(assistant)))

    def end(self, handle: Any) -> None:
        if hasattr(handle, "close"):
            handle.close()


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlhf serve-env", description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=["ours", "verifiers"], default="ours")
    parser.add_argument("--tools", help="ours: `module:function` giving a record's tools")
    parser.add_argument("--factory", help="ours: `module:function` giving a record's environment")
    parser.add_argument("--module", help="verifiers: the taskset's module (its id), importable here or from --path")
    parser.add_argument("--config", default="{}", help="verifiers: JSON merged into the environment's config")
    parser.add_argument("--settings", default="{}", help="ours: JSON of `ppo.environment` settings (max_turns...)")
    parser.add_argument("--path", action="append", default=[], help="a folder put in front of the import path")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes the episodes are spread over, each loading what is served (its own GIL "
                             "and event loop); 1: served in this process")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--idle-s", type=float, default=600.0, help="seconds an untouched episode is kept")
    parser.add_argument("--api-key-env", help="a variable holding the bearer token every request must carry")
    parser.add_argument("--insecure", action="store_true", help="serve beyond this machine without a token")
    parser.add_argument("--timeout-s", type=float, default=Caps.timeout_s,
                        help="seconds a request may take to arrive whole, and a connection may idle")
    parser.add_argument("--max-connections", type=int, default=Caps.max_connections,
                        help="connections (each a thread) at once, past it 503; as many threads for batches' items")
    parser.add_argument("--max-episodes", type=int, default=EpisodeCaps.max_episodes,
                        help="episodes held at once; past it a reset is answered 503")
    parser.add_argument("--max-client-episodes", type=int, default=EpisodeCaps.max_client_episodes,
                        help="episodes held at once for one client address; past it 429")
    return parser.parse_args(argv)


def served_of(args: argparse.Namespace) -> Served:
    """What `args` says to serve, loaded."""
    if args.kind == "verifiers":
        if not args.module:
            raise SystemExit("--kind verifiers needs --module (the taskset's module)")
        from servers.verifiers_bridge import VerifiersServed

        return VerifiersServed(args.module, json.loads(args.config))
    if bool(args.tools) == bool(args.factory):
        raise SystemExit("--kind ours needs one of --tools and --factory")
    return OursServed(args.tools, args.factory, args.path, json.loads(args.settings))


def launch(argv: list[str]) -> int:
    """`rlhf serve-env`: serve in this process, or (a kind with its own environment) from that
    environment's Python, which must be built (`make env-verifiers`)."""
    args = arguments(argv)
    venv = VENVS.get(args.kind)
    if venv is not None and Path(sys.prefix).resolve() != venv.resolve():
        python = venv / "bin" / "python"
        if not (venv / ".installed").exists():
            raise SystemExit(f"--kind {args.kind} runs from {venv}, which is not built: run `make env-{args.kind}`")
        path = os.pathsep.join([str(REPO), *map(str, map(Path.resolve, map(Path, args.path))), os.getcwd(),
                                os.environ.get("PYTHONPATH", "")])
        os.execve(str(python), [str(python), "-m", "servers.env_server", *argv],
                  os.environ | {"PYTHONPATH": path})
    return serve(args)


def serve(args: argparse.Namespace) -> int:
    sys.path[:0] = [*(str(Path(p).resolve()) for p in args.path), os.getcwd()]  # what it serves: importable here
    token = server_token(args.api_key_env, args.host, "run episodes", args.insecure)
    if args.workers < 1:
        raise SystemExit(f"--workers takes a positive number of processes, got {args.workers}")
    served = served_of(args) if args.workers == 1 else Spread(functools.partial(served_of, args), args.workers)
    server = EpisodeServer((args.host, args.port), served, token, args.idle_s,
                           Caps(timeout_s=args.timeout_s, max_connections=args.max_connections),
                           EpisodeCaps(max_episodes=args.max_episodes, max_client_episodes=args.max_client_episodes))
    spread = f", episodes spread over {args.workers} processes" if args.workers > 1 else ""
    print(f"serving {served.serves} environment {served.name} on http://{args.host}:{server.server_port} "
          f"({PROTOCOL}{spread})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(serve(arguments(sys.argv[1:])))
