"""The trainer ranks of one role as Ray actors: placement, rendezvous, DP sharding of a batch, fan-out of calls, one
result back.

Placement: every rank runs in its own bundle of a placement group: the caller's (rank i in bundle i), or the group's
own (PACK: a node is filled before the next; ranks numbered node by node). The torch.distributed rendezvous (rank 0's
TCPStore) is on rank 0's node, never the driver's or the Ray head's (on a multi-node cluster maybe other ones): rank 0
opens it on a port the OS picks and shares that port with the other ranks through Ray's GCS.

Ray is imported lazily so parallel/trainer.py stays importable where Ray is absent (the GPU device machine).
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from molt_hydra.compat.ray import gcs_get, gcs_put
from molt_hydra.parallel.trainer import TrainerWorker
from molt_hydra.parallel.trainer_spec import TrainerSpec


class RankStartFailed(RuntimeError):
    """A rank of a trainer group failed while the group started (its constructor raised, or its process died):
    `role` names it (`actor rank 0`), `error` is Ray's error as it came."""

    def __init__(self, role: str, error: BaseException):
        super().__init__(f"{role}: {error}")
        self.role, self.error = role, error


class _SharedPort:
    """The port of the ranks' rendezvous store, as rank 0 opened it (parallel/launch.py store_port), under a key of
    this group's own in Ray's GCS: the ranks read it from any node, while rank 0 is still in its constructor."""

    def __init__(self):
        self.key = f"molt_hydra/rendezvous/{uuid.uuid4().hex}"

    @property
    def value(self) -> int:
        return int(gcs_get(self.key) or 0)

    @value.setter
    def value(self, port: int) -> None:
        gcs_put(self.key, str(port))


class TrainerGroup:
    """`num_ranks` TrainerWorker actors (one per GPU on GPU hosts, `num_cpus_per_rank` CPUs on CPU).

    placement_group: bundles in rank order; None: the group reserves its own (PACK) and frees it at shutdown.
    borrow_idle_cpus: CPU ranks also train on their node's other cores while the engines don't generate (told through
    `engines_busy`); False keeps each rank to its reserved CPUs, so every step runs on the same thread count.
    startup_timeout_s: how long placement and every rank's start (model build, rendezvous) may take.
    spec: what every rank is built from (parallel/trainer_spec.py); the group fills in each rank's place.
    on_ranks: called with the group once its rank actors are created, before their start is waited for (the run's
    watchers then see a rank stopped by a signal while it builds its model, not only once every rank is up; a start
    past its deadline names the ranks not up, their nodes and the rendezvous).
    After start: `rank_nodes` (each rank's node IP) and `rendezvous` (rank 0's "ip:port")."""

    def __init__(self, num_ranks: int, spec: TrainerSpec, *, num_gpus_per_rank: float = 0,
                 num_cpus_per_rank: float = 1, placement_group=None, startup_timeout_s: float = 600.0,
                 worker_cls: type = TrainerWorker, borrow_idle_cpus: bool = True, on_ranks=None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.num_ranks, self.role = num_ranks, spec.role
        # the tp x cp ranks of one data-parallel group (consecutive in AutoModel's dp x cp x tp mesh) take one shard
        self.replicas = spec.tp_size * spec.cp_size
        self.dp_size = num_ranks // self.replicas
        self.workers, self._own_placement = [], placement_group is None
        bundle = {k: v for k, v in (("CPU", num_cpus_per_rank), ("GPU", num_gpus_per_rank)) if v}
        try:
            if placement_group is None:
                placement_group = self._reserve(bundle, startup_timeout_s)
            self.placement_group = placement_group
            placed = self._bundles_by_node()
            self.rank_nodes = [ip for _, ip in placed]
            where = [PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=b)
                     for b, _ in placed]
            # rank 0 opens the rendezvous store itself, on a port the OS picks, and shares it through the GCS
            # (_SharedPort); before, a port probed free and closed was bound by rank 0 later, and could be taken
            self._shared, addr = _SharedPort(), self.rank_nodes[0]
            # CPU ranks: a second thread ("control") for `engines_busy` hints that arrive while a step runs (GPU
            # ranks keep Ray's plain actor: every call on the thread that set the CUDA device)
            self.on_cpu, self._hints = not num_gpus_per_rank, 0
            self.borrows = self.on_cpu and borrow_idle_cpus
            cls = ray.remote(concurrency_groups={"control": 1})(worker_cls) if self.on_cpu else ray.remote(worker_cls)
            self.workers = [
                cls.options(num_gpus=num_gpus_per_rank, num_cpus=num_cpus_per_rank, scheduling_strategy=where[i])
                .remote(replace(spec, rank=i, world_size=num_ranks, master_addr=addr, shared_port=self._shared,
                                cpu_threads=max(1, int(num_cpus_per_rank)) if self.on_cpu else None,
                                node_ranks=self.rank_nodes.count(self.rank_nodes[i]) if self.borrows else None))
                for i in range(num_ranks)]
            if on_ranks is not None:
                on_ranks(self)
            self._wait_ranks_up(startup_timeout_s)
            if len(set(self.rank_nodes)) > 1:  # a multi-node group says where it runs
                print(f"trainer group {self.role!r}: {num_ranks} ranks on nodes {', '.join(self.rank_nodes)}; "
                      f"rendezvous at rank 0's {self.rendezvous}", flush=True)
        except BaseException:
            self._release()
            raise

    @property
    def rendezvous(self) -> str:
        """Rank 0's "ip:port": its node, and the port its store got (none before rank 0 opened it)."""
        port = self._shared.value
        return f"{self.rank_nodes[0]}:{port}" if port else f"{self.rank_nodes[0]} (rank 0 has opened no store yet)"

    def _reserve(self, bundle: dict, timeout_s: float):
        import ray

        if not bundle:
            raise ValueError(f"trainer group {self.role!r}: a rank needs some CPU or GPU (both are 0)")
        # ranks that fit each node when it is empty: fewer in all can never be placed, so say so now, not after the wait
        fit = sum(min(int(n["Resources"].get(k, 0) / v + 1e-9) for k, v in bundle.items())  # 1e-9: shares like 1/3
                  for n in ray.nodes() if n["Alive"])
        fix = "Fix: lower parallelism.trainer_devices, or give the cluster more nodes / cluster.cpus_per_node / devices"
        if fit < self.num_ranks:
            raise ValueError(f"trainer group {self.role!r}: {self.num_ranks} rank(s) of {bundle} each, but the Ray "
                             f"cluster's nodes hold at most {fit}. {fix}")
        pg = ray.util.placement_group([bundle] * self.num_ranks, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            have, free = ({k: r.get(k, 0) for k in bundle}
                          for r in (ray.cluster_resources(), ray.available_resources()))
            raise TimeoutError(f"trainer group {self.role!r}: Ray could not place {self.num_ranks} rank(s) of {bundle} "
                               f"within {timeout_s:.0f}s; the cluster has {have}, {free} of it free. {fix}") from None
        return pg

    def _bundles_by_node(self) -> list[tuple[int, str]]:
        """(bundle, node IP) of each rank: a given placement group's bundles in their own order; the group's own
        sorted by node (PACK does not promise index order across nodes), so that consecutive ranks share a node."""
        import ray

        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        where = ray.util.placement_group_table(self.placement_group)["bundles_to_node_id"]
        placed = [(b, ips[where[b]]) for b in range(self.num_ranks)]
        if self._own_placement:
            first = {ip: b for b, ip in reversed(placed)}  # each node's lowest bundle
            placed.sort(key=lambda bi: (first[bi[1]], bi[0]))
        return placed

    def _wait_ranks_up(self, timeout_s: float):
        """Every rank built its model and joined the process group; a rank that failed is reported at once (its
        peers would otherwise wait for it until the rendezvous timeout)."""
        import time

        import ray

        pending = {w.__ray_ready__.remote(): i for i, w in enumerate(self.workers)}
        deadline = time.monotonic() + timeout_s
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not done:
                late = sorted(pending.values())
                raise TimeoutError(
                    f"trainer group {self.role!r}: rank(s) {late} (on {[self.rank_nodes[i] for i in late]}) not up "
                    f"after {timeout_s:.0f}s (model build, then the torch.distributed rendezvous at rank 0's "
                    f"{self.rendezvous}). Fix: check that the nodes reach each other on that address and port")
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as e:  # the rank's own error, named by its role and rank
                raise RankStartFailed(f"{self.role} rank {pending[done[0]]}", e) from e
            pending.pop(done[0])

    def _release(self):
        import ray

        for w in self.workers:
            ray.kill(w)
        if self._own_placement and getattr(self, "placement_group", None) is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None

    def shard(self, samples: list) -> list[list]:
        """Each rank's samples: one slice per data-parallel group, the same for its tp x cp ranks (which split each
        sample's work, not the batch; was: a slice per rank, so tensor-parallel peers computed on other samples)."""
        if len(samples) % self.dp_size:
            raise ValueError(f"{len(samples)} samples do not split evenly over {self.dp_size} data-parallel ranks "
                             f"(an uneven split would desynchronise FSDP collectives)")
        n = len(samples) // self.dp_size
        return [samples[r // self.replicas * n:(r // self.replicas + 1) * n] for r in range(self.num_ranks)]

    def per_shard(self, results: list) -> list:
        """Of every rank's results (rank order), those of one rank per data-parallel group: each shard's once."""
        return results[::self.replicas]

    def engines_busy(self, busy: bool) -> list:
        """Tell every CPU rank whether the rollout engines are generating (TrainerWorker.engines_busy): refs to
        await, answered on each rank's control thread even while it trains; none on GPU ranks or ranks that don't
        borrow cores."""
        self._hints += 1
        return [w.engines_busy.options(concurrency_group="control").remote(busy, self._hints)
                for w in self.workers] if self.borrows else []

    def shutdown(self):
        import ray

        ray.get([w.shutdown.remote() for w in self.workers])
        self._release()
