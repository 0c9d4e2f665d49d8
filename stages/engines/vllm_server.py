"""Sampling on vLLM: a server from vLLM's own environment, synced with the policy after every update.

vLLM cannot share this project's environment (its pins conflict with Prefect's and transformers'),
so it runs as the peers' "server mode" does: its own process, started here from `ppo.vllm.python`
with vLLM's own OpenAI-compatible entry point, bound to 127.0.0.1 on a free port, spoken to over
HTTP with vLLM's own routes and nothing of ours:

    /health                     the server is up
    /inference/v1/generate      token ids in; token ids and each sampled token's log-prob out
                                (`--enable-scale-out`; no tokenizer on the server's side)
    /collective_rpc             `reload_weights`: the served folder read again (`VLLM_SERVER_DEV_MODE`,
                                which also gives /reset_prefix_cache; loopback only)

Weights reach the server through a folder in shared memory (/dev/shm): the policy written there as
the plain model it stands for (`holding.save_streamed`: LoRA merged, a sharded policy gathered a
tensor at a time), then `reload_weights` and a reset of the prefix cache, whose keys and values the
old weights computed. A policy whose output head is tied to its input embeddings is served untied,
with the head written as a tensor of its own: vLLM's CPU build (0.32.0) reloads the embeddings but
keeps the head it made at start, so tied, the served policy drifts from the trained one after the
first update (measured: log-prob gap 0.86 after a reload, against 5e-7 untied). vLLM's NCCL weight transfer needs vLLM importable in the trainer's process,
which the conflicting pins rule out; the folder is the path on a GPU too.

The first process starts and stops the server; every process sends its own prompts to it. The
server is stopped when the stage ends, fails or is cancelled (`VLLMSampler.close`), and dies with
the process that started it (`PR_SET_PDEATHSIG`) when that one is killed; so does a small janitor
process, which then removes the served folder (at 8B a served copy holds 16-32 GB of RAM).

On a Ray gang (`launch.engine: ray`) the ranks may sit on several machines, and the server is
placed by Ray: an actor on rank 0's node owns it (`stages.engines.vllm_ray`), and every rank's
requests reach it through that actor, so the server still listens on its node's loopback only.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.config_common import VLLM_CPU_HEAD_SIZES, SampledStage, VLLMConfig, vllm_python
from stages.common.errors import StageUserError
from stages.runtime.holding import save_streamed
from stages.runtime.models import left_padded
from stages.common.tensors import truncate_after_eos
from stages.engines.sampler import Generation, HFSampler, Sampler, Sampling

CPU_KV_CACHE_GIB = 1.0
"""KV cache of a CPU server when `vllm.kv_cache_gib` is unset (vLLM's CPU default, 4 GiB, or a share of the host's memory, is more than a rollout of short responses uses)."""
MAX_CONCURRENT_REQUESTS = 64
"""Requests in flight at once: the server batches what arrives together."""


class VLLMServerError(StageUserError):
    """The vLLM server did not start, answer or stay up; the message holds its log's last lines."""


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


def _die_with_parent() -> None:
    """In the server's process before it starts: SIGTERM when the thread that started it dies, so a
    killed trainer leaves no server behind (vLLM then stops its engine processes itself)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class VLLMServer:
    """One `vllm.entrypoints.openai.api_server` process (and its engine processes, in its own
    process group), serving the model in `folder` on 127.0.0.1."""

    process: subprocess.Popen
    url: str
    log: Path

    @classmethod
    def start(cls, folder: Path, settings: VLLMConfig, dtype: torch.dtype, seed: int, max_model_len: int,
              log: Path) -> VLLMServer:
        """Start the server and wait until it answers `/health` (failing with its log's tail if it exits first)."""
        port = _free_port()
        kv_cache_gib = settings.kv_cache_gib or (None if torch.cuda.is_available() else CPU_KV_CACHE_GIB)
        command = [str(vllm_python(settings)), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(folder), "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port),
                   "--skip-tokenizer-init", "--enable-scale-out", "--generation-config", "vllm",
                   "--logprobs-mode", "processed_logprobs",  # log-probs of the temperature-scaled distribution sampled
                   "--dtype", str(dtype).removeprefix("torch."), "--seed", str(seed),
                   "--max-model-len", str(max_model_len),
                   "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
                   "--tensor-parallel-size", str(settings.tensor_parallel_size)]
        if kv_cache_gib is not None:
            command += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
        environment = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if settings.cuda_visible_devices is not None:
            environment["CUDA_VISIBLE_DEVICES"] = settings.cuda_visible_devices
        if not torch.cuda.is_available():
            # vLLM's CPU worker keeps a core for its HTTP front end by default; the trainer and the
            # server take turns (the trainer waits while the server samples), so sampling gets them all.
            environment.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            # vLLM's CPU guide: preload Intel's OpenMP runtime, which its environment ships
            iomp = vllm_python(settings).parent.parent / "lib" / "libiomp5.so"
            if iomp.exists():
                environment["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD")]))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment,
                                       start_new_session=True, preexec_fn=_die_with_parent)
        server = cls(process, f"http://127.0.0.1:{port}", log)
        try:
            server._wait_until_healthy(settings.startup_timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VLLMServerError(f"the vLLM server exited ({self.process.returncode}) while starting:\n"
                                      f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise VLLMServerError(f"the vLLM server did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:]) + f"\n(whole log: {self.log})"

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `grace` seconds."""
        if self.process.poll() is None:
            for sent, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.process.pid, sent)
                    self.process.wait(wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # engine processes outliving the server
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def post(url: str, body: dict, timeout: float | None = 600.0) -> Any:
    """POST `body` as JSON, the answer's JSON back (None when empty); an error answer raises with its text."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            content = answer.read()
    except urllib.error.HTTPError as e:
        raise VLLMServerError(f"vLLM answered {url} with {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
    return json.loads(content) if content else None


@dataclass
class HTTPEndpoint:
    """A server on this machine, as a process reaches it: vLLM's routes on loopback."""

    url: str

    def generate(self, requests: list[dict]) -> list[dict]:
        """Each request's answer (`/inference/v1/generate`), sent together so the server batches them."""
        with ThreadPoolExecutor(min(len(requests), MAX_CONCURRENT_REQUESTS)) as pool:
            return list(pool.map(lambda body: post(f"{self.url}/inference/v1/generate", body), requests))

    def reload(self) -> None:
        """The served folder read again, and the prefix cache the old weights computed dropped."""
        post(f"{self.url}/collective_rpc", {"method": "reload_weights"})
        post(f"{self.url}/reset_prefix_cache", {})


JANITOR = """
import ctypes, os, shutil, signal, sys
folder, parent = sys.argv[1], int(sys.argv[2])
def remove(*_):
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)
signal.signal(signal.SIGTERM, remove)
ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    remove()
while True:
    signal.pause()
"""
"""The janitor's program: wait for SIGTERM (sent when the process that started it dies, however it
dies, or by `LocalServed.stop`), then remove the served folder."""


@dataclass
class LocalServed:
    """A served folder on this machine, the server reading it (once started) and the janitor that
    removes the folder when the process holding this object dies."""

    folder: Path
    janitor: subprocess.Popen
    server: VLLMServer | None = None

    @classmethod
    def prepare(cls) -> LocalServed:
        folder = served_folder()
        janitor = subprocess.Popen([sys.executable, "-c", JANITOR, str(folder), str(os.getpid())],
                                   start_new_session=True, stdin=subprocess.DEVNULL)
        return cls(folder, janitor)

    def start(self, settings: VLLMConfig, dtype: torch.dtype, seed: int, max_model_len: int,
              log: Path) -> HTTPEndpoint:
        """Start the server on the folder (written by now); how to reach it."""
        self.server = VLLMServer.start(self.folder, settings, dtype, seed, max_model_len, log)
        return HTTPEndpoint(self.server.url)

    def stop(self) -> None:
        """Stop the server, remove the folder, end the janitor (idempotent)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.janitor.poll() is None:
            self.janitor.terminate()
            self.janitor.wait(30)


SERVED_PREFIX = "rlhf-vllm-"
"""Served folders are `<shared memory>/rlhf-vllm-*`, each with the file `owner` naming the process that made it."""


def sampler_for(stage: SampledStage, hf: HFSampler, seed: int, log: Path, on_ray: bool) -> Sampler:
    """What a stage samples its policy with (`stage.rollout_engine`): `hf`, the policy itself, or a
    vLLM server started on `hf`'s model's weights, computing in the dtype `hf`'s forward passes do,
    its log in `log`, placed by Ray when the stage runs as a Ray gang (`on_ray`). The caller closes
    it however it ends."""
    return hf if stage.rollout_engine == "hf" else VLLMSampler.start(hf, stage.vllm, seed, log, on_ray)


def served_folder() -> Path:
    """A fresh served folder in shared memory (the temporary folder where there is none), after removing
    those whose owner has died: a killed stage cannot remove its own, and they hold a whole policy."""
    shared = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    for folder in shared.glob(f"{SERVED_PREFIX}*"):
        try:
            owner = int((folder / "owner").read_text())
        except (OSError, ValueError):
            continue  # being made right now, or not ours
        if not Path(f"/proc/{owner}").exists():
            shutil.rmtree(folder, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=SERVED_PREFIX, dir=shared))
    (folder / "owner").write_text(str(os.getpid()))
    return folder


def write_served(policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, folder: Path, dtype: torch.dtype,
                 main: bool) -> None:
    """The policy as the plain model it stands for into `folder`, its output head untied from the
    input embeddings, as its own tensor (collective: every process calls it)."""
    save_streamed(policy, tokenizer, folder, dtype, main, untie=True)


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


@dataclass
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
        return cls(tokenizer, hf.stop_ids, state, folder, dtype, endpoint, served, policy.device)

    def sync(self, policy: torch.nn.Module) -> None:
        """The policy's current weights into the served folder and the server (every process calls it)."""
        main = self.state.is_main_process
        write_served(policy, self.tokenizer, self.folder, self.dtype, main)
        if main:
            self.endpoint.reload()
        self.state.wait_for_everyone()

    def close(self) -> None:
        """Stop the server and remove the served folder (idempotent)."""
        if self.served is not None:
            self.served.stop()
            self.served = None

    def generate(self, prompts: list[str], sampling: Sampling) -> Generation:
        batch = left_padded(self.tokenizer, prompts, torch.device("cpu"))
        queries, query_mask = batch["input_ids"], batch["attention_mask"]  # (B, Tq)
        rows = [row[mask.bool()].tolist() for row, mask in zip(queries, query_mask)]
        # The request seeds come from the caller's random stream: sampling repeats with it, and on resume.
        first_seed = int(torch.randint(0, 2**31 - 1 - len(rows), (1,)))
        requests = [{"token_ids": prompt, "sampling_params": {
            "n": count, "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature or 0.0,
            "top_p": 1.0, "top_k": 0, "seed": first_seed + index, "logprobs": 0,
            "stop_token_ids": self.stop_ids, "ignore_eos": False, "detokenize": False}}
            for index, (prompt, count) in enumerate(groups_of(rows))]
        answers = self.endpoint.generate(requests)
        choices = [choice for answer in answers for choice in sorted(answer["choices"], key=lambda c: c["index"])]
        tokens = [choice["token_ids"] for choice in choices]
        logprobs = [[entry["logprob"] for entry in choice["logprobs"]["content"]] for choice in choices]
        width = max(1, max(len(t) for t in tokens))
        pad = self.tokenizer.pad_token_id
        responses = torch.tensor([t + [pad] * (width - len(t)) for t in tokens])  # (B, T)
        engine_logprobs = torch.tensor([lp + [0.0] * (width - len(lp)) for lp in logprobs])  # (B, T)
        responses = truncate_after_eos(responses, self.stop_ids, pad)
        on = self.device
        return Generation(queries.to(on), query_mask.to(on), responses.to(on),
                          engine_logprobs=engine_logprobs.to(on))
