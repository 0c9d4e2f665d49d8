"""The run's PNG curves plot what they say: the over-optimisation figure's lines are the
running means of the history's KL and proxy score and of the caller's gold reward."""

from __future__ import annotations

import numpy as np

from rlhf.plots import overoptimization, running_mean


def test_running_mean_averages_the_window_ending_at_each_point():
    assert running_mean([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3) == [1.0, 1.5, 2.0, 3.0, 4.0, 5.0]
    assert running_mean([2.0, 4.0], 1) == [2.0, 4.0]


def test_overoptimization_plots_proxy_and_gold_against_kl_on_their_own_axes():
    history = [{"iteration": i, "rollout/kl": 0.5 * i, "rollout/score": 0.1 * i} for i in range(1, 11)]
    gold = {i: 1.0 - 0.05 * (i - 5) ** 2 for i in range(1, 10)}  # iteration 10 not judged: left out
    figure = overoptimization(history, gold, window=3)
    proxy_axis, gold_axis = figure.axes
    (proxy_line,), (gold_line,) = proxy_axis.get_lines(), gold_axis.get_lines()
    kl = [0.5 * i for i in range(1, 10)]
    np.testing.assert_allclose(proxy_line.get_xdata(), running_mean(kl, 3))
    np.testing.assert_allclose(proxy_line.get_ydata(), running_mean([0.1 * i for i in range(1, 10)], 3))
    np.testing.assert_allclose(gold_line.get_ydata(), running_mean([gold[i] for i in range(1, 10)], 3))
    assert gold_axis.get_ylabel() == "gold reward" and proxy_axis.get_ylabel().startswith("proxy")
    assert len(proxy_axis.collections[0].get_offsets()) == 9  # the per-iteration points

