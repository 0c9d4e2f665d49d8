"""PPO on a CUDA GPU in bf16 (`pytest -m gpu`; `scripts/gpu_check.sh` runs them on a lent GPU machine).
Each test skips where no CUDA device is, as on CI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf.config import with_overrides
from tests.helpers import AUTO_RESOLVED, close, killed_and_resumed, run_ppo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SAMPLING_TOLERANCE = 0.05
"""Largest |ratio - 1| before the first update when the old log-probs are the sampling pass's, in bf16: the
sampling pass runs one token at a time with a KV cache, the update's forward over the whole sequence, and
bf16 rounds them apart (2.2e-2 measured here, on CPU autocast, with the tiny config)."""


def _cfg(tiny_config, **changes):
    return with_overrides(tiny_config.ppo, AUTO_RESOLVED | {"precision": "bf16-mixed", "checkpoint_every": 100}
                          | changes)


def test_ppo_runs_on_cuda_with_bf16(tiny_config, trained, tmp_path):
    result = run_ppo(_cfg(tiny_config, num_iterations=3), trained, tmp_path)
    assert result.tags["rlhf.autocast_dtype"] == "bfloat16" and result.tags["rlhf.trainable_dtype"] == "float32"
    assert np.isfinite(result.history[-1]["train/policy_loss"])


def test_sampling_log_probs_match_a_fresh_forward_in_bf16(tiny_config, trained, tmp_path):
    result = run_ppo(_cfg(tiny_config, num_iterations=2, old_logprobs="sampling"), trained, tmp_path)
    deviation = max(row["train/initial_ratio_deviation"] for row in result.history)
    print(f"bf16 sampling pass against the update's forward: max |ratio - 1| = {deviation:.2e}")
    assert deviation <= SAMPLING_TOLERANCE


def test_lora_uses_the_adapter_disabled_policy_as_reference(tiny_config, trained, tmp_path):
    from stages.rl.ppo_models import load_models

    cfg = _cfg(tiny_config, num_iterations=2, lora={"r": 8}, critic={"kind": "shared"})
    models = load_models(cfg, trained["sft"], trained["reward"])
    assert models.reference is None and next(models.policy.parameters()).is_cuda
    result = run_ppo(cfg, trained, tmp_path)
    # before the first update the policy is its reference: the sampled responses' KL is rounding
    assert abs(result.history[0]["rollout/kl"]) < 0.05
    assert np.isfinite(result.history[-1]["train/policy_loss"])


def test_gradient_checkpointing_changes_no_figure_of_the_first_iteration(tiny_config, trained, tmp_path):
    plain = run_ppo(_cfg(tiny_config, num_iterations=1), trained, tmp_path / "plain")
    checkpointed = run_ppo(_cfg(tiny_config, num_iterations=1, gradient_checkpointing=True), trained,
                           tmp_path / "checkpointed")
    for name in ("rollout/score", "train/policy_loss", "train/value_loss"):
        assert close(plain.history[0][name], checkpointed.history[0][name], rel=0.02), name


def test_a_run_killed_on_the_gpu_resumes_to_the_same_figures(tiny_config, trained, tmp_path):
    cfg = _cfg(tiny_config, num_iterations=6, checkpoint_every=3)
    whole, resumed = killed_and_resumed(cfg, trained, tmp_path)
    assert len(resumed.history) == len(whole.history) == 6
    # the same rollouts and updates after the resume (RNG states restored, CUDA's included); cuBLAS may
    # reduce in another order between runs, so figures agree closely rather than bit for bit
    for name in ("rollout/score", "train/policy_loss"):
        assert close(whole.history[-1][name], resumed.history[-1][name], rel=0.05), name


def test_the_decode_loop_on_cuda_graphs_draws_the_eager_loops_greedy_tokens():
    """`ppo.compile`'s decode on a GPU: the step replayed as a CUDA graph, the end checked every few
    steps; greedy in float32, the eager loop's tokens and, to round-off, its log-probs; a second call
    replays into the kept cache."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.common.tensors import response_mask
    from stages.engines.sampler import HFSampler, Sampling
    from stages.runtime.compiling import Compiler

    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2,
                                          max_position_embeddings=64)).cuda().eval()
    prompts, stops = [[5, 9, 14, 3, 22], [7, 8], [30, 31, 32], [11]], [3, 17, 27, 40]
    results = []
    for compiler in (Compiler(enabled=False), Compiler(enabled=True, static_shapes=True, cuda_graphs=True)):
        sampler = HFSampler(model=policy, tokenizer=SimpleNamespace(pad_token_id=0), stop_ids=stops, compiler=compiler)
        results.append([sampler.generate_ids(prompts, Sampling(24, temperature=None)) for _ in range(2)])
    (eager, _), (graphs, again) = results
    assert torch.equal(graphs.responses, eager.responses) and torch.equal(again.responses, eager.responses)
    mask = response_mask(eager.responses, stops)
    torch.testing.assert_close(graphs.logprobs * mask, eager.logprobs * mask, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(again.logprobs * mask, eager.logprobs * mask, atol=1e-4, rtol=1e-3)
