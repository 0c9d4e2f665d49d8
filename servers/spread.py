"""Episodes spread over worker processes: `rlhf serve-env --workers N`.

A served environment whose work is Python runs on one core however many episodes are under way: the
GIL holds our tools' calls to one, and a verifiers environment runs every rollout on one event loop
(docs/performance.md measured its per-rollout machinery at 70-90 ms of one core per episode). `Spread`
is a `servers.env_server.Served` that starts N processes, each loading its own copy of what is served,
and answers each call from the process that holds its episode; a new episode starts in the process
holding the fewest. The HTTP server, its caps, batches and tokens stay in the parent.

A worker that exits (killed, or crashed mid-call) fails the calls it was answering and its episodes'
later calls (the server answers 422, and the trainer fails those episodes as any failed episode);
new episodes start in the workers still running, and with none left every call fails saying so.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
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

    def _live(self) -> list[_Worker]:
        live = [w for w in self.workers if w.gone is None]
        if not live:
            raise WorkerGone(f"every worker process exited: {'; '.join(w.gone or '' for w in self.workers)}")
        return live


class _Worker:
    """One worker process and the parent's end of its pipe: calls sent under a lock, answers read by a
    thread of their own and handed to the waiting call by its id."""

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
            ok, value = self.conn.recv()
        except EOFError:
            self.process.join()
            raise WorkerGone(f"worker {self.index} exited while loading (exit code {self.process.exitcode})") from None
        if not ok:
            raise value
        self.described = value
        threading.Thread(target=self._read, name=f"serve-env-worker-{self.index}-answers", daemon=True).start()
        return self

    def call(self, *command: Any) -> Any:
        """`command` answered in the worker: its value, or what it raised raised here."""
        answer: Future = Future()
        with self._lock:
            if self.gone is not None:
                raise WorkerGone(self.gone)
            key = next(self._ids)
            self._pending[key] = answer
            self.conn.send((key, command))
        return answer.result()

    def _read(self) -> None:
        while True:
            try:
                key, ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                answer = self._pending.pop(key)
            if ok:
                answer.set_result(value)
            else:
                answer.set_exception(value)
        self.process.join(timeout=5)
        with self._lock:
            self.gone = f"worker process {self.index} (pid {self.process.pid}) exited, code {self.process.exitcode}"
            pending, self._pending = list(self._pending.values()), {}
        for answer in pending:
            answer.set_exception(WorkerGone(self.gone))


def _serve(conn, make: Callable[[], Any]) -> None:
    """A worker's life: load what is served, then answer each call on a thread of its own (a verifiers
    step waits for its rollout's next model call), until the parent's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; its exit ends this one
    try:
        served = make()
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        _send(conn, threading.Lock(), (False, e))
        return
    handles: dict[int, Any] = {}
    ids, lock, send_lock = itertools.count(), threading.Lock(), threading.Lock()
    _send(conn, send_lock, (True, (served.serves, served.name)))

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
            _send(conn, send_lock, (key, True, value))
        except Exception as e:  # noqa: BLE001 - the call's failure is its caller's
            _send(conn, send_lock, (key, False, e))

    while True:
        try:
            key, (name, *args) = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone: rollouts' threads and event loops end with the process
        threading.Thread(target=answer, args=(key, name, tuple(args)), daemon=True).start()


def _send(conn, lock: threading.Lock, message: tuple) -> None:
    """`message` on the pipe; an exception that does not pickle goes as a RuntimeError saying what it was."""
    with lock:
        try:
            conn.send(message)
        except Exception as e:  # noqa: BLE001 - pickling failed before anything was written
            *head, _ok, value = message
            conn.send((*head, False, RuntimeError(f"{type(value).__name__}: {value} (not picklable: {e})")))
