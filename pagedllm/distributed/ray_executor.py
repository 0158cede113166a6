"""Tensor-parallel ranks as Ray actors (``--distributed-executor-backend ray``).

Ray places the ranks; pagedllm adds no cluster layer of its own. The engine joins the Ray
cluster at ``--ray-address`` (default ``$RAY_ADDRESS``, else the cluster ``ray start
--head`` runs on this machine, else a new local one), reserves one bundle per rank in a
placement group (one GPU each on CUDA, one CPU each on the CPU; packed onto as few nodes
as fit), and starts one actor per bundle. Each actor connects back to the engine over
TCP (``multiprocessing.connection``, authenticated with a random key) and serves the
same messages as a local worker process (``worker.py``); the ranks rendezvous for
``torch.distributed`` at rank 0's node. Every node must have the same pagedllm, torch and
model files (the same path), as Ray runs the actors with each node's own Python. The
engine's ``PAGEDLLM_*`` environment variables (kernel and graph switches) travel to every
actor in its runtime environment, so each rank runs what the engine was started with.
"""

from __future__ import annotations

import logging
import os
import secrets
from multiprocessing.connection import Client, Connection, Listener

from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

# Seconds to wait for the placement group (the cluster's free GPUs or CPUs).
PLACEMENT_TIMEOUT_S = 120.0
# Seconds to wait for every actor to connect back.
CONNECT_TIMEOUT_S = 300.0


class RayWorker:
    """The actor: a rank's worker loop, connected back to the engine."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def getenv(self, name: str) -> str | None:
        """The value of ``name`` in this rank's process (what its kernels read)."""
        return os.environ.get(name)

    def free_port(self) -> int:
        from pagedllm.distributed.executor import free_port

        return free_port("0.0.0.0")

    def run(self, address: tuple[str, int], authkey: bytes, rank: int, world_size: int,
            init_method: str, config: EngineConfig) -> None:
        from pagedllm.distributed.worker import run_worker

        conn = Client(address, authkey=authkey)
        conn.send(rank)
        # Ray shows this actor the GPU of its bundle alone.
        run_worker(conn, rank, world_size, init_method, config,
                   0 if config.device == "cuda" else None)


def rank_actor_options(resource: str) -> dict:
    """A rank actor's Ray options beside its placement: one GPU (or one CPU), and this
    process's ``PAGEDLLM_*`` variables in its runtime environment."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PAGEDLLM_")}
    return dict(num_cpus=0 if resource == "GPU" else 1, num_gpus=1 if resource == "GPU" else 0,
                runtime_env={"env_vars": env})


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install "
                         "'pagedllm[ray]' on every node, then start the cluster (ray start "
                         "--head on one node, ray start --address HEAD:6379 on the others)."
                         ) from None
    return ray


class RayWorkers:
    """One Ray actor per rank, in a placement group; connections ordered by rank."""

    def __init__(self, config: EngineConfig) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_placement_group = remove_placement_group
        parallel = config.parallel_config
        size = parallel.world_size
        address = parallel.ray_address or os.environ.get("RAY_ADDRESS")
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=True)
            except ConnectionError as exc:
                raise ValueError(f"No Ray cluster answers at {address}: {exc}. Start one with "
                                 "ray start --head (and ray start --address HEAD:6379 on the "
                                 "other nodes), or give its address with --ray-address."
                                 ) from None
        resource = "GPU" if config.device == "cuda" else "CPU"
        have = ray.cluster_resources().get(resource, 0)
        if have < size:
            raise ValueError(f"{size} ranks (--tensor-parallel-size x --pipeline-parallel-size) "
                             f"need {size} {resource}s in the Ray cluster, which has {have:g}: "
                             "add nodes (ray start --address ...) or lower the sizes.")
        self._group = placement_group([{resource: 1}] * size, strategy="PACK")
        self.actors = []
        self.connections: list[Connection] = []
        self.sentinels: list = []
        try:
            ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(f"The Ray cluster could not place {size} ranks of one "
                                 f"{resource} each within {PLACEMENT_TIMEOUT_S:.0f} s: other "
                                 "work holds them.")
            actor_class = ray.remote(RayWorker)
            for rank in range(size):
                self.actors.append(actor_class.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._group, placement_group_bundle_index=rank),
                    **rank_actor_options(resource),
                ).remote())
            head_ip, port = ray.get([self.actors[0].node_ip.remote(),
                                     self.actors[0].free_port.remote()])
            init_method = f"tcp://{head_ip}:{port}"
            authkey = secrets.token_bytes(32)
            engine_ip = ray.util.get_node_ip_address()
            with Listener((engine_ip, 0), authkey=authkey) as listener:
                self._runs = [actor.run.remote(listener.address, authkey, rank, size,
                                               init_method, config)
                              for rank, actor in enumerate(self.actors)]
                by_rank: dict[int, Connection] = {}
                # An actor that fails before it connects must not block the start forever.
                listener._listener._socket.settimeout(CONNECT_TIMEOUT_S)
                while len(by_rank) < size:
                    conn = listener.accept()
                    by_rank[conn.recv()] = conn
            self.connections = [by_rank[rank] for rank in range(size)]
        except BaseException:
            self.stop(0.0)
            raise
        logger.info("Ray placed %d tensor-parallel ranks (rendezvous %s).", size, init_method)

    def describe_exit(self, rank: int) -> str:
        try:
            self._ray.get(self._runs[rank], timeout=1.0)
        except Exception as exc:  # noqa: BLE001 - the actor's fate, whatever it was
            return f"the Ray actor ended: {type(exc).__name__}"
        return "the Ray actor returned"

    def stop(self, grace_s: float) -> None:
        runs = getattr(self, "_runs", [])
        if runs and grace_s:
            self._ray.wait(runs, num_returns=len(runs), timeout=grace_s)
        for actor in self.actors:
            self._ray.kill(actor)
        self._remove_placement_group(self._group)
