"""GET /memory on a streamed model, and streamed output through the real server."""

from pathlib import Path

import pytest

from flashserve.engine.weights.prepare import prepare
from tests.conftest import NO_EOS, Server, start_server, stop_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def prepared(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    return prepare(str(tiny_llama_dir), tmp_path_factory.mktemp("mem") / "prepared")


@pytest.fixture(scope="module")
def streamed_server(prepared: Path, tmp_path_factory):
    server = start_server(
        prepared,
        tmp_path_factory.mktemp("mem-server"),
        "--resident-layers",
        "2",
        "--placement",
        "interleaved",
    )
    yield server
    stop_server(server)


def greedy(server: Server, n: int = 24) -> str:
    reply = server.client().chat.completions.create(
        model=server.model_id,
        messages=QUESTION,
        temperature=0,
        max_tokens=n,
        logit_bias=NO_EOS,
    )
    assert reply.usage.completion_tokens == n
    return reply.choices[0].message.content


def test_memory_reports_residency_and_batch(streamed_server: Server):
    http = streamed_server.http()
    before = http.get("/memory").json()
    assert before["resident_layers"] == [0, 2] and before["streamed_layers"] == [1, 3]
    assert before["num_layers"] == 4
    assert before["plan"]["resident_count"] == 2
    assert 0 < before["non_layer_bytes"] < before["resident_weight_bytes"]
    assert before["rss_bytes"] > 0 and before["system_available_bytes"] > 0
    greedy(streamed_server)
    after = http.get("/memory").json()
    assert after["batch"]["steps"] > before["batch"]["steps"]
    assert after["batch"]["size"] == 1
    # every decode step streams layers 1 and 3 once for the whole batch
    layer_bytes = (after["resident_weight_bytes"] - after["non_layer_bytes"]) // 2
    assert after["batch"]["last_step_read_bytes"] >= layer_bytes
    assert after["streaming"]["bytes_read"] > before["streaming"]["bytes_read"]


def test_streamed_server_matches_resident_server(streamed_server: Server, llama_server: Server):
    assert greedy(streamed_server) == greedy(llama_server)


def test_memory_on_resident_model(llama_server: Server):
    body = llama_server.http().get("/memory").json()
    assert body["streamed_layers"] == [] and body["plan"] is None
    assert body["resident_layers"] == list(range(body["num_layers"]))
