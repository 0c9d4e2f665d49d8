"""PPO benchmark: our PPO stage against TRL 1.12's PPOTrainer on the same work, in one invocation.

    python -m bench.ppo --config configs/bench.yaml --reference .bench-venv/bin/python

Both run on the same Llama-shaped model built here from a config (no download), the same
prompts, episodes per iteration, response length, PPO epochs and minibatches, each in a fresh
process with the same thread count. Each runs `warmup` untimed iterations, then `iterations`
timed ones per round; the figure is the median timed iteration. The last line is `PPO speedup_vs_trl=<ratio>`.
The two sides alternate for `rounds` rounds. This is a benchmark, not a test: nothing here asserts a speed.

How close our training step is to the machine: the floating-point work of one iteration's
update (every epoch and minibatch, policy and critic, forward and backward) is counted by torch's
`FlopCounterMode` on the untimed warm-up iteration, and divided by the median timed `train` phase;
the float32 matrix-multiply peak of this machine, at the same thread count, is measured in the same
invocation (the best of repeated square products, before and after the runs).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.flops import flop_report  # standard library at import: the reference side imports this module

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ModelShape:
    """The policy (and reward/value model) built for the benchmark."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    vocab_size: int = 512
    max_position_embeddings: int = 256


@dataclass(frozen=True)
class Work:
    """What one PPO iteration does, identical for both implementations."""

    episodes: int
    response_length: int
    ppo_epochs: int
    minibatches: int
    temperature: float
    learning_rate: float
    kl_coef: float
    seed: int


def build_assets(config_file: str, overrides: dict, shape: ModelShape, root: Path) -> tuple[Path, Work, int]:
    """Policy and reward folders plus rendered prompts for the benchmark, in `root`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.config import load_config
    from rlhf.demo.locations import resolve_location
    from rlhf.demo.world import build_world
    from schemas.validate import LengthBudget, load_validated
    from stages.rewards.scoring import load_reward_model
    from stages.runtime.models import load_tokenizer, save_checkpoint

    cfg = load_config(config_file, overrides)
    ppo = cfg.ppo
    world = build_world(root / "worlds", cfg.demo)
    tokenizer = load_tokenizer(str(world / "model"))
    folder = root / f"model-{'-'.join(str(v) for v in asdict(shape).values())}"
    if not (folder / "reward" / "config.json").exists():
        torch.manual_seed(cfg.demo.seed)
        policy = LlamaForCausalLM(LlamaConfig(
            vocab_size=max(shape.vocab_size, len(tokenizer)), hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_heads,
            max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id))
        save_checkpoint(policy, tokenizer, folder / "policy")
        save_checkpoint(load_reward_model(str(folder / "policy"), tokenizer), tokenizer, folder / "reward")
    budget = LengthBudget(ppo.max_prompt_length, ppo.max_prompt_length + ppo.sampling.response_length)
    for name, source in (("prompts", ppo.prompts), ("eval_prompts", ppo.evaluation.prompts)):
        data = load_validated(resolve_location(source.path, str(world)), "prompt", tokenizer=tokenizer, budget=budget)
        data.frame.to_json(folder / f"{name}.jsonl", orient="records", lines=True)
    work = Work(ppo.rollout_batch_size, ppo.sampling.response_length, ppo.num_ppo_epochs, ppo.num_minibatches,
                ppo.sampling.temperature, ppo.learning_rate, ppo.kl.init_coef, ppo.seed)
    return folder, work, cfg.num_threads or 2


def peak_memory_mb() -> float:
    """Peak resident memory of this process (CPU), or peak allocated GPU memory."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_memory_mb() -> float:
    """Current resident memory of this process (not the peak): flat across iterations when nothing leaks."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


TOP_PHASES = ("generate", "forward", "score", "reward_functions", "advantages", "train", "weight_sync")
"""Our stage's `time/<phase>` figures that do not overlap; `forward`'s parts are `values`, `policy_forward` and
`reference`. What an iteration spends outside them (figures, logging) is `other`."""


def summarize(rows: list[dict[str, float]], work: Work, name: str, peak_memory_mb: float) -> dict:
    """Median figures over the timed iterations of every round; each phase's median on its own."""
    median = {key: statistics.median(row.get(key, 0.0) for row in rows) for key in rows[0]}
    split = {k: v for k, v in median.items() if k not in ("seconds", "generated_tokens", "rss_mb")
             and not k.startswith("padding:")}
    padding = {k.removeprefix("padding:"): v for k, v in median.items() if k.startswith("padding:")}
    return {"name": name, "iterations": len(rows), "seconds_per_iteration": median["seconds"],
            "padding_share": padding,
            "episodes_per_second": work.episodes / median["seconds"],
            "generated_tokens_per_second": median["generated_tokens"] / median["seconds"],
            "sampling_tokens_per_second": (median["generated_tokens"] / median["generate"] if "generate" in median
                                           else None),
            "split": split, "peak_memory_mb": peak_memory_mb}


def round_spread(rows: list[dict[str, float]], rounds: int) -> float:
    """The run-to-run spread of the seconds per iteration: (slowest - fastest) / median of the rounds' medians."""
    per_round = len(rows) // rounds
    medians = [statistics.median(r["seconds"] for r in rows[i * per_round:(i + 1) * per_round]) for i in range(rounds)]
    return (max(medians) - min(medians)) / statistics.median(medians)


def matmul_peak_flops(threads: int, size: int = 1024, repeats: int = 30) -> float:
    """This machine's float32 matrix-multiply rate at `threads` threads: the best of `repeats` square
    products of `size`, after a warm-up (2 size^3 floating-point operations each)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _best_seconds(lambda: a @ b, repeats)


def _best_seconds(work, repeats: int) -> float:
    for _ in range(3):
        work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_flops_at(shapes: list[list[int]], threads: int, repeats: int = 20) -> float:
    """The float32 rate of the update's own matrix products: for every linear layer call the update
    made, `(rows, in, out, trained, calls)`, the forward product, the backward product for the input's
    gradient and (trained) the one for the weight's, each timed at its shape (best of `repeats`), weighted
    by how often it ran. The limit the update's linear layers could reach on this machine at these shapes."""
    import torch

    torch.set_num_threads(threads)
    flops = seconds = 0.0
    for rows, inner, outer, trained, calls in shapes:
        x, w, g = torch.randn(rows, inner), torch.randn(outer, inner), torch.randn(rows, outer)
        # Each product is timed at once, in this iteration: the lambdas never outlive x, w and g.
        products = [lambda: x @ w.T, lambda: g @ w] + ([lambda: g.T @ x] if trained else [])  # noqa: B023
        for product in products:
            flops += calls * 2 * rows * inner * outer
            seconds += calls * _best_seconds(product, repeats)
    return flops / seconds


def memory_bandwidth(threads: int, megabytes: int = 512, repeats: int = 10) -> float:
    """Bytes per second this machine moves in a large copy at `threads` threads (read + write counted)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32).normal_()
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _best_seconds(lambda: b.copy_(a), repeats)


# --- ours -------------------------------------------------------------------------------------


def _linear_calls(modules) -> tuple[collections.Counter, list]:
    """Forward hooks on every linear layer of `modules` that count its calls by shape, for `gemm_flops_at`."""
    import torch

    calls, handles = collections.Counter(), []
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, torch.nn.Linear):
                def hook(layer, inputs, _output):
                    if torch.is_grad_enabled():
                        rows = inputs[0].numel() // layer.in_features
                        calls[(rows, layer.in_features, layer.out_features, int(layer.weight.requires_grad))] += 1
                handles.append(layer.register_forward_hook(hook))
    return calls, handles


def run_ours(config_file: str, overrides: dict, assets: Path, work: Work, warmup: int, iterations: int,
             threads: int, count_flops: bool = False) -> dict:
    import pandas as pd
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import stages.ppo
    import stages.rl.rollout
    from bench.flops import PhaseFlops
    from rlhf.config import load_config
    from stages.common.reporting import Reporting
    from stages.ppo import PPOInputs, train_ppo
    from stages.runtime.models import set_determinism

    counted, once = {}, {}
    cfg = load_config(config_file, overrides | {"ppo.num_iterations": warmup + iterations}).ppo
    flops = PhaseFlops()  # the warm-up iteration's FLOPs by phase (not with compiled passes: the counter would trace)
    if count_flops and warmup and cfg.compile is False:
        count_phase_flops(flops)
    real_update, real_save = stages.ppo.ppo_update, stages.ppo.save_state
    real_evaluation, real_save_policy = stages.ppo.final_evaluation, stages.ppo.save_policy

    def ppo_update(trainer, *args, **kwargs):
        """The first update (the warm-up iteration's, untimed) under torch's FLOP counter, its linear layers'
        shapes counted."""
        if "train_flops" in counted:
            return real_update(trainer, *args, **kwargs)
        trained = trainer.models.trained_modules()
        batch = args[0]
        counted["lengths"] = (batch.query_mask.sum(1) + batch.mask.sum(1)).long().tolist()  # real tokens per sequence
        calls, handles = _linear_calls(trained)
        with FlopCounterMode(display=False) as counter:
            figures = real_update(trainer, *args, **kwargs)
        for handle in handles:
            handle.remove()
        counted.update(train_flops=counter.get_total_flops(), gemm_shapes=[[*key, n] for key, n in calls.items()],
                       policy_bytes=sum(p.numel() * p.element_size() for p in trainer.models.policy.parameters()))
        return figures

    def timed_once(name, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            once[name] = once.get(name, 0.0) + time.perf_counter() - start
            return result
        return wrapper

    def in_chunks(items, size):
        """The sampling batch: how many prompts one decode loop carries at once."""
        chunks = real_in_chunks(items, size)
        counted["sampling_batch"] = max(counted.get("sampling_batch", 0), *map(len, chunks))
        return chunks

    real_in_chunks = stages.rl.rollout.in_chunks
    stages.rl.rollout.in_chunks = in_chunks
    stages.ppo.ppo_update = ppo_update
    stages.ppo.save_state = timed_once("checkpoint", real_save)
    stages.ppo.final_evaluation = timed_once("final evaluation and hand-off", real_evaluation)
    stages.ppo.save_policy = timed_once("final evaluation and hand-off", real_save_policy)

    set_determinism(False, threads)
    rows, marks = [], []

    def record(figures: dict[str, float], iteration: int) -> None:
        """Called once per iteration, as it logs: the seconds between two calls are a whole iteration."""
        marks.append(time.perf_counter())
        flops.stop()  # the first iteration's end
        once["compile"] = once.get("compile", 0.0) + figures.get("time/compile", 0.0)
        if iteration > warmup:
            phases = {k.removeprefix("time/"): v for k, v in figures.items()
                      if k.startswith("time/") and k not in ("time/iteration", "time/tokens_per_second")}
            seconds = marks[-1] - marks[-2]
            padding = {"padding:" + k.removeprefix("perf/padding_share/"): v for k, v in figures.items()
                       if k.startswith("perf/padding_share/")}
            rows.append({"seconds": seconds, **phases, **padding,
                         "other": seconds - sum(phases.get(k, 0.0) for k in TOP_PHASES),
                         "generated_tokens": figures["rollout/response_length"] * work.episodes,
                         "rss_mb": resident_memory_mb()})

    prompts = pd.read_json(assets / "prompts.jsonl", lines=True)
    eval_prompts = pd.read_json(assets / "eval_prompts.jsonl", lines=True).head(8)
    with tempfile.TemporaryDirectory() as out:
        train_ppo(cfg, PPOInputs(sft_location=str(assets / "policy"), reward_location=str(assets / "reward"),
                                 prompts=prompts, eval_prompts=eval_prompts), Path(out),
                  Reporting(metrics=record))
    assert torch.get_num_threads() == threads
    if flops.by_phase:
        counted["flops"] = dict(flops.by_phase)
    return {"rows": rows, "peak_memory_mb": peak_memory_mb(), "once": once, **counted}


def count_phase_flops(flops) -> None:
    """`flops` counting from the first iteration's sampling, each operation under the phase our stage
    times it in: every module's `timed` (stages.common.reporting) also opens `flops.phase`."""
    from contextlib import contextmanager

    import stages.common.reporting
    import stages.rl.rollout

    real_timed, real_sample = stages.common.reporting.timed, stages.rl.rollout.Rollouts.sample

    @contextmanager
    def timed(timings, phase):
        with real_timed(timings, phase), flops.phase(phase):
            yield

    def sample(self, *args, **kwargs):
        if not flops.by_phase and not flops.running:
            flops.start()
        return real_sample(self, *args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "timed", None) is real_timed and module is not stages.common.reporting:
            module.timed = timed
    stages.rl.rollout.Rollouts.sample = sample


# --- the orchestration ------------------------------------------------------------------------


def _child(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"benchmark process failed: {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith("RESULT="))
    return json.loads(line.removeprefix("RESULT="))


def _report(result: dict) -> None:
    split = result["split"]
    shown = ", ".join(f"{k} {v:.3f} s" for k, v in split.items()) if split else "not reported"
    print(f"  {result['name']:>5}: {result['seconds_per_iteration']:.3f} s/iteration, "
          f"{result['episodes_per_second']:.1f} episodes/s, "
          f"{result['generated_tokens_per_second']:.0f} generated tokens/s, "
          f"peak memory {result['peak_memory_mb']:.0f} MB; split: {shown}")


def phase_table(results: dict) -> str:
    """Seconds per iteration of each phase, for every side that has the phase (TRL's phases by its own names)."""
    sides = [name for name in ("ours", "ours-compiled", "trl", "trl-compiled") if name in results]
    padding = dict(results["ours"].get("padding_share", {}))  # by our passes' names (`perf/padding_share/<phase>`)
    padding["train"] = padding.get("update")
    rows = [("generate", "generate", "generate"), ("forward: policy (not reused)", "policy_forward", None),
            ("forward: values", "values", "values"), ("forward: reference", "reference", "reference"),
            ("score (reward model)", "score", "score"), ("reward functions", "reward_functions", None),
            ("advantages", "advantages", None), ("update", "train", "update"), ("  of it, compiling", "compile", None),
            ("weight sync", "weight_sync", None), ("logging", None, "logging"), ("garbage collection", None, "gc"),
            ("other (figures, logging)", "other", None), ("whole iteration (median)", None, None)]
    lines = [f"  {'phase (s per iteration, median)':<36} " + " ".join(f"{name:>13}" for name in sides)
             + f" {'ours: padding':>14}"]
    for label, key_ours, key_trl in rows:
        cells = []
        for name in sides:
            key = key_trl if name.startswith("trl") else key_ours
            cells.append(results[name]["seconds_per_iteration"] if label.startswith("whole")
                         else results[name]["split"].get(key) if key else None)
        if all(cell is None for cell in cells):
            continue
        share = padding.get(key_ours) if key_ours else None
        lines.append(f"  {label:<36} " + " ".join(f"{'-' if c is None else f'{c:.3f}':>13}" for c in cells)
                     + ("" if share is None else f" {share:14.1%}"))
    return "\n".join(lines)


def flop_table(reports: dict) -> str:
    """Each side's floating-point work of one iteration by phase (GFLOP, and passes: the phase's FLOPs over
    one forward of its model per sequence), and the share of it that was necessary (`bench.flops`)."""
    lines = []
    for name, report in reports.items():
        phases = ", ".join(f"{phase} {gflop:.2f}" + (f" ({report['passes'][phase]:.2f} passes)"
                                                      if phase in report["passes"] else "")
                           for phase, gflop in sorted(report["gflop"].items(), key=lambda item: -item[1]) if gflop)
        once = "".join(f"; once per run: {phase} {gflop:.2f}" for phase, gflop in report["once_per_run_gflop"].items())
        lines.append(f"  {name}: {report['ran_gflop']:.1f} GFLOP per iteration, {report['necessary_share']:.1%} "
                     f"necessary ({report['necessary_gflop']:.1f}: the update's and one forward of each model per "
                     f"sequence); GFLOP by phase: {phases}{once}")
    return "\n".join(lines)


def machine_limits(ours: dict, extra: dict, threads: int, peak_flops: float) -> dict:
    """The update's FLOP/s against the measured rate of its own matrix products, and sampling's tokens/s
    against reading the policy's weights once per decode step at the measured copy bandwidth."""
    train_flops = extra["train_flops"]
    achieved = train_flops / ours["split"]["train"]
    gemm = gemm_flops_at(extra["gemm_shapes"], threads)
    bandwidth = memory_bandwidth(threads)
    bound = extra["sampling_batch"] * bandwidth / extra["policy_bytes"]
    return {"train_gflop": train_flops / 1e9, "train_gflops": achieved / 1e9, "gemm_gflops": gemm / 1e9,
            "peak_gflops": peak_flops / 1e9, "update_vs_gemm": achieved / gemm, "update_vs_peak": achieved / peak_flops,
            "bandwidth_gbs": bandwidth / 1e9, "policy_mb": extra["policy_bytes"] / 1e6,
            "sampling_batch": extra["sampling_batch"], "sampling_tokens_per_second": ours["sampling_tokens_per_second"],
            "sampling_bound_tokens_per_second": bound,
            "sampling_vs_bandwidth": ours["sampling_tokens_per_second"] / bound}


def cpu_model() -> str:
    """The processor's name as the kernel reports it."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor() or "unknown")


def machine_type(threads: int) -> str:
    """What makes two runs comparable: the processor, its core count and the threads used."""
    return f"{cpu_model()}, {os.cpu_count()} cores, {threads} threads"


def history_entry(args, results: dict, limits: dict, speedup: float | None, threads: int, spread: dict) -> dict:
    import datetime

    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": commit.stdout.strip() + ("+changes" if dirty else ""), "machine": machine_type(threads),
            "config": args.config, "overrides": args.set, "rounds": args.rounds,
            "seconds_per_iteration": {name: r["seconds_per_iteration"] for name, r in results.items()},
            "round_spread": spread, "speedup_vs_trl": speedup,
            "phases": {name: r["split"] for name, r in results.items()}, "limits": limits,
            "padding_share": results["ours"]["padding_share"], "settings": ours_settings(args)}


def ours_settings(args) -> dict:
    """What our side computed with, as the config resolves it: precision, the passes' layout, and the
    CPU numerics (rlhf/numerics.py; runs before the setting existed were native)."""
    import yaml

    from rlhf import numerics
    from rlhf.config import load_config

    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    ppo = load_config(args.config, overrides).ppo
    return {"precision": ppo.precision, "padding_free": ppo.padding_free, "micro_batch_tokens": ppo.micro_batch_tokens,
            "micro_batch_size": ppo.micro_batch_size, "numerics": numerics.mode()}


def comparable(a: dict, b: dict) -> bool:
    """Two history rows measure the same thing: machine type, work (config, overrides) and model size
    (rows from before sizes were recorded are the bench model's)."""
    def shape(e: dict) -> dict:
        return e.get("shape", asdict(ModelShape()))

    return (a["machine"] == b["machine"] and a["config"] == b["config"] and a["overrides"] == b["overrides"]
            and shape(a) == shape(b))


def compare_with_history(path: Path, entry: dict) -> str:
    """The change from the last run on the same machine type with the same work; a slowdown of more than
    10% beyond the larger of the two runs' round-to-round spreads is flagged."""
    def numerics(e: dict) -> str:  # runs from before the setting were native
        return e.get("settings", {}).get("numerics", "native")

    same = [e for e in map(json.loads, path.read_text().splitlines() if path.exists() else [])
            if comparable(e, entry) and numerics(e) == numerics(entry)]
    if not same:
        return f"  history: first run on this machine type ({entry['machine']}) in {path}"
    last = same[-1]
    before, now = last["seconds_per_iteration"]["ours"], entry["seconds_per_iteration"]["ours"]
    change = now / before - 1
    allowed = 0.10 + max(last["round_spread"]["ours"], entry["round_spread"]["ours"])
    line = (f"  history: ours {before:.3f} -> {now:.3f} s/iteration ({change:+.1%}) since {last['commit']} "
            f"({last['date'][:10]}); speedup {last['speedup_vs_trl'] or float('nan'):.2f} -> "
            f"{entry['speedup_vs_trl'] or float('nan'):.2f}")
    if change > allowed:
        line += f"\n  SLOWDOWN: ours is {change:.1%} slower, beyond the {allowed:.1%} allowed (10% + round spread)"
    return line


def side_commands(args, assets: Path, work: Work, shape: ModelShape, threads: int) -> dict[str, list[str]]:
    """Each side's command: ours; with `--compiled` ours with `ppo.compile: true`; TRL 1.12 as users run it;
    with `--compiled` TRL under accelerate's dynamo backend (its PPOTrainer ignores `torch_compile=True`)."""
    common = ([*(f"--set={item}" for item in args.set), "--config", args.config, "--warmup", str(args.warmup),
               "--iterations", str(args.iterations), "--state", args.state]
              + [f"--{k.replace('_', '-')}={v}" for k, v in asdict(shape).items()])
    commands = {"ours": [sys.executable, "-m", "bench.ppo", "--role", "ours", *common]}
    if args.compiled:
        commands["ours-compiled"] = [*commands["ours"], "--set=ppo.compile=true"]
    if args.reference != "none":
        commands["trl"] = [args.reference, str(REPO / "bench" / "trl_reference.py"), "--assets", str(assets),
                           "--work", json.dumps(asdict(work)), "--threads", str(threads),
                           "--warmup", str(args.warmup), "--iterations", str(args.iterations)]
        if args.compiled:
            commands["trl-compiled"] = [*commands["trl"], "--compile", "accelerate"]
    return commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/bench.yaml", help="pipeline config whose ppo section is the work")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. ppo.rollout_batch_size=32 (YAML value); repeatable")
    parser.add_argument("--rows", help="also write every timed iteration of our side to this JSON file")
    parser.add_argument("--reference", default=str(REPO / ".bench-venv" / "bin" / "python"),
                        help="python of the environment with TRL 1.12.0; 'none' skips the reference")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=4, help="timed iterations per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of ours and the reference")
    parser.add_argument("--state", default=str(REPO / ".rlhf" / "bench"), help="where the built model and prompts go")
    for name, value in asdict(ModelShape()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--history", help="append this run's figures to this JSON-lines file and compare with the "
                        "last run there on the same machine type (make bench: bench/results/bench-history.jsonl)")
    parser.add_argument("--compiled", action="store_true", help="also ours with ppo.compile: true and TRL compiled "
                        "(accelerate's dynamo backend), alternating with the plain sides")
    parser.add_argument("--role", choices=["orchestrate", "ours"], default="orchestrate", help=argparse.SUPPRESS)
    parser.add_argument("--count-flops", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = ModelShape(**{name: getattr(args, name) for name in asdict(ModelShape())})
    import yaml

    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    assets, work, threads = build_assets(args.config, overrides, shape, Path(args.state))

    if args.role == "ours":
        print("RESULT=" + json.dumps(run_ours(args.config, overrides, assets, work, args.warmup, args.iterations,
                                              threads, args.count_flops)))
        return 0

    print(f"PPO benchmark: {args.config}; model {asdict(shape)}; {work.episodes} episodes x {work.response_length} "
          f"tokens per iteration, {work.ppo_epochs} epochs x {work.minibatches} minibatches; {threads} threads; "
          f"{args.rounds} alternating rounds of {args.warmup} warm-up + {args.iterations} timed iterations each, "
          f"median over all timed iterations", flush=True)
    commands = side_commands(args, assets, work, shape, threads)
    # Alternating rounds, so that a slow spell of a shared machine falls on every side.
    rows = {name: [] for name in commands}
    peaks = {name: 0.0 for name in commands}
    peak_flops = matmul_peak_flops(threads)
    ours_extra, notes, counted = {}, {}, {}
    for round_ in range(args.rounds):
        for name, command in commands.items():
            # The warm-up iteration's FLOPs counted in the first round (counting slows it about 2.5x; untimed).
            result = _child([*command, "--count-flops"] if round_ == 0 and name in ("ours", "trl") else command)
            rows[name] += result["rows"]
            if "flops" in result:  # the warm-up iteration's, by phase: the same in every round
                counted[name] = {"flops": result["flops"], "lengths": result["lengths"]}
            peaks[name] = max(peaks[name], result["peak_memory_mb"])
            notes[name] = {k: v for k, v in result.items() if k in ("compiled", "warmup_seconds")}
            if name == "ours":
                ours_extra = {k: v for k, v in result.items() if k not in ("rows", "peak_memory_mb")}
            elif name == "ours-compiled":
                notes[name] = {"compile_seconds": result["once"].get("compile", 0.0)}
    peak_flops = max(peak_flops, matmul_peak_flops(threads))
    results = {name: summarize(rows[name], work, name, peaks[name]) for name in commands}
    if args.rows:
        Path(args.rows).write_text(json.dumps(rows["ours"]))
    for result in results.values():
        _report(result)
    print(phase_table(results))
    for name, seconds in ours_extra.get("once", {}).items():
        print(f"  ours, once per run: {name} {seconds:.3f} s")
    limits = machine_limits(results["ours"], ours_extra, threads, peak_flops)
    if "ours-compiled" in results:
        limits["update_vs_gemm_compiled"] = (limits["train_gflop"] * 1e9 / results["ours-compiled"]["split"]["train"]
                                             / (limits["gemm_gflops"] * 1e9))
        print(f"  ours-compiled: update at {limits['update_vs_gemm_compiled']:.0%} of the rate of its own matrix "
              "products (the same work's FLOP count)")
    print(f"  ours: update phase {limits['train_gflop']:.2f} GFLOP per iteration at "
          f"{limits['train_gflops']:.2f} GFLOP/s: "
          f"{limits['update_vs_gemm']:.0%} of the float32 rate of its own matrix products at their shapes "
          f"({limits['gemm_gflops']:.1f} GFLOP/s), {limits['update_vs_peak']:.0%} of the 1024x1024 peak "
          f"({peak_flops / 1e9:.1f} GFLOP/s), both measured in this run at {threads} threads")
    print(f"  ours: sampling {limits['sampling_tokens_per_second']:.0f} tokens/s = "
          f"{limits['sampling_vs_bandwidth']:.1%} "
          f"of the bound of reading the policy's weights ({limits['policy_mb']:.1f} MB) once per decode step of "
          f"{limits['sampling_batch']} sequences at the measured copy bandwidth ({limits['bandwidth_gbs']:.1f} GB/s): "
          f"{limits['sampling_bound_tokens_per_second']:.0f} tokens/s")
    flop_reports = {name: flop_report(side, assets, "train" if name == "ours" else "update")
                    for name, side in counted.items()}
    if flop_reports:
        print(flop_table(flop_reports))
    for name, note in notes.items():
        if note:
            print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in note.items()))
    speedup = None
    if "trl" in results:
        speedup = results["ours"]["episodes_per_second"] / results["trl"]["episodes_per_second"]
    speedups = {f"{a}_vs_{b}": results[a]["episodes_per_second"] / results[b]["episodes_per_second"]
                for a in ("ours", "ours-compiled") for b in ("trl", "trl-compiled") if a in results and b in results}
    for name, ratio in speedups.items():
        print(f"  speedup {name.replace('_vs_', ' against ')}: {ratio:.2f}")
    if args.history:
        entry = history_entry(args, results, limits, speedup, threads,
                              {name: round_spread(rows[name], args.rounds) for name in rows})
        entry |= {"shape": asdict(shape), "speedups": speedups, "notes": notes, "flops": flop_reports}
        print(compare_with_history(Path(args.history), entry))
        with Path(args.history).open("a") as history:
            history.write(json.dumps(entry) + "\n")
    if speedup is not None:
        print(f"PPO speedup_vs_trl={speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
