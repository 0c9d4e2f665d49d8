"""Compiled passes (`ppo.compile`, `stages.runtime.compiling`).

The buckets are worked by hand; a packed layout rounded to buckets maps the same outputs back; a
compiled pass, padded and packed at shapes that need rounding, gives the eager pass's log-probs and
gradients within float32 round-off (one small compile each, so the suite stays fast) and counts its
graphs and compile time; and `auto` spends no compile where the run is too short to repay one.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.sections.ppo import PPOConfig
from stages.common.batches import Sequences
from stages.common.tensors import logprobs_of, response_mask
from stages.rl.ppo_models import compiler_for
from stages.runtime.compiling import Compiler, bucketed
from stages.runtime.forward import forward_response
from stages.runtime.models import resolve_precision
from stages.runtime.packing import Passes, pack


@pytest.fixture(autouse=True)
def _compiling_leaves_nothing_behind():
    """What compiling leaves in the process goes with each test (the worker runs other test files
    after this one): dynamo's caches and the fake tensors they hold, the raised recompile limit, and
    the folder setuptools appends to `sys.path` when inductor builds a kernel."""
    path, limit = list(sys.path), torch._dynamo.config.recompile_limit
    yield
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = limit
    sys.path[:] = path


def test_buckets_are_four_sizes_per_octave_and_never_smaller():
    assert [bucketed(n) for n in (1, 2, 5, 8, 9, 11, 16, 17, 33, 40, 41, 64, 65, 100, 129)] == \
        [1, 2, 5, 8, 10, 12, 16, 20, 40, 40, 48, 64, 80, 112, 160]
    for n in range(1, 600):
        assert n <= bucketed(n) <= 1.25 * n and bucketed(bucketed(n)) == bucketed(n)
    assert len({bucketed(n) for n in range(65, 129)}) == 4


def test_a_bucketed_pack_adds_padding_rows_and_columns_that_nothing_reads():
    queries = torch.tensor([[0, 11, 12], [0, 0, 21], [31, 32, 33]])
    query_mask = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]])
    responses = torch.tensor([[13, 14, 0], [22, 23, 24], [34, 0, 0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    plain = pack(Sequences(queries, query_mask, responses, mask), pad_id=0)
    # Rows of 4 -> 5 columns, 3 rows kept, 3 kept columns -> 3 with this bucket (2 -> 2 rounds nothing below 8).
    packed = pack(Sequences(queries, query_mask, responses, mask), pad_id=0,
                  bucket=lambda n: n + 1 if n in (3, 4) else n)
    assert packed.ids.shape == (4, 5) and packed.ids[3].tolist() == [0] * 5  # a fourth row of padding alone
    assert packed.positions[3].tolist() == [0, 1, 2, 3, 4]
    assert len(packed.kept) == 4 and packed.kept[-1] == packed.kept[-2]  # the extra kept column repeats the last
    outputs = torch.randn(*packed.ids.shape, 2)  # (R, C, 2)
    # The same real outputs at each response token as the unbucketed layout reads from its own columns.
    assert torch.equal(packed.hidden(outputs) * mask.unsqueeze(-1),
                       _moved(plain, packed, outputs) * mask.unsqueeze(-1))
    assert torch.equal(packed.logits(outputs[:, packed.kept]) * mask.unsqueeze(-1),
                       packed.hidden(outputs) * mask.unsqueeze(-1))


def _moved(plain, packed, outputs: torch.Tensor) -> torch.Tensor:
    """The outputs the unbucketed layout would read, found at the bucketed layout's places (each
    sequence keeps its row and start, as first fit puts it there either way). # -> (B, T, D)"""
    width = outputs.shape[1]
    rows, columns = plain.hidden_index // plain.ids.shape[1], plain.hidden_index % plain.ids.shape[1]
    return outputs.reshape(-1, outputs.shape[-1])[rows * width + columns]


def _tiny_policy() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def _batch():
    """9 rows (a bucket of 10), prompts up to 7 tokens, responses up to 9 (buckets of 10): every
    dimension needs rounding."""
    generator = torch.Generator().manual_seed(1)
    queries = torch.randint(1, 64, (9, 7), generator=generator)
    responses = torch.randint(1, 64, (9, 9), generator=generator)
    prompt_lengths = torch.tensor([7, 3, 5, 1, 7, 2, 4, 6, 5])
    response_lengths = torch.tensor([9, 4, 1, 9, 2, 6, 3, 8, 5])
    query_mask = (torch.arange(7) >= 7 - prompt_lengths.unsqueeze(1)).long()
    mask = (torch.arange(9) < response_lengths.unsqueeze(1)).float()
    return queries * query_mask, query_mask, responses * mask.long(), mask


@pytest.mark.multiprocess  # inductor compiles in worker processes
@pytest.mark.parametrize(("padding_free", "static_shapes"), [(False, False), (False, True), (True, True)])
def test_a_compiled_pass_gives_the_eager_log_probs_and_gradients(padding_free, static_shapes):
    """Symbolic shapes (the CPU's way) and bucketed static ones (a GPU's), padded and packed."""
    policy, batch = _tiny_policy(), _batch()
    results = []
    for compiler in (Compiler(enabled=False), Compiler(enabled=True, static_shapes=static_shapes)):
        passes = Passes(precision=resolve_precision("fp32"), padding_free=padding_free, compiler=compiler)
        logits, hidden = forward_response(policy, Sequences(*batch), passes, want_hidden=True)
        logprobs = logprobs_of(logits, batch[2]) * batch[3]  # (B, T)
        (logprobs.sum() + hidden.pow(2).mean()).backward()
        gradients = [p.grad.clone() for p in policy.parameters()]
        policy.zero_grad(set_to_none=True)
        results.append((logprobs.detach(), hidden.detach() * batch[3].unsqueeze(-1), gradients, compiler.figures()))
    (eager, eager_hidden, eager_grads, off), (compiled, compiled_hidden, compiled_grads, on) = results
    assert torch.allclose(compiled, eager, atol=1e-5)
    assert torch.allclose(compiled_hidden, eager_hidden, atol=1e-5)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert off == {} and on["perf/recompiles"] >= 1 and on["time/compile"] > 0


def test_auto_spends_no_compile_on_a_run_too_short_to_repay_one():
    cfg = PPOConfig(prompts={"path": "demo:prompts"}, compile="auto", num_iterations=2, rollout_batch_size=8,
                    num_minibatches=2, max_prompt_length=8, sampling={"response_length": 8})
    compiler = compiler_for(cfg, _tiny_policy(), Passes(precision=resolve_precision("fp32")))
    assert not compiler.enabled and compiler.reason.startswith("off (auto: eager pass")
    assert "compiling could save at most" in compiler.reason
    assert Compiler(enabled=False).figures() == {}


@pytest.mark.multiprocess  # inductor compiles in worker processes
@pytest.mark.parametrize("compact", [False, True])
def test_the_compiled_decode_loop_draws_the_eager_loops_greedy_tokens(compact):
    """A static KV cache and the compiled step give the eager loop's greedy tokens, log-probs and
    hidden states, whether the eager loop's rows leave as they end (`compact`) or not (the compiled
    loop keeps them all); prompts of different lengths."""
    from types import SimpleNamespace

    from stages.engines.sampler import HFSampler, Sampling

    policy = _tiny_policy().eval()
    prompts = [[5, 9, 14, 3, 22], [7, 8], [30, 31, 32], [11]]
    generations = []
    for compiler in (Compiler(enabled=False), Compiler(enabled=True)):
        sampler = HFSampler(model=policy, tokenizer=SimpleNamespace(pad_token_id=0), stop_ids=[3, 17, 40],
                            compact=compact, compiler=compiler)
        generations.append((sampler.generate_ids(prompts, Sampling(12, temperature=None)), compiler.figures()))
    (eager, off), (compiled, on) = generations
    assert torch.equal(compiled.responses, eager.responses)
    assert (eager.responses == 0).any(), "no row ended early: the test would not see rows leave"
    # Up to each row's end token: after it the eager loop computed nothing for a row that left (`compact`).
    mask = response_mask(eager.responses, [3, 17, 40])  # (B, T)
    torch.testing.assert_close(compiled.logprobs * mask, eager.logprobs * mask, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(compiled.hidden * mask.unsqueeze(-1), eager.hidden * mask.unsqueeze(-1), atol=1e-5,
                               rtol=1e-4)
    assert off == {} and set(on) == {"perf/recompiles", "time/compile"}  # the graph may be the other case's


@pytest.mark.parametrize("temperature", [None, 1.0])
def test_checking_for_the_end_every_few_steps_gives_the_same_responses_and_figures(monkeypatch, temperature):
    """With CUDA graphs the decode loop asks "has every row ended?" only every `STOP_CHECK_EVERY`
    steps (each ask waits for the device) and cuts the steps decoded past the last row's end: the
    responses, log-probs, entropy and hidden states, shapes included, are those of asking every step.
    Sampled at temperature 1 too: the steps decoded in vain draw after every row's last draw."""
    from dataclasses import replace
    from types import SimpleNamespace

    from stages.engines import sampler as sampling_module
    from stages.engines.sampler import STOP_CHECK_EVERY, DecodeSteps, HFSampler, Sampling

    policy = _tiny_policy().eval()
    STOPS = [3, 17, 27, 40]  # noqa: N806 - every row of either case ends, the last at step 22
    prompts = [[5, 9, 14, 3, 22], [7, 8], [30, 31, 32], [11]]

    def generate():
        sampler = HFSampler(model=policy, tokenizer=SimpleNamespace(pad_token_id=0), stop_ids=STOPS)
        torch.manual_seed(0)
        return sampler.generate_ids(prompts, Sampling(24, temperature=temperature))

    every_step = generate()
    start = DecodeSteps.start
    monkeypatch.setattr(sampling_module.DecodeSteps, "start", classmethod(
        lambda cls, *args: replace(start(*args), stop_every=STOP_CHECK_EVERY)))
    every_few = generate()
    from stages.common.tensors import is_end

    ends, width = is_end(every_step.responses, STOPS), every_step.responses.shape[1]
    assert ends.any(dim=1).all() and width % STOP_CHECK_EVERY != 0, \
        "every row must end, off a multiple of the check: the test would not see steps cut"
    for name in ("responses", "logprobs", "entropy", "hidden"):
        assert torch.equal(getattr(every_few, name), getattr(every_step, name)), name
    assert every_few.computed_tokens > every_step.computed_tokens  # the steps past the end were decoded


@pytest.mark.multiprocess  # inductor compiles and loads a new kernel in processes of its own
def test_compiled_kernels_are_kept_in_a_private_folder_under_rlhf_home(tmp_path, monkeypatch):
    """Not inductor's default `/tmp/torchinductor_<user>`, which another local user could create first:
    `RLHF_HOME/inductor`, mode 0700, where a compile writes its kernels; a folder the user set is kept."""
    import os
    import stat

    from stages.runtime.compiling import private_kernel_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "home"))
    private_kernel_cache()
    folder = tmp_path / "home" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    torch._dynamo.reset()
    assert torch.compile(lambda x: x * 3 + 1)(torch.arange(5.0)).tolist() == [1.0, 4.0, 7.0, 10.0, 13.0]
    assert any(path.is_file() for path in folder.rglob("*"))  # the kernel compiled for it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    private_kernel_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
