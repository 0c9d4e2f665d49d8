"""The local sandbox's parent side: a fresh working directory, the confined child (`confine.py`), bounded
output, the wall clock, and the whole process group killed at the end, however the code ended."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
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


class _Bounded(threading.Thread):
    """Reads a pipe to its end, keeping its first `limit` bytes; past them, calls `overflow` once."""

    def __init__(self, pipe, limit: int, overflow):
        super().__init__(daemon=True)
        self.pipe, self.limit, self.overflow = pipe, limit, overflow
        self.kept, self.truncated = bytearray(), False

    def run(self):
        while chunk := self.pipe.read1(65536):
            room = self.limit - len(self.kept)
            self.kept += chunk[:max(room, 0)]
            if len(chunk) > room and not self.truncated:
                self.truncated = True
                self.overflow()


def run(kind: str, code: str, limits: Limits, stdin: str = "") -> SandboxResult:
    """Run `code` (`python` or `shell`) confined; nothing of it outlives this call."""
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="rlhf-sandbox-")
    report_read, report_write = os.pipe()
    try:
        Path(workdir, "main.py" if kind == "python" else "main.sh").write_text(code)
        os.chmod(workdir, 0o755)
        spec = {"kind": kind, "cpu_seconds": limits.cpu_seconds, "memory_mb": limits.memory_mb,
                "processes": limits.processes, "open_files": limits.open_files, "file_size_mb": limits.file_size_mb,
                "network": limits.network, "require": list(limits.require), "python": limits.python,
                "trainer": os.getpid(), "packages": PACKAGES}
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
               "PYTHONDONTWRITEBYTECODE": "1"}
        child = subprocess.Popen([sys.executable, "-I", "-S", str(CONFINE), json.dumps(spec), str(report_write)],
                                 cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True, pass_fds=(report_write,))
        os.close(report_write)
        report_write = -1

        def kill():
            _kill_group(child.pid, patience=0.0)

        readers = [_Bounded(child.stdout, limits.output_bytes, kill), _Bounded(child.stderr, limits.output_bytes, kill)]
        for reader in readers:
            reader.start()
        _feed(child, stdin)
        timed_out = False
        try:
            child.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        child.kill()
        child.wait()
        _kill_group(child.pid)  # the code's own children too: the session's group (setsid is denied to them)
        for reader in readers:
            reader.join(timeout=5)
        with os.fdopen(report_read, "rb") as report_file:
            report_read = -1
            report = json.loads(report_file.read() or b"{}")
    finally:
        for fd in (report_read, report_write):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    status = child.returncode
    refused = tuple(report.get("refused", ()))
    return SandboxResult(
        exit_code=None if status < 0 or refused else status, signal=-status if status < 0 else None,
        stdout=readers[0].kept.decode(errors="replace"), stderr=readers[1].kept.decode(errors="replace"),
        timed_out=timed_out, output_truncated=any(r.truncated for r in readers),
        applied=tuple(report.get("applied", ())), missing=dict(report.get("missing", {})), refused=refused,
        python=report.get("python"), seconds=time.perf_counter() - started)


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


def _feed(child: subprocess.Popen, stdin: str) -> None:
    """Writes `stdin` to the child and closes it; a child that stops reading does not hold the caller."""
    def write():
        try:
            child.stdin.write(stdin.encode())
            child.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    threading.Thread(target=write, daemon=True).start()
