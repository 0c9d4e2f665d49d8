"""On-policy distillation on the demo world: a smaller student learns from the demo pipeline's PPO
policy (the teacher) by grading its own samples with the teacher's log-probs, against PPO on the
reward model and SFT on the teacher's samples (off-policy distillation), from the same student SFT.

    python -m bench.distill                  (or: make bench-distill)
    python -m bench.distill --seeds 0 --teacher <folder>      (a teacher of your own: the demo's tokenizer)

1. The teacher: the demo config's SFT and reward stages (`bench.quality.train_upstream`), then its PPO
   section (`ppo.seed` as configured), as `make demo` trains the policy it registers as `champion`.
2. The student: the demo world built with `STUDENT`'s sizes (half the width, half the layers; the same
   data and tokenizer: the world's tokenizer does not depend on the model), then the demo's SFT section.
3. For every training seed, from the student's SFT checkpoint:
   (a) `distill`: `advantage_estimator: distill` with the teacher (no reward model, no KL to SFT), at the
       demo's learning rate and at 3e-4;
   (b) `ppo`: the demo's PPO section against the demo's reward model (the teacher's);
   (c) `sft on teacher samples`: the teacher's responses to the training prompts (cycled), sampled at
       the PPO section's temperature, then the demo's SFT settings for one epoch from the student's SFT
       checkpoint over as many of them as (a) has graded after 4, 10, 20, 30 and 60 iterations
       (iterations x rollout_batch_size): the same teacher samples, off-policy.
   (a) and (b) are evaluated every `--eval-every` iterations (`bench.quality.run_ours`); (c) at each point.
4. Every evaluation is the stage's own against the student SFT's responses to the held-out prompts
   (common random numbers), judged by the demo world's gold function; the teacher is judged against
   the same responses. Training time: (a) and (b) sum `time/iteration` (sampling, the teacher's or
   reward model's pass, the update); (c) is its SFT's wall time plus the teacher's sampling time.
5. Time to the target: the target is `--share` (0.9) of the teacher's gold win rate against the
   student's SFT; a run reaches it at its first evaluation at or above it.

It prints a Markdown table and writes `bench/results/distill-<date>.json` after every run. A
benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STUDENT = {"hidden_size": 32, "intermediate_size": 96, "num_layers": 1}
"""The student's demo-world sizes: half the demo model's width (64), MLP (192) and layers (2)."""
DISTILL = {"advantage_estimator": "distill", "reward": {"terms": []}, "kl.init_coef": 0.0}
"""(a)'s `ppo` settings on top of the config's section, with `teacher.model` the teacher's folder: what `distill`
resolves to from a config file (`with_overrides` resolves only the critic again, so the rest is spelled out)."""
METHODS: dict[str, dict | None] = {
    "distill": DISTILL,
    "distill, learning rate 3e-4": DISTILL | {"learning_rate": 3.0e-4},
    "distill, 20 iterations": DISTILL | {"num_iterations": 20},
    # The teacher's term as a loss: KL over its top 8 tokens and the rest, through the student's logits (GKD's way).
    "distill, top-8 loss": DISTILL | {"teacher.top_k": 8},
    "ppo": {},
    "sft on teacher samples": None,
}
"""Each method's `ppo` settings on top of the config's section (None: SFT on the teacher's samples)."""
OFF_POLICY_POINTS = (4, 10, 20, 30, 60)
"""(c) is trained on as many teacher samples as (a) grades in this many iterations (x rollout_batch_size)."""


def frames(folder: Path, tokenizer, section, names: tuple[str, ...], kind: str) -> list:
    """Validated frames of the `names` files in `folder` (`<name>.jsonl`) under `section`'s length budget."""
    from schemas.validate import LengthBudget, load_validated

    longest = section.max_length if kind == "sft" else section.max_prompt_length + section.sampling.response_length
    budget = LengthBudget(section.max_prompt_length, longest)
    return [load_validated(str(folder / f"{name}.jsonl"), kind, tokenizer=tokenizer, budget=budget).frame
            for name in names]


def sampling_models(cfg, folder: Path):
    """A policy's models for sampling and evaluating alone: no reward model, no critic (`grpo`), no teacher."""
    from rlhf.config import with_overrides
    from stages.rl.ppo_models import load_models

    section = with_overrides(cfg.ppo, {"advantage_estimator": "grpo", "samples_per_prompt": 4, "lora": None,
                                       "sampling.micro_batch_size": None})
    return section, load_models(section, str(folder), None)


def teacher_of(cfg, state: Path, prompts, eval_prompts) -> tuple[Path, Path, dict]:
    """The demo pipeline's SFT, reward and PPO checkpoints of the config (trained once, kept in `state`):
    (PPO policy, reward model, the PPO run's record)."""
    from bench.quality import run_ours, train_upstream
    from rlhf.demo.world import build_world

    world = build_world(state / "worlds", cfg.demo)
    sft, reward = train_upstream(cfg, world, state / "teacher")
    policy, record = state / "teacher" / "ppo" / "checkpoint", state / "teacher" / "ppo-record.json"
    if not record.exists():
        _, run = run_ours(cfg.ppo, sft, reward, prompts, eval_prompts, state / "teacher" / "ppo")
        record.write_text(json.dumps({k: v for k, v in run.items() if k in ("train_seconds", "evaluations")}))
    return policy, reward, json.loads(record.read_text())


def student_sft(cfg, state: Path) -> tuple[Path, Path]:
    """The student's world (`STUDENT` sizes) and its SFT checkpoint (trained once, kept): (world, checkpoint)."""
    from rlhf.demo.world import build_world
    from stages.runtime.models import load_tokenizer
    from stages.sft import SFTInputs, train_sft

    world = build_world(state / "worlds", cfg.demo.model_copy(update=STUDENT))
    checkpoint = state / "student" / "sft" / "checkpoint"
    if not (checkpoint / "config.json").exists():
        tokenizer = load_tokenizer(str(world / "model"))
        train, evaluation = frames(world, tokenizer, cfg.sft, ("sft", "sft_eval"), "sft")
        train_sft(cfg.sft, SFTInputs(str(world / "model"), train, evaluation), state / "student" / "sft")
    return world, checkpoint


def teacher_judged(cfg, teacher: Path, student: Path, eval_prompts) -> dict[str, float]:
    """The teacher's responses to the held-out prompts (the evaluation's seed) against the student SFT's,
    under the gold function: what every student is measured against."""
    from rlhf.demo.world import gold_comparison
    from stages.rl.evaluation import HeldOut
    from stages.rl.rollout import single_turn

    held = {}
    for name, folder in (("teacher", teacher), ("student", student)):
        section, models = sampling_models(cfg, folder)
        held[name] = HeldOut.sample(models, eval_prompts, section.evaluation, section.sampling, single_turn(models))
    prompts = [next(m["content"] for m in reversed(messages) if m["role"] == "user")
               for messages in held["student"].messages]
    gold = gold_comparison(prompts, held["teacher"].sft_texts, held["student"].sft_texts)
    return {key.removeprefix("eval/"): value for key, value in gold.items()}


def teacher_samples(cfg, teacher: Path, prompts, count: int, seed: int, out: Path) -> tuple[Path, float]:
    """`count` responses of the teacher to the training prompts (cycled in order), sampled at the PPO
    section's temperature and length, written as SFT records: (the file, seconds of sampling)."""
    import torch

    from stages.engines.sampler import Sampling
    from stages.rl.rollout import in_chunks, policy_sampler, single_turn

    _, models = sampling_models(cfg, teacher)
    models.train(False)
    rows = [{"prompt": p, "messages": json.loads(m)} for p, m in zip(prompts["prompt"], prompts["prompt_messages"],
                                                                     strict=True)]
    rows = [rows[i % len(rows)] for i in range(count)]
    sampler, source = policy_sampler(models), single_turn(models)
    sampling = Sampling(cfg.ppo.sampling.response_length, cfg.ppo.sampling.temperature)
    torch.manual_seed(seed)
    clock, records = time.perf_counter(), []
    with torch.no_grad():
        for chunk in in_chunks(rows, 64):
            episodes = source.generation(sampler, chunk, sampling, models.policy.device, {}).episodes
            records += [{"prompt": row["messages"][-1]["content"], "response": e.answer}
                        for row, e in zip(chunk, episodes, strict=True) if e.status == "ok"]
    seconds = time.perf_counter() - clock
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return out, seconds


def off_policy(cfg, teacher: Path, student: Path, world: Path, prompts, seed: int, state: Path,
               judge) -> tuple[object, dict]:
    """(c): the student's SFT checkpoint fine-tuned for one epoch on the teacher's first samples, as many
    as (a) has graded after each of `OFF_POLICY_POINTS` iterations, each judged by `judge`: (the last
    evaluation table, record with one evaluation per point; seconds: its SFT's plus its samples' share of
    the sampling time)."""
    from bench.quality import final_figures
    from schemas.validate import LengthBudget, load_validated
    from stages.runtime.models import load_tokenizer
    from stages.sft import SFTInputs, train_sft

    per_iteration = cfg.ppo.rollout_batch_size
    count = max(OFF_POLICY_POINTS) * per_iteration
    samples, sampling_seconds = teacher_samples(cfg, teacher, prompts, count, seed, state / f"samples-{seed}.jsonl")
    tokenizer = load_tokenizer(str(student))
    # The teacher answers a cycled prompt the same way now and then (16 of 3,840 on the demo): kept once each.
    every = load_validated(str(samples), "sft", tokenizer=tokenizer, duplicates="drop",
                           budget=LengthBudget(cfg.sft.max_prompt_length, cfg.sft.max_length)).frame
    [evaluation] = frames(world, tokenizer, cfg.sft, ("sft_eval",), "sft")
    section = cfg.sft.model_copy(update={"num_train_epochs": 1, "max_steps": None, "seed": seed, "num_samples": 0})
    points, final = [], None
    for iterations in OFF_POLICY_POINTS:
        train = every.head(iterations * per_iteration)
        out = state / f"offpolicy-{seed}-{iterations}"
        shutil.rmtree(out, ignore_errors=True)
        clock = time.perf_counter()
        result = train_sft(section, SFTInputs(str(student), train, evaluation), out)
        seconds = time.perf_counter() - clock + sampling_seconds * len(train) / len(every)
        final = judge(result.checkpoint)
        figures = final_figures(final)
        points.append({"iteration": iterations, "seconds": seconds, "teacher_samples": len(train),
                       **{k: figures[k] for k in ("kl", "gold_reward", "gold_win_rate")}})
    return final, {"train_seconds": points[-1]["seconds"], "sampling_seconds": sampling_seconds,
                   "teacher_samples": len(every), "evaluations": points}


def reached(evaluations: list[dict], target: float) -> dict | None:
    """The first evaluation at or above `target`'s gold win rate, or None."""
    return next((point for point in evaluations if point["gold_win_rate"] >= target), None)


def table(results: dict) -> str:
    """The results as a Markdown table: each run's final gold win rate against the student's SFT (and
    against the teacher's), training time, and time to the target."""
    teacher, target = results["teacher"], results["target"]
    lines = [f"teacher (demo PPO policy): gold win rate against the student's SFT {teacher['gold_win_rate']:.3f} "
             f"± {teacher['gold_win_rate_se']:.3f}; target {target:.3f} ({results['share']:.0%} of it)", "",
             "| method | seed | gold win rate vs student SFT | share of teacher's | KL to SFT | train s | "
             "to target: s (iteration) |", "|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        hit = row.get("to_target")
        reach = f"{hit['seconds']:.1f} ({hit['iteration']})" if hit else "not reached"
        lines.append(f"| {row['method']} | {row['seed']} | {row['gold_win_rate']:.3f} ± {row['gold_win_rate_se']:.3f} "
                     f"| {row['gold_win_rate'] / teacher['gold_win_rate']:.2f} | {row['kl']:.2f} | "
                     f"{row['train_seconds']:.1f} | {reach} |")
    points = sorted({e["iteration"] for row in results["rows"] for e in row["evaluations"]} & set(OFF_POLICY_POINTS))
    lines += ["", "Gold win rate against the student's SFT at equal teacher samples (mean over seeds, lowest in "
              "brackets; samples: iterations x rollout_batch_size)", "",
              "| method | " + " | ".join(f"{k} it." for k in points) + " |", "|---|" + "---|" * len(points)]
    for method in dict.fromkeys(row["method"] for row in results["rows"]):
        cells = []
        for k in points:
            found = [e["gold_win_rate"] for row in results["rows"] if row["method"] == method
                     for e in row["evaluations"] if e["iteration"] == k]
            cells.append(f"{sum(found) / len(found):.3f} ({min(found):.3f})" if found else "")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--teacher", type=Path, help="a teacher's folder; default: the demo's PPO policy, trained here")
    parser.add_argument("--eval-every", type=int, default=2)  # OFF_POLICY_POINTS are its multiples
    parser.add_argument("--share", type=float, default=0.9, help="the target: this share of the teacher's win rate")
    parser.add_argument("--state", type=Path, default=REPO / ".rlhf" / "bench" / "distill")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from bench.quality import Judge, final_figures, run_ours
    from rlhf.config import load_config, with_overrides
    from rlhf.demo.world import build_world
    from stages.runtime.models import load_tokenizer, set_determinism

    cfg = load_config(args.config)
    set_determinism(cfg.deterministic, cfg.num_threads or 2)
    state = args.state
    tokenizer = load_tokenizer(str(build_world(state / "worlds", cfg.demo) / "model"))
    prompts, eval_prompts = frames(build_world(state / "worlds", cfg.demo), tokenizer, cfg.ppo,
                                   ("prompts", "prompts_eval"), "prompt")
    teacher, reward, teacher_run = teacher_of(cfg, state, prompts, eval_prompts)
    teacher = args.teacher or teacher
    world, student = student_sft(cfg, state)
    judged = teacher_judged(cfg, teacher, student, eval_prompts)
    out = args.out or REPO / "bench" / "results" / f"distill-{datetime.date.today()}.json"
    results = {"config": args.config, "student": STUDENT, "teacher": judged, "teacher_ppo": teacher_run,
               "share": args.share, "target": args.share * judged["gold_win_rate"], "rows": []}
    base, judge = {"evaluation.every": args.eval_every}, None
    for seed in args.seeds:
        for method in args.methods:
            print(f"--- {method}, seed {seed}", flush=True)
            if METHODS[method] is None:
                judge = judge or Judge(student, reward, eval_prompts, cfg.ppo)
                final, record = off_policy(cfg, teacher, student, world, prompts, seed, state, judge)
            else:
                distills = METHODS[method].get("advantage_estimator") == "distill"
                ppo = with_overrides(cfg.ppo, ({"teacher": {"model": str(teacher)}} if distills else {}) | base
                                     | METHODS[method] | {"seed": seed})
                _, record = run_ours(ppo, student, None if distills else reward, prompts, eval_prompts,
                                     state / f"{method.replace(' ', '-').replace(',', '')}-{seed}",
                                     teacher if distills else None)
                final = record.pop("final_table")
            evaluations = record["evaluations"]
            figures = final_figures(final)
            row = {"method": method, "seed": seed, **figures, "train_seconds": record["train_seconds"],
                   "evaluations": evaluations, "to_target": reached(evaluations, results["target"]),
                   **{k: v for k, v in record.items() if k in ("sampling_seconds", "teacher_samples")}}
            results["rows"].append(row)
            out.write_text(json.dumps(results, indent=1, default=float))
            print(table(results), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
