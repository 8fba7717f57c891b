"""A prompt's last token runs in its last chunk (engine/generation/prefill/last_token.py).

Its numbers are a prompt row's whatever the chunk: cold (one row of a longer
tail), after a cached prompt[:-1] (a tail of one), beside another prompt of
another length (padded), prefilled outside the batch (n > 1). No decode step
runs for it: the first token comes out of the tail's pass.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from flashserve.engine.compute import prompt_matmul
from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.prefill import last_token, layer_major
from flashserve.engine.generation.prefill.alone import prefill_alone
from flashserve.engine.generation.prefill.layer_major import PrefillJob
from flashserve.engine.generation.requests import (
    DoneEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.loader import load
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

from .test_prompt_cache import NO_EOS_BIAS

PROMPT = [(37 * i) % 200 + 3 for i in range(300)]


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not prompt_matmul.integer_available():
        pytest.skip("the integer prompt GEMM does not run here: prompts do not fold")
    return make_model_dir(tmp_path_factory.mktemp("fold") / "q4", "llama", quantize_bits=4)


def _prefilled(model, tokens: list[int], chunk: int = 256) -> list:
    cache = make_prompt_cache(model)
    with prompt_matmul.prompt_rows():
        for start in range(0, len(tokens), chunk):
            mx.eval(model(mx.array([tokens[start : start + chunk]]), cache=cache))
    return cache


def test_the_last_token_has_the_same_numbers_in_any_tail(q4_dir: Path):
    model = load(EngineConfig(model=str(q4_dir))).model
    assert last_token.folds(model)
    cold = last_token.tail_logits(model, _prefilled(model, PROMPT[:256]), [PROMPT[256:]])
    alone = last_token.tail_logits(model, _prefilled(model, PROMPT[:-1]), [PROMPT[-1:]])
    assert cold.shape == (1, model.args.vocab_size)
    assert mx.array_equal(cold, alone).item()  # a 44-token tail and a tail of one
    # Only the last row reached the LM head: the same numbers as the whole chunk's last row.
    with prompt_matmul.prompt_rows():
        whole = model(mx.array([PROMPT[256:]]), cache=_prefilled(model, PROMPT[:256]))[:, -1]
    assert mx.array_equal(cold, whole).item()
    # Two prompts of different lengths in one padded pass: each one's numbers alone.
    short, long_ = PROMPT[:37], PROMPT[100:160]
    batch = [BatchKVCache([0, 0]) for _ in model.layers]
    both = last_token.tail_logits(model, batch, [short, long_])
    for row, tokens in enumerate((short, long_)):
        own = last_token.tail_logits(model, make_prompt_cache(model), [tokens])
        assert mx.array_equal(both[row], own[0]).item()
    # A model with an MLX matmul in its layers (float weights) does not fold.
    assert not last_token.folds(load(EngineConfig(model=str(q4_dir), prompt_matmul="float")).model)


def test_segments_put_the_last_token_in_a_tail_of_at_most_a_chunk():
    cut = last_token.segments(list(range(600)), 256)
    assert [len(s) for s in cut] == [512, 1] and cut[1][0].tokens == list(range(512, 600))
    assert last_token.segments([7], 256)[0][0].tokens == [7]
    assert [s[0].tokens for s in last_token.segments(list(range(256)), 256)] == [list(range(256))]


def _run(engine: Engine, prompt: list[int], n: int = 1, max_tokens: int = 4) -> tuple:
    sampling = SamplingParams(temperature=0.0, logit_bias=NO_EOS_BIAS)
    request = GenerationRequest(prompt, max_tokens, sampling, n=n, logprobs=3)

    async def go() -> tuple:
        tokens, cached = [], 0
        async for event in engine.submit(request):
            if isinstance(event, TokenEvent) and event.index == 0:
                tokens.append((event.token, event.logprob, event.top_logprobs))
            elif isinstance(event, DoneEvent) and event.index == 0:
                cached = event.cached_tokens
        return tokens, cached

    return asyncio.run(go())


def test_every_path_gives_the_first_token_the_same_logprobs(
    q4_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    tails: list[int] = []
    real = last_token.tail_logits

    def spy(model, cache, rows):
        tails.extend(len(r) for r in rows)
        return real(model, cache, rows)

    monkeypatch.setattr(last_token, "tail_logits", spy)
    engine = Engine(EngineConfig(model=str(q4_dir), max_batch=4, prompt_cache_bytes=1 << 28))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    stored: list[int] = []
    real_store = engine.prompt_cache.store
    engine.prompt_cache.store = lambda tokens, cache: (
        stored.append(len(tokens)),
        real_store(tokens, cache),
    )
    try:
        cold, cached = _run(engine, PROMPT)
        assert cached == 0 and tails == [300]  # the whole prompt, its last token in the tail
        assert len(PROMPT) - 1 in stored  # its state at prompt[:-1], cut back from the tail's
        # The same prompt again: prompt[:-1] was stored once the first token was out.
        again, cached = _run(engine, PROMPT)
        assert cached == len(PROMPT) - 1 and tails[-1] == 1
        # A next turn on top of the first answer (and below, the same turn cold).
        turn = PROMPT + [t for t, _, _ in cold] + list(range(60, 90))
        engine_cold = _run(engine, turn, max_tokens=4)  # from the answer's state
        assert engine_cold[1] >= len(PROMPT)
        # Prefilled outside the batch (two choices), no prompt cache.
        engine.prompt_cache = None
        alone, _ = _run(engine, PROMPT, n=2)
        fresh_turn, _ = _run(engine, turn)
    finally:
        engine.shutdown()
    assert again == cold and alone == cold  # tokens, logprobs and top logprobs, exactly
    # The answer's keys came from decode steps, not prompt rows: the same tokens.
    assert [t for t, _, _ in engine_cold[0]] == [t for t, _, _ in fresh_turn]


def test_tails_and_plain_prompts_move_to_generation_together(q4_dir: Path):
    """A Tail and a plain prompt (mlx-lm's way: its last token in the first step) that
    reach generation in one step each get the tokens and logprobs they get alone."""
    model = load(EngineConfig(model=str(q4_dir))).model
    tail, plain = PROMPT[:90], PROMPT[120:131]

    def run(kinds: list[str]) -> dict[str, list]:
        batch = BatchGenerator(model, prefill_step_size=64)
        last_token.install(batch)
        uids = {}
        for kind in kinds:
            if kind == "tail":
                (uids[kind],) = batch.insert_segments([last_token.segments(tail, 64)], [3])
            else:
                (uids[kind],) = batch.insert([plain], [3])
        out: dict[str, list] = {kind: [] for kind in kinds}
        names = {uid: kind for kind, uid in uids.items()}
        while any(len(v) < 3 for v in out.values()):
            for response in batch.next()[1]:
                out[names[response.uid]].append((response.token, response.logprobs.tolist()))
        return out

    together = run(["tail", "plain"])
    assert together == {**run(["tail"]), **run(["plain"])}


def test_a_filled_sliding_window_keeps_no_prompt_end_state(tmp_path: Path):
    """Folded, the state at prompt[:-1] is the tail's cut back by one. A sliding window
    that filled cannot be cut back: nothing is kept rather than a wrong state (outside
    the batch and layer-major: the batch's store checks the same when it takes it)."""
    if not prompt_matmul.integer_available():
        pytest.skip("the integer prompt GEMM does not run here: prompts do not fold")
    path = make_model_dir(
        tmp_path / "gemma", "gemma3_text", overrides={"sliding_window": 16}, quantize_bits=4
    )
    model = load(EngineConfig(model=str(path))).model
    assert last_token.folds(model)  # a fresh rotating cache can be trimmed
    for length, kept_at in ((12, 11), (40, None)):
        kept: list = []
        cache = make_prompt_cache(model)
        prefill_alone(model, PROMPT[:length], cache, 0, 8, keep_prefix=kept.append, fold=True)
        assert [c.offset for c in kept[0]][:1] == [kept_at] if kept_at else kept == []
        job = PrefillJob(PROMPT[:length], make_prompt_cache(model), keep_prefix=True)
        mx.eval(model(mx.array([PROMPT[:length]]), cache=job.cache))
        job.prefix_state = [None] * len(job.cache)
        for index in range(len(job.cache)):
            if job.prefix_state is not None:
                layer_major._snapshot(job, index, trim=1)
        assert (job.prefix_state is None) == (kept_at is None)
        if kept_at:
            assert {c.offset for c in job.prefix_state} == {kept_at}


def test_a_prompt_gets_the_same_first_token_in_chunks_of_any_size(q4_dir: Path):
    """Chunks of 4 tokens before the tail (which would take the decode attention
    outside prompt_rows) give the logprobs of one 40-token tail."""
    model = load(EngineConfig(model=str(q4_dir))).model

    def first(step: int) -> list:
        batch = BatchGenerator(model, prefill_step_size=step)
        last_token.install(batch)
        batch.insert_segments([last_token.segments(PROMPT[:40], step)], [1])
        while not (responses := batch.next()[1]):
            pass
        return responses[0].logprobs.tolist()

    assert first(4) == first(64)


def test_a_streamed_prompt_gets_the_resident_first_token(
    q4_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The layer-major prefill (every layer streamed from disk) folds too, its last
    layer's output projection and MLP on the last row only: the first tokens,
    logprobs and top logprobs of the resident model's batch prefill, exactly."""
    prepared = prepare(str(q4_dir), tmp_path / "prepared")
    cut: list[int] = []
    real = layer_major.past_attention_rows

    def spy(layer, rows, width):
        cut.append(width)
        return real(layer, rows, width)

    monkeypatch.setattr(layer_major, "past_attention_rows", spy)
    results = []
    for knobs in ({}, {"resident_layers": 0}):
        engine = Engine(
            EngineConfig(model=str(prepared), prompt_cache_bytes=0, prefill_step_size=64, **knobs)
        )
        engine.start()
        assert engine.wait_ready(120), engine.load_error
        try:
            results.append(_run(engine, PROMPT)[0])
        finally:
            engine.shutdown()
    assert cut == [300 - 256]  # the streamed run's last chunk, through the last layer
    assert results[1] == results[0]
    # Both against the whole chunk's last row, every row through every layer.
    model = load(EngineConfig(model=str(prepared))).model
    with prompt_matmul.prompt_rows():
        whole = model(mx.array([PROMPT[256:]]), cache=_prefilled(model, PROMPT[:256]))[0, -1]
    for token, bias in NO_EOS_BIAS.items():  # as the requests ask
        whole[token] += bias
    logprobs = whole - mx.logsumexp(whole)
    token, logprob, _ = results[1][0]
    assert token == mx.argmax(whole).item()
    assert logprob == pytest.approx(logprobs[token].item(), abs=1e-5)
