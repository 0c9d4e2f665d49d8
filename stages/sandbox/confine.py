"""The sandbox's server: forks a confined process per run and runs the untrusted code in it (docs/sandbox.md).

    python -I -S stages/sandbox/confine.py SOCKET_FD PACKAGES_JSON

Started once per trainer process by `stages.sandbox.local`, it imports `landlock` and `pyseccomp` once and
serves runs over a private socket: each request is a run's spec and its four pipes (stdin, stdout, stderr,
report). Per run it forks a monitor, which forks the run's process in a new session (its process group is
what the trainer's wall clock kills), in the run's fresh working directory, and waits for it. That process
confines itself, each step a kept Linux mechanism:

1. a network namespace of its own (`unshare(CLONE_NEWNET)`: only a loopback, down), where the process may;
2. rlimits: CPU seconds, address space, processes, open files, file size, no core dumps;
3. as root, the code runs as `nobody`: root is exempt from the process limit, and owns the trainer's files;
4. Landlock: read and execute only beneath the interpreter's and the system's folders, write only in the
   working directory; no TCP bind or connect; no signals to processes outside the sandbox (ABI >= 6);
5. seccomp: no sockets but Unix ones, no new session or process group (the kill reaches every child), no
   ptrace, namespaces, mounts, modules, BPF, io_uring, keys or reboot.

On the report pipe, one JSON line each: the monitor's `{"pid"}`, the process's `{"applied", "missing",
"refused", "python"}` (before the code runs), the monitor's `{"status"}` (the raw wait status). Then the
code runs: Python in an interpreter started afresh (`execve`, isolated mode, a clean environment), or a
shell script. Imports only the standard library, `landlock` and `pyseccomp`: nothing of the project is
importable from the code. When the trainer closes the socket (or dies), the server exits.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import json
import os
import resource
import signal
import socket
import sys

CLONE_NEWNET = 0x40000000
NOBODY = 65534
# Landlock beyond the `landlock` package's files-only ruleset (its plumbing, our fields): linux/landlock.h.
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
SYSTEM_FOLDERS = ("/usr", "/lib", "/lib64", "/bin", "/sbin")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/dev/null", "/dev/urandom", "/dev/zero")
DENIED_CALLS = ("setsid", "setpgid", "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2",
                "pivot_root", "chroot", "unshare", "setns", "kexec_load", "kexec_file_load", "init_module",
                "finit_module", "delete_module", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
                "reboot", "swapon", "swapoff", "userfaultfd", "io_uring_setup", "open_by_handle_at",
                "name_to_handle_at")


def network_namespace(applied: list[str], missing: dict[str, str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        applied.append("network_namespace")
    else:
        missing["network_namespace"] = f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}"


def limits(spec: dict, processes: int, applied: list[str]) -> None:
    mib = 1024 * 1024
    for name, value in ((resource.RLIMIT_CPU, spec["cpu_seconds"]), (resource.RLIMIT_AS, spec["memory_mb"] * mib),
                        (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_NOFILE, spec["open_files"]),
                        (resource.RLIMIT_FSIZE, spec["file_size_mb"] * mib), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(name, (value, value))
    applied.append("rlimits")


def tasks_of(uid: int) -> int:
    """Tasks (threads count: RLIMIT_NPROC counts them) the user `uid` runs now."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


def unprivileged(workdir: str, applied: list[str]) -> None:
    os.chown(workdir, NOBODY, NOBODY)
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    applied.append("unprivileged_user")


def interpreter(preferred: str) -> str | None:
    """The first Python this process (as its user now) can run: the trainer's, else the system's; the
    installed binary itself, not a virtual environment's link to it (whose folder the code may not read)."""
    for candidate in (preferred, "/usr/local/bin/python3", "/usr/bin/python3"):
        real = os.path.realpath(candidate) if candidate else ""
        if real and os.access(real, os.X_OK) and os.access(real, os.R_OK):
            return real
    return None


def imported(name: str):
    """The module `name`, or why not (said in the report; fatal only where required)."""
    try:
        return importlib.import_module(name), None
    except Exception as error:  # noqa: BLE001  (no libseccomp on this machine, say)
        return None, f"{type(error).__name__}: {error}"


def _clean(call, *arguments):
    """`call` with errno cleared first: the `landlock` package's error checks read errno whatever the call
    returned, so a stale one (an `unshare` refused before, say) would fail a call that succeeded."""
    ctypes.set_errno(0)
    return call(*arguments)


def landlock(plumbing, workdir: str, python: str | None, applied: list[str], missing: dict[str, str]) -> None:
    try:
        abi = _clean(plumbing.landlock_abi_version)
    except Exception as error:  # noqa: BLE001  (no Landlock in this kernel, or it is disabled)
        missing["landlock"] = f"{type(error).__name__}: {error}"
        return
    access = plumbing.FSAccess

    class Ruleset(plumbing.RulesetAttr):  # the package's attribute with the fields of ABI 4 (net) and 6 (scopes)
        _fields_ = [("handled_access_net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = Ruleset(access.all(), net, scoped)
    size = ctypes.sizeof(attr) if abi >= 4 else ctypes.sizeof(plumbing.RulesetAttr)
    ruleset = _clean(plumbing.get_create_ruleset(), ctypes.byref(attr), size, 0)
    read = access.EXECUTE | access.READ_FILE | access.READ_DIR
    readable = list(SYSTEM_FOLDERS)
    if python is not None:  # the interpreter's own prefix, wherever it is installed
        readable.append(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    rules = [(p, read) for p in readable] + [(f, access.READ_FILE | access.WRITE_FILE) for f in SYSTEM_FILES]
    for path, allowed in rules + [(workdir, access.all())]:
        if not os.path.exists(path):
            continue
        if not os.path.isdir(path):
            allowed &= access.all_file()
        fd = os.open(path, os.O_PATH)
        try:
            _clean(plumbing.get_add_rule(), ruleset, 1, ctypes.byref(plumbing.PathBeneathAttr(allowed, fd)), 0)
        finally:
            os.close(fd)
    _clean(plumbing.get_prctl(), plumbing.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _clean(plumbing.get_restrict_self(), ruleset, 0)
    os.close(ruleset)
    applied.append("landlock")
    applied.extend((["landlock_tcp"] if net else []) + (["landlock_signal_scope"] if scoped else []))
    if not net:
        missing["landlock_tcp"] = f"Landlock ABI {abi} < 4"
    if not scoped:
        missing["landlock_signal_scope"] = f"Landlock ABI {abi} < 6"


def seccomp(sc, trainer: int, applied: list[str]) -> None:
    rules = sc.SyscallFilter(defaction=sc.ALLOW)
    denied = sc.ERRNO(errno.EPERM)
    rules.add_rule(denied, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    for call in DENIED_CALLS:
        rules.add_rule(denied, call)
    # Without Landlock's signal scope, at least the trainer itself: kill(pid), kill(-pgid), tgkill, pidfd_open.
    def pid_is(value: int):  # an int argument: its low 32 bits (the upper ones may be sign-extended)
        return sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, value & 0xFFFFFFFF)

    rules.add_rule(denied, "kill", pid_is(trainer))
    rules.add_rule(denied, "kill", pid_is(-os.getpgid(trainer)))
    rules.add_rule(denied, "tgkill", pid_is(trainer))
    rules.add_rule(denied, "pidfd_open", pid_is(trainer))
    rules.load()
    applied.append("seccomp")


def confine(spec: dict, plumbing, sc, report: int) -> None:
    """The run's own process, forked by its monitor: each step in turn, the report, then the code. Never returns."""
    applied: list[str] = []
    missing: dict[str, str] = dict(spec["unavailable"])
    root = os.geteuid() == 0
    if spec["network"]:
        missing["network_namespace"] = "network allowed (Limits.network)"
    else:
        network_namespace(applied, missing)
    # As root the code runs as nobody, whose processes are few; else as this user, beside what it runs already.
    limits(spec, spec["processes"] + (0 if root else tasks_of(os.getuid())), applied)
    if root:
        unprivileged(spec["workdir"], applied)
    else:
        missing["unprivileged_user"] = "not started as root: the code runs as the trainer's user"
    python = interpreter(spec["python"]) if spec["kind"] == "python" else None
    if plumbing is not None:
        landlock(plumbing, spec["workdir"], python, applied, missing)
    if sc is not None and not spec["network"]:
        seccomp(sc, spec["trainer"], applied)
    refused = sorted(set(spec["require"]) & set(missing))
    _say(report, {"applied": applied, "missing": missing, "refused": refused, "python": python})
    os.close(report)
    if refused:
        os._exit(125)
    if spec["kind"] == "python":
        if python is None:
            os.write(2, b"sandbox: no Python the sandbox's user may run\n")
            os._exit(126)
        os.execve(python, [python, "-I", "main.py"], spec["env"])
    os.execve("/bin/sh", ["/bin/sh", "main.sh"], spec["env"])


def monitor(spec: dict, fds: list[int], plumbing, sc) -> None:
    """One run, forked by the server: forks the confined process in a session of its own, says its pid,
    waits for it and says how it ended (the raw wait status). Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it (auto-reaping); this one waits
    stdin, stdout, stderr, report = fds
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            os.chdir(spec["workdir"])
            for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
                os.dup2(fd, target)
            os.closerange(3, report)
            os.closerange(report + 1, 65536)
            confine(spec, plumbing, sc, report)
        except BaseException as error:  # noqa: BLE001  (a step that failed: said on stderr, the run fails)
            os.write(2, f"sandbox: {type(error).__name__}: {error}\n".encode())
        os._exit(127)
    for fd in (stdin, stdout, stderr):
        os.close(fd)
    _say(report, {"pid": child})
    _, status = os.waitpid(child, 0)
    _say(report, {"status": status})
    os._exit(0)


def _say(fd: int, message: dict) -> None:
    """One line of JSON on the report pipe (under PIPE_BUF: written whole, never interleaved)."""
    os.write(fd, (json.dumps(message) + "\n").encode())


def serve(connection: socket.socket) -> None:
    """Fork a monitor per request (a spec and its four pipes) until the trainer closes the connection.
    `landlock` and `pyseccomp` are imported once here, before any run gives up root (as `nobody` the
    interpreter's own library may be unreadable): a run costs a fork, not an interpreter's start."""
    plumbing, landlock_error = imported("landlock.plumbing")
    sc, seccomp_error = imported("pyseccomp")
    unavailable = {name: error for name, error in (("landlock", landlock_error), ("seccomp", seccomp_error)) if error}
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    while True:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 4)
        if not message:
            return  # the trainer is gone
        spec = json.loads(message) | {"unavailable": unavailable}
        if os.fork() == 0:
            connection.close()
            monitor(spec, fds, plumbing, sc)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    # No `site` (-I -S: an environment's .pth files and editable finders cost ~0.1 s a start): the two
    # packages come from their folders, which the trainer names.
    sys.path[:0] = json.loads(sys.argv[2])
    serve(socket.socket(fileno=int(sys.argv[1])))
