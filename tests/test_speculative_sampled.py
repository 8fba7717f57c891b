"""Speculative decoding and sampled requests: each keeps its own sampler's output.

A request that opts out (`speculative: false`) samples exactly as on a server
without speculation, even while a speculating request shares its batch; a
speculating request's tokens are distributed as without speculation.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

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
