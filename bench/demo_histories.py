"""The latest pipeline run's metric histories, to compare two runs to the digit (a refactor's check).

    python -m bench.demo_histories dump before.json        # after `make demo`, with the stack's environment
    python -m bench.demo_histories compare before.json after.json

`dump` reads the latest pipeline run in the experiment (as `rlhf summary` finds it) and writes,
per stage, its config hash, its checkpoint's and data's digests, the stack it ran on
(`rlhf.stack.*` tags) and every metric's full history (step -> value). Wall-clock and memory
figures (`time/`, `memory/`, and the trainers' runtime and throughput figures) differ from run to
run on the same work, so they are left out. `compare` lists every metric whose history differs
and every digest that differs, and exits 1 if any does. `tests/golden/demo.json` is such a dump of
the demo on the locked stack (docs/reproducibility.md).
"""

from __future__ import annotations

import argparse
import json
import sys

# Figures of the machine, not of the work: they change between identical runs.
MACHINE_FIGURES = ("time/", "memory/", "train/runtime", "train/samples_per_second", "train/steps_per_second",
                   "eval/runtime", "eval/samples_per_second", "eval/steps_per_second", "train_runtime",
                   "train_samples_per_second", "train_steps_per_second", "system/")


def dump(experiment_name: str) -> dict:
    from mlflow.tracking import MlflowClient

    from rlhf import stack, tracking

    client = MlflowClient()
    experiment = client.get_experiment_by_name(experiment_name)
    parents = [] if experiment is None else client.search_runs(
        [experiment.experiment_id], filter_string="tags.`rlhf.stages` != ''",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not parents:
        raise SystemExit(f"no pipeline runs in experiment {experiment_name!r}")
    parent = parents[0]
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    stages = {}
    for run in children:
        stage = run.data.tags.get(tracking.TAG_STAGE, run.info.run_name)
        histories = {key: {str(m.step): m.value for m in client.get_metric_history(run.info.run_id, key)}
                     for key in sorted(run.data.metrics) if not key.startswith(MACHINE_FIGURES)}
        tags = run.data.tags
        stages[stage] = {"run_id": run.info.run_id, "status": run.info.status,
                         "config_hash": tags.get(tracking.TAG_CONFIG_HASH), "metrics": histories,
                         "checkpoint_digest": tags.get(tracking.TAG_CHECKPOINT_DIGEST),
                         "data_digest": tags.get(tracking.TAG_DATA_DIGEST),
                         "stack": {k.removeprefix(stack.TAG): v for k, v in tags.items() if k.startswith(stack.TAG)}}
    return {"pipeline_run_id": parent.info.run_id, "status": parent.info.status, "stages": stages}


def differences(before: dict, after: dict) -> list[str]:
    found = []
    for stage in sorted(set(before["stages"]) | set(after["stages"])):
        if stage not in before["stages"] or stage not in after["stages"]:
            found.append(f"{stage}: only in {'after' if stage not in before['stages'] else 'before'}")
            continue
        for digest in ("checkpoint_digest", "data_digest"):  # records dumped before they were kept have neither
            old, new = before["stages"][stage].get(digest), after["stages"][stage].get(digest)
            if old and new and old != new:
                found.append(f"{stage} {digest}: {old} -> {new}")
        old, new = before["stages"][stage]["metrics"], after["stages"][stage]["metrics"]
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                found.append(f"{stage} {key}: {old.get(key)} -> {new.get(key)}"[:400])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump", help="write the latest pipeline run's stage metric histories")
    dumping.add_argument("output")
    dumping.add_argument("--experiment", default="rlhf")
    comparing = commands.add_parser("compare", help="list the metrics whose histories differ")
    comparing.add_argument("before")
    comparing.add_argument("after")
    args = parser.parse_args(argv)
    if args.command == "dump":
        record = dump(args.experiment)
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        counts = {stage: len(s["metrics"]) for stage, s in record["stages"].items()}
        print(f"pipeline run {record['pipeline_run_id']} ({record['status']}): metrics per stage {counts}")
        return 0
    with open(args.before) as f, open(args.after) as g:
        before, after = json.load(f), json.load(g)
    found = differences(before, after)
    for stage in sorted(before["stages"]):
        hashes = (before["stages"][stage]["config_hash"], after["stages"].get(stage, {}).get("config_hash"))
        print(f"{stage}: config hash {hashes[0]} -> {hashes[1]}")
    print("\n".join(found) if found else "every metric history is identical")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
