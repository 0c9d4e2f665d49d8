"""`ppo.old_logprobs`: where a rollout's old log-probs come from (`stages.rl.old_logprobs`), on hand-worked cases."""

import torch

from stages.rl.old_logprobs import TOLERANCE, OldLogprobs
from stages.rl.rollout import largest_deviation


def _asked(value: float, calls: list) -> callable:
    def deviation() -> float:
        calls.append(value)
        return value
    return deviation


def test_auto_compares_once_on_the_first_batch_offered_and_keeps_the_verdict():
    calls = []
    auto = OldLogprobs("auto")
    assert auto.reuse(False, _asked(0.0, calls)) is False and calls == []  # nothing offered: no comparison yet
    assert auto.reuse(True, _asked(2e-6, calls)) is True and calls == [2e-6]
    assert auto.reuse(True, _asked(1.0, calls)) is True and calls == [2e-6]  # decided: never compared again
    assert auto.tags() == {"rlhf.old_logprobs": "sampling (auto: the first batch's sampled log-probs were at most "
                                                "2.0e-06 from a forward pass (within the tolerance 0.001))"}


def test_auto_recomputes_where_the_first_batch_is_past_the_tolerance():
    calls = []
    auto = OldLogprobs("auto")
    assert auto.reuse(True, _asked(TOLERANCE * 12, calls)) is False
    assert auto.reuse(True, _asked(0.0, calls)) is False and calls == [TOLERANCE * 12]
    assert auto.tags()["rlhf.old_logprobs"] == ("recompute (auto: the first batch's sampled log-probs were at most "
                                                "1.2e-02 from a forward pass (past the tolerance 0.001))")


def test_the_settings_never_compare_and_a_sampler_without_log_probs_always_recomputes():
    calls = []
    assert OldLogprobs("sampling").reuse(True, _asked(1.0, calls)) is True
    assert OldLogprobs("recompute").reuse(True, _asked(0.0, calls)) is False
    assert OldLogprobs("sampling").reuse(False, _asked(0.0, calls)) is False  # vLLM: the trainer's are recomputed
    assert calls == []
    assert OldLogprobs("recompute").tags() == {"rlhf.old_logprobs": "recompute (set in the config)"}
    never_offered = OldLogprobs("auto")
    never_offered.reuse(False, _asked(0.0, calls))
    assert never_offered.tags() == {
        "rlhf.old_logprobs": "recompute (auto: the sampler gave no log-probs of the trained model)"}


def test_the_deviation_is_read_on_the_models_own_tokens_only():
    sampled = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -9.0]])  # (B, R)
    recomputed = torch.tensor([[-1.0, -2.5, -3.0], [-0.5, -0.5, -1.0]])
    trainable = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 8.0 apart sits on a tool result / padding
    assert largest_deviation(None, sampled, recomputed, trainable) == 0.5
