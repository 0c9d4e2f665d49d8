"""Scaling: what each process holds, and how fast PPO runs, on one process, two DDP processes
and two FSDP2 processes (sampling with the whole policy gathered once per rollout, or gathered
layer by layer at every decode step).

    python -m bench.scale                  (or: make bench-scale)
    python -m bench.scale --engines "1 process" "1 process, critic: reward-lora" --tag critics

1. A Llama-shaped model is built from config (`--hidden`, `--layers`; ~100M parameters by default)
   with random weights and the demo world's tokenizer, and saved as the SFT checkpoint; the reward
   checkpoint is the same folder (a fresh score head). Weights and optimizer state dominate at
   this size, as they do for the models people align.
2. Each engine runs the same PPO work (all four models: policy, critic started from the reward
   model, reference, reward model; `WORK` below) in fresh processes, through `call_stage` as the
   flow runs a stage. The `critic: reward-lora` engines hold three: their critic is adapters and
   a value head on the reward model itself.
3. Every process records, after its first optimizer step: the bytes of the tensors it holds
   (parameters of the four models, gradients of the trained ones, AdamW state; a shard counts its
   local part only), what sampling gathers on top (a sharded policy: all of it, or its largest
   layer) and its resident memory (RSS, after `malloc_trim` hands freed pages back: on CPU there
   are no allocator statistics; RSS also holds the libraries, ~0.5 GiB, and DDP's gradient
   buckets). Peak RSS over the whole run is reported too: it includes loading, where every process
   still reads whole checkpoints before sharding them.
4. Seconds per iteration and sampling tokens per second (all processes' tokens over the sampling
   time) are means over the iterations after the first.

Prints a Markdown table and writes `bench/results/scale-<date>[-<tag>].json`. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ENGINES: dict[str, dict] = {
    "1 process": {"launch": {"num_processes": 1}},
    "2 x DDP": {"launch": {"num_processes": 2}},
    "2 x FSDP2, sampling whole": {"launch": {"num_processes": 2, "accelerate_config": "configs/accelerate/fsdp.yaml"},
                                  "sharded_sampling": "whole"},
    "2 x FSDP2, sampling per layer": {"launch": {"num_processes": 2,
                                                 "accelerate_config": "configs/accelerate/fsdp.yaml"},
                                      "sharded_sampling": "per_layer"},
    # The critic as adapters and a value head on the reward model the scorer holds: one copy of it, not two.
    "1 process, critic: reward-lora": {"launch": {"num_processes": 1}, "critic.kind": "reward-lora"},
    "2 x FSDP2, critic: reward-lora": {"launch": {"num_processes": 2,
                                                  "accelerate_config": "configs/accelerate/fsdp.yaml"},
                                       "sharded_sampling": "whole", "critic.kind": "reward-lora"},
}
"""Each engine's `ppo` settings on top of `WORK`."""

WORK = {"sampling.response_length": 16, "rollout_batch_size": 8, "num_iterations": 3, "num_ppo_epochs": 1,
        "num_minibatches": 1, "evaluation.every": None, "evaluation.samples_per_prompt": 1, "checkpoint_every": 100,
        "critic.kind": "reward", "missing_eos_score": None, "precision": "fp32"}
"""The PPO work every engine does: short responses, one optimizer step per iteration."""


@dataclass(frozen=True)
class Measured:
    """`PPOInputs` and where each process writes what it held."""

    ppo_inputs: object
    figures_dir: Path


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def held_bytes(models, optimizer) -> dict[str, int]:
    """Bytes of the tensors a PPO process holds, counted from the tensors themselves (a shard counts
    its local part): every model's parameters once (a `reward-lora` critic's body is the reward
    model's), the trained ones' gradients (held from backward to the step), AdamW's state."""
    import torch

    held = [*models.trained_modules(), models.reference, models.scorer and models.scorer.model]
    parameters = {id(p): p for m in held if m is not None for p in m.parameters()}.values()
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"weights_bytes": _bytes(parameters), "gradients_bytes": _bytes(models.trainable()),
            "optimizer_bytes": _bytes(state)}


def measured_ppo(cfg, inputs: Measured, output_dir: Path, reporting):
    """`train_ppo`, each process recording what it holds after its first optimizer step."""
    import ctypes

    import psutil
    from accelerate import PartialState

    import stages.ppo
    from stages.runtime.holding import Sharded, decoder_layers

    real_update = stages.ppo.ppo_update

    def ppo_update(trainer, episodes):
        figures = real_update(trainer, episodes)
        path = inputs.figures_dir / f"rank-{trainer.accelerator.process_index}.json"
        if not path.exists():
            models = trainer.models
            # While sampling a sharded policy also holds what it gathers: all of it, or one layer.
            gathered = 0
            if isinstance(models.holding, Sharded):
                units = [models.policy] if models.holding.gather == "whole" else decoder_layers(models.policy)
                gathered = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units)
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed pages back to the system, so RSS shows what is held
            path.write_text(json.dumps({
                "gathered_for_sampling_bytes": gathered,
                "parameters": sum(p.numel() for p in models.policy.parameters()),
                **held_bytes(models, trainer.optimizer),
                "rss_bytes": psutil.Process().memory_info().rss}))
        return figures

    stages.ppo.ppo_update = ppo_update
    result = stages.ppo.train_ppo(cfg, inputs.ppo_inputs, output_dir, reporting)
    (inputs.figures_dir / f"peak-rank-{PartialState().process_index}.json").write_text(
        json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    return result


def build_checkpoint(world: Path, folder: Path, hidden: int, layers: int) -> str:
    """A randomly initialised Llama of the given shape with the demo tokenizer, as an HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.runtime.models import load_tokenizer, save_checkpoint

    tokenizer = load_tokenizer(str(world / "model"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    save_checkpoint(LlamaForCausalLM(config), tokenizer, folder)
    return str(folder)


def run_engine(name: str, checkpoint: str, world: Path, work: Path) -> dict:
    """One engine's PPO run in this process (one process) or its launch (two); its row."""
    # By their importable name: the launched processes unpickle the call, and `python -m` runs this as __main__.
    from bench.scale import Measured, measured_ppo
    from rlhf.config import load_config, with_overrides
    from schemas.validate import LengthBudget, load_validated
    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.ppo import PPOInputs
    from stages.runtime.models import load_tokenizer

    cfg = with_overrides(load_config("configs/tiny.yaml").ppo, WORK | ENGINES[name])
    tokenizer = load_tokenizer(checkpoint)
    budget = LengthBudget(cfg.max_prompt_length, cfg.max_prompt_length + cfg.sampling.response_length)
    prompts = load_validated(str(world / "prompts.jsonl"), "prompt", tokenizer=tokenizer, budget=budget).frame
    eval_prompts = load_validated(str(world / "prompts_eval.jsonl"), "prompt", tokenizer=tokenizer, budget=budget).frame
    shutil.rmtree(work, ignore_errors=True)  # a fresh run: an earlier one's full-state checkpoint would be resumed
    figures_dir = work / "figures"
    figures_dir.mkdir(parents=True)
    inputs = Measured(PPOInputs(sft_location=checkpoint, reward_location=checkpoint,
                                prompts=prompts, eval_prompts=eval_prompts), figures_dir)
    result = call_stage(measured_ppo, cfg, inputs, work / "stage", Reporting(), Determinism(deterministic=False))
    ranks = [json.loads(p.read_text()) | json.loads((figures_dir / f"peak-{p.name}").read_text())
             for p in sorted(figures_dir.glob("rank-*.json"))]
    later = result.history[1:] or result.history
    mean = lambda key: sum(h[key] for h in later) / len(later)  # noqa: E731
    tokens = [cfg.rollout_batch_size * h["rollout/response_length"] / h["time/generate"] for h in later]
    return {"engine": name, "processes": len(ranks), "parameters_per_model": ranks[0]["parameters"],
            "held_as": result.tags["rlhf.held_as"], "ranks": ranks,
            "model_and_optimizer_gib": max((r["weights_bytes"] + r["gradients_bytes"] + r["optimizer_bytes"]) / 2**30
                                           for r in ranks),
            "rss_after_first_step_gib": max(r["rss_bytes"] for r in ranks) / 2**30,
            "gathered_for_sampling_gib": max(r["gathered_for_sampling_bytes"] for r in ranks) / 2**30,
            "peak_rss_gib": max(r["peak_rss_bytes"] for r in ranks) / 2**30,
            "seconds_per_iteration": mean("time/iteration"), "generate_seconds": mean("time/generate"),
            "train_seconds": mean("time/train"), "sampling_tokens_per_second": sum(tokens) / len(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--state", type=Path, default=REPO / ".rlhf" / "bench-scale")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--tag", help="results file scale-<date>-<tag>.json")
    parser.add_argument("--engine", help="run this one engine here (used by the driver)")
    args = parser.parse_args()
    if args.engine:
        row = run_engine(args.engine, str(args.state / "checkpoint"), args.state / "world", args.state / args.engine)
        print("ROW=" + json.dumps(row))
        return

    from rlhf.config import load_config
    from rlhf.demo.world import build_world

    args.state.mkdir(parents=True, exist_ok=True)
    world = build_world(args.state / "worlds", load_config("configs/tiny.yaml").demo)
    (args.state / "world").unlink(missing_ok=True)
    (args.state / "world").symlink_to(world)
    build_checkpoint(world, args.state / "checkpoint", args.hidden, args.layers)
    rows = []
    for name in args.engines:  # each in fresh processes: its memory is its own
        done = subprocess.run([sys.executable, "-m", "bench.scale", "--engine", name, "--state", str(args.state),
                               "--hidden", str(args.hidden), "--layers", str(args.layers)],
                              cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        rows.append(json.loads(next(line for line in done.stdout.splitlines() if line.startswith("ROW="))[4:]))
        print(f"{name}: done", flush=True)

    base = next((r for r in rows if r["engine"] == "2 x DDP"), rows[0])  # shares of what a DDP process holds
    ddp = base["model_and_optimizer_gib"]
    print(f"\nPPO, Llama-shaped, {rows[0]['parameters_per_model'] / 1e6:.0f}M parameters per model "
          f"(hidden {args.hidden}, {args.layers} layers), four models (three with `critic: reward-lora`), CPU fp32\n")
    print(f"| engine | held as | model + optimizer per process, GiB | share of {base['engine']}'s | "
          "+ gathered while sampling, GiB "
          "| RSS after first step, GiB | peak RSS, GiB | s / iteration | sampling tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['held_as']} | {r['model_and_optimizer_gib']:.2f} | "
              f"{r['model_and_optimizer_gib'] / ddp:.0%} | {r['gathered_for_sampling_gib']:.2f} | "
              f"{r['rss_after_first_step_gib']:.2f} | {r['peak_rss_gib']:.2f} | "
              f"{r['seconds_per_iteration']:.1f} | {r['sampling_tokens_per_second']:.1f} |")
    import torch

    out = (REPO / "bench" / "results"
           / f"scale-{datetime.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json")
    out.write_text(json.dumps({"hidden": args.hidden, "layers": args.layers, "work": WORK, "torch": torch.__version__,
                               "device": "cpu", "rows": rows}, indent=2) + "\n")
    print(f"\nwritten: {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
