"""Speculative decoding and sampled requests: each keeps its own sampler's output.

A request that opts out (`speculative: false`) samples exactly as on a server
without speculation, even while a speculating request shares its batch; a
speculating request's tokens are distributed as without speculation.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import GenerationRequest, SamplingParams, TokenEvent
from flashserve.engine.generation.worker import Engine
from tests.conftest import NO_EOS, Server, start_server, stop_server
from tests.test_speculative import CODE, SPEC, spec_counters


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(a server speculating with prompt lookup, the same model without speculation)."""
    spec = start_server(tiny_llama_dir, tmp_path_factory.mktemp("sampled-spec"), *SPEC)
    try:
        plain = start_server(tiny_llama_dir, tmp_path_factory.mktemp("sampled-plain"))
    except Exception:
        stop_server(spec)
        raise
    yield spec, plain
    stop_server(plain)
    stop_server(spec)


def beside_an_edit(server: Server, seed: int) -> tuple[str, str]:
    """A seeded temperature-1 request with `speculative: false`, sent once an edit-style
    greedy request (which speculates where the server does) is decoding; both texts."""
    edit = {"prompt": CODE * 4, "max_tokens": 120, "temperature": 0, "stream": True}
    edit["logit_bias"] = NO_EOS  # it outlives the sampled request
    sampled = {
        "prompt": "one two three four " * 8,
        "max_tokens": 30,
        "temperature": 1.0,
        "seed": seed,
        "speculative": False,
    }
    decoding = threading.Event()
    pieces: list[str] = []

    def stream_edit() -> None:
        with server.http().stream("POST", "/v1/completions", json=edit) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
                    decoding.set()
        decoding.set()

    thread = threading.Thread(target=stream_edit)
    thread.start()
    try:
        assert decoding.wait(60)
        response = server.http().post("/v1/completions", json=sampled)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
    finally:
        thread.join(120)
    return text, "".join(pieces)


def test_opted_out_request_keeps_its_sampler_beside_a_speculating_one(
    servers: tuple[Server, Server],
) -> None:
    """Each seed's sampled text is the one the server without speculation returns for
    the same pair, while verification passes ran for the edit beside it."""
    spec, plain = servers
    for seed in (1, 2, 3):
        before = spec_counters(spec)
        on = beside_an_edit(spec, seed)
        after = spec_counters(spec)
        off = beside_an_edit(plain, seed)
        assert after["passes_total"] > before["passes_total"]
        assert on[1] == off[1]  # the greedy edit: identical by construction
        assert on[0] == off[0], seed


# -- the distribution of sampled tokens ------------------------------------------------

REQUESTS, CHOICES, LENGTH = 100, 8, 8
# The chance that the test fails although both arms draw from one distribution, all
# positions together (Bonferroni: each position is tested at ALPHA / positions).
ALPHA = 0.001
# The random model narrowed to two tokens it picks between by its own logits: its
# output repeats pairs, so prompt lookup drafts at most positions.
NARROW = {100: 30.0, 101: 30.0}


def chi_square_sf(x: float, df: int) -> float:
    """P(X > x) for X chi-square with df (an integer) degrees of freedom: the closed
    forms of the regularized upper gamma function, no approximation."""
    if x <= 0:
        return 1.0
    if df % 2 == 0:
        term = total = 1.0
        for i in range(1, df // 2):
            term *= x / (2 * i)
            total += term
        return math.exp(-x / 2) * total
    term, total = math.sqrt(x), 0.0
    for i in range(1, (df + 1) // 2):
        total += term
        term *= x / (2 * i + 1)
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 / math.pi) * math.exp(-x / 2) * total


def homogeneity_p(a: list[int], b: list[int]) -> float:
    """The p-value of a chi-square homogeneity test of samples a and b (outcomes seen
    fewer than 10 times in both together pooled into one)."""
    outcomes = sorted(set(a) | set(b))
    table = np.array([[a.count(o) for o in outcomes], [b.count(o) for o in outcomes]])
    rare = table.sum(axis=0) < 10
    counts = np.concatenate([table[:, ~rare], table[:, rare].sum(axis=1, keepdims=True)], 1)
    counts = counts[:, counts.sum(axis=0) > 0]
    df = counts.shape[1] - 1
    if df < 1:
        return 1.0  # one outcome: nothing to tell apart
    expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0) / counts.sum()
    return chi_square_sf(float(((counts - expected) ** 2 / expected).sum()), df)


def test_chi_square_tail_is_exact() -> None:
    """Against known quantiles: df 1 (a squared normal), 2 (an exponential), 3 and 4."""
    assert chi_square_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi_square_sf(2 * math.log(1000), 2) == pytest.approx(0.001, rel=1e-12)
    assert chi_square_sf(7.814727903251178, 3) == pytest.approx(0.05, rel=1e-9)
    assert chi_square_sf(13.276704135987622, 4) == pytest.approx(0.01, rel=1e-9)


def test_sampled_output_distribution_is_unchanged(tiny_llama_dir: Path) -> None:
    """Temperature 1 with top-k 3, REQUESTS x CHOICES samples each way: at every output
    position the tokens (accepted drafts or resampled residuals when on) are
    distributed alike with speculation on and off. Every sample comes from a random
    stream of its own: choice c of a request seeded s draws from stream s + c, and
    the requests' seeds are CHOICES apart, the second arm's after the first's."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), speculative="prompt-lookup"))
    # Every step drafts up to 4 tokens where lookup finds some, whatever it costs here.
    engine.speculation.cost.plan = lambda batch, candidates: 4  # type: ignore[method-assign]
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    prompt = [5, 6, 7, 8] * 12

    async def many(speculative: bool, first_seed: int) -> list[list[int]]:
        outputs = []
        for r in range(REQUESTS):
            seed = first_seed + r * CHOICES
            params = SamplingParams(temperature=1.0, top_k=3, seed=seed, logit_bias=NARROW)
            request = GenerationRequest(prompt, LENGTH, params, n=CHOICES, speculative=speculative)
            by_choice: dict[int, list[int]] = {}
            async for event in engine.submit(request):
                if isinstance(event, TokenEvent):
                    by_choice.setdefault(event.index, []).append(event.token)
            outputs += [o for o in by_choice.values() if len(o) == LENGTH]
        return outputs

    try:
        plain = asyncio.run(many(False, 0))
        spec = asyncio.run(many(True, REQUESTS * CHOICES))
        stats = engine.stats.speculative
    finally:
        engine.shutdown()
    assert stats.drafted_tokens > 200 and 0 < stats.accepted_tokens < stats.drafted_tokens
    assert len(plain) > REQUESTS * CHOICES // 2 and len(spec) > REQUESTS * CHOICES // 2
    positions = range(1, LENGTH)  # the first token is sampled before any verification
    for j in positions:
        p = homogeneity_p([o[j] for o in plain], [o[j] for o in spec])
        assert p >= ALPHA / len(positions), (j, p)
