"""The sampler seam (`stages.engines.sampler`): what an engine gives, and what the rollout recomputes when it cannot."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlhf.config import with_overrides
from stages.rl.ppo_models import load_models
from stages.rl.ppo_rollout import policy_sampler, rollout
from stages.engines.sampler import Generation, HFSampler, Sampling
from tests.helpers import AUTO_RESOLVED


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

    def sync(self, policy: torch.nn.Module) -> None:
        self.inner.sync(policy)


def test_a_rollout_recomputes_what_its_sampler_cannot_give(tiny_config, trained):
    """Old log-probs, entropy and the shared critic's values from a forward pass, the same as the
    sampling pass gives them (fp32: up to float rounding)."""
    cfg = _cfg(tiny_config, critic={"kind": "shared"}, sampling={"response_length": 12})
    models = load_models(cfg, trained["sft"], trained["reward"])
    prompts = list(trained["prompts"]["prompt"][:6])
    torch.manual_seed(0)
    full = rollout(models, policy_sampler(models), prompts, cfg.sampling, {})
    torch.manual_seed(0)
    recomputed = rollout(models, TokensOnly(policy_sampler(models)), prompts, cfg.sampling, {})
    assert torch.equal(full.responses, recomputed.responses)
    for name in ("logprobs", "ref_logprobs", "values", "entropy"):
        torch.testing.assert_close(getattr(recomputed, name) * full.mask, getattr(full, name) * full.mask,
                                   atol=1e-4, rtol=0, msg=name)
