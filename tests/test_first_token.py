"""On the CPU a first token is handed back before the step after it runs.

mlx-lm starts each step's successor (`mx.async_eval`) before it returns the
step's tokens; on the CPU that call runs most of the successor, so the first
token would wait a whole decode step (generation/fairness.py). The step
that emits a sequence's first token leaves its successor lazy; tokens are
those of an engine without the gate, alone and in a batch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation import fairness
from flashserve.engine.generation.requests import GenerationRequest, SamplingParams, TokenEvent
from flashserve.engine.generation.worker import Engine

from .test_prompt_cache import BASE, GROWN, NO_EOS_BIAS


def _tokens(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(model), max_batch=4))
    engine.start()
    assert engine.wait_ready(120), engine.load_error

    async def one(prompt: list[int]) -> list[int]:
        sampling = SamplingParams(temperature=0.0, logit_bias=NO_EOS_BIAS)
        handle = engine.submit(GenerationRequest(prompt, 6, sampling))
        return [e.token async for e in handle if isinstance(e, TokenEvent)]

    async def run() -> list[list[int]]:
        alone = [await one(prompts[0])]
        return alone + list(await asyncio.gather(*(one(p) for p in prompts)))

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_first_token_steps_leave_their_successor_lazy_and_tokens_unchanged(
    cache_arch_dirs: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
):
    lazy_steps: list[int] = []
    real = fairness._StepMx.async_eval

    def spy(self: fairness._StepMx, *arrays) -> None:
        if getattr(self.local, "lazy", False):
            lazy_steps.append(1)
        real(self, *arrays)

    monkeypatch.setattr(fairness._StepMx, "async_eval", spy)
    prompts = [BASE, GROWN, [*BASE, 3]]
    gated = _tokens(cache_arch_dirs[arch], prompts)
    # One step emits the lone request's first token; the batch of three
    # starts together, so its first tokens come out in one or a few steps.
    assert 2 <= len(lazy_steps) <= 4
    monkeypatch.setattr(fairness, "first_token_gate", lambda batch: None)
    assert gated == _tokens(cache_arch_dirs[arch], prompts)
    assert all(len(t) == 6 for t in gated)
