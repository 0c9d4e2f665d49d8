"""Generation: one way for every stage to sample responses.

A `Sampler` answers prompts with responses (token ids, and where the engine can give them each
token's log-prob, the entropy and the final hidden state that predicted it) and receives the
policy's current weights (`sync`). What an engine cannot give is None, and the caller recomputes
it with a forward pass. `stages.engines.vllm_server.VLLMSampler` samples on a vLLM server: token ids and
vLLM's own log-probs (`engine_logprobs`), which the rollout compares with its recomputed ones.
`HFSampler` is transformers' model itself: it samples the live policy, so `sync` only counts the
version, and it owns what is HF-specific (the KV-cached decode loop, a sharded
model's gathering for it and the "every process finished?" check).

PPO's rollout (`stages.rl.ppo_rollout`) samples through it, for training and for every evaluation
(PPO's and DPO's); the reward stage's normalisation samples and SFT's greedy samples too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, StaticCache

from stages.common.tensors import entropy_of, is_end, logprobs_of, response_mask, truncate_after_eos
from stages.runtime.compiling import Compiler, bucketed
from stages.runtime.holding import Holding, Replicated
from stages.runtime.models import Precision, left_padded, left_padded_ids, position_ids_for

# --- the sampler --------------------------------------------------------------------------------

STOP_CHECK_EVERY = 8
"""Decode steps between "has every row ended?" checks when steps replay CUDA graphs: each check waits
for the device, so the host cannot queue the next steps ahead; at most 7 steps are decoded in vain."""


@dataclass(frozen=True)
class Sampling:
    """What one `generate` call asks for."""

    max_new_tokens: int
    """Tokens per response at most."""
    temperature: float | None = 1.0
    """Sample from the full temperature-scaled distribution (no top-k, no top-p); None: greedy."""
    logprobs: bool = True
    """Keep each token's log-prob, the entropy and (where the engine can) the hidden state. HF draws
    these responses with its own decode loop, and the others with transformers' `generate`: the two
    consume the random stream differently, so a caller keeps the one its recorded figures came from."""
    seeds: tuple[int, ...] | None = None
    """One seed per prompt: each response is drawn from its own random stream, so its tokens do not
    depend on which prompts share its batch (continuous episodes); None: the caller's stream, as drawn."""


@dataclass(kw_only=True)
class Generation:
    """Sampled responses; (B, T) over response tokens unless noted. None: the engine cannot give it."""

    queries: torch.Tensor  # (B, Tq) left-padded prompt ids
    query_mask: torch.Tensor  # (B, Tq)
    responses: torch.Tensor  # truncated after the first end token, then padding
    logprobs: torch.Tensor | None = None  # log pi(token) under the temperature-scaled logits it was drawn from
    entropy: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # (B, T, H) final hidden states at the positions that predicted each token
    engine_logprobs: torch.Tensor | None = None  # an inference engine's own log pi(token), beside the trainer's
    computed_tokens: int | None = None
    """Positions the engine's passes computed (prompts and decode steps), where it counts them."""
    version: int = 0
    """The policy version that drew them: updates its weights had had (the sampler's last `sync`)."""


class Sampler(Protocol):
    """An engine that answers prompts from the policy's current weights."""

    concurrent: bool
    """Whether calls from several threads are answered together (a server batches them); False: each call
    is one batch, on the caller's thread, and the caller batches."""
    version: int
    """The policy version it samples: updates its weights have had (the last `sync`'s)."""

    def generate(self, prompts: list[str], sampling: Sampling) -> Generation:
        """Responses to rendered `prompts`, one per prompt (repeat a prompt for several)."""
        ...

    def generate_ids(self, prompts: list[list[int]], sampling: Sampling) -> Generation:
        """Responses to prompts given as token ids, never re-tokenised (a multi-turn episode's
        context so far: `stages.envs`)."""
        ...

    def sync(self, policy: torch.nn.Module, version: int) -> None:
        """Take the policy's current weights, `version` updates in (every process calls it after each update)."""
        ...

    def most(self, value: int) -> int:
        """The largest `value` of the processes that sample together (a sharded policy's, collectively);
        this process's own where each samples alone."""
        ...

    def close(self) -> None:
        """Release what the engine holds apart from the trainer (a server); the stage calls it however it ends."""
        ...


def _in_rows(x: torch.Tensor, live: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    """The live rows' step outputs in the whole batch's rows, `fill` in the others. # (L, ...) -> (B, ...)"""
    if len(live) == rows:
        return x
    return torch.full((rows, *x.shape[1:]), fill, dtype=x.dtype, device=x.device).index_copy(0, live, x)


def draw(probs: torch.Tensor, streams: list[torch.Generator] | None = None) -> torch.Tensor:
    """One token per row from categorical `probs` by inverse-CDF sampling: one uniform number per
    row (from the row's own stream where `streams` are given, else the caller's), where
    torch.multinomial draws one per vocabulary entry. # (B, V) -> (B, 1)"""
    cdf = probs.cumsum(dim=-1)  # (B, V)
    if streams is None:
        u = torch.rand(len(probs), 1, device=probs.device, dtype=cdf.dtype)
    else:
        u = torch.cat([torch.rand(1, 1, generator=g, device=g.device, dtype=cdf.dtype) for g in streams])
        u = u.to(probs.device)
    u = u * cdf[:, -1:]  # scaled: cdf[-1] may round below 1
    return torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1)


def row_streams(seeds: tuple[int, ...] | None, device: torch.device) -> list[torch.Generator] | None:
    """A random stream per row, seeded so (`Sampling.seeds`); None without seeds."""
    if seeds is None:
        return None
    device = device if device.type == "cuda" else torch.device("cpu")
    return [torch.Generator(device).manual_seed(seed) for seed in seeds]


@dataclass(kw_only=True)
class HFSampler:
    """A transformers model sampling itself: it holds the live weights, so `sync` only counts the version."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    stop_ids: list[int]
    """Every token id that ends a response (`stages.runtime.models.stop_token_ids`)."""
    precision: Precision = Precision("fp32", None)
    """Autocast for the decode loop; transformers' `generate` runs as the model is held."""
    holding: Holding = field(default_factory=Replicated)
    """How the processes hold the model: a sharded one is gathered for sampling."""
    compact: bool = False
    """A row that ended leaves the decode loop's batch (and its KV cache) at once, instead of being
    computed on to the longest response; its random draws leave with it, so the draws differ from
    the uncompacted loop's once a row ends."""
    compiler: Compiler = field(default_factory=Compiler)
    """On: decode steps on a static KV cache, through the compiled model (`ppo.compile`), every row
    to the longest response (`compact` is the eager loop's); greedy, the same tokens as the eager loop."""

    version: int = 0
    concurrent = False
    _caches: dict[tuple[int, int], StaticCache] = field(default_factory=dict, repr=False)
    """The compiled loop's static KV caches by (rows, width), kept across calls: a CUDA graph replays
    into the addresses it was captured with, and a new cache each call would capture it again."""

    def sync(self, policy: torch.nn.Module, version: int) -> None:
        self.version = version  # the weights it samples are the live policy's already

    def most(self, value: int) -> int:
        return self.holding.most(value)

    def close(self) -> None:
        return None

    def generate(self, prompts: list[str], sampling: Sampling) -> Generation:
        return self._generate(left_padded(self.tokenizer, prompts, self.model.device), sampling)

    def generate_ids(self, prompts: list[list[int]], sampling: Sampling) -> Generation:
        return self._generate(left_padded_ids(prompts, self.tokenizer.pad_token_id, self.model.device), sampling)

    def _generate(self, batch: dict[str, torch.Tensor], sampling: Sampling) -> Generation:
        if sampling.logprobs or sampling.seeds is not None:  # per-row streams: our loop's
            return self._decode(batch, sampling)
        return self._transformers_generate(batch, sampling)

    @torch.no_grad()
    def _decode(self, batch: dict[str, torch.Tensor], sampling: Sampling) -> Generation:
        """Up to `max_new_tokens` tokens per prompt, one KV-cached step at a time, keeping each
        token's log-prob, the entropy and the final hidden state of the step that produced it: the
        rollout then needs no second policy pass for old log-probs and (shared-body) values. Stops
        early once every row has an end token (on every process, when the model is sharded); with
        `compact`, rows that ended leave the batch as they end. Positions after a row's end hold
        padding (tokens) and zeros (figures) where they were not computed."""
        model = self.model
        queries, query_mask = batch["input_ids"], batch["attention_mask"]  # (B, Tq)
        steps = DecodeSteps.start(model, query_mask, sampling.max_new_tokens, self.compiler, self._caches)
        positions, step_ids = position_ids_for(query_mask), queries  # (L, t): the live rows'
        live = torch.arange(len(queries), device=model.device)  # (L,) the rows still in the batch
        tokens, logprobs, entropy, hidden = [], [], [], []
        finished = torch.zeros(len(queries), dtype=torch.bool, device=model.device)
        streams = row_streams(sampling.seeds, model.device)  # (L,) or None: the caller's stream
        computed = 0
        with self.precision.autocast(model.device), self.holding.sampling(model):
            for step in range(sampling.max_new_tokens):
                computed += step_ids.numel()  # the prompts, then one position per live row
                logits, last_hidden = steps.forward(step_ids, positions)  # (L, 1, V) float32, (L, 1, H)
                token = (logits[:, -1].argmax(-1, keepdim=True) if sampling.temperature is None
                         else draw(torch.softmax(logits[:, -1] / sampling.temperature, dim=-1), streams))  # (L, 1)
                tokens.append(_in_rows(token, live, len(queries), self.tokenizer.pad_token_id))
                logprobs.append(_in_rows(logprobs_of(logits, token, sampling.temperature or 1.0), live, len(queries)))
                entropy.append(_in_rows(entropy_of(logits, sampling.temperature or 1.0), live, len(queries)))
                hidden.append(_in_rows(last_hidden, live, len(queries)))
                ended = is_end(token.squeeze(1), self.stop_ids)  # (L,)
                finished[live] |= ended
                if (step + 1) % steps.stop_every == 0 and self.holding.all_finished(finished):
                    break
                step_ids, positions = token, positions[:, -1:] + 1
                steps.advance(token)
                if self.compact and steps.drops_rows and ended.any() and not ended.all():
                    keep = (~ended).nonzero().squeeze(1)  # never empty: a sharded peer may go on
                    steps.keep(keep)
                    live, step_ids, positions = live[keep], step_ids[keep], positions[keep]
                    streams = None if streams is None else [streams[i] for i in keep.tolist()]
        responses = truncate_after_eos(torch.cat(tokens, dim=1), self.stop_ids, self.tokenizer.pad_token_id)
        width = steps.width_used(responses, self.stop_ids)  # the steps decoded past the last row's end, cut
        return Generation(queries=queries, query_mask=query_mask, responses=responses[:, :width],
                          logprobs=torch.cat(logprobs, dim=1)[:, :width], entropy=torch.cat(entropy, dim=1)[:, :width],
                          hidden=torch.cat(hidden, dim=1)[:, :width], computed_tokens=computed, version=self.version)

    @torch.inference_mode()
    def _transformers_generate(self, batch: dict[str, torch.Tensor], sampling: Sampling) -> Generation:
        """transformers' `generate`, the model in eval mode for it (dropout off)."""
        model = self.model
        options = {"do_sample": False} if sampling.temperature is None else {
            "do_sample": True, "temperature": sampling.temperature, "top_k": 0, "top_p": 1.0}
        was_training = model.training
        model.eval()
        with self.holding.sampling(model):
            out = model.generate(**batch, **options, max_new_tokens=sampling.max_new_tokens,
                                 pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.stop_ids)  # (B, Tq + T)
        model.train(was_training)
        new_tokens = out[:, batch["input_ids"].shape[1]:]  # (B, T)
        return Generation(queries=batch["input_ids"], query_mask=batch["attention_mask"],
                          responses=truncate_after_eos(new_tokens, self.stop_ids, self.tokenizer.pad_token_id),
                          version=self.version)


@dataclass(kw_only=True)
class DecodeSteps:
    """The KV cache and the attention mask of one decode loop, and how each step runs: eager on a
    growing cache (`DynamicCache`), or, compiled, on a cache of the loop's whole length
    (`StaticCache`) with a mask of that width, so every step after the prefill has one shape (the
    columns not written yet are hidden by causality). # mask: (L, Tq + t) or (L, Tq + T)"""

    model: PreTrainedModel
    cache: DynamicCache | StaticCache
    mask: torch.Tensor
    run: Callable
    """What the steps after the prefill call: the model, or its compiled forward."""
    drops_rows: bool = True
    """Rows may leave the batch: not from a static cache, whose shape is the compiled graph's."""
    graphs: bool = False
    """`run` replays CUDA graphs, whose outputs the next replay overwrites: each step's are copied out."""
    stop_every: int = 1
    """Steps between checks that every row has ended, each a wait for the device: 1, except with CUDA
    graphs (`STOP_CHECK_EVERY`), whose steps then queue ahead of the host; the steps decoded past the
    last row's end are cut after the loop (`width_used`), so the outputs are the same either way."""
    written: int = 0
    """Positions of the cache filled so far."""

    @classmethod
    def start(cls, model: PreTrainedModel, query_mask: torch.Tensor, max_new_tokens: int,
              compiler: Compiler, caches: dict[tuple[int, int], StaticCache]) -> DecodeSteps:
        """The steps of one loop: eager, or compiled on a static cache from `caches` (made and kept
        there on its shape's first loop, emptied for each later one)."""
        if not compiler.enabled:
            return cls(model=model, cache=DynamicCache(), mask=query_mask, run=model)
        # The static cache's tensors have fixed addresses, so its shape is part of the graph: widths
        # rounded to buckets, and the batch kept whole (a row that ends is computed on, as without `compact`).
        width = bucketed(query_mask.shape[1] + max_new_tokens)
        mask = torch.nn.functional.pad(query_mask, (0, width - query_mask.shape[1]), value=1)
        cache = caches.get((len(query_mask), width))
        if cache is None:
            cache = caches[len(query_mask), width] = StaticCache(config=model.config, max_cache_len=width)
        else:
            cache.reset()
        graphs = compiler.cuda_graphs and query_mask.device.type == "cuda"
        return cls(model=model, cache=cache, mask=mask,
                   run=compiler(model, "decode"), drops_rows=False, graphs=graphs,
                   stop_every=STOP_CHECK_EVERY if graphs else 1)

    @property
    def static(self) -> bool:
        return isinstance(self.cache, StaticCache)

    def forward(self, step_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: the prompts' prefill (eager), then one token per live row; the last position's
        logits in float32 and its final hidden state. # (L, t) -> (L, 1, V), (L, 1, H)"""
        width = step_ids.shape[1]
        extra = {}
        if self.static:  # where this step writes the cache
            extra["cache_position"] = torch.arange(self.written, self.written + width, device=step_ids.device)
        mask = self.mask[:, :self.written + width] if self.static and self.written == 0 else self.mask
        replay = self.graphs and self.written > 0
        if replay:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's outputs were copied out
        out = (self.model if self.written == 0 else self.run)(
            input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
            use_cache=True, output_hidden_states=True, logits_to_keep=1, **extra)
        self.written += width
        logits, hidden = out.logits[:, -1:].float(), out.hidden_states[-1][:, -1:]
        return (logits.clone(), hidden.clone()) if replay else (logits, hidden)

    def width_used(self, responses: torch.Tensor, stop_ids: list[int]) -> int:
        """The responses' columns up to the last row's end token, where steps ran past it (`stop_every`);
        every column otherwise. # (B, T) -> int"""
        if self.stop_every == 1:
            return responses.shape[1]
        return int(response_mask(responses, stop_ids).sum(dim=1).max())  # a row without an end: every column

    def advance(self, token: torch.Tensor) -> None:
        """The mask after a step: a growing cache's gains the token's column; a static one has it."""
        if not self.static:
            self.mask = torch.cat([self.mask, torch.ones_like(token)], dim=1)

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows go on: their cache and mask rows."""
        if self.static:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[rows], layer.values[rows]
                layer.batch_size = len(rows)
        else:
            self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
