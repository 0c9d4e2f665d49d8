"""The vLLM server of a stage that runs as a Ray gang (`launch.engine: ray`, `rollout_engine: vllm`).

    rank 0 (any node)            ServerActor (rank 0's node)             vLLM server (vLLM's own Python)
    RayServed.prepare  --------> served folder in /dev/shm + janitor
    (every rank writes)          the folder, as on one machine
    RayServed.start    --------> LocalServed.start  -------------------> <served folder>/server.sock
    RayEndpoint (every rank) --> generate / reload: HTTP on the socket -> /inference/v1/generate, /collective_rpc

The actor is a Python of this project's environment; the server it starts is the vLLM
environment's Python, exactly as on one machine (`LocalServed`). The actor does not run in the
vLLM environment itself: a Ray actor's interpreter must hold the cluster's Ray version, and the
vLLM environment holds vLLM's lock, not ours. What Ray adds is where the server runs and how long:
- placed on rank 0's node (hard node affinity), so rank 0 writes the served folder into the
  shared memory the server reads, and reserving the GPUs it serves on (`tensor_parallel_size`;
  none on a CPU cluster, where the trainer and the server take turns on the same cores);
- owned by rank 0's process: when that process ends, however it ends (the stage done, a failure,
  a rank lost and the gang torn down, the driver cancelled), Ray ends the actor, its server gets
  SIGTERM (`PR_SET_PDEATHSIG`) and its janitor removes the served folder;
- every rank's requests go through the actor, so the server, with its development routes
  (`/collective_rpc`), listens on its node's loopback only.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf.sections.base import VLLMConfig, vllm_python
from stages.engines.vllm_process import LocalServed, VLLMServerError

ACTOR_CONCURRENCY = 16
"""Calls the actor serves at once: every rank's batch reaches the server together, which batches them."""
PLACEMENT_TIMEOUT = 120.0
"""Seconds to wait for the actor to start on rank 0's node (and make the served folder)."""
REQUEST_TIMEOUT = 1800.0
"""Seconds one rank's batch of requests may take through the actor."""


class ServerActor:
    """A vLLM server and its served folder on one node, owned by rank 0 (`ray.remote(ServerActor)`)."""

    def __init__(self, python: str):
        import ray

        self.where = f"node {ray.get_runtime_context().get_node_id()[:12]} ({ray.util.get_node_ip_address()})"
        self.missing = None if Path(python).exists() else python
        self.served = None if self.missing else LocalServed.prepare()
        self.endpoint = None

    def folder(self) -> str:
        if self.missing:
            raise VLLMServerError(f"no vLLM environment at {self.missing} on {self.where}, rank 0's node: every node "
                                  "that may hold rank 0 needs it (`make vllm-env` there, or vllm.python)")
        return str(self.served.folder)

    def start(self, settings: VLLMConfig, dtype: torch.dtype, seed: int, max_model_len: int, log: str) -> None:
        self.endpoint = self.served.start(settings, dtype, seed, max_model_len, Path(log))

    def generate(self, requests: list[dict]) -> list[dict]:
        return self.endpoint.generate(requests)

    def reload(self) -> None:
        self.endpoint.reload()

    def stop(self) -> None:
        if self.served is not None:
            self.served.stop()


def _get(ref, waited_for: str, timeout: float):
    """`ray.get(ref)`, its failure as a `VLLMServerError` that names what was waited for."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        raise VLLMServerError(f"{waited_for}: no answer within {timeout:.0f} s") from None
    except RayTaskError as e:
        raise VLLMServerError(f"{waited_for}: {e.cause}") from None
    except RayActorError as e:
        raise VLLMServerError(f"{waited_for}: the vLLM server's actor died ({str(e).strip()[-500:]})") from None


@dataclass
class RayEndpoint:
    """How a rank reaches the server: its actor, by name (picklable, so rank 0 can broadcast it)."""

    name: str
    _actor: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {"name": self.name, "_actor": None}

    def actor(self):
        import ray

        if self._actor is None:
            self._actor = ray.get_actor(self.name)
        return self._actor

    def generate(self, requests: list[dict]) -> list[dict]:
        return _get(self.actor().generate.remote(requests), "sampling on the vLLM server", REQUEST_TIMEOUT)

    def reload(self) -> None:
        _get(self.actor().reload.remote(), "reloading the vLLM server's weights", REQUEST_TIMEOUT)


@dataclass
class RayServed:
    """Rank 0's hold on the server's actor: `VLLMSampler.start` prepares it, starts it, stops it."""

    actor: Any
    name: str
    folder: Path
    """The served folder, on rank 0's node (the actor's)."""

    @classmethod
    def prepare(cls, settings: VLLMConfig) -> RayServed:
        """The server's actor on this node, holding a fresh served folder (the vLLM environment checked there)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        gpus = settings.tensor_parallel_size if torch.cuda.is_available() else 0
        name = f"rlhf-vllm-{uuid.uuid4().hex[:12]}"
        actor = ray.remote(ServerActor).options(
            name=name, num_cpus=0, num_gpus=gpus, max_concurrency=ACTOR_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(str(vllm_python(settings)))
        served = cls(actor, name, Path())
        try:
            folder = _get(actor.folder.remote(), f"the vLLM server's actor on rank 0's node {node[:12]} "
                          f"({gpus} GPU)", PLACEMENT_TIMEOUT)
        except BaseException:
            served.stop()
            raise
        return cls(actor, name, Path(folder))

    def start(self, settings: VLLMConfig, dtype: torch.dtype, seed: int, max_model_len: int,
              log: Path) -> RayEndpoint:
        """Start the server on the folder (written by now); how every rank reaches it."""
        # Ray hands the actor its GPUs (CUDA_VISIBLE_DEVICES): a choice of devices in the settings would fight it.
        settings = settings.model_copy(update={"devices": None})
        _get(self.actor.start.remote(settings, dtype, seed, max_model_len, str(log)), "starting the vLLM server",
             settings.startup_timeout + 60)
        return RayEndpoint(self.name)

    def stop(self) -> None:
        """Stop the server, remove its folder, end the actor (idempotent)."""
        import ray

        try:
            _get(self.actor.stop.remote(), "stopping the vLLM server", 120)
        except VLLMServerError:
            pass  # the actor is gone or stuck: killing it below ends its server and janitor as well
        ray.kill(self.actor)
