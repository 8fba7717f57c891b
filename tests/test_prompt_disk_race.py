"""The prompt cache's disk tier under agent timing: the next turn arrives the
instant an answer ends, while the writer thread is still storing that answer
(and deleting an entry: evicted to make room for it).

Before the fix, a load that came after lookup() found the prompt's entry and
after the writer deleted it failed the request with a KeyError (issue 46).
The writer once deleted the prompt's entry as redundant when the answer's
longer state landed; since the disk tier writes only what is new (issue 42),
the answer's state continues that entry instead, and deletions come from
the byte budget.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import make_prompt_cache

from flashserve.engine.prompt_cache import disk as prompt_disk
from flashserve.engine.prompt_cache import files as prompt_files
from flashserve.engine.prompt_cache.disk import DiskTier

from .conftest import NO_EOS, start_server, stop_server

PROMPT = list(range(10, 60))


def _state(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_an_entry_deleted_between_lookup_and_load_is_still_served(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    model, _ = mlx_load(str(tiny_llama_dir))
    first = prompt_files.prepare(PROMPT, _state(model, PROMPT))
    tier = DiskTier(tmp_path, first.nbytes * 3 // 2, "race-model")  # room for one entry
    tier.put(first)
    assert tier.flush()
    name, _, usable = tier.lookup([*PROMPT, 1, 2])
    assert usable == len(PROMPT)
    read = prompt_files.read

    def read_then_lose_the_race(path: Path, fingerprint: str, *args: object):
        out = read(path, fingerprint, *args)
        # Another conversation's state lands now; this entry is evicted for it.
        other = [9, *PROMPT[1:]]
        tier.put(prompt_files.prepare(other, _state(model, other)))
        assert tier.flush()
        assert not path.exists()
        return out

    monkeypatch.setattr(prompt_disk.prompt_files, "read", read_then_lose_the_race)
    loaded = tier.load(name)
    assert loaded is not None and loaded[0] == PROMPT
    tier.close()


def _disk_only_server(model: Path, workdir: Path, disk_bytes: str):
    """A memory tier too small to hold a state: every turn looks its prefix up on disk."""
    return start_server(
        model, workdir, "--prompt-cache-bytes", "1", "--prompt-cache-disk-bytes", disk_bytes
    )


def test_next_turn_sent_the_instant_an_answer_ends(tiny_llama_dir: Path, tmp_path: Path) -> None:
    server = _disk_only_server(tiny_llama_dir, tmp_path, "1GB")
    try:
        http = server.http()
        prompt = "Turn zero. " * 8
        for turn in range(24):
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logit_bias": NO_EOS}
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 200, (turn, answer.text)
            prompt += answer.json()["choices"][0]["text"] + f" Turn {turn + 1}."
        stats = http.get("/cache/stats").json()["prompt_cache"]
        assert stats["disk"]["hits"] > 0, stats
        assert "KeyError" not in server.log_tail(200_000)
    finally:
        stop_server(server)


def test_next_turn_sent_on_the_final_chunk_while_the_writer_evicts(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Streaming: each next turn leaves the moment the chunk carrying finish_reason
    arrives (before the stream's end), while the writer stores the answer and,
    with a disk tier a few states large, evicts older chains to make room."""
    # ~7 states: 40 turns write 185 KB and more (at 200 KB a CI run evicted nothing).
    server = _disk_only_server(tiny_llama_dir, tmp_path, "120000")
    try:
        http = server.http()
        prompt = "Turn zero. " * 8
        for turn in range(40):
            body = {
                "prompt": prompt,
                "max_tokens": 4,
                "temperature": 0,
                "logit_bias": NO_EOS,
                "stream": True,
            }
            text = ""
            with http.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200, turn
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = json.loads(line[len("data: ") :])["choices"][0]
                    text += choice["text"]
                    if choice.get("finish_reason"):
                        break  # the rest of the stream is left unread
            assert text, turn
            prompt += text + f" Turn {turn + 1}."
        disk = http.get("/cache/stats").json()["prompt_cache"]["disk"]
        assert disk["evicted"] > 0 and disk["hits"] > 0, disk
        log = server.log_tail(400_000)
        assert "KeyError" not in log and "Traceback" not in log
    finally:
        stop_server(server)


def test_a_lookup_waits_for_the_queued_write_that_serves_it(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The answer's state, larger than the memory tier, is only on its way to disk
    when the next turn looks its prefix up: the lookup is served that state (from
    the queued write) instead of settling for the prompt's shorter entry."""
    from flashserve.engine.prompt_cache.cache import PromptCache

    model, _ = mlx_load(str(tiny_llama_dir))
    tier = DiskTier(tmp_path, 1 << 30, "race-model")
    cache = PromptCache(1, "race-model", disk=tier)  # no state fits in memory
    cache.store(PROMPT, _state(model, PROMPT))
    assert tier.flush()
    write = tier._write

    def slow_write(entry):
        time.sleep(0.5)  # a state of tens of MB on a busy disk
        write(entry)

    monkeypatch.setattr(tier, "_write", slow_write)
    answered = [*PROMPT, 61, 62, 63, 64]
    cache.store(answered, _state(model, answered))
    state, reused = cache.fetch([*answered, 65, 66])
    assert state is not None and reused == len(answered)
    tier.close()


def test_a_lookup_never_waits_for_the_writer(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Another conversation's state is being written (the writer held there) and this
    conversation's answer is queued behind it, gone from a memory tier too small
    for it: the next turn is served at once with the answer's state, bit for bit,
    waiting neither for the other conversation's write nor for its own."""
    from flashserve.engine.prompt_cache.cache import PromptCache

    model, _ = mlx_load(str(tiny_llama_dir))
    tier = DiskTier(tmp_path, 1 << 30, "race-model")
    cache = PromptCache(1, "race-model", disk=tier)  # no state fits in memory
    writing, release = threading.Event(), threading.Event()
    write = tier._write

    def held_write(entry):
        writing.set()
        release.wait(60)  # a large state on a busy disk
        write(entry)

    monkeypatch.setattr(tier, "_write", held_write)
    try:
        other = [9, 8, 7, *PROMPT]
        cache.store(other, _state(model, other))
        assert writing.wait(10)
        answered = [*PROMPT, 61, 62, 63, 64]
        cache.store(answered, _state(model, answered))
        start = time.monotonic()
        state, reused = cache.fetch([*answered, 65, 66])
        waited = time.monotonic() - start
        # A prompt the queued state runs past is served its common prefix (trimmed).
        diverged, diverged_reused = cache.fetch([*PROMPT, 61, 62, 99])
    finally:
        release.set()
    assert waited < 1.0 and reused == len(answered), (waited, reused)
    expected = _state(model, answered)
    for got, want in zip(state, expected, strict=True):
        assert got.offset == want.offset
        n = want.offset
        assert mx.array_equal(got.keys[:, :, :n], want.keys[:, :, :n])
        assert mx.array_equal(got.values[:, :, :n], want.values[:, :, :n])
    assert diverged is not None and diverged_reused == len(PROMPT) + 2
    assert all(c.offset == len(PROMPT) + 2 for c in diverged)
    tier.close()
