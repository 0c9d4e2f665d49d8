"""Where a rollout's old log-probs come from: the sampling pass, or a second forward over the sampled sequences.

transformers' decode loop computes the log-probs of the tokens it samples, under the very weights the
update starts from; a forward over the whole sequences (the update's own pass) computes them again,
differing only by how the KV-cached steps round against the full-sequence pass. `ppo.old_logprobs`:

    sampling   the sampler's, always (and a critic on the policy's body reads the sampler's hidden states)
    recompute  a second forward, always
    auto       the run's first micro-batch takes both and compares them on the model's own tokens;
               the sampler's for the rest of the run where they agree to `TOLERANCE`, else the forward's
               (a resumed attempt compares again, on its own first batch)

The verdict and the deviation it was drawn from are the run's `rlhf.old_logprobs` tag. A sampler that
holds no log-probs of the trained model (a vLLM server: its own are the behaviour policy's, kept beside
as `engine_logprobs` for truncated importance sampling) always gets the second forward.
"""

from __future__ import annotations

from collections.abc import Callable

TOLERANCE = 1e-3
"""The largest |log p_sampled - log p_forward| over a batch's model tokens that `auto` takes as one
policy: the first update's ratio within 0.1% of 1, the fp32 threshold of the initial-ratio warning.
Measured: ~1e-6 in fp32; ~1e-2 where the passes round to bf16 (the demo model)."""


class OldLogprobs:
    """`ppo.old_logprobs` as a run takes it: `reuse` says, batch by batch, whether the sampler's log-probs
    stand as the old ones; under `auto` the first batch that offers them decides for the run."""

    def __init__(self, setting: str = "sampling", reason: str = "set in the config"):
        self.verdict: str | None = None if setting == "auto" else setting
        """`sampling` or `recompute`; None until `auto`'s first comparison."""
        self.reason = reason

    def reuse(self, offered: bool, deviation: Callable[[], float]) -> bool:
        """Whether this batch's old log-probs are the sampler's. `offered`: whether the sampler holds what
        the update needs (its log-probs, and hidden states for a critic on the policy's body);
        `deviation()`: the largest |Δ log p| against a forward pass over every process, which `auto`
        calls on the first batch offered, and only then (collective where the forward is)."""
        if not offered:
            return False
        if self.verdict is None:
            worst = deviation()
            self.verdict = "sampling" if worst <= TOLERANCE else "recompute"
            self.reason = (f"auto: the first batch's sampled log-probs were at most {worst:.1e} from a forward pass "
                           f"({'within' if worst <= TOLERANCE else 'past'} the tolerance {TOLERANCE:g})")
        return self.verdict == "sampling"

    def tags(self) -> dict[str, str]:
        """`rlhf.old_logprobs`: where the run's old log-probs came from, and why."""
        if self.verdict is None:  # `auto`, and no batch ever offered them
            return {"rlhf.old_logprobs": "recompute (auto: the sampler gave no log-probs of the trained model)"}
        return {"rlhf.old_logprobs": f"{self.verdict} ({self.reason})"}


def by_precision(sixteen_bits: bool, where: str) -> OldLogprobs:
    """`auto` where it does not compare (`where` says where, in the tag): the sampler's in fp32, a second
    forward where the passes round to 16 bits. DPO's evaluations, which train nothing to compare against."""
    return OldLogprobs("recompute" if sixteen_bits else "sampling", reason=f"auto {where}: by precision, not compared")
