"""The terminal view of a run: one line per step (the learning curve as it goes) and a closing summary."""

from __future__ import annotations

import math
import time

from rich.console import Console


class Progress:
    def __init__(self, total_steps: int | None, enabled: bool = True):
        self.total, self.enabled = total_steps, enabled
        self.console = Console(highlight=False, soft_wrap=True, markup=False)  # names are the user's (datasource)
        self.started = time.monotonic()
        self.first_step: int | None = None

    def step(self, step: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step = step - 1
        per_step = (time.monotonic() - self.started) / max(step - self.first_step, 1)
        eta = f" | ETA {max(self.total - step, 0) * per_step:5.0f}s" if self.total else ""
        reward = m.get("reward", float("nan"))
        bar = "█" * int(round(20 * min(max(reward, 0.0), 1.0))) if math.isfinite(reward) else ""
        self.console.print(
            f"step {step:>4}{'/' + str(self.total) if self.total else ''} | reward {reward:6.3f} "
            f"{bar:<20} | vllm_kl {m.get('vllm_kl', float('nan')):9.2e}"
            + (f" | routing {m['routing/agreement']:.3f}" if "routing/agreement" in m else "")  # MoE actors
            + f" | loss {m.get('policy_loss', float('nan')):8.4f}"
            + (f" | {m['perf/rollout_tokens_per_sec']:7.0f} tok/s" if "perf/rollout_tokens_per_sec" in m else "")
            + f" | {m.get('timing/step_total', 0.0):5.1f}s{eta}"
        )

    def eval(self, step: int, m: dict[str, float]) -> None:
        if self.enabled:
            shown = ", ".join(f"{k} {v:.3f}" for k, v in sorted(m.items()) if "pass" in k)
            self.console.print(f"eval @ step {step}: {shown}")

    def summary(self, lines: list[str]) -> None:
        self.console.rule("run finished")
        for line in lines:
            self.console.print(line)
