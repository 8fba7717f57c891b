"""The next turn of a conversation reuses its prompt + answer when memory pressure
sheds right after the answer ends (issue 46: under a 1.2 GB cap the next turn
reused only the prompt, or nothing with the disk tier off).

A shed floor far above any real free memory makes every memory check (every
64 batch steps, after that step's answers are stored) shed: the pressure hooks
shrink the expert cache and the prompt cache's memory tier (to its newest
entry), then resident layers stream. The answer's length is chosen so that
its last step is such a check, and the server is asked whether it was: its
step count ends on a check, and its memory tier holds one entry, so a check
ran after the answer's state was stored. The answer is forced to one token
(logit_bias), so the next turn's prompt holds exactly the answer's tokens,
whatever the tokenizer would make of its text.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flashserve.engine.generation.memory_guard import MEMORY_CHECK_INTERVAL as CHECK_EVERY
from tests.conftest import start_server, stop_server
from tests.streaming_fixtures import prepared_model

PROMPT = [10 + i % 200 for i in range(300)]
ANSWER_TOKEN = 77


def _complete(http, prompt: list[int], tokens: int) -> int:
    """Run one request; the prompt tokens it took from the prompt cache."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "logit_bias": {str(ANSWER_TOKEN): 100},
    }
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == tokens
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("disk", ["1000000000", "0"], ids=["disk-tier", "memory-only"])
def test_next_turn_reuses_prompt_and_answer_after_shedding(
    tmp_path_factory, tmp_path: Path, disk: str
) -> None:
    prepared = prepared_model(tmp_path_factory, "qwen3_moe")
    server = start_server(
        prepared,
        tmp_path,
        "--expert-cache",
        "16",
        "--shed-floor",
        str(10**15),
        "--prompt-cache-bytes",
        "1000000000",
        "--prompt-cache-disk-bytes",
        disk,
    )
    try:
        http = server.http(timeout=300)

        def steps() -> int:
            return http.get("/memory").json()["batch"]["steps"]

        # Steps a request takes besides its tokens (its prefill's share).
        before = steps()
        _complete(http, [3, 4, 5, *PROMPT[:40]], 8)
        extra = steps() - before - 8
        prompt = PROMPT
        for turn in range(3):
            start = steps() + extra
            tokens = (CHECK_EVERY - start % CHECK_EVERY) % CHECK_EVERY
            tokens += CHECK_EVERY if tokens < 8 else 0
            cached = _complete(http, prompt, tokens)
            # The answer's last step was a check: the server's own step count ends on
            # one, and the check shrank the memory tier after the answer was stored
            # (an earlier check would leave the answer's state beside the one it kept).
            assert steps() % CHECK_EVERY == 0, (turn, steps())
            # The check runs on the worker just after the reply went out: wait for its
            # shedding event (pressure is on at every check), then read the tier.
            deadline = time.monotonic() + 30
            while len(http.get("/memory").json()["shedding_events"]) < turn + 1:
                assert time.monotonic() < deadline, turn
                time.sleep(0.02)
            memory = http.get("/cache/stats").json()["prompt_cache"]["memory"]
            assert memory["entries"] == 1, (turn, memory)
            if turn:
                # All the last turn sent and got back (but the answer's last
                # token, never fed to the model).
                assert cached >= len(prompt) - 3 - 1, (turn, cached, len(prompt))
            prompt = [*prompt, *[ANSWER_TOKEN] * tokens, 5, 6, 7]
        # Pressure was on at every check (the last one runs just after its reply).
        assert len(http.get("/memory").json()["shedding_events"]) >= 2
        assert http.get("/cache/stats").json()["prompt_cache"]["memory"]["released_bytes"] > 0
    finally:
        stop_server(server)
