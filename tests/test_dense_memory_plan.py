"""`--residency auto` on a dense model: the memory plan (streaming/denseplan.py) on its
own, and a real server serving a dense model larger than its real cgroup v1 limit
(issue 54: the plan overcommitted, and the process thrashed until the OOM killer
came).
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import anthropic
import mlx.core as mx
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation import memory_guard
from flashserve.engine.generation.memory_guard import MemoryGuard
from flashserve.engine.generation.prefill.layer_major import LayerMajorPrefill, PrefillJob
from flashserve.engine.generation.stats import WorkerStats
from flashserve.engine.loader import load
from flashserve.engine.streaming import denseplan
from flashserve.engine.streaming.denseplan import (
    FILE_HOT,
    FILE_MIN,
    MIN_CONTEXT,
    DenseSettings,
    DenseShape,
    apply_dense_plan,
    plan_dense,
)
from flashserve.engine.streaming.diskio import drop_page_cache
from flashserve.engine.streaming.lending import Lending
from flashserve.engine.streaming.memory import SystemMemory
from flashserve.engine.streaming.residency import plan_residency
from flashserve.engine.weights.model import ModelLoadError
from tests.conftest import NO_EOS, stop_server
from tests.streaming_fixtures import big_llama, prepared_model, source_model
from tests.test_expert_direct_reads import _cached_pages
from tests.test_memory_limits import _make_group, _remove_group, _start_in_group
from tests.test_streaming import PROMPT, greedy

MB = 1024 * 1024
CAP = 256 * MB  # the ~300 MB float32 llama does not fit


def _shape(**changes: object) -> DenseShape:
    shape = DenseShape(
        layer_bytes=[30 * MB] * 24,
        kv_bytes_per_token=200 * 1024,
        held_bytes_per_token=16 * 1024,
        context_length=4096,
        activations=lambda chunk, context: chunk * 128 * 1024 + chunk * context * 128,
        float_copy_bytes=48 * MB,
        float_slice_bytes=16 * MB,
    )
    for key, value in changes.items():
        setattr(shape, key, value)
    return shape


def _settings(**changes: object) -> DenseSettings:
    settings = DenseSettings(
        prompt_cache_bytes=100 * MB,
        prefix_states=True,
        prefetch_depth=2,
        keep_float_copies=True,
        chunk=512,
        context=1024,
    )
    for key, value in changes.items():
        setattr(settings, key, value)
    return settings


def _plan(available: int, limit: int | None = None, **kwargs: object):
    args: dict = {
        "limit": limit or available + 100 * MB,
        "available": available,
        "source": "cgroup v1 /x",
        "shed_floor": 300 * MB,
        "file_bytes": 40 * MB,
        "disk_tier": True,
    }
    args.update(kwargs)
    return plan_dense(_shape(), _settings(), **args)


def _planned(plan) -> int:
    """Everything the plan sets aside, what was in use at load included."""
    return (
        plan.in_use_bytes
        + plan.file_reserve_bytes
        + plan.runtime_reserve_bytes
        + plan.prefill_reserve_bytes
        + plan.kv_reserve_bytes
        + plan.prompt_cache_bytes
        + plan.resident_layer_bytes
        + plan.stream_buffer_bytes
    )


def test_a_model_that_fits_stays_resident_and_its_context_widens() -> None:
    plan, kept = _plan(available=4096 * MB)
    assert plan.resident_layers == 24 and plan.stream_buffer_bytes == 0
    assert kept == _settings(context=4096)  # nothing given up; the context widened
    assert plan.context_tokens == 4096  # the model's whole context fits beside it
    assert _planned(plan) <= plan.limit_bytes


def test_layers_that_do_not_all_fit_take_the_memory_tier_first() -> None:
    """A resident layer saves its bytes on every token; the disk tier keeps prompt
    states: the memory tier goes before a layer does."""
    plan, kept = _plan(available=1100 * MB)
    assert 0 < plan.resident_layers < 24
    assert kept.prompt_cache_bytes == 0 and not kept.prefix_states
    assert kept.chunk == 512  # not given up: it fit
    assert any("memory tier" not in r and "disk tier only" in r for r in plan.reasons)
    # A second layer read ahead would hold a layer's bytes: one layer ahead, one
    # more resident layer than with the configured depth 2.
    assert kept.prefetch_depth == 1 and plan.prefetch_depth == 1
    assert any(r.startswith("layers do not all fit: prefetch depth 1") for r in plan.reasons)
    assert plan.stream_buffer_bytes == 2 * 30 * MB
    assert _planned(plan) <= plan.limit_bytes
    # Without a disk tier the memory tier is the only prompt cache: it stays.
    memory_only, kept = _plan(available=1100 * MB, disk_tier=False)
    assert kept.prompt_cache_bytes == 100 * MB and kept.prefix_states
    assert memory_only.resident_layers < plan.resident_layers


@pytest.mark.parametrize(("placement", "spread"), [("auto", True), ("first_n", False)])
def test_the_plan_spreads_its_resident_layers_unless_told_otherwise(
    monkeypatch, placement: str, spread: bool
) -> None:
    """placement auto: interleaved under the dense plan, so each read ahead overlaps a
    layer's compute or two, never a run of resident layers; a placement set is kept."""
    monkeypatch.setattr(denseplan, "system_memory", lambda: SystemMemory(1100 * MB, 1000 * MB))
    monkeypatch.setattr(denseplan, "process_file_resident", lambda: 40 * MB)
    config = EngineConfig(residency="auto", placement=placement, prompt_cache_bytes=0)
    plan = apply_dense_plan(config, _shape())
    assert 0 < plan.resident_layers < 24
    residency = plan_residency(config, layer_bytes=[30 * MB] * 24, non_layer_bytes=MB)
    resident = residency.resident_layers
    assert len(resident) == plan.resident_layers
    runs = max(len(list(g)) for k, g in itertools.groupby(range(24), resident.__contains__) if k)
    count = len(resident)  # spread: no run longer than the streamed layers leave room for
    shortest = -(-count // (24 - count))
    assert (config.placement, runs) == (("interleaved", shortest) if spread else ("first_n", count))


def test_what_is_kept_free_is_the_code_serving_touches() -> None:
    """Under a small limit the plan keeps free the part of the files mapped at load that
    serving keeps touching (FILE_HOT of them, FILE_MIN at least), not the MoE plan's
    32 MB floor and half again; its shed floor is a fraction of the limit, under that.
    Under a large limit the floor (4%) and its headroom stay the larger."""
    plan, _ = _plan(available=400 * MB, limit=450 * MB, file_bytes=46 * MB)
    assert plan.file_reserve_bytes == int(46 * MB * FILE_HOT) > FILE_MIN
    assert plan.shed_floor_bytes == int(450 * MB * 0.04) < plan.file_reserve_bytes
    more, _ = _plan(available=400 * MB, limit=450 * MB, file_bytes=100 * MB)
    assert more.file_reserve_bytes == int(100 * MB * FILE_HOT)
    # What more code keeps free, layers or the context give up.
    assert (more.resident_layers, more.context_tokens) < (plan.resident_layers, plan.context_tokens)
    small, _ = _plan(available=400 * MB, limit=450 * MB, file_bytes=10 * MB)
    assert small.file_reserve_bytes == FILE_MIN
    large, _ = _plan(available=1900 * MB, limit=2000 * MB, file_bytes=46 * MB)
    assert large.shed_floor_bytes == 80 * MB and large.file_reserve_bytes == 120 * MB


def test_a_tight_limit_gives_up_in_the_stated_order_then_refuses() -> None:
    steps = []
    for available in range(800, 100, -10):
        try:
            plan, kept = _plan(available=available * MB, limit=(available + 100) * MB)
        except ModelLoadError as exc:
            refusal = str(exc)
            break
        assert _planned(plan) <= plan.limit_bytes, available
        given = [r.split("gave up ")[1].split(":")[0] for r in plan.reasons if "gave up" in r]
        steps.append((given, plan.context_tokens, kept))
    else:
        pytest.fail("never refused")
    # Each tighter limit gives up a prefix of the same list, in the stated order.
    order = [
        "the prompt cache's memory tier",
        "prefetch depth",
        "prefetch depth",
        "float copies kept for a layer's chunks",
        *["the prefill chunk"] * 3,
    ]
    longest = max((given for given, _, _ in steps), key=len)
    assert longest == order
    assert all(given == order[: len(given)] for given, _, _ in steps)
    # Then the context shrinks, never below MIN_CONTEXT, before the refusal.
    contexts = [context for given, context, _ in steps if given == order]
    assert min(contexts) >= MIN_CONTEXT and min(contexts) < 1024
    assert steps[-1][2].chunk == 64 and steps[-1][2].prefetch_depth == 0
    assert "cannot serve this model" in refusal and f"{MIN_CONTEXT}-token context" in refusal
    assert re.search(r"\d+\.\d\d MB needed", refusal), refusal


# -- a real server in a real cgroup ----------------------------------------------------


def _peak_private(pid: int, stop: threading.Event, out: list[int]) -> None:
    while not stop.wait(0.02):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    out.append(int(line.split()[1]) * 1024)
        except OSError:
            return


def test_a_dense_model_larger_than_its_cgroup_serves_within_a_plan_that_fits(
    tmp_path_factory, tmp_path
) -> None:
    _, prepared = big_llama(tmp_path_factory)
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["total_bytes"] > CAP
    group = _make_group(CAP)
    server = None
    stop, samples = threading.Event(), []
    try:
        server = _start_in_group(
            group,
            prepared,
            tmp_path,
            "--residency",
            "auto",
            "--prompt-cache-bytes",
            "64MB",
            "--prompt-cache-dir",
            str(tmp_path / "prompt-cache"),
            "--stream-keepalive",
            "0",
            # A float cache: the 8-bit one the plan would take is tests/test_dense_plan_kv.py's.
            "--plan-kv-bits",
            "none",
        )
        assert server.process is not None
        sampler = threading.Thread(
            target=_peak_private, args=(server.process.pid, stop, samples), daemon=True
        )
        sampler.start()
        http = server.http(timeout=600)
        memory = http.get("/memory").json()
        plan = memory["memory_plan"]
        assert plan["limit_bytes"] == CAP and plan["limit_source"] == f"cgroup v1 {group}"
        # Every reserve, with what was in use at load, sums under the limit.
        planned = sum(
            plan[key]
            for key in (
                "in_use_bytes",
                "file_reserve_bytes",
                "runtime_reserve_bytes",
                "prefill_reserve_bytes",
                "kv_reserve_bytes",
                "prompt_cache_bytes",
                "resident_layer_bytes",
                "stream_buffer_bytes",
            )
        )
        assert planned <= CAP, plan
        context = plan["context_tokens"]
        model_context = json.loads((prepared / "config.json").read_text())[
            "max_position_embeddings"
        ]
        assert MIN_CONTEXT <= context < model_context
        assert memory["context_length"] == context
        assert memory["model_context_length"] == model_context
        card = http.get("/v1/models").json()["data"][0]
        assert (card["context_length"], card["model_context_length"]) == (context, model_context)

        _context_errors(server, http, card["id"], context)
        _kv_admission(server, plan["kv_budget_tokens"], context)

        # A prompt that fills the memory-bound context, then its next turn; /health
        # answers at once while the prefill runs (it never waits for the worker).
        prompt = [20 + i % 280 for i in range(context - 24)]
        latencies: list[float] = []
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logit_bias": NO_EOS}
        done = threading.Event()
        replies: list = []

        def complete() -> None:
            replies.append(http.post("/v1/completions", json=body))
            done.set()

        threading.Thread(target=complete, daemon=True).start()
        probe = server.http(timeout=30)
        while not done.wait(0.05):
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
        assert replies[0].status_code == 200, replies[0].text
        assert len(latencies) >= 5 and max(latencies) < 0.5, latencies
        answer = replies[0].json()["choices"][0]["text"]
        nxt = http.post(
            "/v1/completions",
            json={**body, "prompt": [*prompt, *[30] * 8], "max_tokens": 4},
        )
        assert nxt.status_code == 200, nxt.text
        assert nxt.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt)
        assert answer is not None
        stop.set()
        # The plan held: private memory never took the room it keeps free for the
        # file-backed working set (the libraries' code: the kernel's to keep), and
        # the kernel killed nothing. The loan lends the plan's reserves and what it
        # left spare (less than a layer), never that room: its bound is the limit's.
        anon_bound = CAP - plan["file_reserve_bytes"]
        assert samples and max(samples) <= anon_bound, (max(samples), plan)
        assert server.process.poll() is None
        assert "oom_kill 0" in (group / "memory.oom_control").read_text()
        assert int((group / "memory.max_usage_in_bytes").read_text()) <= CAP
        assert http.get("/memory").json()["shedding_events"] == []
    finally:
        stop.set()
        if server is not None:
            stop_server(server)
        _remove_group(group)


def _context_errors(server, http, model: str, context: int) -> None:
    """A request whose KV cannot fit gets the context-length error of its dialect."""
    long_text = "word " * (context + 50)  # the tiny tokenizer: more tokens than that
    # OpenAI: Chat Completions, Completions, Responses (code context_length_exceeded).
    sdk = server.client()
    with pytest.raises(openai.BadRequestError) as chat:
        sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": long_text}], max_tokens=8
        )
    assert chat.value.code == "context_length_exceeded"
    assert f"maximum context length is {context} tokens" in str(chat.value)
    reply = http.post("/v1/completions", json={"prompt": [20] * (context - 4), "max_tokens": 8})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as responses:
        sdk.responses.create(model=model, input=long_text)
    assert responses.value.code == "context_length_exceeded"
    # Anthropic: its own words, which make Claude Code compact the conversation.
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": long_text}]
        )
    found = re.search(r"prompt is too long: (\d+) tokens > (\d+) maximum", str(messages.value))
    assert found and int(found[1]) > context and int(found[2]) == context - 1
    # One that fits is served.
    ok = http.post(
        "/v1/completions",
        json={"prompt": [20] * 16, "max_tokens": 4, "temperature": 0, "logit_bias": NO_EOS},
    )
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layers_read_around_the_page_cache_give_the_resident_tokens(tmp_path_factory, arch) -> None:
    """Under the plan streamed layer files are read with O_DIRECT (weights/reader.py):
    into an aligned start of a longer buffer, the last block read past the file's
    end. The tokens are the resident model's, and no page of the files is cached."""
    src = source_model(tmp_path_factory, arch)
    prepared = prepared_model(tmp_path_factory, arch)
    model, _ = mlx_lm_load(str(src))
    ref_tokens, ref_logprobs, _ = greedy(model, PROMPT)
    loaded = load(EngineConfig(model=str(prepared), resident_layers=0, prefetch_depth=1))
    streamer = loaded.streamer
    streamer.direct_reads = True
    files = [info.file for info in streamer.layers]
    for file in files:
        drop_page_cache(file)
    tokens, logprobs, _ = greedy(loaded.model, PROMPT)
    assert tokens == ref_tokens
    assert mx.allclose(logprobs, ref_logprobs, atol=1e-4).item()
    assert streamer.stats.bytes_read > 0 and streamer.stats.prefetch_hits > 0
    assert any(file.stat().st_size % 4096 for file in files)  # a last block past the end
    assert sum(_cached_pages(file) for file in files) == 0


def streamed_llama(tmp_path_factory) -> tuple:
    """(the tiny llama loaded with every layer streamed, prefetch depth 1; mlx-lm's
    greedy tokens and last log-probabilities for PROMPT)."""
    src = source_model(tmp_path_factory, "llama")
    prepared = prepared_model(tmp_path_factory, "llama")
    model, _ = mlx_lm_load(str(src))
    ref_tokens, ref_logprobs, _ = greedy(model, PROMPT)
    loaded = load(EngineConfig(model=str(prepared), resident_layers=0, prefetch_depth=1))
    return loaded, ref_tokens, ref_logprobs


def test_lent_layers_keep_the_resident_tokens_and_go_back_when_called(tmp_path_factory) -> None:
    """streaming/lending.py: with room on loan, streamed layers that run stay resident
    (no read of their own), greedy tokens unchanged; called back, they stream again."""
    loaded, ref_tokens, ref_logprobs = streamed_llama(tmp_path_factory)
    streamer = loaded.streamer
    size = streamer.layer_bytes(0)
    lending = Lending(
        streamer, 10 * size, 4 * size, kv_bytes_per_token=0, planned_depth=1, max_depth=1
    )
    lending.settle(3 * size + size // 2, grow=True)  # room for three layers
    tokens, logprobs, _ = greedy(loaded.model, PROMPT)
    assert tokens == ref_tokens and mx.allclose(logprobs, ref_logprobs, atol=1e-4).item()
    assert len(streamer.lent) == 3 and sorted(streamer.resident_layers) == sorted(streamer.lent)
    loads = streamer.stats.layer_loads
    greedy(loaded.model, PROMPT, tokens=4)
    per_token = (streamer.stats.layer_loads - loads) / 4
    assert per_token <= len(streamer.layers) - 3 + 1  # the lent ones are read no more
    lending.settle(size, grow=False)  # a prefill comes: room for one
    assert len(streamer.lent) == 1 and streamer.lend_room == 0
    lending.settle(0, grow=False)
    assert streamer.lent == [] and streamer.resident_layers == []
    tokens, _, _ = greedy(loaded.model, PROMPT)
    assert tokens == ref_tokens


def test_lent_layers_are_spread_between_streamed_ones(tmp_path_factory) -> None:
    """The loan keeps first the layers that run after a streamed one: with room for two
    of four streamed layers, 1 and 3, not 0 and 1 (a read ahead would wait out their
    run); with room left and no such layer, whichever runs next."""
    loaded, ref_tokens, _ = streamed_llama(tmp_path_factory)
    streamer = loaded.streamer
    size = streamer.layer_bytes(0)
    lending = Lending(
        streamer, 10 * size, 4 * size, kv_bytes_per_token=0, planned_depth=1, max_depth=1
    )
    lending.settle(2 * size + size // 2, grow=True)
    tokens, _, _ = greedy(loaded.model, PROMPT)
    assert tokens == ref_tokens
    assert sorted(streamer.lent) == [1, 3] and streamer.streamed_layers == [0, 2]
    lending.settle(3 * size + size // 2, grow=True)
    assert greedy(loaded.model, PROMPT)[0] == ref_tokens
    assert sorted(streamer.lent) == [0, 1, 3]


@pytest.mark.parametrize(("times", "from_cache"), [(1, False), (3, False), (3, True)])
def test_reads_past_the_plan_are_logged_and_shed(
    tmp_path_factory, monkeypatch, caplog, times, from_cache
):
    """A process re-reading its code and weights (memory taken by something the plan did
    not foresee) sees more than the model read per step: past twice, and past the slack
    a window's one-time reads get, it says so and sheds, whatever available memory says.
    At the plan's rate plus the slack (a small model's first steps after the page cache
    was dropped: its runtime paged in), or where the prompt cache's disk tier read the
    excess (restoring a state), nothing happens."""
    prepared = prepared_model(tmp_path_factory, "llama")
    loaded = load(EngineConfig(model=str(prepared), resident_layers=2))
    model = sum(f.stat().st_size for f in prepared.rglob("*") if f.is_file())
    # /proc/self/io is read once a window: each read finds `times` the model per step,
    # and the slack besides.
    window = times * model * memory_guard.WINDOW + memory_guard.READ_SLACK
    reads = itertools.count(0, window)
    monkeypatch.setattr(memory_guard, "process_read_bytes", lambda: next(reads))
    disk = SimpleNamespace(stats=SimpleNamespace(bytes_read=0), queued_bytes=lambda: 0)
    guard = MemoryGuard(loaded, kv_budget=None, prompt_cache=SimpleNamespace(disk=disk))
    stats = WorkerStats()
    for step in range(1, 2 * memory_guard.WINDOW + 1):
        stats.steps = step
        if from_cache and step % memory_guard.WINDOW == 0:
            disk.stats.bytes_read += (times - 1) * model * memory_guard.WINDOW
        guard.after_step(stats, {})
    events = loaded.streamer.residency.events
    if times == 1 or from_cache:
        assert events == [] and len(loaded.streamer.resident_layers) == 2
        return
    assert [e.note for e in events] == ["reads past the plan"] * 2
    assert loaded.streamer.resident_layers == []  # one layer shed per window
    assert "memory is overcommitted" in caplog.text
    tokens, _, _ = greedy(loaded.model, PROMPT, tokens=4)
    assert len(tokens) == 4


def test_a_prefill_takes_a_larger_chunk_where_its_prompt_leaves_room() -> None:
    """The plan sized the prefill for its whole context; a shorter prompt leaves the
    rest of the KV room unused, and the prefill takes the configured chunk (and
    kept float copies) back as far as that room allows."""
    shape = _shape()
    streamer = SimpleNamespace(
        dense_shape=shape, planned_prefill=(64, False), max_prefill=(512, True)
    )
    lending = Lending(streamer, 0, 0, kv_bytes_per_token=0, planned_depth=0, max_depth=0)
    need = lambda chunk, keep, tokens: (  # noqa: E731
        shape.activations(chunk, tokens)
        + (shape.float_copy_bytes if keep else shape.float_slice_bytes)
        + tokens * shape.held_bytes_per_token
    )
    assert lending.prefill_settings(need(64, False, 1000), 1000) == (64, False)
    assert lending.prefill_settings(need(256, False, 1000), 1000) == (256, False)
    assert lending.prefill_settings(need(256, True, 1000), 1000) == (256, True)
    assert lending.prefill_settings(10 * need(512, True, 1000), 1000) == (512, True)
    assert lending.prefill_settings(0, 1000) == (64, False)  # never below the plan's


def _kv_admission(server, budget: int, context: int) -> None:
    """Two requests that each fit the context but not the batch's KV together: the
    second waits in the queue until the first has ended; both are served."""
    size = min(context - 8, budget // 2 + 32)
    assert 2 * size > budget >= size
    seen: list[tuple[int, int]] = []
    replies: list = []

    def complete(first: int) -> None:
        body = {"prompt": [first] + [21] * (size - 9), "max_tokens": 8, "temperature": 0}
        replies.append(
            server.http(timeout=600).post("/v1/completions", json={**body, "logit_bias": NO_EOS})
        )

    threads = [threading.Thread(target=complete, args=(t,), daemon=True) for t in (30, 31)]
    for thread in threads:
        thread.start()
    probe = server.http(timeout=30)
    while any(t.is_alive() for t in threads):
        stats = probe.get("/health").json()["stats"]
        seen.append((stats["active"], stats["queued"]))
        time.sleep(0.02)
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert max(active for active, _ in seen) == 1, seen  # never both in the batch
    assert any(queued == 1 for _, queued in seen), seen  # one waited


def test_a_prefill_from_a_restored_prefix_does_not_hold_it_twice(tmp_path_factory) -> None:
    """A next turn starts from a restored state; its chunks' cache copies (which report
    the offset the masks read) must not keep the restored KV alive beside the cache
    it grows into until the chunk's last layer: that was the state held twice, and
    the next turn under a 0.65x cap was OOM-killed."""
    prepared = prepared_model(tmp_path_factory, "llama")
    loaded = load(EngineConfig(model=str(prepared), resident_layers=0, prefetch_depth=0))
    prefill = LayerMajorPrefill.for_model(
        loaded.model, loaded.config, chunk_tokens=64, group_bytes=1 << 30, streamer=loaded.streamer
    )
    assert prefill is not None
    cache = make_prompt_cache(loaded.model)
    first = [5 + i % 200 for i in range(1000)]  # 1,000 tokens: its KV fills 1,024 exactly
    prefill.run([PrefillJob(first, cache)])
    mx.eval([c.state for c in cache])
    restored = sum(c.nbytes for c in cache)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    prefill.run([PrefillJob([7] * 40, cache)])  # grows every layer's KV past 1,024
    mx.eval([c.state for c in cache])
    grown = sum(c.nbytes for c in cache) - restored
    over = mx.get_peak_memory() - base
    # The grown cache (new blocks: mlx-lm concatenates), one layer's old KV while
    # it is replaced, the chunks' activations; not the whole restored KV again.
    layers = len(cache)
    assert over < restored + grown + restored * 1.5 / layers, (over, restored, grown, layers)
