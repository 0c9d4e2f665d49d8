"""What the PPO processes compute together (torch.distributed collectives over DDP's process group).

Every function here is a no-op on one process and must be called by every process on several.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

from stages.common.tensors import masked_whiten

MAX_FIGURES = ("_max", "initial_ratio_deviation")
"""Figures summarised by their largest value (over minibatches and processes), not their mean."""


def is_max_figure(key: str) -> bool:
    """Whether figure `key` is summarised by its largest value (`MAX_FIGURES`)."""
    return key.endswith(MAX_FIGURES)


def combined(key: str, values: list, total) -> float:
    """Figure `key`'s values as one: the largest for `MAX_FIGURES`, else `total(values)` (a sum or a mean)."""
    return max(values) if is_max_figure(key) else total(values)


def over_processes(accelerator: Accelerator, figures: dict[str, float]) -> dict[str, float]:
    """Each figure averaged over processes; `MAX_FIGURES` take the largest (collective)."""
    if accelerator.num_processes == 1:
        return figures
    keys = sorted(figures)
    values = torch.tensor([figures[k] for k in keys], dtype=torch.float64, device=accelerator.device)
    summed, largest = values.clone(), values.clone()
    torch.distributed.all_reduce(summed)
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    return {k: (largest[i] if is_max_figure(k) else summed[i] / accelerator.num_processes).item()
            for i, k in enumerate(keys)}


def mean_over_processes(accelerator: Accelerator, value: float) -> float:
    """`value`'s mean over processes (collective), as `over_processes` takes a figure's."""
    return over_processes(accelerator, {"value": value})["value"]


def sum_over_processes(accelerator: Accelerator, x: torch.Tensor) -> torch.Tensor:
    """`x` summed over processes (collective); `x` itself on one process."""
    if accelerator.num_processes == 1:
        return x
    total = x.clone()
    torch.distributed.all_reduce(total)
    return total


def gathered(accelerator: Accelerator, x: torch.Tensor) -> torch.Tensor:
    """Every process's `x` concatenated along the first dimension, in rank order (collective).
    # (B, ...) -> (P * B, ...)"""
    return x if accelerator.num_processes == 1 else accelerator.gather(x)


def check_weights_agree(accelerator: Accelerator, module: torch.nn.Module) -> None:
    """Fail loudly if the processes' trained weights differ: gradients were not synchronised (collective)."""
    if accelerator.num_processes == 1:
        return
    total = torch.stack([p.detach().double().sum() for p in module.parameters() if p.requires_grad]).sum()
    low, high = total.clone(), total.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    if (high - low).abs() > 1e-6 * high.abs().clamp(min=1.0):
        raise RuntimeError(f"the {accelerator.num_processes} processes ended with different weights "
                           f"(parameter sums {low.item():.9g} .. {high.item():.9g}): gradients were not synchronised")


def whiten_over_processes(accelerator: Accelerator, x: torch.Tensor, mask: torch.Tensor,
                          shift_mean: bool = True) -> torch.Tensor:
    """`masked_whiten` with mean and variance over every process's entries, as one process holding
    the whole rollout batch would take them (collective). # (B, T) -> (B, T)"""
    if accelerator.num_processes == 1:
        return masked_whiten(x, mask, shift_mean)
    sums = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()  # (3,)
    torch.distributed.all_reduce(sums)
    total, squares, n = sums
    mean = total / n
    var = (squares / n - mean ** 2) * n / (n - 1).clamp(min=1.0)
    return masked_whiten(x, mask, shift_mean, moments=(mean.to(x.dtype), var.to(x.dtype)))


def computed_on_main(accelerator: Accelerator, rows: list, compute):
    """`compute(rows of every process, concatenated in rank order)`, run on the main process alone,
    and its result handed to every process (collective): work whose cost is paid once (a user's
    reward function). An exception `compute` raises is raised on every process."""
    if accelerator.num_processes == 1:
        return compute(rows)
    everyone: list[list] = [[] for _ in range(accelerator.num_processes)]
    torch.distributed.all_gather_object(everyone, rows)
    outcome: list = [None]
    if accelerator.is_main_process:
        try:
            outcome = [(True, compute([row for part in everyone for row in part]))]
        except Exception as e:  # noqa: BLE001 - handed to every process, raised there
            outcome = [(False, e)]
    torch.distributed.broadcast_object_list(outcome, src=0)
    done, value = outcome[0]
    if not done:
        raise value
    return value
