"""How much of a PPO iteration's floating-point work was necessary, for `bench/ppo.py` (both sides).

What ran: torch's `FlopCounterMode` over one whole (warm-up, untimed) iteration, its count split by the
phase each side already times (`PhaseFlops`). What was necessary: the update's products as they ran,
plus one forward of each model per sequence over its real tokens (`flop_report`): the policy (its
sampling), the reference, the critic and the reward model, counted the same way on models built from
the benchmark's configs. Their ratio is the share of the iteration's work that was necessary: what is
left is padding, passes over the same tokens twice, and decode steps over rows that had ended.

Imported by `bench/trl_reference.py` in TRL's environment: torch and transformers only, imported late.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


class PhaseFlops:
    """One `FlopCounterMode` from `start()` to `stop()`, its count attributed to the innermost `phase`
    open when each operation ran (`outside` where none is)."""

    def __init__(self, outside: str = "other"):
        from torch.utils.flop_counter import FlopCounterMode

        self.outside = outside
        self.counter = FlopCounterMode(display=False)
        self.by_phase: dict[str, float] = defaultdict(float)
        self.open: list[str] = []
        self.counted = 0
        self.running = False

    def start(self) -> None:
        self.counter.__enter__()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._settle()
            self.counter.__exit__(None, None, None)
            self.running = False

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The block's operations counted under `name` (while counting)."""
        self._settle()
        self.open.append(name)
        try:
            yield
        finally:
            self._settle()
            self.open.pop()

    def _settle(self) -> None:
        """What was counted since the last call, to the phase open during it."""
        if not self.running:
            return
        total = self.counter.get_total_flops()
        self.by_phase[self.open[-1] if self.open else self.outside] += total - self.counted
        self.counted = total


def forward_flops(folder: Path, lengths: Iterable[int], head: str) -> float:
    """FLOPs of one forward of the model whose config is in `folder` (`head`: `causal` for a language
    model, `score` for a one-output sequence classifier) over one sequence of each of `lengths`, counted
    as `PhaseFlops` counts them (random weights of that shape; one pass per distinct length)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(folder, num_labels=1)
    kind = AutoModelForCausalLM if head == "causal" else AutoModelForSequenceClassification
    model = kind.from_config(config).eval()
    counts, total = Counter(lengths), 0.0
    with torch.no_grad():
        for length, n in counts.items():
            with FlopCounterMode(display=False) as counter:
                model(input_ids=torch.ones(1, length, dtype=torch.long))
            total += n * counter.get_total_flops()
    return total


ONCE_PER_RUN = ("old_logprobs_check",)
"""Phases a run takes once, on its first batch (the counted iteration): reported beside the iteration's
work, not in it (`ppo.old_logprobs: auto`'s one comparison)."""


def flop_report(side: dict, assets: Path, update_phase: str) -> dict:
    """One side's counted phases (`side["flops"]`, by its own phase names, the update's as `update_phase`)
    and sequence lengths as GFLOP per phase, the necessary GFLOP and the necessary share, and each
    phase's passes: its FLOPs over one forward of the model it runs, per sequence. `ONCE_PER_RUN`
    phases are set apart."""
    once = {phase: side["flops"][phase] for phase in ONCE_PER_RUN if phase in side["flops"]}
    flops = {phase: value for phase, value in side["flops"].items() if phase not in once}
    lengths = side["lengths"]
    one_policy = forward_flops(assets / "policy", lengths, "causal")
    one_reward = forward_flops(assets / "reward", lengths, "score")
    necessary = flops.get(update_phase, 0.0) + 2 * one_policy + 2 * one_reward
    ran = sum(flops.values())
    per_model = {"generate": one_policy, "policy_forward": one_policy, "reference": one_policy,
                 "values": one_reward, "score": one_reward, update_phase: one_policy + one_reward}
    return {"gflop": {phase: value / 1e9 for phase, value in flops.items()},
            "passes": {phase: flops[phase] / per_model[phase] for phase in per_model if flops.get(phase)},
            "ran_gflop": ran / 1e9, "necessary_gflop": necessary / 1e9, "necessary_share": necessary / ran,
            "once_per_run_gflop": {phase: value / 1e9 for phase, value in once.items()}}
