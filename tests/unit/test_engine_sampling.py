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

    async def generate(self, prompt, params, request_id, lora_request=None):
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


def test_generate_waits_for_the_finished_output_and_a_stream_asks_for_deltas(tiny_model):
    """`generate` is handed each completion once (no wake-up per sampled token); `generate_stream` gets every step."""
    from vllm.sampling_params import RequestOutputKind

    engine = VLLMEngine(tiny_model)
    engine._llm = front = ParamsOnlyFront()
    request = GenerationRequest("s", [1, 2, 3], Sampling(max_tokens=4))

    async def both():
        await engine.generate(request)
        return [d async for d in engine.generate_stream(request)]

    asyncio.run(both())
    assert [p.output_kind for p in front.params] == [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA]


def test_joined_stream_takes_its_versions_from_the_engines_spans():
    """Deltas are stamped when this process reads them, which can be after a weight sync; the last delta's spans say
    which weights sampled each token, and the joined completion follows them."""
    from molt_hydra.rollout.engine import join_deltas
    from molt_hydra.rollout.generation import Generation

    deltas = [Generation([5, 6], [-0.1, -0.2], [3, 3], ""), Generation([7], [-0.3], [3], ""),
              Generation([8], [-0.4], [3], "length", version_spans=[(2, 0, 3), (3, 3, 4)])]
    joined = join_deltas(deltas)
    assert joined.versions == [2, 2, 2, 3]
    assert (joined.token_ids, joined.logprobs, joined.finish_reason) == (
        [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], "length")
    assert join_deltas(deltas[:2]).versions == [3, 3, 3]  # no spans (cut stream): the stamps as read
