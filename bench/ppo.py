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
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
    from rlhf.demo_locations import resolve_location
    from rlhf.demo_world import build_world
    from schemas.validate import LengthBudget, load_validated
    from stages.runtime.models import load_tokenizer, save_checkpoint
    from stages.rl.scoring import load_reward_model

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
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
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


def summarize(rows: list[dict[str, float]], work: Work, name: str, peak_memory_mb: float) -> dict:
    """Median figures over the timed iterations of every round."""
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    return {"name": name, "iterations": len(rows), "seconds_per_iteration": median["seconds"],
            "episodes_per_second": work.episodes / median["seconds"],
            "generated_tokens_per_second": median["generated_tokens"] / median["seconds"],
            "split": {k: median[k] for k in ("generate", "forward", "score", "train") if k in median},
            "peak_memory_mb": peak_memory_mb}


def matmul_peak_flops(threads: int, size: int = 1024, repeats: int = 30) -> float:
    """This machine's float32 matrix-multiply rate at `threads` threads: the best of `repeats` square
    products of `size`, after a warm-up (2 size^3 floating-point operations each)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# --- ours -------------------------------------------------------------------------------------


def run_ours(config_file: str, overrides: dict, assets: Path, work: Work, warmup: int, iterations: int,
             threads: int) -> dict:
    import pandas as pd
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import stages.ppo
    from rlhf.config import load_config
    from stages.runtime.models import set_determinism
    from stages.ppo import PPOInputs, train_ppo
    from stages.common.reporting import Reporting

    counted, real_update = {}, stages.ppo.ppo_update

    def ppo_update(*args, **kwargs):
        """The first update (the warm-up iteration's, untimed) under torch's FLOP counter."""
        if counted:
            return real_update(*args, **kwargs)
        with FlopCounterMode(display=False) as counter:
            figures = real_update(*args, **kwargs)
        counted["train_flops"] = counter.get_total_flops()
        return figures

    stages.ppo.ppo_update = ppo_update

    set_determinism(False, threads)
    cfg = load_config(config_file, overrides | {"ppo.num_iterations": warmup + iterations}).ppo
    rows = []

    def record(figures: dict[str, float], iteration: int) -> None:
        if iteration > warmup:
            rows.append({"seconds": figures["time/iteration"], "generate": figures["time/generate"],
                         "forward": figures["time/forward"], "score": figures["time/score"], "train": figures["time/train"],
                         "generated_tokens": figures["rollout/response_length"] * work.episodes,
                         "rss_mb": resident_memory_mb()})

    prompts = pd.read_json(assets / "prompts.jsonl", lines=True)
    eval_prompts = pd.read_json(assets / "eval_prompts.jsonl", lines=True).head(8)
    with tempfile.TemporaryDirectory() as out:
        train_ppo(cfg, PPOInputs(str(assets / "policy"), str(assets / "reward"), prompts, eval_prompts), Path(out),
                  Reporting(metrics=record))
    assert torch.get_num_threads() == threads
    return {"rows": rows, "peak_memory_mb": peak_memory_mb(), **counted}


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
          f"{result['episodes_per_second']:.1f} episodes/s, {result['generated_tokens_per_second']:.0f} generated tokens/s, "
          f"peak memory {result['peak_memory_mb']:.0f} MB; split: {shown}")


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
    parser.add_argument("--role", choices=["orchestrate", "ours"], default="orchestrate", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = ModelShape(**{name: getattr(args, name) for name in asdict(ModelShape())})
    import yaml

    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    assets, work, threads = build_assets(args.config, overrides, shape, Path(args.state))

    if args.role == "ours":
        print("RESULT=" + json.dumps(run_ours(args.config, overrides, assets, work, args.warmup, args.iterations, threads)))
        return 0

    print(f"PPO benchmark: {args.config}; model {asdict(shape)}; {work.episodes} episodes x {work.response_length} "
          f"tokens per iteration, {work.ppo_epochs} epochs x {work.minibatches} minibatches; {threads} threads; "
          f"{args.rounds} alternating rounds of {args.warmup} warm-up + {args.iterations} timed iterations each, "
          f"median over all timed iterations", flush=True)
    common = [*(f"--set={item}" for item in args.set), "--config", args.config, "--warmup", str(args.warmup), "--iterations", str(args.iterations),
              "--state", args.state] + [f"--{k.replace('_', '-')}={v}" for k, v in asdict(shape).items()]
    commands = {"ours": [sys.executable, "-m", "bench.ppo", "--role", "ours", *common]}
    if args.reference != "none":
        commands["trl"] = [args.reference, str(REPO / "bench" / "trl_reference.py"), "--assets", str(assets),
                           "--work", json.dumps(asdict(work)), "--threads", str(threads),
                           "--warmup", str(args.warmup), "--iterations", str(args.iterations)]
    # Alternating rounds, so that a slow spell of a shared machine falls on both sides.
    rows = {name: [] for name in commands}
    peaks = {name: 0.0 for name in commands}
    peak_flops = matmul_peak_flops(threads)
    train_flops = None
    for _ in range(args.rounds):
        for name, command in commands.items():
            result = _child(command)
            rows[name] += result["rows"]
            peaks[name] = max(peaks[name], result["peak_memory_mb"])
            train_flops = result.get("train_flops", train_flops)
    peak_flops = max(peak_flops, matmul_peak_flops(threads))
    results = {name: summarize(rows[name], work, name, peaks[name]) for name in commands}
    if args.rows:
        Path(args.rows).write_text(json.dumps(rows["ours"]))
    for result in results.values():
        _report(result)
    achieved = train_flops / results["ours"]["split"]["train"]
    print(f"  ours: training phase {train_flops / 1e9:.2f} GFLOP per iteration at {achieved / 1e9:.2f} GFLOP/s, "
          f"{achieved / peak_flops:.0%} of this machine's float32 matrix-multiply peak ({peak_flops / 1e9:.1f} GFLOP/s "
          f"at {threads} threads, measured in this run)")
    if "trl" in results:
        print(f"PPO speedup_vs_trl={results['ours']['episodes_per_second'] / results['trl']['episodes_per_second']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
