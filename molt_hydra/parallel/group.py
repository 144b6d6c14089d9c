"""The trainer ranks of one role as Ray actors: DP sharding of a batch, fan-out of calls, one result back.

Ray is imported lazily so parallel/trainer.py stays importable where Ray is absent (the GPU device machine).
"""

from __future__ import annotations

from molt_hydra.parallel.trainer import TrainerWorker


def _addr_and_port():
    import ray

    from molt_hydra.parallel.launch import free_port
    return ray.util.get_node_ip_address(), free_port()


class TrainerGroup:
    """`num_ranks` TrainerWorker actors (one per GPU on GPU hosts, `num_cpus_per_rank` CPUs on CPU).

    placement_group: bundles in rank order (node-sorted); None places actors wherever Ray likes.
    worker_kwargs: TrainerWorker keyword arguments (model_path, role, lr, ...)."""

    def __init__(self, num_ranks: int, *, num_gpus_per_rank: float = 0, num_cpus_per_rank: float = 1,
                 placement_group=None, worker_cls: type = TrainerWorker, **worker_kwargs):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def strategy(i):
            if placement_group is None:
                return None
            return PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=i)

        addr, port = ray.get(ray.remote(num_cpus=0)(_addr_and_port).options(scheduling_strategy=strategy(0)).remote())
        cls = ray.remote(worker_cls)
        self.num_ranks = num_ranks
        self.workers = [
            cls.options(num_gpus=num_gpus_per_rank, num_cpus=num_cpus_per_rank, scheduling_strategy=strategy(i))
            .remote(rank=i, world_size=num_ranks, master_addr=addr, master_port=port, **worker_kwargs)
            for i in range(num_ranks)]
        ray.get([w.__ray_ready__.remote() for w in self.workers])

    def shard(self, samples: list) -> list[list]:
        if len(samples) % self.num_ranks:
            raise ValueError(f"{len(samples)} samples do not split evenly over {self.num_ranks} data-parallel ranks "
                             f"(an uneven split would desynchronise FSDP collectives)")
        n = len(samples) // self.num_ranks
        return [samples[i * n:(i + 1) * n] for i in range(self.num_ranks)]

    def _all(self, method: str, per_rank_args=None, **kw):
        import ray
        args = per_rank_args or [()] * self.num_ranks
        return ray.get([getattr(w, method).remote(*a, **kw) for w, a in zip(self.workers, args)])

    def train_step(self, samples: list[dict], loss_fn=None, num_optimizer_steps: int = 1) -> dict:
        kw = dict(num_optimizer_steps=num_optimizer_steps)
        if loss_fn is not None:
            kw["loss_fn"] = loss_fn
        return self._all("train_step", [(s,) for s in self.shard(samples)], **kw)[0]

    def compute_logprobs(self, samples: list[dict], with_entropy: bool = False) -> list:
        outs = self._all("compute_logprobs", [(s,) for s in self.shard(samples)], with_entropy=with_entropy)
        return [x for o in outs for x in o]

    def save_checkpoint(self, root: str, client_state: dict | None = None, keep: int = 3) -> str:
        return self._all("save_checkpoint", root=root, client_state=client_state, keep=keep)[0]

    def load_checkpoint(self, root: str) -> dict | None:
        return self._all("load_checkpoint", root=root)[0]

    def export_hf(self, out_dir: str, dtype: str = "bf16") -> str:
        return self._all("export_hf", out_dir=out_dir, dtype=dtype)[0]

    def shutdown(self):
        import ray
        self._all("shutdown")
        for w in self.workers:
            ray.kill(w)
