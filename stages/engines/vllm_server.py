"""Sampling on vLLM: a server from vLLM's own environment, synced with the policy after every update.

vLLM cannot share this project's environment (its pins conflict with Prefect's and transformers'),
so it runs as the peers' "server mode" does: its own process, started here from `ppo.vllm.python`
with vLLM's own OpenAI-compatible entry point, listening on a Unix socket in its served folder (a
folder only this user may enter, so no other local user reaches its routes), spoken to over HTTP
with vLLM's own routes and nothing of ours:

    /health                     the server is up
    /inference/v1/generate      token ids in; token ids and each sampled token's log-prob out
                                (`--enable-scale-out`; no tokenizer on the server's side)
    /collective_rpc             `reload_weights`: the served folder read again (`VLLM_SERVER_DEV_MODE`,
                                which also gives /reset_prefix_cache; this user's socket only)

Weights reach the server through a folder in shared memory (/dev/shm): the policy written there as
the plain model it stands for (`holding.save_streamed`: LoRA merged, a sharded policy gathered a
tensor at a time), then `reload_weights` and a reset of the prefix cache, whose keys and values the
old weights computed. A policy whose output head is tied to its input embeddings is served untied,
with the head written as a tensor of its own: vLLM's CPU build (0.32.0) reloads the embeddings but
keeps the head it made at start, so tied, the served policy drifts from the trained one after the
first update (measured: log-prob gap 0.86 after a reload, against 5e-7 untied). vLLM's NCCL
weight transfer needs vLLM importable in the trainer's process, which the conflicting pins rule
out; the folder is the path on a GPU too.

A reload never meets a request in flight: `sync` closes a gate (`Gate`) that every request passes,
waits until this process's requests in flight are answered and the other processes have done the
same, and reopens it after the reload; so every response is drawn by one version, whichever thread
sent it (episodes continued across an update by `rollout.partial` wait there, turn by turn).

The first process starts and stops the server; every process sends its own prompts to it. The
server is stopped when the stage ends, fails or is cancelled (`VLLMSampler.close`), and dies with
the process that started it (`PR_SET_PDEATHSIG`) when that one is killed; so does a small janitor
process, which then removes the served folder (at 8B a served copy holds 16-32 GB of RAM).

On a Ray gang (`launch.engine: ray`) the ranks may sit on several machines, and the server is
placed by Ray: an actor on rank 0's node owns it (`stages.engines.vllm_ray`), and every rank's
requests reach it through that actor, so the server still listens on its node's socket only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.sections.base import VLLM_CPU_HEAD_SIZES, SampledStage, VLLMConfig
from stages.common.errors import StageUserError
from stages.common.tensors import truncate_after_eos
from stages.engines.sampler import Generation, HFSampler, Sampler, Sampling
from stages.engines.vllm_process import LocalServed
from stages.runtime.holding import SaveFormat, save_streamed
from stages.runtime.models import left_padded, left_padded_ids


def head_size(model: PreTrainedModel) -> int:
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_servable(model: PreTrainedModel, on_gpu: bool) -> None:
    """Refuse, before a server is started, a model whose attention heads vLLM's CPU build cannot serve."""
    size = head_size(model)
    if not on_gpu and size not in VLLM_CPU_HEAD_SIZES:
        raise StageUserError(f"rollout_engine 'vllm': the policy's attention heads are {size} wide, which vLLM's "
                             f"CPU build does not serve (it serves {list(VLLM_CPU_HEAD_SIZES)}); sample with "
                             "rollout_engine: hf, or run on a GPU")


def sampler_for(stage: SampledStage, hf: HFSampler, seed: int, log: Path, on_ray: bool) -> Sampler:
    """What a stage samples its policy with (`stage.rollout_engine`): `hf`, the policy itself, or a
    vLLM server started on `hf`'s model's weights, computing in the dtype `hf`'s forward passes do,
    its log in `log`, placed by Ray when the stage runs as a Ray gang (`on_ray`). The caller closes
    it however it ends."""
    return hf if stage.rollout_engine == "hf" else VLLMSampler.start(hf, stage.vllm, seed, log, on_ray)


def write_served(policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, folder: Path, dtype: torch.dtype,
                 main: bool) -> None:
    """The policy as the plain model it stands for into `folder`, its output head untied from the
    input embeddings, as its own tensor (collective: every process calls it)."""
    save_streamed(policy, tokenizer, folder, SaveFormat(dtype, untie=True), main)


def groups_of(rows: list[list[int]]) -> list[tuple[list[int], int]]:
    """Runs of equal consecutive prompts as (prompt, count): a group estimator's samples of one prompt
    are one request for `n` samples."""
    groups: list[tuple[list[int], int]] = []
    for row in rows:
        if groups and groups[-1][0] == row:
            groups[-1] = (row, groups[-1][1] + 1)
        else:
            groups.append((row, 1))
    return groups


@dataclass(frozen=True)
class Requests:
    """Prompts as the server takes them, ready to send."""

    queries: torch.Tensor  # (B, Tq) left-padded prompt ids
    query_mask: torch.Tensor  # (B, Tq)
    bodies: list[dict]
    """One `/inference/v1/generate` body per run of equal prompts (`groups_of`)."""


class Gate:
    """What requests pass while the server's weights hold still: any number at once, from any thread;
    `closed` waits until none is in flight and holds new ones back until it ends."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._in_flight, self._closed = 0, False

    @contextmanager
    def request(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._closed)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    @contextmanager
    def closed(self) -> Iterator[None]:
        with self._changed:
            self._closed = True
            self._changed.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            with self._changed:
                self._closed = False
                self._changed.notify_all()


@dataclass(kw_only=True)
class VLLMSampler:
    """Samples from a vLLM server that holds the policy's weights as of the last `sync`.

    Gives token ids and vLLM's log-probs of them (`Generation.engine_logprobs`), not the trainer's:
    the rollout recomputes those itself, so the engine's mismatch is measured, never trained on unseen."""

    tokenizer: PreTrainedTokenizerBase
    stop_ids: list[int]
    state: PartialState
    """The processes of the stage (one, or those of its launch)."""
    folder: Path
    """The served folder, in shared memory on the server's machine: the policy as of the last `sync`."""
    dtype: torch.dtype
    """Dtype of the served weights."""
    endpoint: Any
    """How this process reaches the server: `HTTPEndpoint`, or `vllm_ray.RayEndpoint` on a Ray gang."""
    served: Any
    """On the first process, what `close` stops (`LocalServed`, or `vllm_ray.RayServed`); None on the others."""
    device: torch.device
    version: int = 0
    gate: Gate = field(default_factory=Gate)
    """Requests pass it; a sync closes it while the server reloads."""
    concurrent = True

    @classmethod
    def start(cls, hf: HFSampler, settings: VLLMConfig, seed: int, log: Path, on_ray: bool = False) -> VLLMSampler:
        """Write `hf`'s model into a fresh shared-memory folder and start a server on it (first process;
        on a Ray gang, through an actor on its node), computing in the dtype `hf`'s forward passes do;
        every process learns how to reach the server (collective)."""
        policy, tokenizer, state = hf.model, hf.tokenizer, PartialState()
        dtype = hf.precision.autocast_dtype or torch.float32
        check_servable(policy, torch.cuda.is_available())
        main = state.is_main_process
        served = None
        if main:
            if on_ray:
                from stages.engines.vllm_ray import RayServed

                served = RayServed.prepare(settings)
            else:
                served = LocalServed.prepare()
        folder = Path(broadcast_object_list([str(served.folder) if main else ""])[0])
        write_served(policy, tokenizer, folder, dtype, main)
        endpoint = None
        if main:
            max_model_len = settings.max_model_len or policy.config.max_position_embeddings
            try:
                endpoint = served.start(settings, dtype, seed, max_model_len, log)
            except BaseException:
                served.stop()
                raise
        endpoint = broadcast_object_list([endpoint])[0]
        return cls(tokenizer=tokenizer, stop_ids=hf.stop_ids, state=state, folder=folder, dtype=dtype,
                   endpoint=endpoint, served=served, device=policy.device)

    def sync(self, policy: torch.nn.Module, version: int) -> None:
        """The policy's current weights into the served folder and the server, once no process has a
        request in flight; requests sent meanwhile wait for the reload (every process calls it)."""
        main = self.state.is_main_process
        with self.gate.closed():
            self.state.wait_for_everyone()  # every process's requests in flight answered
            write_served(policy, self.tokenizer, self.folder, self.dtype, main)
            if main:
                self.endpoint.reload()
            self.state.wait_for_everyone()
            self.version = version

    def close(self) -> None:
        """Stop the server and remove the served folder (idempotent)."""
        if self.served is not None:
            self.served.stop()
            self.served = None

    def most(self, value: int) -> int:
        return value  # each process's requests are its own: the server batches them

    def generate(self, prompts: list[str], sampling: Sampling) -> Generation:
        return self.answer([self.requests(prompts, sampling)])[0]

    def generate_ids(self, prompts: list[list[int]], sampling: Sampling) -> Generation:
        batch = left_padded_ids(prompts, self.tokenizer.pad_token_id, torch.device("cpu"))
        return self.answer([self._requests_of(batch, sampling)])[0]

    def requests(self, prompts: list[str], sampling: Sampling) -> Requests:
        """The server's requests for `prompts`: tokenised here, their seeds drawn from this thread's
        random stream (so sampling repeats with it, on resume too, whichever thread later sends them)."""
        return self._requests_of(left_padded(self.tokenizer, prompts, torch.device("cpu")), sampling)

    def _requests_of(self, batch: dict[str, torch.Tensor], sampling: Sampling) -> Requests:
        """The requests for a left-padded batch of prompt ids: the server takes token ids, never text."""
        queries, query_mask = batch["input_ids"], batch["attention_mask"]  # (B, Tq)
        rows = [row[mask.bool()].tolist() for row, mask in zip(queries, query_mask, strict=True)]
        if sampling.seeds is None:  # drawn here; a group of equal prompts is one request for n samples
            first_seed = int(torch.randint(0, 2**31 - 1 - len(rows), (1,)))
            groups = [(prompt, count, first_seed + index) for index, (prompt, count) in enumerate(groups_of(rows))]
        else:  # one request per prompt, with its own seed
            groups = [(prompt, 1, seed) for prompt, seed in zip(rows, sampling.seeds, strict=True)]
        bodies = [{"token_ids": prompt, "sampling_params": {
            "n": count, "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature or 0.0,
            "top_p": 1.0, "top_k": 0, "seed": seed, "logprobs": 0,
            "stop_token_ids": self.stop_ids, "ignore_eos": False, "detokenize": False}}
            for prompt, count, seed in groups]
        return Requests(queries, query_mask, bodies)

    def answer(self, batches: list[Requests]) -> list[Generation]:
        """Each batch's responses: every request sent at once (the server batches them), from any thread,
        by the version the server holds while they are answered."""
        with self.gate.request():
            version = self.version
            answers = self.endpoint.generate([body for batch in batches for body in batch.bodies])
        generations, start = [], 0
        for batch in batches:
            mine, start = answers[start:start + len(batch.bodies)], start + len(batch.bodies)
            generations.append(self._generation(batch, mine, version))
        return generations

    def _generation(self, batch: Requests, answers: list[dict], version: int) -> Generation:
        choices = [choice for answer in answers for choice in sorted(answer["choices"], key=lambda c: c["index"])]
        tokens = [choice["token_ids"] for choice in choices]
        logprobs = [[entry["logprob"] for entry in choice["logprobs"]["content"]] for choice in choices]
        width = max(1, max(len(t) for t in tokens))
        pad = self.tokenizer.pad_token_id
        responses = torch.tensor([t + [pad] * (width - len(t)) for t in tokens])  # (B, T)
        engine_logprobs = torch.tensor([lp + [0.0] * (width - len(lp)) for lp in logprobs])  # (B, T)
        responses = truncate_after_eos(responses, self.stop_ids, pad)
        on = self.device
        return Generation(queries=batch.queries.to(on), query_mask=batch.query_mask.to(on), responses=responses.to(on),
                          engine_logprobs=engine_logprobs.to(on), version=version)
