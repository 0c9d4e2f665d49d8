"""The sandbox's child: confines its own process, then runs the untrusted code in it (docs/sandbox.md).

    python -I -S stages/sandbox/confine.py SPEC_JSON REPORT_FD

Started by `stages.sandbox.local` in a new session (its process group is what the wall clock kills), in a
fresh working directory, with a clean environment. In order, each step a kept Linux mechanism:

1. a network namespace of its own (`unshare(CLONE_NEWNET)`: only a loopback, down), where the process may;
2. rlimits: CPU seconds, address space, processes, open files, file size, no core dumps;
3. as root, the code runs as `nobody`: root is exempt from the process limit, and owns the trainer's files;
4. Landlock: read and execute only beneath the interpreter's and the system's folders, write only in the
   working directory; no TCP bind or connect; no signals to processes outside the sandbox (ABI >= 6);
5. seccomp: no sockets but Unix ones, no new session or process group (the kill reaches every child), no
   ptrace, namespaces, mounts, modules, BPF, io_uring, keys or reboot.

It reports on REPORT_FD (JSON: the mechanisms applied, those missing and why), closes it, then runs the
code: Python in an interpreter started afresh (`execv`, isolated mode), or a shell command. Imports only
the standard library, `landlock` and `pyseccomp`: nothing of the project is importable from the code.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import json
import os
import resource
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
    """The first Python this process (as its user now) can run: the trainer's, else the system's."""
    for candidate in (preferred, "/usr/local/bin/python3", "/usr/bin/python3"):
        if candidate and os.access(candidate, os.X_OK) and os.access(os.path.realpath(candidate), os.R_OK):
            return candidate
    return None


def imported(name: str):
    """The module `name`, or why not (said in the report; fatal only where required)."""
    try:
        return importlib.import_module(name), None
    except Exception as error:  # noqa: BLE001  (no libseccomp on this machine, say)
        return None, f"{type(error).__name__}: {error}"


def landlock(plumbing, workdir: str, python: str | None, applied: list[str], missing: dict[str, str]) -> None:
    try:
        abi = plumbing.landlock_abi_version()
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
    ruleset = plumbing.get_create_ruleset()(ctypes.byref(attr), size, 0)
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
            plumbing.get_add_rule()(ruleset, 1, ctypes.byref(plumbing.PathBeneathAttr(allowed, fd)), 0)
        finally:
            os.close(fd)
    plumbing.get_prctl()(plumbing.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    plumbing.get_restrict_self()(ruleset, 0)
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


def main() -> None:
    spec, report = json.loads(sys.argv[1]), int(sys.argv[2])
    applied: list[str] = []
    missing: dict[str, str] = {}
    # No `site` (-S: an environment's .pth files and editable finders cost ~0.1 s a start): the two packages
    # come from their folders, named in the spec, and are imported before the process gives up root (as
    # `nobody`, the interpreter's own library may be unreadable).
    sys.path[:0] = spec["packages"]
    plumbing, error = imported("landlock.plumbing")
    if error:
        missing["landlock"] = error
    sc, error = (None, None) if spec["network"] else imported("pyseccomp")
    if error:
        missing["seccomp"] = error
    workdir = os.getcwd()
    root = os.geteuid() == 0
    if spec["network"]:
        missing["network_namespace"] = "network allowed (sandbox.network: true)"
    else:
        network_namespace(applied, missing)
    # As root the code runs as nobody, whose processes are few; else as this user, beside what it runs already.
    limits(spec, spec["processes"] + (0 if root else tasks_of(os.getuid())), applied)
    if root:
        unprivileged(workdir, applied)
    else:
        missing["unprivileged_user"] = "not started as root: the code runs as the trainer's user"
    python = interpreter(spec["python"]) if spec["kind"] == "python" else None
    if plumbing is not None:
        landlock(plumbing, workdir, python, applied, missing)
    if sc is not None:
        seccomp(sc, spec["trainer"], applied)
    refused = sorted(set(spec["require"]) & set(missing))
    os.write(report, json.dumps({"applied": applied, "missing": missing, "refused": refused,
                                 "python": python}).encode())
    os.close(report)
    if refused:
        os._exit(125)
    if spec["kind"] == "python":
        if python is None:
            os.write(2, b"sandbox: no Python the sandbox's user may run\n")
            os._exit(126)
        os.execv(python, [python, "-I", "main.py"])
    os.execv("/bin/sh", ["/bin/sh", "main.sh"])


if __name__ == "__main__":
    main()
