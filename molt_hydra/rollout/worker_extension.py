"""The class every vLLM worker is extended with (`worker_extension_cls`, rollout/engine.py); called via collective_rpc:
the weight sync's receiver (weight_sync/receiver.py), plus what the engine actor asks of its workers besides."""

from __future__ import annotations

import torch

from molt_hydra.weight_sync.receiver import WeightReceiver

# quiet_executor and routing_capture are imported where used: they import vLLM internals that only some workers need


class EngineWorkerExtension(WeightReceiver):
    def device_free_bytes(self) -> int:
        """Free memory on this worker's device (what a colocated engine's sleep gives back); 0 on CPU."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0

    def queue_reader_busy_loop_s(self) -> float:
        """Seconds this worker spins on its scheduler-output queue before it blocks (rollout/quiet_executor.py)."""
        from molt_hydra.compat.vllm import worker_busy_loop_s

        return worker_busy_loop_s()

    # --- R3 on CPU: the engine's own expert selection per request (rollout/routing_capture.py) ---

    def start_routing_capture(self) -> None:
        from molt_hydra.compat.vllm import EngineRoutingCapture

        self._routing_capture = EngineRoutingCapture(self)

    def pop_routed_experts(self, request_id: str, num_positions: int) -> list | None:
        return self._routing_capture.pop(request_id, num_positions)
