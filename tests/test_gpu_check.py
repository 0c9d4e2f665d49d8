"""The GPU check that runs on a lent GPU machine (`scripts/gpu_check.sh`, issue 60), without one: its
wheel list against what the stages import, and its dry run on the CPU."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from bench.gpu_stages import VARIANTS
from bench.gpu_wheels import CARRIED, IMAGE, IMAGE_VERSIONS, NOT_ON_THE_DEVICE, locked_version

REPO = Path(__file__).resolve().parent.parent


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _imported_distributions() -> set[str]:
    """The distributions whose modules `stages/`, `rlhf/` and `schemas/` import, at any depth of the file,
    but those the GPU check does not use (`NOT_ON_THE_DEVICE`)."""
    modules = set()
    for folder in ("stages", "rlhf", "schemas"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    modules.add(node.module.split(".")[0])
    owners = metadata.packages_distributions()
    return {_canonical(d) for module in modules - set(NOT_ON_THE_DEVICE)
            for d in owners.get(module, [])} - {"rlhf-pipeline"}


def _needed(names: set[str]) -> dict[str, list[Requirement]]:
    """`names` and what they require (no extras), as installed here, each with the requirements on it;
    the image's own distributions bring their own requirements, so only the others are followed."""
    needed: dict[str, list[Requirement]] = {name: [] for name in names}
    todo = list(names)
    carried = {_canonical(name) for name in CARRIED}
    while todo:
        name = todo.pop()
        if name in IMAGE and name not in carried:
            continue
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                dependency = _canonical(requirement.name)
                if dependency not in needed:
                    todo.append(dependency)
                needed.setdefault(dependency, []).append(requirement)
    return needed


def test_the_wheels_carried_are_what_the_stages_need_beyond_the_image():
    needed = _needed(_imported_distributions())
    carried = {_canonical(name) for name in CARRIED}
    assert set(needed) - IMAGE - carried == set(), "imported by the stages, in neither the image nor the wheels"
    assert carried - set(needed) == set(), "carried, but nothing the stages import needs it"
    assert carried & IMAGE == {"transformers", "peft", "pandas"}  # carried at the lock's versions over the image's
    for name in CARRIED:
        assert locked_version(name)
    for name, version in IMAGE_VERSIONS.items():  # what the carried wheels require of the image's versions
        if name not in carried:
            assert all(r.specifier.contains(version, prereleases=True) for r in needed.get(name, [])), name


@pytest.mark.multiprocess
def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    env = os.environ | {"GPU_CHECK_DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
                        "GPU_CHECK_PARTS": "demo llama 3b update", "GPU_CHECK_VARIANTS": ":".join(VARIANTS),
                        "GPU_CHECK_ENGINES": "graphs graphs-fp32 eager generate-static generate"}
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== stages: exit 0" in done.stdout and "== kernels: exit 0" in done.stdout, done.stdout[-3000:]
    (results,) = tmp_path.glob("gpu-cpu-dry-*.json")
    record = json.loads(results.read_text())
    rows = record["stages"]["stages"]
    assert [(r["world"], r["stage"], r["status"]) for r in rows] == [
        (world, stage, "ok") for world in ("demo", "3b", "llama") for stage in ("sft", "reward", "ppo")]
    assert [r["variant"] for r in rows if r["world"] == "3b"] == ["lora"] * 3
    assert all(r["planned_peak_gib"] > 0 for r in rows)
    assert [r["variant"] for r in record["stages"]["update"]] == list(VARIANTS)
    # On the CPU the update trains in fp32 against a bf16 matmul rate, which portable numerics make slow
    # (AVX2 has no bf16 products): the ratio may pass 1 here, so only its sign is checked.
    assert all(r["update_mfu"] > 0 for r in record["stages"]["update"])
    assert record["stages"]["profile"]["top"] and (tmp_path / "profile-ppo.txt").read_text()
    assert [d["engine"] for d in record["kernels"]["decode"]] == [
        "PPO sampler, compiled, bf16 weights", "PPO sampler, compiled, float32 weights under bf16 autocast",
        "PPO sampler, eager, bf16 weights", "transformers generate (static cache)", "transformers generate"]
    assert all(d["profile"]["top"] for d in record["kernels"]["decode"])
    assert "skipped" in record["pytest"]["summary"]  # no CUDA here: the GPU tests skip, and run nowhere else
