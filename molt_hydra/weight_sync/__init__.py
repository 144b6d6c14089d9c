"""The trainer -> engine weight protocol, versioned: what the runtime calls.

- `resolve_transport(...)`: `rollout.weight_sync.transport`, auto resolved from placement (the runtime passes the
  placement: runtime/roles.py `weight_transport`); `setup_weight_sync(transport, actor, engines, ...)`, once: opens
  what that transport needs.
- `push_from_rank(worker, engines, transport, version, ...)`, on every trainer rank per sync: gathers the weights
  (buckets.py), rank 0 pushes them (sender.py) and stamps `version` on every engine.
- the sync probe (probe.py): do the engines hold, and compute with, the trainer's weights.
The engine's end is `receiver.WeightReceiver`, mixed into vLLM's workers (rollout/worker_extension.py).

Transports (transports.py, shared_memory.py, shared_params.py), each a value of the config key:
| transport | where | how |
|---|---|---|
| shared_memory | CPU, one host | packed into a reused memfd region the engines map; plain CPU weights: in place |
| object_store | any host; every LoRA run | safetensors bytes through Ray's object store (LoRA: the adapter alone) |
| nccl | GPU, engines on their own GPUs | packed buckets broadcast over a process group of their own |
| cuda_ipc | GPU, colocated | packed buckets mapped by IPC handle; one trainer rank: its own parameters, in one pass |
"""

from molt_hydra.weight_sync.sender import push_from_rank, resolve_transport, setup_weight_sync

__all__ = ["push_from_rank", "resolve_transport", "setup_weight_sync"]
