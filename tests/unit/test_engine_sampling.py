"""The sampling parameters `VLLMEngine` sends vLLM: token ids out, so text is decoded only for stop strings."""

from __future__ import annotations

import asyncio

import pytest

from molt_hydra.rollout.engine import VLLMEngine
from molt_hydra.rollout.generation import GenerationRequest, Sampling


class ParamsOnlyFront:
    """Stands in for vLLM's AsyncLLM: records what it is asked to sample and ends without output."""

    def __init__(self):
        self.params = []

    async def generate(self, prompt, params, request_id):
        self.params.append(params)
        return
        yield


@pytest.mark.parametrize("stop", [(), ("\n\n",)])
def test_text_is_decoded_only_to_match_stop_strings(tiny_model, stop):
    engine = VLLMEngine(tiny_model)
    engine._llm = front = ParamsOnlyFront()
    (out,) = asyncio.run(engine.generate(GenerationRequest("s", [1, 2, 3], Sampling(max_tokens=4, stop=stop))))
    assert out.finish_reason == "abort"  # the stand-in sampled nothing
    assert front.params[0].detokenize is bool(stop)
    assert front.params[0].stop == (list(stop) or [])
