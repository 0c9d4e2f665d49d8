"""The project's own stages on a GPU (issue 60): SFT -> reward -> PPO through `call_stage`, as the flow
calls them, each measured against its memory plan.

    python -m bench.gpu_stages --out stages.json [--dry]

1. On the demo world (its tokenizer and tiny Llama): the three stages with the demo's settings, PPO for
   `DEMO_ITERATIONS` iterations.
2. On a ~0.5B Llama built from config (`bench.gpu.LLAMA_05B`'s shape: hidden 896, 24 layers, 14 heads,
   2 KV heads; the demo tokenizer's vocabulary), random weights: the three stages for a few steps each,
   PPO at a size where the update has work (`LARGE_PPO`). One PPO iteration is profiled (`torch.profiler`,
   the top kernels by GPU time).
3. A Llama-3.2-3B-shaped model (`LLAMA_32_3B`: hidden 3072, 28 layers, 24 heads, 8 KV heads, MLP 8192;
   the demo tokenizer's vocabulary, so 2.8B parameters rather than 3.2B), made on the device with random
   weights and saved in bf16: SFT, reward and PPO with LoRA, PPO's critic on the reward model's own
   weights (`critic.kind: reward-lora`), a few steps each (`LARGE_3B`).
4. The PPO update's model FLOP utilisation on the 0.5B Llama, full and LoRA, with and without gradient
   checkpointing, and with `ppo.compile` (the decode replayed as CUDA graphs): model FLOPs (6 x parameters
   x tokens trained, 4 x with LoRA's frozen weights) over the update's seconds (`time/train`), against the
   bf16 matmul rate measured first (`bench.gpu.ceilings`).

Per stage: status, seconds, `time/*` per PPO phase, peak allocated GPU memory (`call_stage`'s
`memory/peak_allocated_gib`) against the plan's peak less its runtime allowance (`rlhf plan`'s figure
for the same section on this device). Rows are written to `--out` as each finishes, so a run stopped
at its limit keeps what it measured. `--dry` runs the same steps on the CPU at the tiny config's sizes
(`scripts/gpu_check.sh` with `GPU_CHECK_DRY=1`, run by `tests/test_gpu_check.py`). A benchmark, not a test.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

DEMO_ITERATIONS = 10
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128)
"""The dry run's stand-in for the 0.5B Llama."""

LARGE_SFT = {"max_steps": 20, "batch_size": 16, "eval_steps": 1000, "logging_steps": 5, "num_samples": 2}
LARGE_REWARD = {"max_steps": 20, "batch_size": 16, "eval_steps": 1000, "logging_steps": 5, "min_eval_accuracy": 0.0}
LARGE_PPO = {"num_iterations": 3, "rollout_batch_size": 256, "sampling.response_length": 128, "num_ppo_epochs": 2,
             "num_minibatches": 2, "critic.kind": "shared", "evaluation.every": None,
             "evaluation.samples_per_prompt": 1, "checkpoint_every": 100, "missing_eos_score": None}
"""The 0.5B runs' settings on the demo config: a few steps each, PPO with 256 x (prompt + 128) tokens a rollout
so that the update has work (random weights rarely end a response early), the shared value head so that the
update's FLOPs are the policy's alone."""
LLAMA_32_3B = dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                   intermediate_size=8192, rope_theta=500000.0)
"""Llama-3.2-3B's body (its config on the hub); the vocabulary is the demo tokenizer's."""
LARGE_3B = {"sft": {"max_steps": 6, "batch_size": 8, "eval_steps": 1000, "logging_steps": 2, "num_samples": 2,
                    "lora": {"r": 16}},
            "reward": {"max_steps": 6, "batch_size": 8, "eval_steps": 1000, "logging_steps": 2,
                       "min_eval_accuracy": 0.0, "lora": {"r": 16}},
            "ppo": {"num_iterations": 3, "rollout_batch_size": 64, "sampling.response_length": 64, "num_ppo_epochs": 1,
                    "num_minibatches": 2, "lora": {"r": 16}, "critic.kind": "reward-lora", "evaluation.every": None,
                    "evaluation.samples_per_prompt": 1, "checkpoint_every": 100, "missing_eos_score": None}}
"""The 3B chain: LoRA r 16 on every stage, a few steps each; PPO 64 x (prompt + 64) tokens an iteration."""
DRY = {"sft": {"max_steps": 4, "eval_steps": 1000, "num_samples": 1},
       "reward": {"max_steps": 4, "eval_steps": 1000, "min_eval_accuracy": 0.0},
       "ppo": {"num_iterations": 2, "rollout_batch_size": 8, "sampling.response_length": 8, "num_minibatches": 2,
               "critic.kind": "shared", "evaluation.every": None, "checkpoint_every": 100}}
"""The dry run's settings on the tiny config, for every world."""
DRY_3B = {stage: DRY[stage] | {"lora": {"r": 4}} for stage in DRY} | {
    "ppo": DRY["ppo"] | {"lora": {"r": 4}, "critic.kind": "reward-lora"}}
"""The dry run of the 3B chain: LoRA, and the critic on the reward model."""
VARIANTS = {"full": {}, "full, compiled": {"compile": True}, "lora": {"lora": {"r": 16}},
            "lora, checkpointing": {"lora": {"r": 16}, "gradient_checkpointing": True},
            "full, checkpointing": {"gradient_checkpointing": True},
            "full, frozen float32": {"frozen_dtype": "float32"}}
"""The update's runs, 2 iterations each (the second measured), from the random base model rather than the SFT
checkpoint (whose responses end after a few tokens, as the demo's do) at a learning rate that keeps it
random, so every response runs to about its 128 tokens and each update has the same work. `full, compiled` is
`ppo.compile: true` (the decode's steps replayed as CUDA graphs); `full, frozen float32` holds the reference and
reward model as issue 60 did (`frozen_dtype: auto` is bf16 on a GPU now)."""
VARIANT_PPO = {"num_iterations": 2, "learning_rate": 1e-6}
PPO_PHASES = ("generate", "reference", "values", "score", "advantages", "train", "iteration")


class Results:
    """The results file, rewritten as each part finishes."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record
        self.write()

    def add(self, key: str, value) -> None:
        self.record.setdefault(key, []).append(value)
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.record, indent=1, default=str) + "\n")


def build_llama(world: Path, folder: Path, shape: dict, dtype: torch.dtype | None = None) -> str:
    """A randomly initialised Llama of `shape` with the demo tokenizer, made on the GPU where there is one
    and saved as a Hugging Face folder (in `dtype`, default float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.runtime.models import load_tokenizer, save_checkpoint

    tokenizer = load_tokenizer(str(world / "model"))
    torch.manual_seed(0)
    config = LlamaConfig(**shape, vocab_size=len(tokenizer), max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    save_checkpoint(model, tokenizer, folder, dtype)
    model = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return str(folder)


def planned(cfg, stage: str, section, checkpoint: str, eval_prompts: int) -> dict:
    """`rlhf plan`'s figures for `section` on this device: its peak (less the runtime allowance, which
    torch's allocator does not see), the phase, and the model-and-optimizer state."""
    from stages.memory.phases import Counts, Target, this_device
    from stages.memory.plan import plan
    from stages.memory.shapes import GIB, RUNTIME_GIB, model_shape

    result = plan(cfg.model_copy(update={stage: section}), [stage], {"policy": model_shape(checkpoint)},
                  Target(this_device(), Counts(eval_prompts, eval_prompts, eval_prompts))).stages[stage]
    return {"planned_peak_gib": result.peak / GIB - RUNTIME_GIB, "planned_phase": result.peak_phase,
            "planned_state_gib": result.state_bytes() / GIB}


class Profiled:
    """A `Reporting.metrics` hook that profiles one PPO iteration (the second: the first compiles and
    allocates) and keeps the top kernels by GPU time."""

    def __init__(self, iteration: int = 2):
        self.iteration, self.profiler, self.table, self.top, self.busy = iteration, None, "", [], {}

    def __call__(self, figures: dict, iteration: int) -> None:
        from torch.profiler import profile

        from bench.gpu import SELF_TIME, busy_us, profiler_activities, top_events

        if iteration == self.iteration - 1:
            self.profiler = profile(activities=profiler_activities())
            self.profiler.start()
        elif iteration == self.iteration and self.profiler is not None:
            self.profiler.stop()
            events = self.profiler.key_averages()
            self.table = events.table(sort_by=SELF_TIME, row_limit=25)
            self.top = top_events(events, 15)
            # the device's busy time against the iteration's wall clock (which the profiler slows)
            self.busy = {"iteration": iteration, "busy_ms": busy_us(events) / 1e3,
                         "wall_ms": figures.get("time/iteration", 0.0) * 1e3}


class PhasePeaks:
    """The largest GPU memory allocated in each timed PPO phase (`stages.common.reporting.timed`), over a
    run: the timer is swapped in the modules that time phases while the block runs. The allocator's peak
    is reset as each phase starts (folded into the phases still open first), so `call_stage`'s own peak
    then covers only what ran after the last phase; `overall` takes the larger."""

    MODULES = ("stages.ppo", "stages.rl.rollout", "stages.rl.scoring", "stages.rl.teacher", "stages.envs.episode",
               "stages.envs.loop", "stages.envs.ahead")

    def __init__(self):
        self.peaks: dict[str, float] = {}
        self.open: list[str] = []

    def _fold(self) -> None:
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        for phase in self.open:
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)

    def timed(self, timings: dict[str, float], phase: str):
        from stages.common.reporting import timed

        @contextmanager
        def measured():
            self._fold()
            self.open.append(phase)
            torch.cuda.reset_peak_memory_stats()
            try:
                with timed(timings, phase):
                    yield
            finally:
                self._fold()
                self.open.remove(phase)

        return measured()

    @contextmanager
    def installed(self):
        import importlib

        if not torch.cuda.is_available():
            yield self
            return
        modules = [importlib.import_module(name) for name in self.MODULES]
        originals = [module.timed for module in modules]
        for module in modules:
            module.timed = self.timed
        try:
            yield self
        finally:
            for module, original in zip(modules, originals, strict=True):
                module.timed = original


def stage_row(world: str, stage: str, variant: str, run) -> tuple[dict, object]:
    """`run()` (a stage through `call_stage`: its result and its plan's figures), timed; the row and the
    stage's result (None where it failed)."""
    row = {"world": world, "stage": stage, "variant": variant}
    started = time.perf_counter()
    try:
        result, plan_figures = run()
    except Exception as error:  # a failed stage is a result to record, and the others still run
        row.update(status="failed", error=f"{type(error).__name__}: {error}"[:2000],
                   traceback=traceback.format_exc()[-3000:], seconds=time.perf_counter() - started)
        print(f"{world} {stage} {variant}: FAILED {row['error'][:500]}", flush=True)
        return row, None
    metrics = result.metrics
    row.update(status="ok", seconds=time.perf_counter() - started, **plan_figures,
               peak_allocated_gib=metrics.get("memory/peak_allocated_gib"),
               peak_rss_gib=metrics.get("memory/peak_rss_gib"), tags=getattr(result, "tags", {}),
               metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    if row["peak_allocated_gib"]:
        row["plan_over_measured"] = row["planned_peak_gib"] / row["peak_allocated_gib"]
    history = getattr(result, "history", None)
    if history:
        later = history[1:] or history  # the first iteration compiles kernels and fills the allocator
        row["time"] = {phase: sum(h.get(f"time/{phase}", 0.0) for h in later) / len(later) for phase in PPO_PHASES}
        row["history"] = [{k: v for k, v in h.items() if k.startswith(("time/", "rollout/", "train/policy_loss",
                                                                       "train/initial_ratio", "perf/"))}
                          for h in history]
    print(f"{world} {stage} {variant}: ok in {row['seconds']:.1f} s, peak allocated "
          f"{row['peak_allocated_gib'] or 0:.3f} GiB against the plan's {row['planned_peak_gib']:.3f}", flush=True)
    return row, result


def update_mfu(row: dict, parameters: int, prompt_tokens: float, matmul_flops: float, lora: bool) -> dict:
    """The PPO update's model FLOPs per second from a PPO row: tokens trained (prompt + response, every
    epoch) x 6 (4 for LoRA) x parameters, over `time/train`, and its fraction of the matmul rate."""
    history, section = row["history"][1:] or row["history"], row["section"]
    tokens = [section["rollout_batch_size"] * (prompt_tokens + h["rollout/response_length"]) * section["num_ppo_epochs"]
              for h in history]
    seconds = [h["time/train"] for h in history]
    flops = (4 if lora else 6) * parameters * sum(tokens) / sum(seconds)
    return {"update_tokens_per_iteration": sum(tokens) / len(tokens), "update_seconds": sum(seconds) / len(seconds),
            "update_model_flops_per_s": flops, "update_mfu": flops / matmul_flops}


def chain(world_name: str, cfg, base: str, world: Path, work: Path, changes: dict, results: Results,
          profile: Profiled | None = None, with_ppo: bool = True, variant: str = "full") -> dict | None:
    """SFT from `base`, reward from the SFT checkpoint, PPO from both, each through `call_stage` with
    `changes[stage]` on `cfg`'s section, each stage's row added to `results`. What the update's other
    variants need: `run_ppo(section, folder, reporting, policy)`, PPO's section, the prompts' mean length
    in tokens; None if a stage failed. `with_ppo=False` stops after the reward model."""
    from rlhf.config import with_overrides
    from schemas.validate import LengthBudget, load_validated
    from stages.common.reporting import Reporting
    from stages.launch.call import Determinism, call_stage
    from stages.ppo import PPOInputs, train_ppo
    from stages.reward import RewardInputs, train_reward
    from stages.runtime.models import load_tokenizer
    from stages.sft import SFTInputs, train_sft

    tokenizer = load_tokenizer(base)
    sft, reward, ppo = (with_overrides(getattr(cfg, stage), changes.get(stage, {}))
                        for stage in ("sft", "reward", "ppo"))

    def data(name: str, kind: str, section=sft):
        total = section.max_prompt_length + section.sampling.response_length if kind == "prompt" else section.max_length
        return load_validated(str(world / f"{name}.jsonl"), kind, tokenizer=tokenizer,
                              budget=LengthBudget(section.max_prompt_length, total)).frame

    prompts, eval_prompts = data("prompts", "prompt", ppo), data("prompts_eval", "prompt", ppo)

    def run(stage: str, train, section, inputs, start: str, folder: Path, reporting=None):
        figures = planned(cfg, stage, section, start, len(eval_prompts))
        return call_stage(train, section, inputs, folder, reporting or Reporting(),
                          Determinism(deterministic=False)), figures

    row, trained = stage_row(world_name, "sft", variant, lambda: run(
        "sft", train_sft, sft, SFTInputs(base, data("sft", "sft"), data("sft_eval", "sft")), base, work / "sft"))
    results.add("stages", row)
    if trained is None:
        return None
    sft_checkpoint = str(trained.checkpoint)
    row, trained = stage_row(world_name, "reward", variant, lambda: run(
        "reward", train_reward, reward, RewardInputs(
            model_location=sft_checkpoint, policy_location=sft_checkpoint,
            train=data("preferences", "preference", reward), evaluation=data("preferences_eval", "preference", reward),
            normalization_prompts=eval_prompts), sft_checkpoint, work / "reward"))
    results.add("stages", row)
    if trained is None:
        return None
    reward_checkpoint = str(trained.checkpoint)

    def run_ppo(section, folder: Path, reporting=None, policy: str = sft_checkpoint):
        inputs = PPOInputs(sft_location=policy, reward_location=reward_checkpoint,
                           prompts=prompts, eval_prompts=eval_prompts)
        return run("ppo", train_ppo, section, inputs, policy, folder, reporting)

    prompt_tokens = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts["prompt"])
    done = {"run_ppo": run_ppo, "section": ppo, "prompt_tokens": prompt_tokens / len(prompts), "base": base}
    if not with_ppo:
        return done
    row, _ = stage_row(world_name, "ppo", variant, lambda: run_ppo(
        ppo, work / "ppo", Reporting(metrics=profile) if profile else None))
    row["section"] = ppo.model_dump(include={"rollout_batch_size", "num_ppo_epochs", "num_minibatches"})
    results.add("stages", row)
    return done


def update_variants(done: dict, results: Results, parameters: int, matmul_flops: float, work: Path,
                    variants: list[str]) -> None:
    """The PPO update's MFU and each timed phase's peak memory, for each of `variants` (of `VARIANTS`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlhf.config import with_overrides

    off_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    for variant in variants:
        changes = VARIANTS[variant]
        section = with_overrides(done["section"], changes | VARIANT_PPO)
        phases = PhasePeaks()

        def run(section=section, folder=work / variant, phases=phases, variant=variant):
            attention = sdpa_kernel(off_cudnn) if "cuDNN" in variant else nullcontext()
            with phases.installed(), attention:
                return done["run_ppo"](section, folder, policy=done["base"])

        row, _ = stage_row("llama", "ppo", variant, run)
        row["section"] = section.model_dump(include={"rollout_batch_size", "num_ppo_epochs", "num_minibatches"})
        if phases.peaks:
            row["phase_peak_allocated_gib"] = phases.peaks
            row["peak_allocated_gib"] = max([*phases.peaks.values(), row.get("peak_allocated_gib") or 0.0])
            row["plan_over_measured"] = row["planned_peak_gib"] / row["peak_allocated_gib"]
        if row["status"] == "ok":
            row.update(update_mfu(row, parameters, done["prompt_tokens"], matmul_flops, lora="lora" in variant))
            print(f"update, {variant}: {row['update_mfu']:.1%} MFU, {row['update_seconds']:.2f} s for "
                  f"{row['update_tokens_per_iteration']:.0f} tokens, peak {row['peak_allocated_gib'] or 0:.2f} GiB "
                  f"(plan {row['planned_peak_gib']:.2f}), phases {row.get('phase_peak_allocated_gib')}", flush=True)
        results.add("update", {"variant": variant} | {k: v for k, v in row.items() if k != "history"})


def matmul_rate(dry: bool) -> float:
    """The bf16 matmul rate the MFU is counted against: `bench.gpu`'s measurement (a small one when dry)."""
    from bench.gpu import ceilings

    return ceilings(512 if dry else 8192)["bf16_matmul_flops"]


def main() -> None:
    import argparse

    from bench.gpu import LLAMA_05B
    from rlhf.config import load_config
    from rlhf.demo.world import build_world
    from stages.memory.shapes import model_shape

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/rlhf-gpu-stages")
    parser.add_argument("--dry", action="store_true", help="the tiny config, on the CPU")
    parser.add_argument("--parts", nargs="+", default=["demo", "llama", "3b", "update"],
                        choices=["demo", "llama", "3b", "update"],
                        help="demo: the demo world's chain; llama: the 0.36B chain with PPO profiled; 3b: the "
                             "3B-shaped LoRA chain; update: the update's variants (from the 0.36B's SFT and reward "
                             "checkpoints)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="the update's variants to run, in this order")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.parent.mkdir(parents=True, exist_ok=True)
    for runs in ("demo", "llama", "llama-base", "3b", "3b-base"):  # a finished run's checkpoint would be resumed
        shutil.rmtree(work / runs, ignore_errors=True)
    import transformers
    import trl

    results = Results(out, {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                            "torch": torch.__version__, "transformers": transformers.__version__,
                            "trl": trl.__version__, "date": time.strftime("%Y-%m-%d"), "dry": args.dry})
    cfg = load_config("configs/tiny.yaml" if args.dry else "configs/demo.yaml")
    world = build_world(work / "worlds", cfg.demo)
    if "demo" in args.parts:  # the demo world's chain
        chain("demo", cfg, str(world / "model"), world, work / "demo",
              DRY if args.dry else {"ppo": {"num_iterations": DEMO_ITERATIONS}}, results)
    if "3b" in args.parts:  # the 3B-shaped LoRA chain
        base = build_llama(world, work / "3b-base", TINY_LLAMA if args.dry else LLAMA_32_3B, torch.bfloat16)
        results.record["3b"] = {"shape": LLAMA_32_3B, "parameters": model_shape(base).parameters}
        results.write()
        chain("3b", cfg, base, world, work / "3b", DRY_3B if args.dry else LARGE_3B, results, variant="lora")
    if not {"llama", "update"} & set(args.parts):
        return
    shape = TINY_LLAMA if args.dry else {k: v for k, v in LLAMA_05B.items()
                                         if k not in ("vocab_size", "max_position_embeddings", "tie_word_embeddings")}
    base = build_llama(world, work / "llama-base", shape)
    results.record["llama"] = shape | {"parameters": model_shape(base).parameters}
    profiled = Profiled()
    done = chain("llama", cfg, base, world, work / "llama",
                 DRY if args.dry else {"sft": LARGE_SFT, "reward": LARGE_REWARD, "ppo": LARGE_PPO}, results, profiled,
                 with_ppo="llama" in args.parts)
    if "llama" in args.parts:  # the 0.36B chain's PPO ran, one iteration profiled
        results.record["profile"] = {"top": profiled.top} | profiled.busy
        (out.parent / "profile-ppo.txt").write_text(profiled.table)
        results.write()
    if done and "update" in args.parts:
        results.record["bf16_matmul_flops"] = matmul_rate(args.dry)
        update_variants(done, results, model_shape(base).parameters, results.record["bf16_matmul_flops"],
                        work / "llama", args.variants)


if __name__ == "__main__":
    main()
