"""Padding-free passes (`ppo.padding_free`) and micro-batches by tokens (`ppo.micro_batch_tokens`).

The packed layout is worked through by hand on a three-row batch; then, on the tiny trained models,
packed passes give the padded passes' log-probs and values within float32 round-off and the update's
gradient is the padded one's for every critic and loss aggregation, however the minibatch is cut
into micro-batches by tokens; a model whose attention cannot keep packed sequences apart is refused
with the reason; and each real model family of tests/model_families.py passes the probe, but OPT, whose
learned positions come from the attention mask.
"""

from __future__ import annotations

import pytest
import torch

from stages.common.batches import Sequences
from stages.runtime.packing import (
    TokenCounts,
    first_fit_decreasing,
    micro_batch_cost,
    micro_batches_needed,
    pack,
    padding_share,
    split_by_tokens,
)
from tests.model_families import FAMILIES, build_family


def _three_rows():
    """Prompts of 2, 1 and 3 tokens (left-padded to 3), responses of 2, 3 and 1 (right-padded to 3)."""
    queries = torch.tensor([[0, 11, 12], [0, 0, 21], [31, 32, 33]])
    query_mask = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]])
    responses = torch.tensor([[13, 14, 0], [22, 23, 24], [34, 0, 0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return queries, query_mask, responses, mask


def test_pack_lays_sequences_end_to_end_and_maps_outputs_back_by_hand():
    packed = pack(Sequences(*_three_rows()), pad_id=0)
    # Lengths 4, 4, 4; capacity 4: one sequence per row, longest first, ties in row order.
    assert packed.ids.tolist() == [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    assert packed.positions.tolist() == [[0, 1, 2, 3]] * 3
    assert packed.real_tokens == 12 and packed.computed_tokens == 12
    # Response token t is predicted at column (prompt length + t - 1): row 0 at 1, 2; row 1 at 0, 1, 2; row 2 at 2.
    assert packed.kept.tolist() == [0, 1, 2]
    outputs = torch.arange(3 * 4, dtype=torch.float).reshape(3, 4, 1)  # (R, C, 1): the flat column index
    assert packed.hidden(outputs).squeeze(-1).tolist() == [[1, 2, 0], [4, 5, 6], [10, 0, 0]]  # masked: row 0, column 0
    kept = outputs[:, packed.kept]  # (R, K, 1)
    assert packed.logits(kept).squeeze(-1).tolist() == [[1, 2, 0], [4, 5, 6], [10, 0, 0]]


def test_short_sequences_share_a_row_and_their_positions_restart():
    queries, query_mask, responses, mask = _three_rows()
    queries[2], query_mask[2] = torch.tensor([0, 0, 33]), torch.tensor([0, 0, 1])  # row 2: 1 + 1 tokens
    mask[1] = torch.tensor([1.0, 0.0, 0.0])  # row 1: 1 + 1 tokens; row 0: 2 + 2
    packed = pack(Sequences(queries, query_mask, responses, mask), pad_id=9)
    assert packed.ids.tolist() == [[11, 12, 13, 14], [21, 22, 33, 34]]
    assert packed.positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]  # row 2 starts again at 0
    # Row 0's response at columns 1, 2 of packed row 0; row 1's at column 0 of packed row 1; row 2's at column 2.
    assert packed.kept.tolist() == [0, 1, 2]
    outputs = torch.arange(2 * 4, dtype=torch.float).reshape(2, 4, 1)  # (R, C, 1): the flat column index
    assert packed.hidden(outputs).squeeze(-1).tolist() == [[1, 2, 0], [4, 0, 0], [6, 0, 0]]
    assert packed.real_tokens == 8 and packed.computed_tokens == 8


def test_a_later_chain_restarts_its_positions_and_packs_even_when_padded_was_asked():
    """Row 1's response holds a second chain from its second token (a rewritten history): positions count
    from there again, and a batch with chains is packed whatever `padding_free` says."""
    from stages.runtime.models import resolve_precision
    from stages.runtime.packing import Passes

    restarts = torch.zeros(3, 3)
    restarts[1, 1] = 1.0  # row 1: prompt [21], then [22] | a new chain [23, 24]
    packed = pack(Sequences(*_three_rows(), restarts), pad_id=0)
    assert packed.ids.tolist() == [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    assert packed.positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1], [0, 1, 2, 3]]
    padded = Passes(precision=resolve_precision("fp32"), padding_free=False)
    assert padded.layout(Sequences(*_three_rows(), restarts)) is not None
    assert padded.layout(Sequences(*_three_rows(), torch.zeros(3, 3))) is None


def test_a_later_chain_attends_to_itself_only(trained):
    """The policy's logits over a row of two chains are, on the second chain, those of that chain run
    alone as prompt + response: it sees nothing of the first chain."""
    from stages.runtime.forward import forward_response
    from stages.runtime.models import load_causal_lm, load_tokenizer, resolve_precision
    from stages.runtime.packing import Passes

    policy = load_causal_lm(trained["sft"], load_tokenizer(trained["sft"])).eval()
    first, second = [5, 6, 7, 8, 9], [10, 11, 12, 13]  # chain 1's turn and glue; chain 2's context, then its turn
    row = Sequences(torch.tensor([[3, 4]]), torch.tensor([[1, 1]]), torch.tensor([first + second]),
                    torch.ones(1, 9), torch.tensor([[0.0] * 5 + [1.0, 0.0, 0.0, 0.0]]))
    alone = Sequences(torch.tensor([[10, 11]]), torch.tensor([[1, 1]]), torch.tensor([[12, 13]]), torch.ones(1, 2))
    passes = Passes(precision=resolve_precision("fp32"))
    with torch.no_grad():
        chained, _ = forward_response(policy, row, passes)  # (1, 9, V)
        own, _ = forward_response(policy, alone, passes)  # (1, 2, V)
        unchained, _ = forward_response(policy, row._replace(restarts=None), passes)
    torch.testing.assert_close(chained[:, -2:], own, atol=1e-5, rtol=1e-5)  # tokens 12, 13 as predicted alone
    assert not torch.allclose(unchained[:, -2:], own, atol=1e-3)  # without the restart they saw the first chain
    torch.testing.assert_close(chained[:, :5], unchained[:, :5], atol=1e-5, rtol=1e-5)  # the first chain unchanged


def test_first_fit_decreasing_by_hand():
    assert first_fit_decreasing([3, 2, 4], 4) == [[2], [0], [1]]  # 3 + 2 > 4: the 2 opens a third row
    assert first_fit_decreasing([3, 1, 2, 2], 4) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([5], 4)


def test_micro_batches_by_tokens_by_hand():
    # Padded: rows x (longest prompt + longest response); packed: the tokens.
    assert micro_batch_cost([2, 5], [3, 1], packed=False) == 2 * (5 + 3)
    assert micro_batch_cost([2, 5], [3, 1], packed=True) == 11
    # Lengths 32, 5, 5: the long one alone, the two short ones together under a budget of 20.
    assert micro_batches_needed([2, 2, 2], [30, 3, 3], budget=20, packed=True) == 2
    assert micro_batches_needed([2, 2, 2], [30, 3, 3], budget=100, packed=True) == 1
    # Longest first, cut at each k / count of the tokens; no run left empty, rows of like length together.
    assert split_by_tokens([10, 10, 10, 10, 100, 5], 3) == [[4], [0], [1, 2, 3, 5]]
    assert split_by_tokens([4, 4, 4, 4], 2) == [[0, 1], [2, 3]]
    assert split_by_tokens([7, 1], 2) == [[0], [1]]


def test_padding_share_and_counts():
    assert padding_share(75, 100) == 0.25 and padding_share(0, 0) == 0.0
    counts = TokenCounts()
    counts.add("update", 30, 40)
    counts.add("update", 30, 40)
    counts.add("reference", 10, 10)
    assert counts.shares() == {"perf/padding_share/reference": 0.0, "perf/padding_share/update": 0.25}
    assert counts.shares() == {}  # counting starts again


def _models(tiny_config, trained, padding_free, **overrides):
    from rlhf.config import with_overrides
    from stages.rl.ppo_models import load_models
    from tests.helpers import AUTO_RESOLVED

    cfg = with_overrides(tiny_config.ppo, AUTO_RESOLVED | {"rollout_batch_size": 8, "num_minibatches": 1,
                                                           "sampling.response_length": 16, "padding_free": padding_free}
                         | overrides)
    torch.manual_seed(0)
    return cfg, load_models(cfg, trained["sft"], trained["reward"])


@pytest.mark.parametrize("critic", ["reward", "shared", "reward-lora"])
def test_packed_passes_give_the_padded_log_probs_and_values(tiny_config, trained, critic):
    """The rollout's passes (policy, critic, reference) packed and padded, on the same sampled batch."""
    from stages.common.tensors import logprobs_of
    from stages.rl.ppo_models import policy_and_values
    from stages.rl.rollout import policy_sampler
    from stages.runtime.forward import forward_response
    from tests.helpers import single_turn_rollout

    cfg, models = _models(tiny_config, trained, True, **{"critic.kind": critic, "old_logprobs": "recompute"})
    assert models.padding_free is True
    batch = single_turn_rollout(models, policy_sampler(models), list(trained["prompts"]["prompt"].head(8)),
                                cfg.sampling)
    lengths = batch.mask.sum(1) + batch.query_mask.sum(1)
    assert lengths.min() < lengths.max()
    with torch.no_grad():
        logits, values = policy_and_values(models, batch.sequences)
        packed_reference, _ = forward_response(models.reference, batch.sequences, models.passes("reference"))
        models.padding_free = False
        padded_logits, padded_values = policy_and_values(models, batch.sequences)
        padded_reference, _ = forward_response(models.reference, batch.sequences, models.passes("reference"))
    mask = batch.mask
    for packed, padded in ((logits, padded_logits), (packed_reference, padded_reference)):
        torch.testing.assert_close(logprobs_of(packed, batch.responses) * mask,
                                   logprobs_of(padded, batch.responses) * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values * mask, padded_values * mask, atol=1e-5, rtol=1e-5)
    shares = models.counts.shares()
    assert shares["perf/padding_share/update"] > 0.0  # the padded passes counted their padding
    assert 0.0 <= shares["perf/padding_share/reference"] < 1.0


@pytest.mark.parametrize("critic", ["reward", "shared"])
def test_padding_free_and_token_budgets_do_not_change_the_gradient(tiny_config, trained, critic):
    """The update's gradient, padded in micro-batches of rows against packed in micro-batches of
    tokens, for every loss aggregation: the same to 1e-5."""
    from accelerate import Accelerator

    from rlhf.config import with_overrides
    from rlhf.sections.ppo import PPOConfig
    from stages.rl.ppo_models import ActorCritic
    from tests.helpers import ppo_gradient_setup, ppo_gradients

    cfg, models, batch, advantages, returns = ppo_gradient_setup(tiny_config, trained, critic)
    accelerator, actor_critic = Accelerator(cpu=True), ActorCritic(models)
    for aggregation in PPOConfig.model_fields["loss_aggregation"].annotation.__args__:
        varied = with_overrides(cfg, {"loss_aggregation": aggregation, "kl.loss_coef": 0.1})
        models.padding_free = False
        whole = ppo_gradients(models, accelerator, actor_critic, batch, advantages, returns, varied)
        assert sum(g.norm() for g in whole.values()) > 0
        models.padding_free = True
        for budget in (None, 1, 40, 80):  # one row per micro-batch, a few rows, about half
            split = ppo_gradients(models, accelerator, actor_critic, batch, advantages, returns,
                                  varied.model_copy(update={"micro_batch_tokens": budget}))
            for name in whole:
                torch.testing.assert_close(split[name], whole[name], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{aggregation}, {budget}: {name}: {m}")  # noqa: B023
        models.padding_free = False  # micro-batches by tokens on the padded passes too
        split = ppo_gradients(models, accelerator, actor_critic, batch, advantages, returns,
                              varied.model_copy(update={"micro_batch_tokens": 60}))
        for name in whole:
            torch.testing.assert_close(split[name], whole[name], atol=1e-5, rtol=1e-5)


def test_auto_packs_only_where_it_saves_a_tenth():
    from stages.runtime.models import resolve_precision
    from stages.runtime.packing import Passes

    passes = Passes(precision=resolve_precision("fp32"), padding_free="auto", counts=TokenCounts(), phase="update")
    ragged = _three_rows()  # 12 real tokens padded to 3 x (3 + 3) = 18 positions
    assert passes.layout(Sequences(*ragged)) is not None
    full = (ragged[0], torch.ones_like(ragged[1]), ragged[2], torch.ones_like(ragged[3]))  # no padding at all
    assert passes.layout(Sequences(*full)) is None
    assert passes.counts.counts["update"] == [12.0 + 18.0, 12.0 + 18.0]


def test_a_model_that_lets_packed_sequences_see_each_other_is_refused(trained):
    from transformers import AutoModelForCausalLM

    from stages.rl.ppo_models import packing_setting
    from stages.runtime.forward import padding_free_refusal

    model = AutoModelForCausalLM.from_pretrained(trained["sft"], attn_implementation="sdpa")
    assert padding_free_refusal(model) is None
    forward = model.forward

    def own_positions(*args, position_ids=None, attention_mask=None, **kwargs):
        # No attention mask, no positions: one causal sequence per row, as a model without packing support sees it.
        return forward(*args, attention_mask=torch.ones_like(kwargs["input_ids"]), **kwargs)

    model.forward = own_positions
    reason = padding_free_refusal(model)
    assert reason is not None and "does not keep packed sequences apart" in reason, reason
    with pytest.raises(ValueError, match="ppo.padding_free: .* set it to auto"):
        packing_setting(True, [(model, False)])
    assert packing_setting("auto", [(model, False)]) is False


REFUSED = {"opt": "OPT's learned positions are counted from the attention mask, not the position ids"}
"""Families whose attention cannot keep packed sequences apart, and why: `auto` runs them padded."""


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_families_take_packed_passes_or_are_refused(name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from stages.runtime.forward import padding_free_refusal

    folder = build_family(name, tmp_path)
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reward = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, num_labels=1).eval()
    refusals = [padding_free_refusal(policy), padding_free_refusal(reward.base_model, base=True)]
    if name in REFUSED:
        assert all(r is not None and "does not keep packed sequences apart" in r for r in refusals), refusals
    else:
        assert refusals == [None, None]


def test_sft_padding_free_batches_train_as_padded_ones_and_report_their_padding(world, tiny_config, tokenizer,
                                                                                 tmp_path):
    """TRL's padding-free SFT batches (`sft.padding_free`) on SDPA: the same losses as padded batches, and
    each stage's logs carry its batches' padding share (none left where padding-free)."""
    from stages.common.reporting import Reporting
    from stages.sft import train_sft
    from tests.helpers import sft_inputs

    results, logged = {}, {}
    for padding_free in (False, True):
        cfg = tiny_config.sft.model_copy(update={"max_steps": 6, "logging_steps": 2, "padding_free": padding_free})
        figures = []
        results[padding_free] = train_sft(cfg, sft_inputs(world, tokenizer), tmp_path / str(padding_free),
                                          Reporting(metrics=lambda m, step, seen=figures: seen.append(m)))
        logged[padding_free] = [m["perf/padding_share/train"] for m in figures if "perf/padding_share/train" in m]
    for name in ("train/loss", "eval/loss"):
        assert results[True].metrics[name] == pytest.approx(results[False].metrics[name], rel=1e-5)
    assert logged[False] and min(logged[False]) > 0.0  # the demonstrations differ in length
    assert logged[True] and max(logged[True]) == 0.0


def test_a_compacted_decode_loop_samples_what_the_full_one_does(trained):
    """Greedy (no random draws), rows that ended leaving the batch change no token, log-prob, entropy
    or hidden state of the others, and the loop computes fewer positions."""
    from stages.engines.sampler import HFSampler, Sampling
    from stages.runtime.models import load_causal_lm, load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(trained["sft"], padding_side="left")
    model = load_causal_lm(trained["sft"], tokenizer).eval()
    prompts = list(trained["prompts"]["prompt"].head(8))
    out = {}
    for compact in (False, True):
        sampler = HFSampler(model=model, tokenizer=tokenizer, stop_ids=stop_token_ids(model), compact=compact)
        out[compact] = sampler.generate(prompts, Sampling(24, temperature=None))
    full, compacted = out[False], out[True]
    assert torch.equal(full.responses, compacted.responses)
    mask = (full.responses != tokenizer.pad_token_id).float()  # real tokens (through the end token)
    lengths = mask.sum(1)
    assert lengths.min() < lengths.max(), "responses of equal length would not compact"
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(getattr(compacted, name) * mask, getattr(full, name) * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compacted.hidden * mask.unsqueeze(-1), full.hidden * mask.unsqueeze(-1),
                               atol=1e-5, rtol=1e-5)
    assert compacted.computed_tokens < full.computed_tokens
