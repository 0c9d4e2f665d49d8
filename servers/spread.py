"""Episodes spread over worker processes: `rlhf serve-env --workers N`.

A served environment whose work is Python runs on one core however many episodes are under way: the
GIL holds our tools' calls to one, and a verifiers environment runs every rollout on one event loop
(docs/performance.md measured its per-rollout machinery at 70-90 ms of one core per episode). `Spread`
is a `servers.env_server.Served` that starts N processes, each loading its own copy of what is served,
and answers each call from the process that holds its episode; a new episode starts in the process
holding the fewest. The HTTP server, its caps, batches and tokens stay in the parent.

A worker that exits (killed, or crashed mid-call) fails the calls it was answering and its episodes'
later calls (the server answers 422, and the trainer fails those episodes as any failed episode);
new episodes start in the workers still running, and with none left every call but a close fails
saying so.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


class WorkerGone(RuntimeError):
    """The worker process holding an episode exited: the call fails, and its episode with it."""


@dataclass(frozen=True)
class _Remote:
    """An episode's handle in the parent: the worker that holds it and the worker's own handle id."""

    worker: _Worker
    handle: int


class Spread:
    """`make()`'s environment served from `workers` processes (`servers.env_server.Served`)."""

    def __init__(self, make: Callable[[], Any], workers: int):
        if workers < 2:
            raise ValueError(f"spreading takes at least 2 worker processes, got {workers}")
        context = multiprocessing.get_context("spawn")  # the parent's threads are not copied into a child
        started = [_Worker.start(context, make, index) for index in range(workers)]
        self.workers = [worker.ready() for worker in started]  # loaded side by side
        self.serves, self.name = self.workers[0].described
        self._lock = threading.Lock()

    def dataset(self, split: str) -> list[dict] | None:
        return self._live()[0].call("dataset", split)

    def start(self, row: dict) -> tuple[_Remote, list[dict], list[dict] | None]:
        with self._lock:
            worker = min(self._live(), key=lambda w: (w.held, w.index))
            worker.held += 1
        try:
            handle, messages, tools = worker.call("start", row)
        except BaseException:
            with self._lock:
                worker.held -= 1
            raise
        return _Remote(worker, handle), messages, tools

    def step(self, episode: _Remote, assistant: dict) -> Any:
        return episode.worker.call("step", episode.handle, assistant)

    def end(self, episode: _Remote) -> None:
        with self._lock:
            episode.worker.held -= 1
        try:
            episode.worker.call("end", episode.handle)
        except WorkerGone:
            pass  # the episode went with its worker

    def close(self) -> None:
        """Every worker ended."""
        for worker in self.workers:
            worker.close()

    def _live(self) -> list[_Worker]:
        live = [w for w in self.workers if w.gone is None]
        if not live:
            raise WorkerGone(f"every worker process exited: {'; '.join(w.gone or '' for w in self.workers)}")
        return live


class _Worker:
    """One worker process and the parent's end of its pipe: calls sent under a lock, answers read by a
    thread of their own and handed to the waiting call by its id. Each answer is `(key, ok, payload)`,
    the payload pickled on its own, so one that does not unpickle here fails its own call only."""

    def __init__(self, process, conn, index: int):
        self.process, self.conn, self.index = process, conn, index
        self.held = 0
        """Episodes started here and not ended (guarded by `Spread._lock`)."""
        self.gone: str | None = None
        """Why the worker is no longer answering; None while it runs."""
        self.described: tuple[str, str] = ("", "")
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()

    @classmethod
    def start(cls, context, make: Callable[[], Any], index: int) -> _Worker:
        conn, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, make), name=f"serve-env-worker-{index}", daemon=True)
        process.start()
        child.close()  # the child's end lives in the child alone: its exit is the parent's end of file
        return cls(process, conn, index)

    def ready(self) -> _Worker:
        """This worker once it has loaded what it serves (what it raised, raised here)."""
        try:
            _, ok, payload = self.conn.recv()
        except EOFError:
            self.process.join()
            raise WorkerGone(f"worker {self.index} exited while loading (exit code {self.process.exitcode})") from None
        value = _loaded(payload)
        if not ok or isinstance(value, _Unreadable):
            raise SystemExit(f"worker process {self.index} could not load what is served: {value}")
        self.described = value
        threading.Thread(target=self._read, name=f"serve-env-worker-{self.index}-answers", daemon=True).start()
        return self

    def close(self) -> None:
        """The worker ended (its calls under way fail as a dead worker's)."""
        self.process.terminate()
        self.process.join(timeout=10)

    def call(self, *command: Any) -> Any:
        """`command` answered in the worker: its value, or what it raised raised here."""
        answer: Future = Future()
        with self._lock:
            if self.gone is not None:
                raise WorkerGone(self.gone)
            key = next(self._ids)
            self._pending[key] = answer
            try:
                self.conn.send((key, command))
            except OSError:  # it exited, and the reader has not said so yet
                del self._pending[key]
                raise WorkerGone(f"worker process {self.index} (pid {self.process.pid}) exited") from None
        return answer.result()

    def _read(self) -> None:
        while True:
            try:
                key, ok, payload = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                answer = self._pending.pop(key)
            value = _loaded(payload)
            if ok and not isinstance(value, _Unreadable):
                answer.set_result(value)
            else:
                answer.set_exception(value)
        with self._lock:  # no call is sent from here on
            self.gone = f"worker process {self.index} (pid {self.process.pid}) exited"
        self.process.join(timeout=5)
        with self._lock:
            self.gone += f", code {self.process.exitcode}"
            pending, self._pending = list(self._pending.values()), {}
        for answer in pending:
            answer.set_exception(WorkerGone(self.gone))


class WorkerRaised(RuntimeError):
    """What the served environment raised in a worker, its type's name and message: exceptions of
    Python's own types cross as themselves (a ValueError still answers 400), others as this (their
    classes, and what their modules import, stay in the worker)."""


class _Unreadable(RuntimeError):
    """An answer that did not unpickle in the parent."""


def _loaded(payload: bytes) -> Any:
    try:
        return pickle.loads(payload)
    except Exception as e:  # noqa: BLE001 - fails this call alone
        return _Unreadable(f"the worker's answer did not unpickle here: {type(e).__name__}: {e}")


def _crossing(error: BaseException) -> BaseException:
    """`error` as it can cross to the parent (`WorkerRaised`)."""
    if type(error).__module__ == "builtins" and not isinstance(error, (SystemExit, KeyboardInterrupt)):
        return error
    return WorkerRaised(f"{type(error).__name__}: {error}")


def _serve(conn, make: Callable[[], Any]) -> None:
    """A worker's life: load what is served, then answer each call on a thread of its own (a verifiers
    step waits for its rollout's next model call), until the parent's end closes."""
    # Ctrl-C is the parent's to handle, its exit ends this process. A Python handler, not SIG_IGN: what
    # this process starts (MCP servers, a runtime's programs) gets the default back when it execs.
    signal.signal(signal.SIGINT, lambda *_: None)
    send_lock = threading.Lock()
    try:
        served = make()
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        _send(conn, send_lock, -1, False, _crossing(e))
        return
    handles: dict[int, Any] = {}
    ids, lock = itertools.count(), threading.Lock()
    _send(conn, send_lock, -1, True, (served.serves, served.name))

    def answer(key: int, name: str, args: tuple) -> None:
        try:
            if name == "start":
                handle, messages, tools = served.start(*args)
                with lock:
                    handles[number := next(ids)] = handle
                value = (number, messages, tools)
            elif name in ("step", "end"):
                with lock:
                    handle = handles[args[0]] if name == "step" else handles.pop(args[0])
                value = getattr(served, name)(handle, *args[1:])
            else:
                value = served.dataset(*args)
        except BaseException as e:  # noqa: BLE001 - the call's failure is its caller's, a SystemExit's too
            _send(conn, send_lock, key, False, _crossing(e))
            return
        if not _send(conn, send_lock, key, True, value) and name == "start":
            with lock:  # a start whose answer could not go back must not leave its episode behind
                unanswered = handles.pop(number)
            served.end(unanswered)

    while True:
        try:
            key, (name, *args) = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone: rollouts' threads and event loops end with the process
        threading.Thread(target=answer, args=(key, name, tuple(args)), daemon=True).start()


def _send(conn, lock: threading.Lock, key: int, ok: bool, value: Any) -> bool:
    """An answer on the pipe, its value pickled on its own; one that does not pickle goes as the
    `WorkerRaised` saying so (False: the value did not go)."""
    try:
        payload, sent = pickle.dumps(value), True
    except Exception as e:  # noqa: BLE001 - nothing is written yet
        ok, sent = False, False
        payload = pickle.dumps(WorkerRaised(f"an answer that does not pickle ({type(e).__name__}: {e})"))
    with lock:
        conn.send((key, ok, payload))
    return sent
