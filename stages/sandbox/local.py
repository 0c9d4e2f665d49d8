"""The local sandbox's trainer side: a fresh working directory, the run handed to this process's confining
server (`confine.py`), bounded output, the wall clock, and the run's whole process group killed at the end,
however the code ended."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CONFINE = Path(__file__).with_name("confine.py")
MECHANISMS = ("network_namespace", "rlimits", "unprivileged_user", "landlock", "landlock_tcp",
              "landlock_signal_scope", "seccomp")
"""What `Limits.require` may name: each step of `confine.py`."""
START_TIMEOUT_S = 60.0
"""Seconds the server may take to fork a run's process (it starts in well under one)."""
PACKAGES = sorted({str(Path(importlib.util.find_spec("landlock").origin).parent.parent),
                   str(Path(importlib.util.find_spec("pyseccomp").origin).parent)})
"""Where `landlock` and `pyseccomp` are installed: the confining child starts without `site`, imports from here."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one sandboxed run may use."""

    wall_seconds: float = 10.0
    """Wall-clock limit; then the whole process group is killed."""
    cpu_seconds: int = 10
    """CPU seconds (RLIMIT_CPU), over every process of the run."""
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS)."""
    processes: int = 32
    """Processes and threads the code may start (RLIMIT_NPROC; as root, all sandboxes' `nobody` share it)."""
    open_files: int = 64
    """Open file descriptors of each process (RLIMIT_NOFILE)."""
    file_size_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE)."""
    output_bytes: int = 64 * 1024
    """stdout and stderr kept, each; past it the run is killed (`output_truncated`)."""
    network: bool = False
    """Let the code reach the network (no namespace, no socket filter); off by default."""
    require: tuple[str, ...] = ()
    """Mechanisms (`MECHANISMS`) without which the run is refused rather than run with less."""
    python: str = field(default_factory=lambda: sys.executable)
    """The Python that runs the code, where the sandbox's user may run it; else the system's `python3`."""

    def __post_init__(self):
        unknown = set(self.require) - set(MECHANISMS)
        if unknown:
            raise ValueError(f"sandbox require: unknown mechanisms {sorted(unknown)}; known: {list(MECHANISMS)}")


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """How one sandboxed run ended, and what confined it."""

    exit_code: int | None
    """The code's exit status; None where it was killed (`signal`) or never ran (`refused`)."""
    stdout: str
    stderr: str
    signal: int | None = None
    """The signal that ended it, if one did (SIGKILL: the wall clock, the output bound, or RLIMIT_CPU's SIGXCPU)."""
    timed_out: bool = False
    output_truncated: bool = False
    applied: tuple[str, ...] = ()
    """The mechanisms that confined it."""
    missing: dict[str, str] = field(default_factory=dict)
    """The mechanisms this machine lacks, and why."""
    refused: tuple[str, ...] = ()
    """Required mechanisms that were missing: the code did not run."""
    python: str | None = None
    """The interpreter that ran Python code (the trainer's, else the system's: what `nobody` may run)."""
    group: int | None = None
    """The run's process group (its first process's pid), every process of which was killed at the end."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Ran to the end and exited 0."""
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated

    def text(self) -> str:
        """The run as a tool's answer: how it ended, then stdout and stderr."""
        if self.refused:
            ended = f"refused: this machine lacks {', '.join(self.refused)}"
        elif self.timed_out:
            ended = "killed: wall-clock limit"
        elif self.output_truncated:
            ended = "killed: output limit"
        elif self.signal is not None:
            ended = f"killed by signal {signal.Signals(self.signal).name}"
        else:
            ended = f"exit {self.exit_code}"
        return f"{ended}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


class _Server:
    """This process's confining server (`confine.py`): started at the first run, again if it died or the
    process forked since. Runs are sent to it as a spec and four pipes over a private socket."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.connection: socket.socket | None = None
        self.owner = -1

    def send(self, spec: dict, fds: list[int]) -> None:
        with self.lock:
            if self.owner != os.getpid() or self.process.poll() is not None:
                self._start()
            try:
                socket.send_fds(self.connection, [json.dumps(spec).encode()], fds)
            except OSError:  # it died since the check: once more, on a new one
                self._start()
                socket.send_fds(self.connection, [json.dumps(spec).encode()], fds)

    def _start(self) -> None:
        if self.connection is not None and self.owner == os.getpid():
            self.connection.close()  # a dead server's end (a forked parent's stays the parent's)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(CONFINE), str(theirs.fileno()), json.dumps(PACKAGES)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.connection, self.owner = ours, os.getpid()


SERVER = _Server()


class _Bounded(threading.Thread):
    """Reads a pipe to its end, keeping its first `limit` bytes; past them, calls `overflow` once."""

    def __init__(self, fd: int, limit: int, overflow):
        super().__init__(daemon=True)
        self.fd, self.limit, self.overflow = fd, limit, overflow
        self.kept, self.truncated = bytearray(), False

    def run(self):
        try:
            while chunk := os.read(self.fd, 65536):
                room = self.limit - len(self.kept)
                self.kept += chunk[:max(room, 0)]
                if len(chunk) > room and not self.truncated:
                    self.truncated = True
                    self.overflow()
        finally:
            os.close(self.fd)


class _Report(threading.Thread):
    """Reads the run's report lines: its process's pid, the confinement, the wait status (`ended` set)."""

    def __init__(self, fd: int):
        super().__init__(daemon=True)
        self.fd, self.fields, self.started, self.ended = fd, {}, threading.Event(), threading.Event()

    def run(self):
        with os.fdopen(self.fd, "rb") as lines:
            for line in lines:
                self.fields |= json.loads(line)
                if "pid" in self.fields:
                    self.started.set()
                if "status" in self.fields:
                    self.ended.set()
        self.started.set()
        self.ended.set()  # the pipe closed: ended, whatever was said


def run(kind: str, code: str, limits: Limits, stdin: str = "") -> SandboxResult:
    """Run `code` (`python` or `shell`) confined; nothing of it outlives this call."""
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="rlhf-sandbox-")
    try:
        main = Path(workdir, "main.py" if kind == "python" else "main.sh")
        main.write_text(code)
        os.chmod(main, 0o644)  # readable by the run's user (nobody) whatever the trainer's umask (the stack's: 077)
        os.chmod(workdir, 0o755)
        spec = {"kind": kind, "workdir": workdir, "cpu_seconds": limits.cpu_seconds, "memory_mb": limits.memory_mb,
                "processes": limits.processes, "open_files": limits.open_files, "file_size_mb": limits.file_size_mb,
                "network": limits.network, "require": list(limits.require), "python": limits.python,
                "trainer": os.getpid(), "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
                                                "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1"}}
        pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, report: (read, write) each
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        try:
            SERVER.send(spec, theirs)
        finally:
            for fd in theirs:
                os.close(fd)
        report = _Report(pipes[3][0])

        def kill():
            if report.started.is_set() and "pid" in report.fields:
                _kill_group(report.fields["pid"], patience=0.0)

        readers = [_Bounded(pipes[1][0], limits.output_bytes, kill), _Bounded(pipes[2][0], limits.output_bytes, kill)]
        for thread in (report, *readers):
            thread.start()
        _feed(pipes[0][1], stdin)
        timed_out = not report.ended.wait(timeout=limits.wall_seconds)
        report.started.wait(timeout=START_TIMEOUT_S)
        if "pid" not in report.fields:
            raise RuntimeError(f"the sandbox's server ended before starting the run (exit {SERVER.process.poll()})")
        _kill_group(report.fields["pid"])  # the code's own children too: its session's group (setsid is denied)
        report.ended.wait()
        for thread in (report, *readers):
            thread.join(timeout=5)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    fields = report.fields
    status = os.waitstatus_to_exitcode(fields["status"]) if "status" in fields else None
    refused = tuple(fields.get("refused", ()))
    return SandboxResult(
        exit_code=None if status is None or status < 0 or refused else status,
        signal=-status if status is not None and status < 0 else None,
        stdout=readers[0].kept.decode(errors="replace"), stderr=readers[1].kept.decode(errors="replace"),
        timed_out=timed_out, output_truncated=any(r.truncated for r in readers),
        applied=tuple(fields.get("applied", ())), missing=dict(fields.get("missing", {})), refused=refused,
        python=fields.get("python"), group=fields.get("pid"), seconds=time.perf_counter() - started)


def _kill_group(group: int, patience: float = 2.0) -> None:
    """SIGKILL to every process of `group`, again until none is left (a fork in flight as the first one
    landed) or `patience` seconds have passed (what is left then are zombies, its reaper's to collect)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def _feed(fd: int, stdin: str) -> None:
    """Writes `stdin` to the run and closes it; a run that stops reading does not hold the caller."""
    def write():
        try:
            with os.fdopen(fd, "wb") as pipe:
                pipe.write(stdin.encode())
        except OSError:  # the run closed its stdin or ended first
            pass

    threading.Thread(target=write, daemon=True).start()
