"""Speculative decoding (engine/speculative/): several tokens per pass, same output.

Each server speculates (prompt lookup); its baseline is the same request with
`speculative: false`, so both run on the same weights in the same process.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load as mlx_load

from flashserve.engine.speculative import batch as speculative_batch
from flashserve.engine.speculative.accept import accept_sampled
from flashserve.engine.speculative.adaptive import SpeculativeStats
from flashserve.engine.speculative.batch import Speculation, SpeculativeConfig
from flashserve.engine.speculative.lookup import NgramIndex
from flashserve.engine.speculative.rollback import roll_back
from flashserve.engine.weights.prepare import prepare
from tests.conftest import Server, start_server, stop_server

SPEC = ("--speculative", "prompt-lookup", "--speculative-max-draft", "6")
# Code repeated with small changes: prompt lookup's case (an agent editing a file).
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
PROMPTS = [CODE * 4, "one two three four " * 8, "What is the capital of France?"]


def complete(server: Server, prompt: str, speculative: bool, **kwargs: Any) -> dict:
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "speculative": speculative}
    response = server.http().post("/v1/completions", json={**body, **kwargs})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def chat(server: Server, speculative: bool, ask: str, **kwargs: Any) -> dict:
    """A greedy chat turn about CODE; its message."""
    body = {
        "messages": [{"role": "user", "content": ask + CODE * 3}],
        "max_tokens": 50,
        "temperature": 0,
        "speculative": speculative,
    }
    response = server.http().post("/v1/chat/completions", json={**body, **kwargs})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def spec_counters(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("flashserve_speculative_"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]  # each engine's samples carry its model's label
            out[name.removeprefix("flashserve_speculative_")] = float(value)
    return out


def assert_speculated(before: dict[str, float], after: dict[str, float]) -> None:
    """Between two readings of the counters tokens were drafted and some accepted: the
    speculative path ran, not only plain steps."""
    assert after["drafted_tokens_total"] > before["drafted_tokens_total"]
    assert after["accepted_tokens_total"] > before["accepted_tokens_total"]
    assert after["passes_total"] > before["passes_total"]


def check_identity(server: Server, batched: bool, **kwargs: Any) -> None:
    """Each prompt's greedy output with speculation equals it without, alone or batched."""
    plain = [complete(server, p, False, **kwargs) for p in PROMPTS]
    before = spec_counters(server)
    if batched:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            spec = list(pool.map(lambda p: complete(server, p, True, **kwargs), PROMPTS))
    else:
        spec = [complete(server, p, True, **kwargs) for p in PROMPTS]
    after = spec_counters(server)
    for a, b in zip(plain, spec, strict=True):
        assert b["text"] == a["text"]
        if kwargs.get("logprobs") is not None:
            assert b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
            np.testing.assert_allclose(
                b["logprobs"]["token_logprobs"], a["logprobs"]["token_logprobs"], atol=1e-4
            )
    assert_speculated(before, after)


@pytest.fixture(scope="module")
def llama_spec(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_llama_dir, tmp_path_factory.mktemp("spec-llama"), *SPEC)
    yield server
    stop_server(server)


@pytest.mark.parametrize("batched", [False, True])
def test_dense_greedy_identity(llama_spec: Server, batched: bool) -> None:
    check_identity(llama_spec, batched)


def test_logprobs_come_from_the_verified_distributions(llama_spec: Server) -> None:
    check_identity(llama_spec, True, logprobs=3)


def test_acceptance_shows_in_metrics_and_health(llama_spec: Server) -> None:
    complete(llama_spec, CODE * 4, True)
    counters = spec_counters(llama_spec)
    assert 0 < counters["acceptance_rate"] <= 1
    assert counters["tokens_per_pass"] > 1  # more than one token per pass on average
    stats = llama_spec.health().json()["stats"]["speculative"]
    assert stats["accepted_tokens"] <= stats["drafted_tokens"]


def test_chat_with_tools_identity(llama_spec: Server) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "edit",
                "description": "Replace text in a file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]

    def ask(speculative: bool) -> dict:
        return chat(llama_spec, speculative, "Edit this file:\n", tools=tools)

    plain = ask(False)
    before = spec_counters(llama_spec)
    assert ask(True) == plain
    assert_speculated(before, spec_counters(llama_spec))


def test_penalties_and_logit_bias_identity(llama_spec: Server) -> None:
    """Processors run position by position over the draft, as in plain steps."""
    check_identity(
        llama_spec, True, logit_bias={"0": -100, "1": -100}, repetition_penalty=1.1, logprobs=2
    )


def test_grammar_identity_and_rollback(llama_spec: Server) -> None:
    """A JSON schema's grammar runs over drafted tokens, ends drafts it forbids, and is
    rolled back past rejected ones: the same JSON with speculation on as off."""
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string"}, "lines": {"type": "integer"}},
        "required": ["code", "lines"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "edit", "schema": schema}}

    def ask(speculative: bool) -> str:
        message = chat(llama_spec, speculative, "As JSON:\n", response_format=fmt)
        return message["content"]

    plain = ask(False)
    before = spec_counters(llama_spec)
    assert ask(True) == plain
    after = spec_counters(llama_spec)
    assert after["passes_total"] > before["passes_total"]


def test_speculative_field_is_validated(llama_spec: Server) -> None:
    body = {"prompt": "x", "max_tokens": 2, "speculative": "sometimes"}
    response = llama_spec.http().post("/v1/completions", json=body)
    assert response.status_code == 400
    assert "speculative" in response.text


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_streamed_layers_identity(
    tiny_llama_dir: Path, cache_arch_dirs: dict[str, Path], arch: str, tmp_path_factory
) -> None:
    """0% residency: every layer read from disk once per verification pass (and, for
    the hybrid model, once more per recompute)."""
    model_dir = tiny_llama_dir if arch == "llama" else cache_arch_dirs[arch]
    prepared = prepare(str(model_dir), tmp_path_factory.mktemp("spec-prep") / "p")
    args = ("--residency", "fixed", "--resident-layers", "0", *SPEC)
    server = start_server(prepared, tmp_path_factory.mktemp("spec-streamed"), *args)
    # The random hybrid model never repeats itself: narrowed to two tokens, as in
    # test_hybrid_model_speculates_alone.
    bias = {"logit_bias": {"100": 30, "101": 30}} if arch == "qwen3_next" else {}
    try:
        check_identity(server, batched=False, **bias)
        check_identity(server, batched=True, **bias)
    finally:
        stop_server(server)


def test_moe_expert_cache_identity(tiny_moe_dir: Path, tmp_path_factory) -> None:
    prepared = prepare(str(tiny_moe_dir), tmp_path_factory.mktemp("spec-moe") / "p")
    server = start_server(
        prepared, tmp_path_factory.mktemp("spec-moe-s"), "--expert-cache", "16", *SPEC
    )
    try:
        check_identity(server, batched=False)
        check_identity(server, batched=True)
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def hybrid_spec(cache_arch_dirs: dict[str, Path], tmp_path_factory) -> Iterator[Server]:
    server = start_server(
        cache_arch_dirs["qwen3_next"], tmp_path_factory.mktemp("spec-hybrid"), *SPEC
    )
    yield server
    stop_server(server)


def test_hybrid_model_speculates_alone(hybrid_spec: Server) -> None:
    """qwen3_next (Gated DeltaNet + attention) alone: drafts verified and accepted,
    recurrent state restored and recomputed after rejections, output equal. The
    random tiny model is narrowed to two tokens (logit_bias), which it picks between
    by its own logits: prompt lookup drafts runs of them that are partly right."""
    before = spec_counters(hybrid_spec)
    bias = {"logit_bias": {"100": 30, "101": 30}}
    check_identity(hybrid_spec, batched=False, logprobs=2, **bias)
    after = spec_counters(hybrid_spec)
    assert after["passes_total"] > before["passes_total"]
    assert after["accepted_tokens_total"] > before["accepted_tokens_total"]
    assert after["recompute_passes_total"] > before["recompute_passes_total"]


def test_hybrid_model_speculates_batched(hybrid_spec: Server) -> None:
    """Batched, the hybrid model's rows accept different counts; the recompute pass
    runs each row's kept tokens right-padded; output equal."""
    before = spec_counters(hybrid_spec)
    check_identity(hybrid_spec, batched=True, logit_bias={"100": 30, "101": 30})
    after = spec_counters(hybrid_spec)
    assert after["recompute_passes_total"] > before["recompute_passes_total"]


# -- the pieces, on the engine side ---------------------------------------------------


def run_batch(
    model: Any, prompts: list[list[int]], speculative: bool, truth: list[list[int]] | None = None
) -> tuple:
    """Greedy generation of `prompts` through BatchGenerator, speculating or not:
    ([(tokens, final cache)] in prompt order, the speculative counters). `truth`:
    a plain run's tokens per prompt; every step is then a pass over 5 drafted
    tokens, those of the plain run with one made wrong, at a place that moves
    with the position and differs per row."""
    batch = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    stats = SpeculativeStats()
    if speculative:
        spec = Speculation(SpeculativeConfig("prompt-lookup", 5), stats)
        spec.install(batch)
        if truth is not None:

            def draft(seq: Any, context: list[int], k: int) -> list[int]:
                rows = [i for i, t in enumerate(truth) if t[: len(context)] == context]
                if not rows:
                    return []  # the run left the plain one's tokens: the test fails there
                row = rows[0]
                future = truth[row][len(context) : len(context) + k]
                wrong = (len(context) + 2 * row) % 5
                return [t + (j == wrong) for j, t in enumerate(future)]

            spec.draft = draft  # type: ignore[method-assign]
            spec.cost.plan = lambda batch, candidates: 5  # type: ignore[method-assign]
    uids = batch.insert(prompts, max_tokens=[30] * len(prompts))
    for uid in uids:
        if speculative:
            spec.register(uid, True, None)
    finished = {}
    while len(finished) < len(uids):
        for r in batch.next_generated():
            if r.finish_reason is not None:
                finished[r.uid] = (r.all_tokens, r.prompt_cache)
    return [finished[u] for u in uids], stats


def test_rollback_leaves_the_cache_of_a_plain_run(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After speculative steps in which the sequences rejected drafts at different
    positions (one pass takes each row back by its own count: the rows' extra keys
    rolled into their left padding), each sequence's cache holds the keys and values
    a plain run's holds, and the same tokens."""
    model, _ = mlx_load(str(tiny_llama_dir))
    prompts = [[5 + i % 7 for i in range(40)], [9 + (i * i) % 23 for i in range(25)]]

    plain, _ = run_batch(model, prompts, False)
    drops: list[list[int]] = []  # keys each row gave back, per pass

    def recording(cache: list[Any], drop: list[int]) -> None:
        drops.append(list(drop))
        roll_back(cache, drop)

    monkeypatch.setattr(speculative_batch, "roll_back", recording)
    speculative, stats = run_batch(model, prompts, True, truth=[t for t, _ in plain])
    assert stats.drafted_tokens > stats.accepted_tokens > 0  # some rejected
    # Passes in which both rows rejected a draft, at different places: each row's
    # cache taken back by its own count.
    assert sum(min(d) > 0 and len(set(d)) > 1 for d in drops) >= 3
    for (tokens_a, cache_a), (tokens_b, cache_b) in zip(plain, speculative, strict=True):
        assert tokens_b == tokens_a
        for a, b in zip(cache_a, cache_b, strict=True):
            assert a.offset == b.offset
            ka, va, kb, vb = a.keys, a.values, b.keys, b.values
            assert ka.shape == kb.shape
            assert mx.allclose(ka, kb, atol=1e-5).item() and mx.allclose(va, vb, atol=1e-5).item()


@pytest.mark.parametrize("batched", [False, True])
def test_recurrent_state_after_rejection_is_a_plain_runs(cache_arch_dirs, batched: bool) -> None:
    """qwen3_next, alone and two sequences accepting different counts: after
    speculative steps with rejections (recurrent state restored, kept tokens
    recomputed, right-padded), every layer's state, recurrent and attention,
    equals a plain run's, and so do the tokens."""
    model, _ = mlx_load(str(cache_arch_dirs["qwen3_next"]))
    prompts = [[5 + i % 7 for i in range(40)], [9 + (i * i) % 23 for i in range(25)]]
    prompts = prompts if batched else prompts[:1]
    plain, _ = run_batch(model, prompts, False)
    speculative, stats = run_batch(model, prompts, True, truth=[t for t, _ in plain])
    assert stats.passes > 0 and stats.drafted_tokens > stats.accepted_tokens > 0
    assert stats.recompute_passes > 0
    recurrent = 0
    for (tokens_a, cache_a), (tokens_b, cache_b) in zip(plain, speculative, strict=True):
        assert tokens_b == tokens_a
        recurrent += check_same_cache(cache_a, cache_b)
    assert recurrent > 0


def check_same_cache(cache_a: list[Any], cache_b: list[Any]) -> int:
    """Assert two caches of one sequence hold the same state; the recurrent layers'
    count."""
    recurrent = 0
    for a, b in zip(cache_a, cache_b, strict=True):
        if hasattr(a, "keys"):
            assert a.offset == b.offset
            assert mx.allclose(a.keys, b.keys, atol=1e-4).item()
            assert mx.allclose(a.values, b.values, atol=1e-4).item()
        else:
            recurrent += 1
            for x, y in zip(a.cache, b.cache, strict=True):
                assert x.shape == y.shape
                assert mx.allclose(x, y, atol=1e-4).item()
    return recurrent


def test_speculative_sampling_keeps_the_distribution() -> None:
    """Tokens out of accept_sampled are distributed as p, whatever the draft: total
    variation within a bound that holds with overwhelming probability."""
    rng = np.random.default_rng(0)
    vocab, samples = 6, 40_000
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    for draft_token in (0, 3, 5):  # likely, middling and unlikely drafts
        counts = np.zeros(vocab)
        firsts = np.zeros(vocab)
        for _ in range(samples):
            # Two drafted positions; the first emitted token and the second's are checked.
            probs = np.stack([p, p[::-1], p])
            n, after = accept_sampled(probs, [draft_token, 1], rng)
            first = draft_token if n >= 1 else after
            firsts[first] += 1
            if n >= 1:
                counts[1 if n >= 2 else after] += 1
        tv_first = 0.5 * np.abs(firsts / samples - p).sum()
        assert tv_first < 0.015, (draft_token, tv_first)
        second = counts / counts.sum()
        assert 0.5 * np.abs(second - p[::-1]).sum() < 0.03


def test_prompt_lookup_drafts_what_followed_before() -> None:
    index = NgramIndex()
    context = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert index.draft(context, 3) == [4, 5, 9]
    assert index.draft([*context, 4, 7, 7, 7], 2) == [7]  # the output itself is looked up
    assert NgramIndex().draft([1, 2, 3], 4) == []


def test_server_refuses_unknown_mode(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="speculative"):
        start_server(tiny_llama_dir, tmp_path, "--speculative", "medusa")


def perturbed_copy(model_dir: Path, out: Path, scale: float) -> Path:
    """`model_dir` with seeded noise (scale x each matrix's std) added to every matrix:
    the same vocabulary, an argmax that differs from the original's at some positions."""
    shutil.copytree(model_dir, out)
    mx.random.seed(7)
    for path in out.glob("*.safetensors"):
        weights = mx.load(str(path))
        for name, w in weights.items():
            if w.ndim >= 2:
                noise = scale * mx.std(w) * mx.random.normal(w.shape)
                weights[name] = (w + noise).astype(w.dtype)
        mx.save_safetensors(str(path), weights)
    return out


@pytest.mark.parametrize("draft", ["itself", "perturbed"])
def test_draft_model_identity(tiny_llama_dir: Path, tmp_path_factory, draft: str) -> None:
    """A draft model drafts where prompt lookup finds nothing; greedy output unchanged.
    The model itself drafts only right tokens; a perturbed copy of it (same vocabulary)
    drafts wrong ones too, which are rejected, and right ones, which are accepted."""
    work = tmp_path_factory.mktemp("spec-draft")
    model = tiny_llama_dir if draft == "itself" else perturbed_copy(tiny_llama_dir, work / "d", 0.1)
    args = ("--speculative", "draft", "--speculative-draft-model", str(model))
    server = start_server(tiny_llama_dir, work, *args)
    try:
        check_identity(server, batched=False)
        check_identity(server, batched=True)
        counters = spec_counters(server)
    finally:
        stop_server(server)
    if draft == "itself":
        assert counters["acceptance_rate"] > 0.9  # the same model: its drafts are right
    else:
        assert 0 < counters["accepted_tokens_total"] < counters["drafted_tokens_total"]
        assert counters["acceptance_rate"] < 0.9


def test_draft_mode_needs_a_draft_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="speculative_draft_model"):
        start_server(tiny_llama_dir, tmp_path, "--speculative", "draft")


def test_prompt_cache_turns_identity(tiny_llama_dir: Path, tmp_path_factory) -> None:
    """With the prompt cache on, a second turn that resends the first (prompt + answer)
    starts from the state a speculative answer stored: cached tokens reported, and
    the same output as a turn without speculation."""
    args = ("--prompt-cache-bytes", "100000000", *SPEC)
    server = start_server(tiny_llama_dir, tmp_path_factory.mktemp("spec-pc"), *args)
    try:

        def turn(prompt: str, speculative: bool) -> dict:
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
            response = server.http().post(
                "/v1/completions", json={**body, "speculative": speculative}
            )
            assert response.status_code == 200, response.text
            return response.json()

        first = turn(CODE * 4, True)
        follow = CODE * 4 + first["choices"][0]["text"] + "\n# again\n" + CODE
        before = spec_counters(server)
        on = turn(follow, True)
        assert_speculated(before, spec_counters(server))
        # More than the first prompt came from the cache: the answer's state too.
        cached = on["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > first["usage"]["prompt_tokens"]
        assert on["choices"][0]["text"] == turn(follow, False)["choices"][0]["text"]
    finally:
        stop_server(server)
