"""The sandbox (stages/sandbox): code that tries to escape fails safely, the result says what was refused, and
the trainer (this test process) is unharmed. Each escape is one test; docs/sandbox.md says what each
mechanism stops."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stages.sandbox import code
from stages.sandbox.code import code_of, python_tools, run_python, run_shell
from stages.sandbox.local import Limits

pytestmark = pytest.mark.multiprocess  # each run is a confined Python process

REPO = Path(__file__).resolve().parent.parent
QUICK = Limits(wall_seconds=5.0, cpu_seconds=5)
DENIED = ("PermissionError", "Permission denied", "Operation not permitted")


def refused(result) -> bool:
    """The code ran, and what it tried was refused by the system (not by the code's own mistake)."""
    return result.exit_code not in (None, 0) and any(word in result.stderr for word in DENIED)


def test_code_runs_and_says_how_it_was_confined():
    result = run_python("import sys\nprint(sum(range(10)))\nprint('oops', file=sys.stderr)\nraise SystemExit(3)")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "45\n", "oops\n")
    assert {"rlimits", "landlock", "seccomp"} <= set(result.applied)
    assert set(result.applied).isdisjoint(result.missing)
    assert result.text().startswith("exit 3\nstdout:\n45\n")


def test_code_runs_under_the_stacks_umask():
    """The stack runs with umask 077 (scripts/stack.sh): the code's file is still readable by the run's
    user (nobody, under a root trainer). Seen in a deployment: every run failed, and every reward was 0."""
    before = os.umask(0o077)
    try:
        result = run_python("print(6 * 7)", QUICK)
        shell = run_shell("echo 42", QUICK)
    finally:
        os.umask(before)
    assert (result.exit_code, result.stdout) == (0, "42\n"), result.stderr
    assert (shell.exit_code, shell.stdout) == (0, "42\n"), shell.stderr


@pytest.fixture
def secrets(tmp_path, monkeypatch):
    """What the trainer holds: credentials under RLHF_HOME, an ssh key, a run's checkpoint, readable by it."""
    home = tmp_path / "rlhf-home"
    (home / "credentials").mkdir(parents=True)
    (home / "credentials" / "mlflow").write_text("token-123")
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "id_ed25519").write_text("PRIVATE KEY")
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setenv("RLHF_HOME", str(home))
    monkeypatch.setenv("HOME", str(tmp_path))
    return {"credentials": home / "credentials" / "mlflow", "ssh": tmp_path / ".ssh" / "id_ed25519",
            "checkpoint": tmp_path / "run" / "checkpoint" / "model.safetensors",
            "reward source": REPO / "rlhf" / "demo" / "rewards.py"}


@pytest.mark.parametrize("what", ["credentials", "ssh", "checkpoint", "reward source"])
def test_the_trainers_files_are_unreadable(secrets, what):
    path = secrets[what]
    assert path.read_bytes()  # the trainer reads it
    result = run_python(f"print(open({str(path)!r}).read())", QUICK)
    assert refused(result), result.text()
    assert path.read_text() not in result.stdout
    # Nor its folder listed, nor the environment inherited.
    result = run_python(f"import os\nprint(os.listdir({str(path.parent)!r}))\n", QUICK)
    assert refused(result), result.text()
    assert "RLHF_HOME" not in run_python("import os; print(dict(os.environ))", QUICK).stdout


def test_the_user_home_is_unreadable():
    for path in ("/root/.ssh", os.path.expanduser("~/.ssh"), "/etc/shadow", "/proc/1/environ"):
        result = run_python(f"print(open({path!r}).read())", QUICK)
        assert result.exit_code != 0 and not result.stdout, (path, result.text())


def test_writes_outside_its_directory_are_refused(tmp_path):
    target = tmp_path / "planted.py"
    result = run_python(f"open({str(target)!r}, 'w').write('import os')", QUICK)
    assert refused(result), result.text()
    assert not target.exists()
    result = run_python("open('/tmp/planted', 'w').write('x')", QUICK)
    assert refused(result) and not Path("/tmp/planted").exists()
    # Its own directory is writable, and gone afterwards.
    result = run_python("import os\nopen('notes.txt', 'w').write('ok')\nprint(os.getcwd())", QUICK)
    assert result.ok and not Path(result.stdout.strip()).exists()


def test_a_fork_bomb_is_bounded_and_nothing_outlives_it():
    started = time.perf_counter()
    result = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                        Limits(wall_seconds=3.0, cpu_seconds=5, processes=16))
    assert result.timed_out and result.exit_code is None
    assert time.perf_counter() - started < 30
    assert result.group is not None and not _members_of(result.group)  # none left running (zombies aside)


def _members_of(group: int) -> list[int]:
    """Live processes of the process group `group` (another test's sandbox runs are other groups)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, _, pgrp = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            found.append(int(pid))
    return found


def test_ten_gigabytes_are_refused():
    result = run_python("block = bytearray(10 * 1024 ** 3)\nprint(len(block))", QUICK)
    assert result.exit_code == 1 and "MemoryError" in result.stderr and not result.stdout


def test_sockets_are_refused():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    server.settimeout(0.2)

    def accept():
        deadline = time.time() + 6
        while time.time() < deadline:
            try:
                accepted.append(server.accept())
            except TimeoutError:
                pass

    listener = threading.Thread(target=accept)
    listener.start()
    try:
        tcp = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)", QUICK)
        udp = run_python(f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
                         f"('127.0.0.1', {port}))", QUICK)
    finally:
        listener.join()
        server.close()
    assert refused(tcp) and refused(udp), (tcp.text(), udp.text())
    assert not accepted


def test_sleeping_forever_is_killed_on_the_wall_clock():
    started = time.perf_counter()
    result = run_python("import time\ntime.sleep(10 ** 6)", Limits(wall_seconds=1.0))
    assert result.timed_out and result.signal == 9 and result.text().startswith("killed: wall-clock limit")
    assert time.perf_counter() - started < 10


def test_its_parent_and_the_trainer_cannot_be_killed():
    trainer = os.getpid()
    result = run_python(f"import os, signal\nos.kill({trainer}, signal.SIGKILL)", QUICK)
    assert refused(result), result.text()
    result = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", QUICK)
    assert refused(result), result.text()
    result = run_python(f"import os, signal\nos.killpg({os.getpgid(trainer)}, signal.SIGKILL)", QUICK)
    assert refused(result), result.text()
    assert os.getpid() == trainer  # still here


def test_a_hundred_megabytes_of_output_are_cut():
    limits = Limits(wall_seconds=20.0, output_bytes=4096)
    result = run_python("import sys\nsys.stdout.write('x' * 100_000_000)", limits)
    assert result.output_truncated and not result.ok and len(result.stdout) == 4096


def test_a_new_session_cannot_escape_the_kill():
    result = run_python("import os\nos.setsid()", QUICK)
    assert refused(result), result.text()


def test_a_required_mechanism_that_is_missing_refuses_the_run():
    # With the network allowed there is no namespace: requiring one refuses to run the code at all.
    result = run_python("print('ran')", Limits(network=True, require=("network_namespace",)))
    assert result.refused == ("network_namespace",) and result.exit_code is None and not result.stdout
    assert result.text().startswith("refused: this machine lacks network_namespace")
    with pytest.raises(ValueError, match="unknown mechanisms"):
        Limits(require=("firewall",))


def test_shell_runs_confined():
    result = run_shell("echo hello; cat /etc/shadow", QUICK)
    assert result.stdout == "hello\n" and result.exit_code != 0


def test_tests_pass_scores_code_against_the_records_tests():
    responses = ["```python\ndef add(a, b):\n    return a + b\n```", "def add(a, b):\n    return a - b",
                 "import socket\nsocket.create_connection(('127.0.0.1', 1))\ndef add(a, b):\n    return a + b"]
    tests = ["assert add(2, 3) == 5"] * 3
    assert code.tests_pass([[{"role": "user", "content": "add"}]] * 3, responses, tests) == [1.0, 0.0, 0.0]
    assert code_of("Here:\n```py\nx = 1\n```\nand more") == "x = 1\n"


def test_the_tool_answers_with_how_the_code_ended():
    (tool,) = python_tools({})
    assert tool("print(6 * 7)") == "exit 0\nstdout:\n42\n\nstderr:\n"
    assert tool("open('/etc/shadow')").startswith("exit 1\n")


def test_the_server_goes_with_its_trainer():
    """The confining server lives as long as the process that started it: a trainer that ends (or dies)
    leaves nothing behind."""
    script = ("from stages.sandbox.code import run_python\nfrom stages.sandbox.local import SERVER\n"
              "assert run_python('pass').ok\nprint(SERVER.process.pid)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    server = int(done.stdout.split()[-1])
    deadline = time.time() + 10
    while time.time() < deadline and _running(server):
        time.sleep(0.05)
    assert not _running(server)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _others_may_read(path: Path) -> bool:
    """Whether a user other than the owner may reach `path` (every folder above it searchable, it readable)."""
    import stat

    return (all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)
            and path.stat().st_mode & stat.S_IROTH != 0)


def test_a_trainer_that_is_not_root_still_gets_landlock_and_seccomp():
    """As another user (no namespace, no change of user), the files, the network and the signals stay closed."""
    import shutil

    from stages.sandbox.local import PACKAGES

    system = Path("/usr/bin/python3")
    paths = [REPO / "stages" / "sandbox" / "code.py", *(Path(p) / "pyseccomp.py" for p in PACKAGES[:1])]
    if os.geteuid() != 0 or not shutil.which("setpriv") or not system.exists() or not all(
            _others_may_read(p) for p in paths):
        pytest.skip("needs root (to become nobody), setpriv, the system's python3 and a checkout nobody may read")
    reads = f"open({str(REPO / 'README.md')!r}).read()"
    script = (f"import sys, json\nsys.path[:0] = {[str(REPO), *PACKAGES]!r}\n"
              "from stages.sandbox.code import run_python\n"
              f"r = run_python({reads!r})\n"
              "k = run_python('import os; os.kill(os.getppid(), 9)')\n"
              "print(json.dumps([r.exit_code, r.stderr, list(r.applied), k.exit_code, k.stderr]))")
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(system), "-c", script],
                          capture_output=True, text=True, cwd="/tmp", timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    read, read_stderr, applied, kill, kill_stderr = json.loads(done.stdout.splitlines()[-1])
    assert {"rlimits", "landlock", "landlock_signal_scope", "seccomp"} <= set(applied)
    assert "unprivileged_user" not in applied and read == 1 and "PermissionError" in read_stderr
    assert kill == 1 and "PermissionError" in kill_stderr


def test_a_server_that_died_is_started_again():
    from stages.sandbox.local import SERVER

    assert run_python("pass", QUICK).ok
    SERVER.process.kill()
    SERVER.process.wait()
    result = run_python("print('again')", QUICK)
    assert result.ok and result.stdout == "again\n" and SERVER.process.poll() is None
