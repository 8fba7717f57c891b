"""The engine's n choices, logprobs and prompt logprobs (issue 18), on real tiny models.

Resident and fully streamed (0% residency, where prefill goes layer-major):
n choices share one prefill and decode in the batch; logprobs agree with an
independent mlx-lm forward over the same files.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.utils import load as mlx_lm_load

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    PromptLogprobsEvent,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

PROMPT_TEXT = "Once upon a time in a land far away, a fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("choices") / "llama", "llama")


@pytest.fixture(scope="module", params=["resident", "0%"])
def engine(request, model_dir, tmp_path_factory):
    path, knobs = model_dir, {}
    if request.param == "0%":
        path = prepare(str(model_dir), tmp_path_factory.mktemp("choices-prepared") / "llama")
        knobs = {"residency": "fixed", "resident_layers": 0}
    # No prompt cache: every prompt token is prefilled, so the count is exact.
    eng = Engine(
        EngineConfig(
            model=str(path), max_batch=4, prompt_cache_bytes=0, prefill_step_size=8, **knobs
        )
    )
    eng.start()
    assert eng.wait_ready(60), eng.load_error
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(model_dir):
    """mlx-lm's own load of the same files: the independent computation."""
    model, tokenizer = mlx_lm_load(str(model_dir))
    return model, tokenizer


def prompt_ids(engine: Engine) -> list[int]:
    return engine.loaded.tokenizer.encode(PROMPT_TEXT)


def run(engine: Engine, request: GenerationRequest) -> list:
    async def collect():
        return [event async for event in engine.submit(request)]

    return asyncio.run(collect())


def by_choice(events: list) -> dict[int, list[TokenEvent]]:
    out: dict[int, list[TokenEvent]] = {}
    for event in events:
        if isinstance(event, TokenEvent):
            out.setdefault(event.index, []).append(event)
    return out


def reference_logprobs(reference, tokens: list[int]) -> mx.array:
    """log-softmax of mlx-lm's logits at every position of `tokens`, float32."""
    model, _ = reference
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_n_greedy_choices_equal_the_single_answer_with_one_prefill(engine):
    prompt = prompt_ids(engine)
    single = run(engine, GenerationRequest(prompt, 12, SamplingParams(temperature=0)))
    before = engine.stats_dict()["prefill_tokens_total"]
    events = run(engine, GenerationRequest(prompt, 12, SamplingParams(temperature=0), n=3))
    assert engine.stats_dict()["prefill_tokens_total"] - before == len(prompt)
    choices = by_choice(events)
    expected = [e.token for e in by_choice(single)[0]]
    assert sorted(choices) == [0, 1, 2]
    for index in range(3):
        assert [e.token for e in choices[index]] == expected
    done = [e for e in events if isinstance(e, DoneEvent)]
    assert sorted(d.index for d in done) == [0, 1, 2]
    assert all(d.prompt_tokens == len(prompt) and d.completion_tokens == 12 for d in done)


def test_seeded_choices_repeat_and_differ(engine):
    prompt = prompt_ids(engine)

    def sample():
        params = SamplingParams(temperature=1.0, seed=1234)
        choices = by_choice(run(engine, GenerationRequest(prompt, 16, params, n=3)))
        return [[e.token for e in choices[i]] for i in range(3)]

    first, second = sample(), sample()
    assert first == second
    assert len({tuple(c) for c in first}) > 1  # each choice has its own stream


def test_logprobs_match_an_independent_forward(engine, reference):
    prompt = prompt_ids(engine)
    events = run(
        engine, GenerationRequest(prompt, 8, SamplingParams(temperature=0), n=2, logprobs=5)
    )
    choices = by_choice(events)
    generated = [e.token for e in choices[0]]
    expected = reference_logprobs(reference, prompt + generated)
    for index in (0, 1):
        for step, event in enumerate(choices[index]):
            assert event.top_logprobs is not None and len(event.top_logprobs) == 5
            top_ids = [t for t, _ in event.top_logprobs]
            # Greedy: the sampled token is the most likely one listed.
            assert top_ids[0] == event.token
            assert event.logprob == pytest.approx(event.top_logprobs[0][1], abs=1e-6)
            row = expected[len(prompt) - 1 + step]
            assert event.logprob == pytest.approx(row[event.token].item(), abs=1e-4)
            for token, value in event.top_logprobs:
                assert value == pytest.approx(row[token].item(), abs=1e-4)


def test_prompt_logprobs_of_a_forced_sequence(engine, reference):
    """What evaluation tools send: the prompt scored, nothing generated."""
    prompt = prompt_ids(engine)
    events = run(
        engine,
        GenerationRequest(prompt, 0, SamplingParams(temperature=0), prompt_logprobs=3),
    )
    scores = [e for e in events if isinstance(e, PromptLogprobsEvent)]
    assert len(scores) == 1 and not [e for e in events if isinstance(e, TokenEvent)]
    (scored,) = scores
    assert scored.tokens == prompt and scored.logprobs[0] is None
    expected = reference_logprobs(reference, prompt)
    for position in range(1, len(prompt)):
        row = expected[position - 1]
        assert scored.logprobs[position] == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        assert [t for t, _ in scored.top_logprobs[position]] == mx.argsort(-row)[:3].tolist()
    (done,) = [e for e in events if isinstance(e, DoneEvent)]
    assert (done.finish_reason, done.completion_tokens) == ("length", 0)


def test_logprobs_under_a_constraint_list_only_allowed_tokens(engine):
    prompt = prompt_ids(engine)
    allowed = prompt[1:4]

    def only_allowed(tokens, logits):
        mask = mx.full(logits.shape, -mx.inf)
        mask[..., mx.array(allowed)] = 0
        return logits + mask

    events = run(
        engine,
        GenerationRequest(
            prompt,
            4,
            SamplingParams(temperature=0),
            logprobs=10,
            logits_processors=[only_allowed],
        ),
    )
    for event in by_choice(events)[0]:
        assert event.token in allowed
        assert {t for t, _ in event.top_logprobs} <= set(allowed)
        assert event.top_logprobs[0][0] == event.token


def test_n_beyond_the_batch_is_refused(engine):
    events = run(engine, GenerationRequest(prompt_ids(engine), 4, n=5))
    (error,) = events
    assert isinstance(error, ErrorEvent)
    assert (error.status, error.param) == (400, "n")


def forced_texts(engine: Engine, forced_ids: list[int], continuation: bool) -> list[str]:
    """The texts of a greedy answer made to be `forced_ids`: each TokenEvent's, then the
    DoneEvent's."""

    def forced(tokens, logits):
        step = len(tokens) - len(prompt_ids(engine))
        mask = mx.full(logits.shape, -mx.inf)
        mask[..., forced_ids[min(step, len(forced_ids) - 1)]] = 0
        return logits + mask

    request = GenerationRequest(
        prompt_ids(engine),
        len(forced_ids),
        SamplingParams(temperature=0),
        logits_processors=[forced],
        continuation=continuation,
        use_prompt_cache=False,
    )
    events = run(engine, request)
    return [e.text for e in events if isinstance(e, (TokenEvent, DoneEvent))]


def test_a_continuation_keeps_the_first_space(engine):
    """ "The capital of France is" + " Paris": the space is the completion's text. A
    chat answer's first space (SentencePiece's "▁Hello" after a header) is dropped."""
    tokenizer = engine.loaded.tokenizer
    spaced = tokenizer.encode(" fox jumps", add_special_tokens=False)
    assert tokenizer.decode(spaced[:1]).startswith(" ")
    assert "".join(forced_texts(engine, spaced, continuation=True)) == " fox jumps"
    assert "".join(forced_texts(engine, spaced, continuation=False)) == "fox jumps"


def test_a_lone_space_goes_out_with_its_own_token(engine):
    """mlx-lm's BPE detokenizer holds a token that is one space until the next one (to
    drop an answer's first space). Once the text has begun a space goes out with its own
    token: the text is mlx-lm's, only sooner (a completion whose first token is a space
    no longer waits a step for its first chunk). A chat answer's first space is still
    held and dropped."""
    tokenizer = engine.loaded.tokenizer
    space = tokenizer.encode(" ", add_special_tokens=False)
    assert len(space) == 1 and tokenizer.decode(space) == " "
    words = tokenizer.encode("fox", add_special_tokens=False)
    forced_ids = [space[0], *words, space[0], space[0], *words]

    def mlx_lm_text(continuation: bool) -> str:
        plain = tokenizer.detokenizer  # mlx-lm's own, with the same seed for a continuation
        if continuation:
            plain.text, plain.offset = "\u2060", 1
        for token in forced_ids:
            plain.add_token(token)
        plain.finalize()
        return plain.text[plain.offset :]

    n = len(words)
    texts = forced_texts(engine, forced_ids, continuation=True)
    assert texts[0] == " " and texts[n + 1 : n + 3] == [" ", " "]
    assert "".join(texts) == mlx_lm_text(continuation=True) == " fox  fox"
    texts = forced_texts(engine, forced_ids, continuation=False)
    assert texts[0] == "" and texts[n + 1 : n + 3] == [" ", " "]
    assert "".join(texts) == mlx_lm_text(continuation=False) == "fox  fox"
