"""The `speculative` section of `flashserve bench`: several tokens per pass over the weights.

Rows (issues 44 and 55), each decoded by one engine, greedy, with speculation
off (the request's `speculative: false`) and on (prompt lookup) in turn,
twice (four times for the resident rows, which take seconds); the best run of
each is reported:

* an agent-style edit on the default model (SmolLM2-135M GGUF, prepared):
  reproduce a ~300-token code block with one change, at 0% residency (every
  layer read from disk each pass, page cache dropped after each read) and at
  100% residency;
* prose (a short story: drafts mostly rejected or not found) at 0% and at
  100% residency: the batch should stop drafting where it does not pay;
* four concurrent prose streams at 100% residency (aggregate tokens/s): a
  pass runs every sequence of the batch, so it costs more per sequence than
  one stream's, and drafting must turn off where it does not pay;
* an MoE (the `experts` section's random qwen3_moe) with its expert cache at
  25% of all experts.

Per row: decode tokens/s off and on and their ratio, weight bytes read per
generated token, the acceptance rate and tokens per verification pass, and
whether the two outputs are the same tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flashserve.engine.bench.common import print_table, start_engine
from flashserve.engine.bench.experts import bench_moe_model
from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.weights.layout import is_current

log = logging.getLogger(__name__)

CODE = '''def load_settings(path):
    """Read the settings file and return a dict of its values."""
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def save_settings(path, settings):
    """Write the settings back, one key = value per line, sorted by key."""
    with open(path, "w") as f:
        for key in sorted(settings):
            f.write(f"{key} = {settings[key]}\\n")


def merge_settings(base, override):
    """The base settings with every key of override on top."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged


def check_settings(settings, required):
    """Raise KeyError naming the first required key that is missing."""
    for key in required:
        if key not in settings:
            raise KeyError(f"missing setting: {key}")
    return True
'''
EDIT = (
    "Here is a Python file:\n\n```python\n" + CODE + "```\n\n"
    "Rewrite the whole file with `load_settings` renamed to `read_settings`. "
    "Reply with the complete file in one code block."
)
PROSE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
STREAMS = [  # four concurrent chat users, none of whom asks for text it was given
    PROSE,
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a poem about the sea in autumn.",
    "What were the main causes of the French Revolution?",
]
EDIT_TOKENS, QUICK_TOKENS = 320, 64
MOE_CACHE_FRACTION = 0.25
ROUNDS = 2  # off, on, off, on: the best of each
# Resident rows take seconds a round: more rounds, so that on a shared machine
# each way more likely has one that ran undisturbed (their targets are 3% apart).
RESIDENT_ROUNDS = 4
TARGETS = {
    "edit-0%": 2.0,
    "edit-100%": 1.3,
    "rejected-0%": 0.97,
    "prose-100%": 0.97,
    "4-streams-100%": 0.97,
    "moe-25%": 1.0,
}


@dataclass
class Run:
    tokens: list[list[int]]  # each stream's
    seconds: float  # the window every stream decodes in (one stream: first token to last)
    counted: int  # tokens inside the window, all streams
    bytes_read: int  # weights read from disk, whole run
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    emitted: int = 0
    sequence_passes: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.counted / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Row:
    name: str
    model: str
    off_tokens_per_s: float
    on_tokens_per_s: float
    speedup: float
    target: float
    off_bytes_per_token: float
    on_bytes_per_token: float
    acceptance: float
    tokens_per_pass: float
    tokens: int
    identical: bool


def default_prepared(work_dir: Path) -> Path:
    """The default model, prepared once (the `layers` section's copy)."""
    from flashserve.engine.weights.prepare import prepare
    from flashserve.engine.weights.sources import default_model_path

    prepared = work_dir / "layers-default" / "prepared"
    if not is_current(prepared):
        log.info("preparing the default model into %s", prepared)
        prepare(str(default_model_path()), prepared, force=True)
    return prepared


def generate(engine: Any, prompts: list[list[int]], tokens: int, speculative: bool) -> Run:
    """Greedy requests, one per prompt, all at once; their tokens, the aggregate decode
    rate while every one decodes, and the bytes and drafts the run cost."""
    spec = engine.stats.speculative
    before = (spec.drafted_tokens, spec.accepted_tokens, spec.passes)
    before += (spec.emitted_tokens, spec.sequence_passes)
    read = engine.weight_bytes_read()
    params = SamplingParams(temperature=0.0)

    async def one(prompt: list[int]) -> tuple[list[int], list[float]]:
        out, times = [], []
        request = GenerationRequest(prompt, tokens, params, speculative=speculative)
        async for event in engine.submit(request):
            if isinstance(event, ErrorEvent):
                raise RuntimeError(f"bench request failed: {event.message}")
            if isinstance(event, TokenEvent):
                out.append(event.token)
                times.append(time.perf_counter())
        return out, times

    async def go() -> list[tuple[list[int], list[float]]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    streams = asyncio.run(go())
    after = (spec.drafted_tokens, spec.accepted_tokens, spec.passes)
    after += (spec.emitted_tokens, spec.sequence_passes)
    delta = [a - b for a, b in zip(after, before, strict=True)]
    # From the last stream's first token to the first stream's last: every stream
    # decodes in it (one stream: its first token to its last).
    start = max(times[0] for _, times in streams)
    end = min(times[-1] for _, times in streams)
    counted = sum(1 for _, times in streams for t in times if start < t <= end)
    return Run(
        [out for out, _ in streams],
        max(end - start, 0.0),
        counted,
        engine.weight_bytes_read() - read,
        *delta,
    )


def measure(
    name: str,
    config: EngineConfig,
    texts: list[str],
    tokens: int,
    chat: bool,
    rounds: int = ROUNDS,
) -> Row:
    """Off and on, in turn, `rounds` times, after a warm-up request (kernels, expert
    cache, allocator); `texts`: one prompt per concurrent stream."""
    engine = start_engine(config)
    try:
        assert engine.loaded is not None
        tokenizer = engine.loaded.tokenizer
        if chat:
            prompts = [
                list(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": text}], add_generation_prompt=True
                    )
                )
                for text in texts
            ]
        else:
            prompts = [tokenizer.encode(text) for text in texts]
        generate(engine, prompts, min(tokens, 16), False)
        offs, ons = [], []
        for _ in range(rounds):
            offs.append(generate(engine, prompts, tokens, False))
            ons.append(generate(engine, prompts, tokens, True))
    finally:
        engine.shutdown()
    # The best round of each: on a shared machine noise only ever slows a run down.
    off = max(offs, key=lambda r: r.tokens_per_s)
    on = max(ons, key=lambda r: r.tokens_per_s)
    identical = all(r.tokens == offs[0].tokens for r in offs + ons)
    n_off = max(sum(map(len, off.tokens)), 1)
    n_on = max(sum(map(len, on.tokens)), 1)
    return Row(
        name=name,
        model=Path(config.model or "").parent.name,
        off_tokens_per_s=off.tokens_per_s,
        on_tokens_per_s=on.tokens_per_s,
        speedup=on.tokens_per_s / off.tokens_per_s if off.tokens_per_s else 0.0,
        target=TARGETS[name],
        off_bytes_per_token=off.bytes_read / n_off,
        on_bytes_per_token=on.bytes_read / n_on,
        acceptance=on.accepted / on.drafted if on.drafted else 0.0,
        tokens_per_pass=on.emitted / on.sequence_passes if on.sequence_passes else 1.0,
        tokens=n_on,
        identical=identical,
    )


def run(work_dir: Path, *, quick: bool = False) -> list[dict]:
    tokens = QUICK_TOKENS if quick else EDIT_TOKENS
    default = default_prepared(work_dir)
    streamed = {"residency": "fixed", "resident_layers": 0}
    cold = {"stream_drop_page_cache": True}  # every streamed read from the disk
    base = {"speculative": "prompt-lookup", "speculative_max_draft": 8}
    moe = bench_moe_model(work_dir, quick)
    slots = _expert_count(moe)
    resident = EngineConfig(model=str(default), **base)
    rounds = ROUNDS if quick else RESIDENT_ROUNDS
    rows = [
        measure(
            "edit-0%",
            EngineConfig(model=str(default), **base, **streamed, extra=cold),
            [EDIT],
            tokens,
            chat=True,
        ),
        measure("edit-100%", resident, [EDIT], tokens, chat=True, rounds=rounds),
        measure(
            "rejected-0%",
            EngineConfig(model=str(default), **base, **streamed, extra=cold),
            [PROSE],
            tokens,
            chat=True,
        ),
        measure("prose-100%", resident, [PROSE], tokens, chat=True, rounds=rounds),
        measure("4-streams-100%", resident, STREAMS, tokens, chat=True, rounds=rounds),
        measure(
            "moe-25%",
            EngineConfig(
                model=str(moe), **base, expert_cache=str(max(1, int(slots * MOE_CACHE_FRACTION)))
            ),
            [EDIT],
            tokens,
            chat=False,
        ),
    ]
    print_table(
        f"Speculative decoding (prompt lookup, at most 8 drafted), greedy, up to {tokens} "
        f"tokens per stream; off / on from one engine, best of {ROUNDS} rounds ({rounds} for "
        "the 100% rows); tok/s: all streams together while every one decodes; bytes = "
        "weights read from disk per token",
        [
            "row",
            "off tok/s",
            "on tok/s",
            "on/off",
            "target",
            "MB/token off",
            "MB/token on",
            "accepted",
            "tokens/pass",
            "tokens",
            "same tokens",
        ],
        [
            [
                r.name,
                r.off_tokens_per_s,
                r.on_tokens_per_s,
                r.speedup,
                f">= {r.target}",
                r.off_bytes_per_token / 1e6,
                r.on_bytes_per_token / 1e6,
                f"{r.acceptance:.0%}",
                r.tokens_per_pass,
                r.tokens,
                "yes" if r.identical else "NO",
            ]
            for r in rows
        ],
    )
    return [asdict(r) for r in rows]


def _expert_count(prepared: Path) -> int:
    """Experts of every MoE layer of a prepared model (the expert cache's slots for 100%)."""
    import json

    config = json.loads((prepared / "config.json").read_text())
    text = config.get("text_config") or config
    layers = int(text["num_hidden_layers"])
    return layers * int(text["num_experts"])
