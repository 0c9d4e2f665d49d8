"""A vLLM server as a process on this machine: started from vLLM's own environment on a Unix socket,
spoken to over HTTP with vLLM's own routes, and the shared-memory folder it serves, which a janitor
process removes when the process holding it dies (`LocalServed`). `stages.engines.vllm_server`
says how the policy's sampler uses it; `stages.engines.vllm_ray` places it with Ray."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlhf.sections.base import VLLMConfig, vllm_python
from stages.common.errors import StageUserError
from stages.common.processes import die_with_parent

CPU_KV_CACHE_GIB = 1.0
"""KV cache of a CPU server when `vllm.kv_cache_gib` is unset (vLLM's CPU default, 4 GiB, or a share
of the host's memory, is more than a rollout of short responses uses)."""
MAX_CONCURRENT_REQUESTS = 64
"""Requests in flight at once: the server batches what arrives together."""


class VLLMServerError(StageUserError):
    """The vLLM server did not start, answer or stay up; the message holds its log's last lines."""


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the server's `--uds`)."""

    def __init__(self, path: str, timeout: float | None):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def request(socket_path: str, method: str, route: str, body: dict | None = None,
            timeout: float | None = 600.0) -> tuple[int, bytes]:
    """(status, body) of one request to the server listening on `socket_path`."""
    connection = _UnixConnection(socket_path, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, route, body=data, headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


@dataclass
class VLLMServer:
    """One `vllm.entrypoints.openai.api_server` process (and its engine processes, in its own
    process group), serving the model in `folder` on a Unix socket in that folder (0700), so that
    its routes, the development ones (`/collective_rpc`) included, are this user's alone: no TCP
    port, which any local user could reach."""

    process: subprocess.Popen
    socket: str
    """The Unix socket the server listens on."""
    log: Path

    @classmethod
    def start(cls, folder: Path, settings: VLLMConfig, dtype: torch.dtype, seed: int, max_model_len: int,
              log: Path) -> VLLMServer:
        """Start the server and wait until it answers `/health` (failing with its log's tail if it exits first)."""
        listening = str(folder / "server.sock")
        kv_cache_gib = settings.kv_cache_gib or (None if torch.cuda.is_available() else CPU_KV_CACHE_GIB)
        command = [str(vllm_python(settings)), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(folder), "--served-model-name", "policy", "--uds", listening,
                   "--skip-tokenizer-init", "--enable-scale-out", "--generation-config", "vllm",
                   "--logprobs-mode", "processed_logprobs",  # log-probs of the temperature-scaled distribution sampled
                   "--dtype", str(dtype).removeprefix("torch."), "--seed", str(seed),
                   "--max-model-len", str(max_model_len),
                   "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
                   "--tensor-parallel-size", str(settings.tensor_parallel_size)]
        if not torch.cuda.is_available():
            # vLLM 0.32's CPU runner fails a seeded request whose prompt was split over two steps
            # ("CPU Generator does not use offset"): multi-turn contexts exceed one step's token budget.
            command += ["--no-enable-chunked-prefill"]
        if kv_cache_gib is not None:
            command += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
        environment = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if settings.devices is not None and torch.cuda.is_available():
            environment["CUDA_VISIBLE_DEVICES"] = settings.devices
        if not torch.cuda.is_available():
            # vLLM's CPU worker keeps a core for its HTTP front end by default; the trainer and the
            # server take turns (the trainer waits while the server samples), so sampling gets them all.
            environment.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            if settings.devices is not None:
                environment["VLLM_CPU_OMP_THREADS_BIND"] = settings.devices
            # vLLM's CPU guide: preload Intel's OpenMP runtime, which its environment ships
            iomp = vllm_python(settings).parent.parent / "lib" / "libiomp5.so"
            if iomp.exists():
                environment["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD")]))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment,
                                       start_new_session=True, preexec_fn=partial(die_with_parent, signal.SIGTERM))
        server = cls(process, listening, log)
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
                if request(self.socket, "GET", "/health", timeout=5)[0] == 200:
                    return
            except (OSError, http.client.HTTPException):  # not listening yet
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


def post(socket_path: str, route: str, body: dict, timeout: float | None = 600.0) -> Any:
    """POST `body` as JSON to `route`, the answer's JSON back (None when empty); an error answer raises
    with its text."""
    status, content = request(socket_path, "POST", route, body, timeout)
    if status >= 400:
        raise VLLMServerError(f"vLLM answered {route} with {status}: {content.decode(errors='replace')[:2000]}")
    return json.loads(content) if content else None


@dataclass
class HTTPEndpoint:
    """A server on this machine, as a process reaches it: vLLM's routes on its Unix socket."""

    socket: str

    def generate(self, requests: list[dict]) -> list[dict]:
        """Each request's answer (`/inference/v1/generate`), sent together so the server batches them."""
        with ThreadPoolExecutor(min(len(requests), MAX_CONCURRENT_REQUESTS)) as pool:
            return list(pool.map(lambda body: post(self.socket, "/inference/v1/generate", body), requests))

    def reload(self) -> None:
        """The served folder read again, and the prefix cache the old weights computed dropped."""
        post(self.socket, "/collective_rpc", {"method": "reload_weights"})
        post(self.socket, "/reset_prefix_cache", {})


JANITOR = """
import glob, os, select, shutil, signal, sys, time
folder, owner = sys.argv[1], int(sys.argv[2])
if os.fork():
    os._exit(0)  # the parent returns at once: this process is no longer in its owner's process tree
os.setsid()
shared = set()  # shared-memory files the server's processes have mapped (vLLM's message queues, semaphores)
def server_group():
    try:
        return int(open(os.path.join(folder, "server")).read())
    except (OSError, ValueError):
        return None  # no server started on the folder (yet)
def note_shared(group):
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            if int(open(stat).read().rsplit(")", 1)[1].split()[2]) != group:  # the process group field
                continue
            for line in open(stat[:-4] + "maps"):
                path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
                if path.startswith("/dev/shm/") and "rlhf-vllm-" not in path:
                    shared.add(path.removesuffix(" (deleted)"))
        except (OSError, ValueError, IndexError):
            pass
def alive(group):
    try:
        os.killpg(group, 0)
        return True
    except OSError:
        return False
def remove(*_):
    group = server_group()
    if group is not None:  # end the server's process group, engine processes included: politely, then not
        note_shared(group)
        for sent, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(group, sent)
            except OSError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and alive(group):
                time.sleep(0.2)
    for path in shared:  # what a killed engine could not unlink itself
        try:
            os.unlink(path)
        except OSError:
            pass
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)
signal.signal(signal.SIGTERM, remove)
print(os.getpid(), flush=True)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
try:
    owner_exited = os.pidfd_open(owner)
    wait = lambda: bool(select.select([owner_exited], [], [], 2.0)[0])  # readable once the owner has exited
except ProcessLookupError:
    wait = lambda: True
except OSError:  # no pidfd (Linux before 5.3): look every second
    wait = lambda: time.sleep(1) or not os.path.exists(f"/proc/{owner}")
while not wait():
    group = server_group()
    if group is not None:
        note_shared(group)  # noted while the server runs: once killed, no process shows what it had mapped
remove()
"""
"""The janitor's program: when its owner exits, however it exits (or on SIGTERM from
`LocalServed.stop`), end the server's process group (the file `server` in the folder names it),
unlink the shared-memory files its processes had mapped (a killed vLLM engine leaves its message
queues, 170 and 250 MB each, in /dev/shm), and remove the served folder. It leaves its owner's
process tree, because whatever kills the owner may kill its children with it: Ray SIGKILLs an
actor's child processes when it ends the actor, which leaves vLLM's engine processes, the
server's grandchildren, running without it."""


@dataclass
class LocalServed:
    """A served folder on this machine, the server reading it (once started) and the janitor that
    removes the folder when the process holding this object dies."""

    folder: Path
    janitor: int
    """The janitor's process id."""
    server: VLLMServer | None = None

    @classmethod
    def prepare(cls) -> LocalServed:
        folder = served_folder()
        with subprocess.Popen([sys.executable, "-c", JANITOR, str(folder), str(os.getpid())], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE) as started:
            janitor = int(started.stdout.readline())  # the detached process's id, once it is set up
        return cls(folder, janitor)

    def start(self, settings: VLLMConfig, dtype: torch.dtype, seed: int, max_model_len: int,
              log: Path) -> HTTPEndpoint:
        """Start the server on the folder (written by now); how to reach it."""
        self.server = VLLMServer.start(self.folder, settings, dtype, seed, max_model_len, log)
        (self.folder / "server").write_text(str(self.server.process.pid))  # its process group, for the janitor
        return HTTPEndpoint(self.server.socket)

    def stop(self) -> None:
        """Stop the server, remove the folder, end the janitor (idempotent)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            os.kill(self.janitor, signal.SIGTERM)
        except ProcessLookupError:
            pass


SERVED_PREFIX = "rlhf-vllm-"
"""Served folders are `<shared memory>/rlhf-vllm-*`, each with the file `owner` naming the process that made it."""


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
