"""The token-in/token-out contract between agent runners and the rollout engines.

Every arrow in the runtime carries token ids, never re-tokenized text. A `TokenGenerator` takes prompt ids and
returns generated ids with the sampling logprob and the policy version of every generated token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class EngineFailure(RuntimeError):
    """The engines could not give a generation (one timed out or died past its retries, none is alive, or vLLM ended
    the request with finish reason abort / error): a rollout dropped for it is counted as engine_aborted, not as the
    agent's failure."""


class EngineTimeout(EngineFailure, TimeoutError):
    """An engine did not answer a request within train.timeouts.engine_call_s."""


@dataclass(frozen=True)
class Sampling:
    """Sampling values for one request. Every value is explicit, so a checkpoint's generation_config never leaks in."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_tokens: int = 1  # Molt's value; >0 masks EOS on early steps, which shifts those tokens' processed logprobs
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives per generated token returned to a chat client (the sampled one is always kept)
    structured: dict | None = None  # vLLM StructuredOutputsParams fields (json / regex / ...): guided decoding


@dataclass
class Generation:
    """One sampled completion. `logprobs[i]` and `versions[i]` belong to `token_ids[i]`."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string / token that ended it, when one did
    routed_experts: list | None = None  # MoE: [prompt + generated positions][layer][top-k] expert ids, when enabled
    engine_index: int = -1
    top_logprobs: list[dict[int, float]] | None = None  # per token: the `Sampling.top_logprobs` best alternatives
    # The finished output of an engine: (version, start, end) over the whole completion, as the engine core stamped
    # its tokens; on the last delta of a stream it corrects the provisional versions of the earlier deltas.
    version_spans: list[tuple[int, int, int]] | None = None

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(f"Generation is misaligned: {len(self.token_ids)} tokens, {len(self.logprobs)} logprobs, "
                             f"{len(self.versions)} versions")


@dataclass
class GenerationRequest:
    """What a runner sends: the session id keeps all turns of one rollout on one engine."""

    session_id: str
    prompt_ids: list[int]
    sampling: Sampling
    images: list = field(default_factory=list)


class TokenGenerator(Protocol):
    """Anything that turns prompt ids into `Generation`s: the router over engine actors, or one engine in-process."""

    async def generate(self, request: GenerationRequest) -> list[Generation]:  # one per `sampling.n`
        ...
