"""Multi-turn benchmark: does RL in episodes learn to call the demo's tool and use what it says?

    python -m bench.tools                        (seeds 0-2, GRPO and PPO; about 30 minutes on 2 cores)
    python -m bench.tools --seeds 0 --estimators grpo --iterations 10

On the tool world (`configs/tools.yaml`, `demo.task: tools`), SFT is trained once on its transcripts
(which call the tool half of the time). Then, for every training seed and estimator (`grpo`; `gae`,
PPO with a critic on the policy), two runs from that checkpoint with the same prompts, reward function
and work per iteration:

- `episodes`: multi-turn, against the built-in tool-calling environment (`ppo.environment`);
- `single-turn`: the same policy trained without the environment, answering in one turn (a tool call
  it writes is then just text): the baseline the episodes must beat.
- `served`: the same episodes against the world written as a verifiers environment
  (examples/verifiers/tools_world), served by `rlhf serve-env --kind verifiers` in its own process
  (`make env-verifiers`), its score the environment's (`reward.terms: []`): what `--settings` adds,
  `python -m bench.tools --estimators grpo --settings episodes served`.
- `served-ours`: the same episodes against the built-in tools served by `rlhf serve-env --kind ours`, scored
  by the same reward terms in the trainer: the protocol's own cost, beside the in-process run
  (`--settings episodes served-ours served`: seconds per iteration of each, and the environment's wait).
- `agent`: the same episodes run by an agent program, examples/agents/tools_agent.py (a plain openai-SDK
  loop, `environment.agent`, as configs/tools-agent.yaml), scored by the same reward terms:
  `python -m bench.tools --estimators grpo --settings episodes agent`;
- `sdk-agent`: the same, the agent written with the OpenAI Agents SDK (examples/agents/sdk_agent.py, as
  configs/tools-agent-sdk.yaml).

Each final policy is judged on the held-out prompts by the hidden gold function, on its final answers,
against the SFT policy's answers in episodes (the tool run's evaluation baseline, common random
numbers, so every run of a seed meets the same SFT answers): gold reward, gold win rate with its
standard error, the tool-call rate before (SFT) and after, the KL to SFT per sequence (the model's own
tokens), the training seconds (the sum of `time/iteration`) and the median seconds per iteration and of
them waiting on the environments (`time/episode_wait`). Writes
`bench/results/tools-<date>.json` and prints a table. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def upstream(cfg, state: Path):
    """The tool world, its validated frames and the SFT checkpoint (trained once, kept in `state`)."""
    from flows.inputs import length_budget
    from rlhf.demo.world import build_world
    from schemas.validate import load_validated
    from stages.runtime.models import load_tokenizer
    from stages.sft import SFTInputs, train_sft

    world = build_world(state / "worlds", cfg.demo)
    tokenizer = load_tokenizer(str(world / "model"))

    def frame(name: str, kind: str, stage: str, columns: tuple[str, ...] = ()):
        return load_validated(str(world / f"{name}.jsonl"), kind, tokenizer=tokenizer,
                              budget=length_budget(cfg, stage), columns=columns).frame

    columns = tuple(cfg.ppo.reward.columns)
    frames = {"prompts": frame("prompts", "prompt", "ppo", columns),
              "prompts_eval": frame("prompts_eval", "prompt", "ppo", columns)}
    checkpoint = state / "sft" / "checkpoint"
    if not (checkpoint / "config.json").exists():
        train_sft(cfg.sft, SFTInputs(str(world / "model"), frame("sft", "sft", "sft"), frame("sft_eval", "sft", "sft")),
                  state / "sft")
    return checkpoint, frames


def run(ppo_cfg, sft: Path, frames: dict, out: Path) -> dict:
    """One PPO run and its final evaluation table."""
    from stages.ppo import PPOInputs, train_ppo

    shutil.rmtree(out, ignore_errors=True)
    result = train_ppo(ppo_cfg, PPOInputs(sft_location=str(sft), reward_location=None,
                                          prompts=frames["prompts"], eval_prompts=frames["prompts_eval"]), out)
    return {"table": result.evaluation, "metrics": result.metrics,
            "train_seconds": float(sum(row["time/iteration"] for row in result.history)),
            "seconds_per_iteration": float(np.median([row["time/iteration"] for row in result.history])),
            "episode_wait_per_iteration": float(np.median([row.get("time/episode_wait", 0.0)
                                                           for row in result.history])),
            "final_rollout": {k: v for k, v in result.history[-1].items() if k.startswith("rollout/")},
            "history": result.history}


SERVED = {"served": ("verifiers", 8490, ["--module", "tools_world", "--path", "examples/verifiers"]),
          "served-ours": ("ours", 8491, ["--tools", "rlhf.demo.tools:tools"])}
"""Each served setting's server: its kind, port and what it serves."""


def serving(setting: str, workers: int = 1):
    """`setting`'s tool world served (`rlhf serve-env`, its episodes over `workers` processes), once it answers."""
    import subprocess
    import sys

    import httpx

    kind, port, served = SERVED[setting]
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-env", "--kind", kind, *served,
                                "--port", str(port), "--workers", str(workers)], cwd=REPO, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
            return process
        except httpx.HTTPError:
            assert process.poll() is None, f"the {kind} environment server exited while starting"
            time.sleep(0.5)
    raise RuntimeError(f"the {kind} environment server did not start within 2 minutes")


def served_config(episodes, setting: str):
    """`episodes` against the served world: verifiers' scored by it (the environment's rules, no reward
    terms here), ours by the same reward terms as in process."""
    from rlhf.config import with_overrides

    kind, port, _ = SERVED[setting]
    changes = {"environment": {"tools": None, "server": {"url": f"http://127.0.0.1:{port}", "kind": kind}}}
    return with_overrides(episodes, changes | ({"reward": {"terms": []}} if kind == "verifiers" else {}))


def agent_config(episodes, program: str):
    """`episodes` run by an example agent program (examples/agents) instead of the built-in tool loop, the same
    reward terms."""
    from rlhf.config import with_overrides

    return with_overrides(episodes, {"environment": {"tools": None, "agent": program},
                                     "paths": [str(REPO / "examples" / "agents")]})


def judged(table, sft_answers: list[str]) -> dict:
    """The table's final answers against the SFT policy's answers in episodes, by the gold function;
    in episodes, the gold reward of the answers that followed a tool call and of those that did not."""
    from rlhf.demo.world import gold_comparison, gold_tool_score, last_user_turns

    prompts = last_user_turns(table["prompt_messages"])
    gold = gold_comparison(prompts, list(table["policy_response"]), sft_answers, list(table["liked"]))
    figures = {key.removeprefix("eval/"): value for key, value in gold.items()} | {"kl": float(table["kl"].mean())}
    for who in ("policy", "sft"):
        if f"{who}_tool_calls" not in table:
            continue
        golds = np.array([gold_tool_score(p, liked, answer) for p, liked, answer in
                          zip(prompts, table["liked"], table[f"{who}_response"], strict=True)])
        called = np.array(table[f"{who}_tool_calls"]) > 0
        figures[f"{who}_gold_after_call"] = float(golds[called].mean()) if called.any() else None
        figures[f"{who}_gold_without_call"] = float(golds[~called].mean()) if (~called).any() else None
    return figures


def main(argv: list[str] | None = None) -> int:
    from rlhf.config import load_config, with_overrides

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tools.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--estimators", nargs="+", default=["grpo", "gae"])
    parser.add_argument("--iterations", type=int, default=None, help="ppo.num_iterations (default: the config's)")
    parser.add_argument("--settings", nargs="+", default=["episodes", "single-turn"],
                        choices=["episodes", "single-turn", "served", "served-ours", "agent", "sdk-agent"])
    parser.add_argument("--serve-workers", type=int, default=1,
                        help="the served settings' `rlhf serve-env --workers`: processes spreading their episodes")
    parser.add_argument("--sft-seed", type=int, default=None,
                        help="sft.seed (default: the config's): another SFT checkpoint to start from")
    parser.add_argument("--state", type=Path, default=REPO / ".rlhf" / "bench-tools")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    state = args.state
    if args.sft_seed is not None:  # its own checkpoint, next to the config's
        cfg, state = with_overrides(cfg, {"sft": {"seed": args.sft_seed}}), state / f"sft-seed-{args.sft_seed}"
    started = time.time()
    sft, frames = upstream(cfg, state)
    servers = [serving(setting, args.serve_workers) for setting in SERVED if setting in args.settings]
    try:
        rows = runs(args, cfg, sft, frames, state)
    finally:
        for server in servers:
            server.terminate()
            server.wait()
    summary = summarise(rows)
    print(summary)
    out = args.out or REPO / "bench" / "results" / f"tools-{datetime.date.today()}.json"
    out.write_text(json.dumps({"config": args.config, "sft_seed": cfg.sft.seed, "seeds": args.seeds,
                               "settings": args.settings, "serve_workers": args.serve_workers,
                               "iterations": args.iterations,
                               "machine": platform.processor() or platform.machine(),
                               "seconds": time.time() - started, "runs": rows, "summary": summary}, indent=2))
    print(f"wrote {out}")
    return 0


def runs(args, cfg, sft, frames, state) -> list[dict]:
    """Every seed's and estimator's runs in each setting, judged."""
    from rlhf.config import with_overrides

    rows = []
    for seed in args.seeds:
        for estimator in args.estimators:
            changes = {"seed": seed, "advantage_estimator": estimator, "evaluation": {"every": None}}
            if args.iterations:
                changes["num_iterations"] = args.iterations
            episodes = with_overrides(cfg.ppo, changes | {"samples_per_prompt": "auto"})
            configs = {"episodes": episodes, "single-turn": with_overrides(episodes, {"environment": None}),
                       "agent": agent_config(episodes, "tools_agent:run"),
                       "sdk-agent": agent_config(episodes, "sdk_agent:run")} \
                | {setting: served_config(episodes, setting) for setting in SERVED}
            results = {setting: run(configs[setting], sft, frames, state / f"{estimator}-{seed}-{setting}")
                       for setting in args.settings}
            tools = next(results[s] for s in ("episodes", "agent", "sdk-agent", "served", "served-ours")
                         if s in results)
            sft_answers = list(tools["table"]["sft_response"])
            for setting, result in results.items():
                metrics = result["metrics"]
                rows.append({"seed": seed, "estimator": estimator, "setting": setting,
                             **judged(result["table"], sft_answers),
                             "tool_call_rate": metrics.get("eval/tool_call_rate"),
                             "tool_call_rate_sft": tools["metrics"]["eval/tool_call_rate_sft"],
                             "train_seconds": result["train_seconds"],
                             "seconds_per_iteration": result["seconds_per_iteration"],
                             "episode_wait_per_iteration": result["episode_wait_per_iteration"],
                             "final_rollout": result["final_rollout"]})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "final_rollout"}), flush=True)
    return rows


def summarise(rows: list[dict]) -> str:
    """Mean and spread (min-max over seeds) per estimator and setting."""
    lines = ["| estimator | setting | gold win rate vs SFT | gold reward (SFT's) | tool calls: SFT -> after | "
             "KL | train s | s per iteration (environment's wait) |", "|---|---|---|---|---|---|---|---|"]
    for estimator in dict.fromkeys(r["estimator"] for r in rows):
        for setting in ("episodes", "agent", "sdk-agent", "served-ours", "served", "single-turn"):
            mine = [r for r in rows if r["estimator"] == estimator and r["setting"] == setting]
            if not mine:
                continue

            calls = "-" if mine[0]["tool_call_rate"] is None else _spread(mine, "tool_call_rate", 2)
            lines.append(f"| {estimator} | {setting} | {_spread(mine, 'gold_win_rate')} | "
                         f"{_spread(mine, 'gold_reward', 2)} ({np.mean([r['gold_reward_sft'] for r in mine]):.2f}) | "
                         f"{np.mean([r['tool_call_rate_sft'] for r in mine]):.2f} -> {calls} | "
                         f"{_spread(mine, 'kl', 1)} | {_spread(mine, 'train_seconds', 0)} | "
                         f"{_spread(mine, 'seconds_per_iteration', 2)} "
                         f"({np.mean([r['episode_wait_per_iteration'] for r in mine]):.2f}) |")
    return "\n".join(lines)


def _spread(rows: list[dict], key: str, digits: int = 3) -> str:
    """Mean [min, max] of `key` over `rows`."""
    values = np.array([r[key] for r in rows], dtype=float)
    return f"{values.mean():.{digits}f} [{values.min():.{digits}f}, {values.max():.{digits}f}]"


if __name__ == "__main__":
    raise SystemExit(main())
