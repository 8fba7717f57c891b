"""What every bench section shares: its models, its engine, streams of requests, tables."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import ErrorEvent, GenerationRequest, SamplingParams
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.layout import is_current
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

log = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path.home() / ".cache" / "flashserve" / "bench"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a server the bench starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports (mlx.launch's ring gives rank i the
    port start + i). Taken below the kernel's ephemeral range, where no outgoing
    connection's port lands between this check and the ranks' binds."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(100):
        start = rng.randrange(10000, max(low - count, 10001))
        socks: list[socket.socket] = []
        try:
            for port in range(start, start + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports below {low}")


def bench_model(
    work_dir: Path,
    name: str,
    arch: str,
    overrides: dict,
    *,
    bits: int | None = 4,
    expert_bits: int | None = None,
) -> tuple[Path, Path]:
    """A random model (mlx-lm dir) and its prepared streaming layout, made once."""
    source = work_dir / name / "source"
    prepared = work_dir / name / "prepared"
    if not (source / "config.json").exists():
        log.info("writing bench model %s (%s)", name, arch)
        make_model_dir(source, arch, overrides=overrides, quantize_bits=bits, group_size=64)
    if not is_current(prepared):  # missing, or an older layout
        log.info("preparing %s for streaming", name)
        prepare(str(source), prepared, expert_bits=expert_bits, force=True)
    return source, prepared


def start_engine(config: EngineConfig) -> Engine:
    engine = Engine(config)
    engine.start()
    if not engine.wait_ready():
        raise RuntimeError(f"bench model failed to load: {engine.load_error}")
    return engine


@dataclass
class StreamsResult:
    streams: int
    tokens: int  # decode tokens inside the timed window (all streams)
    seconds: float  # from the last stream's first token to the first stream's last token
    steps: int = 0  # worker decode steps over the whole run
    layer_loads: int = 0  # streamed-layer loads over the whole run
    prefill_seconds: float = 0.0  # submit to the last stream's first token

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def run_streams(engine: Engine, streams: int, tokens: int, text: str = "") -> StreamsResult:
    """`streams` concurrent greedy requests of `tokens` tokens; aggregate decode rate.

    Each prompt is `text` (a long one decodes at a long context) and "Fox {i}:".

    Timed from the moment every stream has its first token (all prompts are
    prefilled) until the first stream ends, counting the tokens in that window:
    steady-state decode of the whole batch, the same measure as the layers
    section. Prefill is reported apart.
    """
    assert engine.loaded is not None
    tokenizer = engine.loaded.tokenizer
    streamer = engine.loaded.streamer
    # Random models may emit EOS early; a strongly negative EOS bias keeps
    # every stream at exactly `tokens` tokens.
    bias = dict.fromkeys(tokenizer.eos_token_ids, -1000000000.0)

    def request(i: int) -> GenerationRequest:
        # Short: on the CPU backend prefill costs about as much per token as decode.
        prompt = tokenizer.encode(f"{text}Fox {i}:")
        return GenerationRequest(prompt, tokens, SamplingParams(temperature=0, logit_bias=bias))

    async def go() -> list[list[float]]:
        async def one(i: int) -> list[float]:
            times = []
            async for event in engine.submit(request(i)):
                if isinstance(event, ErrorEvent):
                    raise RuntimeError(f"bench request failed: {event.message}")
                times.append(time.perf_counter())  # a token, or the end
            return times

        return await asyncio.gather(*(one(i) for i in range(streams)))

    steps, loads = engine.stats.steps, streamer.stats.layer_loads if streamer else 0
    start = time.perf_counter()
    per_stream = asyncio.run(go())
    # times[-1] is each stream's end event; its tokens are the events before it.
    # The window holds only steps in which every stream decodes: from the last
    # stream's first token to the first stream's last token.
    window_start = max(times[0] for times in per_stream)
    window_end = min(times[-2] for times in per_stream if len(times) > 1)
    if window_end <= window_start:  # too few tokens to overlap: time to the end
        window_end = max(times[-1] for times in per_stream)
    decoded = sum(1 for times in per_stream for t in times[:-1] if window_start < t <= window_end)
    return StreamsResult(
        streams=streams,
        tokens=decoded,
        seconds=window_end - window_start,
        steps=engine.stats.steps - steps,
        layer_loads=(streamer.stats.layer_loads if streamer else 0) - loads,
        prefill_seconds=window_start - start,
    )


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
