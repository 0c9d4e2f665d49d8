"""The sampler seam (`stages.engines.sampler`): what an engine gives, and what the rollout recomputes when it cannot."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlhf.config import with_overrides
from stages.common.tensors import logprobs_of
from stages.engines.sampler import Generation, HFSampler, Sampling
from stages.rl.ppo_models import load_models
from stages.rl.rollout import policy_sampler
from stages.runtime.forward import forward_response
from tests.helpers import AUTO_RESOLVED, single_turn_rollout


def _cfg(tiny_config, **changes):
    return with_overrides(tiny_config.ppo, AUTO_RESOLVED | changes)


def test_the_decode_loop_and_transformers_generate_agree_when_greedy(tiny_config, trained):
    """Both HF paths answer the same prompts with the same tokens where no random number is drawn."""
    models = load_models(_cfg(tiny_config), trained["sft"], trained["reward"])
    models.train(False)
    sampler = policy_sampler(models)
    prompts = list(trained["prompts"]["prompt"][:6])  # of different lengths: left padding
    ours = sampler.generate(prompts, Sampling(12, temperature=None))
    theirs = sampler.generate(prompts, Sampling(12, temperature=None, logprobs=False))
    assert theirs.logprobs is None and theirs.hidden is None
    assert torch.equal(ours.queries, theirs.queries)
    width = min(ours.responses.shape[1], theirs.responses.shape[1])  # the loop stops when every row ended
    assert torch.equal(ours.responses[:, :width], theirs.responses[:, :width])


@dataclass
class TokensOnly:
    """An engine that gives token ids alone (as one serving another copy of the weights may)."""

    inner: HFSampler

    def generate(self, prompts: list[str], sampling: Sampling) -> Generation:
        return replace(self.inner.generate(prompts, sampling), logprobs=None, entropy=None, hidden=None)

    version = 0

    def sync(self, policy: torch.nn.Module, version: int) -> None:
        self.inner.sync(policy, version)


def test_a_rollout_recomputes_what_its_sampler_cannot_give(tiny_config, trained):
    """Old log-probs, entropy and the shared critic's values from a forward pass, the same as the
    sampling pass gives them (fp32: up to float rounding)."""
    cfg = _cfg(tiny_config, critic={"kind": "shared"}, sampling={"response_length": 12})
    models = load_models(cfg, trained["sft"], trained["reward"])
    prompts = list(trained["prompts"]["prompt"][:6])
    torch.manual_seed(0)
    full = single_turn_rollout(models, policy_sampler(models), prompts, cfg.sampling)
    torch.manual_seed(0)
    recomputed = single_turn_rollout(models, TokensOnly(policy_sampler(models)), prompts, cfg.sampling)
    assert torch.equal(full.responses, recomputed.responses)
    for name in ("logprobs", "ref_logprobs", "values", "entropy"):
        torch.testing.assert_close(getattr(recomputed, name) * full.mask, getattr(full, name) * full.mask,
                                   atol=1e-4, rtol=0, msg=name)


def test_a_rollout_sampled_earlier_is_scored_under_the_policy_as_it_is_now(tiny_config, trained):
    """Responses sampled ahead by an older policy (`stages.envs.ahead`): the rollout takes
    them as they were sampled, keeps the sampler's log-probs as `engine_logprobs`, and computes the
    old log-probs under the policy's weights now, where the next update starts."""
    cfg = _cfg(tiny_config, sampling={"response_length": 12})
    models = load_models(cfg, trained["sft"], trained["reward"])
    prompts = list(trained["prompts"]["prompt"][:4])
    torch.manual_seed(0)
    earlier = policy_sampler(models).generate(prompts, Sampling(12, 1.0))  # by the weights as they were
    ahead = replace(earlier, logprobs=None, entropy=None, hidden=None, engine_logprobs=earlier.logprobs)
    with torch.no_grad():
        for p in models.policy.parameters():
            p.mul_(1.05)  # an update since
    timings = {}
    batch = single_turn_rollout(models, policy_sampler(models), prompts, cfg.sampling, timings, sampled=[ahead])
    assert "generate" not in timings and torch.equal(batch.responses, earlier.responses)
    with torch.no_grad():  # the new weights' own pass over the same tokens
        logits, _ = forward_response(models.policy, batch.sequences, models.passes("test"))
    torch.testing.assert_close(batch.logprobs, logprobs_of(logits, batch.responses, 1.0) * batch.mask)
    torch.testing.assert_close(batch.engine_logprobs, earlier.logprobs * batch.mask, atol=0, rtol=0)
    assert (batch.logprobs - batch.engine_logprobs).abs().max() > 1e-3  # the two policies differ
