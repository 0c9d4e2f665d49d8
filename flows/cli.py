"""`rlhf`: the shell entry point.

    rlhf validate --kind {sft,preference,prompt} PATH [--format F] [--tokenizer T --max-prompt-length N --max-length N]
    rlhf summary [--experiment rlhf]      the latest pipeline run and its stage runs, with links to the MLflow UI
    rlhf config show [CONFIG] [--stage ppo] [--first]
                                          a config's settings: the ones most people change first, then by section
    rlhf config-reference [--write PATH]  every config field with its default and meaning (Markdown: docs/config.md)
    rlhf plan CONFIG [--processes N] [--device-memory GiB] [--stages ...] [--json]
                                          each stage's memory per process, from the models' configs alone
    rlhf serve-reward [--checkpoint DIR | --run ID] [--host 127.0.0.1] [--port 8300] [--api-key-env VAR]
                                          a reward checkpoint over HTTP, for `remote` reward terms (`POST /score`)
    rlhf serve-env --kind {ours,verifiers} ...   an environment over HTTP, for `environment.server` (--help)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _validate(args: argparse.Namespace) -> int:
    from schemas.errors import DataContractError
    from schemas.validate import LengthBudget, load_validated

    tokenizer = budget = None
    if args.tokenizer:
        from stages.runtime.models import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        budget = LengthBudget(args.max_prompt_length, args.max_length)
    try:
        data = load_validated(args.path, args.kind, format=args.format, split=args.split, tokenizer=tokenizer,
                              budget=budget, duplicates=args.duplicates)
    except DataContractError as e:
        print(e.report(limit=args.limit), file=sys.stderr)
        return 1
    print(data.summary())
    return 0


def _summary(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from rlhf import tracking

    client = MlflowClient()
    experiment = client.get_experiment_by_name(args.experiment)
    parents = [] if experiment is None else client.search_runs(
        [experiment.experiment_id], filter_string="tags.`rlhf.stages` != ''",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not parents:
        print(f"no pipeline runs in experiment {args.experiment!r}", file=sys.stderr)
        return 1
    parent = parents[0]
    if url := tracking.experiment_url(experiment.experiment_id):
        print(f"runs of experiment {args.experiment!r}: {url}")
    print(f"pipeline run {parent.info.run_name} ({parent.info.status}), its config and description: "
          f"{tracking.run_url(parent.info.run_id) or parent.info.run_id}")
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                                  order_by=["attributes.start_time ASC"])
    reused = [client.get_run(run_id) for key, run_id in parent.data.tags.items() if key.startswith(tracking.TAG_REUSED)]
    for run in sorted(children + reused, key=lambda r: r.info.start_time):
        stage = run.data.tags.get(tracking.TAG_STAGE, "?")
        figures = ", ".join(f"{k}={run.data.metrics[k]:.4g}" for k in sorted(run.data.metrics) if k.startswith("eval/"))
        origin = " reused" if run.data.tags.get("mlflow.parentRunId") != parent.info.run_id else ""
        print(f"  {stage:7s} run {run.info.run_id} ({run.info.status}{origin}) {figures}")
        if url := tracking.run_url(run.info.run_id, "model-metrics"):
            print(f"          curves: {url}")
    return 0 if parent.info.status == "FINISHED" else 1


CONFIG_REFERENCE = "docs/config.md"
"""Where the configuration reference lives, relative to the repository; `tests/test_config.py` keeps it current."""


def config_reference() -> str:
    """The configuration reference page (`rlhf.config_guide.reference`): `rlhf config-reference` prints it;
    `--write docs/config.md` regenerates the page."""
    from rlhf.config_guide import reference

    return reference()


def _config_show(args: argparse.Namespace) -> int:
    from rlhf.config import ConfigError, load_config
    from rlhf.config_guide import show

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(show(cfg, args.stage, everything=not args.first))
    return 0


def _config_reference(args: argparse.Namespace) -> int:
    from pathlib import Path

    page = config_reference()
    if args.write:
        Path(args.write).write_text(page)
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(page)
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from flows.inputs import data_counts, model_shapes_of
    from flows.records.lineage import Teacher
    from rlhf import tracking
    from rlhf.config import ConfigError, load_config
    from stages.memory.phases import Device, Target, this_device
    from stages.memory.plan import plan, plan_json, plan_table
    from stages.memory.shapes import GIB

    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    world = None
    if cfg.demo is not None:
        from rlhf.demo.world import build_world

        world = str(build_world(tracking.state_dir() / "worlds", cfg.demo))
    device = this_device()
    if args.device_memory is not None:
        device = Device("cuda" if args.device_kind == "gpu" else "cpu", args.device_memory * GIB)
    try:
        teacher = Teacher.of(cfg) if "ppo" in args.stages else None
    except tracking.TrackingError as e:
        print(f"teacher.model {e}", file=sys.stderr)
        return 2
    shapes = model_shapes_of(cfg, args.stages, world, teacher)
    result = plan(cfg, args.stages, shapes, Target(device, data_counts(cfg, world), args.processes),
                  args.processes_per_node)
    print(json.dumps(plan_json(result), indent=2) if args.json else plan_table(result))
    return 0 if all(result.verdicts.values()) else 1


def _serve_reward(args: argparse.Namespace) -> int:
    """Serve a reward checkpoint (a folder, a reward run's, or the experiment's latest finished reward
    run's) on `--host:--port` until stopped; its `POST /score` is what a `remote` reward term of kind
    `score` posts to."""
    import tempfile

    import uvicorn

    from rlhf import tracking
    from servers.reward_server import RequestDeadline, reward_app
    from stages.rewards.scoring import RewardScorer

    run_id, checkpoint = args.run_id, args.checkpoint
    limits = _serve_limits(args)
    with tempfile.TemporaryDirectory(prefix="rlhf-serve-reward-") as scratch:
        if checkpoint is None:
            run_id = run_id or tracking.latest_finished_run_id(args.experiment, "reward")
            if run_id is None:
                print(f"no finished reward run in experiment {args.experiment!r}: give --checkpoint or --run",
                      file=sys.stderr)
                return 2
            checkpoint = str(tracking.download_checkpoint(run_id, Path(scratch) / "reward"))
        scorer = RewardScorer.from_pretrained(checkpoint)
        served = {"checkpoint": checkpoint, "run_id": run_id}
        print(f"serving {checkpoint} (run {run_id or '-'}) on http://{args.host}:{args.port}/score", flush=True)
        app = reward_app(scorer, served, args.max_batch, limits)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=5,
                    limit_concurrency=limits.max_queue + 64, http=RequestDeadline)
    return 0


def _serve_limits(args: argparse.Namespace):
    """The reward server's `Limits` from the command line, its token read from `--api-key-env`; refused
    where it listens beyond this machine without one, unless `--insecure`."""
    from servers.auth import server_token
    from servers.reward_server import Limits

    token = server_token(args.api_key_env, args.host, "use the model", args.insecure)
    given = {"max_body_bytes": args.max_body_mb and int(args.max_body_mb * 2**20), "max_rows": args.max_rows,
             "max_chars": args.max_chars, "max_queue": args.max_queue, "timeout_s": args.timeout_s}
    return Limits(api_key=token, **{name: value for name, value in given.items() if value is not None})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF pipeline tools")
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser("validate", help="check a data file against its contract")
    validate.add_argument("path", help="local .jsonl/.json/.parquet/.csv file or a datasets name")
    validate.add_argument("--kind", required=True, choices=["sft", "preference", "prompt"])
    validate.add_argument("--format", default="auto", choices=["auto", "plain", "hh", "chat"])
    validate.add_argument("--split", default="train", help="split, for a datasets name")
    validate.add_argument("--tokenizer", help="tokenizer (hub id or folder) for chat templates and length checks")
    validate.add_argument("--max-prompt-length", type=int, default=64)
    validate.add_argument("--max-length", type=int, default=128)
    validate.add_argument("--duplicates", default="error", choices=["error", "drop"])
    validate.add_argument("--limit", type=int, default=50, help="problems to print at most")
    validate.set_defaults(run=_validate)

    summary = commands.add_parser("summary", help="the latest pipeline run and its stages in MLflow")
    summary.add_argument("--experiment", default="rlhf")
    summary.set_defaults(run=_summary)

    reference = commands.add_parser("config-reference", help=f"print the configuration reference ({CONFIG_REFERENCE})")
    reference.add_argument("--write", metavar="PATH",
                           help=f"write it to PATH instead of printing it ({CONFIG_REFERENCE} regenerates the page)")
    reference.set_defaults(run=_config_reference)

    shown = commands.add_parser("config", help="a config's settings, the ones most people change first on top")
    shown.add_argument("action", choices=["show"], help="show: print them with the config's values")
    shown.add_argument("config", nargs="?", default="configs/demo.yaml", help="a pipeline config (YAML)")
    shown.add_argument("--stage", default="ppo", choices=["sft", "reward", "ppo", "dpo"])
    shown.add_argument("--first", action="store_true", help="only the settings most people change first")
    shown.set_defaults(run=_config_show)

    planner = commands.add_parser("plan", help="each stage's memory per process, and whether it fits")
    planner.add_argument("config", help="a pipeline config (YAML)")
    planner.add_argument("--processes", type=int, help="plan each stage on this many processes (its launch's engine)")
    planner.add_argument("--processes-per-node", type=int,
                         help="processes one node holds (default: 8 on GPUs, one machine on the CPU)")
    planner.add_argument("--device-memory", type=float,
                         help="GiB of one device (default: this machine's GPU, else its RAM)")
    planner.add_argument("--device-kind", choices=["gpu", "cpu"], default="gpu",
                         help="with --device-memory: a GPU per process, or RAM the processes share")
    planner.add_argument("--stages", nargs="+", default=["sft", "reward", "ppo", "dpo"],
                         choices=["sft", "reward", "ppo", "dpo"])
    planner.add_argument("--json", action="store_true", help="the plan as JSON")
    planner.set_defaults(run=_plan)

    serve = commands.add_parser("serve-reward", help="serve a reward checkpoint over HTTP for remote reward terms")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a reward checkpoint folder")
    source.add_argument("--run", dest="run_id", help="a reward run's id; default: the latest finished one")
    serve.add_argument("--experiment", default="rlhf", help="where the latest finished reward run is looked for")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    serve.add_argument("--port", type=int, default=8300)
    serve.add_argument("--max-batch", type=int, default=64, help="responses scored in one pass at most")
    serve.add_argument("--api-key-env", help="an environment variable holding the bearer token clients must send")
    serve.add_argument("--insecure", action="store_true", help="serve beyond this machine without a token")
    # Unset: servers.reward_server.Limits' defaults.
    serve.add_argument("--max-body-mb", type=float, help="a request body's size at most (413 past it)")
    serve.add_argument("--max-rows", type=int, help="responses in one request at most (413 past it)")
    serve.add_argument("--max-chars", type=int, help="characters per response or message at most (422 past it)")
    serve.add_argument("--max-queue", type=int, help="requests waiting at most (503 with Retry-After past it)")
    serve.add_argument("--timeout-s", type=float, help="seconds a request may wait for its scores (504 past it)")
    serve.set_defaults(run=_serve_reward)

    commands.add_parser("serve-env", help="serve an environment over HTTP for `environment.server` (its own --help)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-env"]:  # its arguments are its own (servers/env_server.py)
        from servers.env_server import launch

        return launch(argv[1:])
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
