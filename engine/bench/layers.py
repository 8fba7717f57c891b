"""The `layers` section of `flashserve bench`: layer streaming vs plain mlx-lm.

For each bench model (the default SmolLM2 GGUF and a ~1 GB random llama,
written and prepared once under the work dir), in one run:

* decode tokens/s of plain mlx-lm (the source model, loaded as `serve` loads
  it without a prepared directory) and of the streaming path at 100 / 75 / 50
  / 25 / 0 % residency (first_n placement), prefetch depth 1 and 0;
* peak memory of each row: its resident weights plus the MLX peak above the
  memory in use before the row started (streaming buffers, KV cache,
  activations), which is what the row would peak at in a process of its own;
* the I/O bound: cold read speed of the layer files, measured in the same run,
  divided by the bytes streamed per token. The speed is the best of three
  readers: one sequential reader, MLX's safetensors reader one file at a time,
  and four parallel readers; prefetching keeps more than one read in flight,
  and this disk (like most SSDs) is much faster with a queue of reads than with
  one, so a one-reader figure would be no bound;
* the bytes actually read from the block device per model pass
  (/proc/self/io), which shows that the streamed rows really read from disk.

Every row uses the same decode loop (mlx-lm's generate_step, greedy, a short
prompt, timed from the first token to the last). The page cache is dropped
before every row and streamed layer files are evicted after each use, so every
token reads its streamed layers from disk. Rows are run in rounds, the same
configurations one after another in each round, and the best round of each is
reported: on a shared machine noise only ever slows a row down.
"""

from __future__ import annotations

import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from flashserve.engine.config import EngineConfig
from flashserve.engine.streaming.diskio import drop_page_cache, measure_read_speed
from flashserve.engine.weights.layout import is_current

log = logging.getLogger(__name__)

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
RESIDENCIES = (1.0, 0.75, 0.5, 0.25, 0.0)
# ~1 GB float32 on disk: 16 layers of 61 MB.
LARGE_LLAMA = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
QUICK_LLAMA = dict(
    LARGE_LLAMA,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TARGET_RESIDENT = 0.97  # 100% residency through the streaming path / plain mlx-lm
TARGET_IO = 0.8  # 0% residency with prefetch / I/O bound
TARGET_PREFETCH = 1.3  # prefetch on / off at 0-50% residency


@dataclass
class BenchModel:
    label: str
    source: Path  # what plain mlx-lm loads (a GGUF file or an mlx-lm directory)
    prepared: Path


@dataclass
class Row:
    model: str
    name: str
    residency: float | None  # None: plain mlx-lm
    prefetch: bool | None
    resident_layers: int
    num_layers: int
    weight_bytes: int  # resident weights of this row
    stream_bytes_per_token: int = 0
    io_bound: float | None = None  # tokens/s the disk allows
    runs: list[float] = field(default_factory=list)  # tokens/s per round
    peak_bytes: int = 0
    disk_bytes_per_token: float | None = None  # read from the device; None: not on Linux

    @property
    def tokens_per_s(self) -> float:
        return max(self.runs) if self.runs else 0.0


def bench_models(work_dir: Path, quick: bool) -> list[BenchModel]:
    """The default model and a random llama, prepared once under `work_dir`."""
    from flashserve.engine.weights.prepare import prepare
    from flashserve.engine.weights.sources import default_model_path
    from flashserve.engine.weights.synthetic import make_model_dir

    models = []
    default = default_model_path()
    prepared = work_dir / "layers-default" / "prepared"
    if not is_current(prepared):  # missing, or an older layout
        log.info("preparing the default model into %s", prepared)
        prepare(str(default), prepared, force=True)
    models.append(BenchModel("SmolLM2-135M Q4 (default)", default, prepared))

    name = "layers-llama-quick" if quick else "layers-llama-1gb"
    source = work_dir / name / "source"
    prepared = work_dir / name / "prepared"
    if not (source / "config.json").exists():
        log.info("writing the random llama into %s", source)
        make_model_dir(source, "llama", overrides=QUICK_LLAMA if quick else LARGE_LLAMA)
    if not is_current(prepared):  # missing, or an older layout
        log.info("preparing %s", prepared)
        prepare(str(source), prepared, force=True)
    size = sum(f.stat().st_size for f in (prepared / "layers").iterdir())
    models.append(BenchModel(f"random llama f32 ({size / 1e9:.2f} GB of layers)", source, prepared))
    return models


def decode(model: Any, prompt: mx.array, tokens: int) -> float:
    """Greedy decode; tokens/s from the first token to the last (prefill excluded)."""
    from mlx_lm.generate import generate_step

    first = end = None
    count = 0
    for _token, _ in generate_step(
        prompt, model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        count += 1
        end = time.perf_counter()
        if first is None:
            first = end
    if count < 2 or first is None or end is None:
        return 0.0
    return (count - 1) / max(end - first, 1e-9)


def disk_read_bytes() -> int | None:
    """Bytes this process has read from block devices (Linux); None elsewhere."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def mlx_read_speed(directory: Path, limit: int = 1 << 30) -> float:
    """Cold read speed of the safetensors files under `directory` through mx.load,
    one file at a time as streaming reads them; bytes per second."""
    files = sorted(directory.glob("*.safetensors"))
    drop_page_cache(directory)
    total = 0
    start = time.perf_counter()
    for file in files:
        arrays = mx.load(str(file))
        mx.eval(list(arrays.values()))
        total += sum(a.nbytes for a in arrays.values())
        del arrays
        if total >= limit:
            break
    elapsed = time.perf_counter() - start
    mx.clear_cache()
    return total / max(elapsed, 1e-9)


def parallel_read_speed(directory: Path, threads: int = 4, limit: int = 1 << 30) -> float:
    """Cold read speed of the files under `directory` with `threads` readers, one
    file each at a time, in 16 MB blocks; bytes per second."""
    files, total = [], 0
    for file in sorted(directory.glob("*.safetensors")):
        if total >= limit:
            break
        files.append(file)
        total += file.stat().st_size

    def read(file: Path) -> int:
        buffer = bytearray(16 << 20)
        count = 0
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                count += n
        return count

    drop_page_cache(directory)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(read, files))
    return done / max(time.perf_counter() - start, 1e-9)


def _weight_bytes(model: Any) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()) if isinstance(a, mx.array))


def _measure(
    row: Row, model: Any, prompt: mx.array, tokens: int, cold: Path, passes: Any = None
) -> None:
    """One timed decode of `row`, page cache dropped first; records tokens/s, peak
    memory and device reads per model pass (`passes()`: passes since the decode
    began; default: one per token)."""
    gc.collect()
    mx.clear_cache()
    drop_page_cache(cold)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    read = disk_read_bytes()
    row.runs.append(decode(model, prompt, tokens))
    if read is not None:
        # Per model pass, as streamed bytes are: generate_step also runs a
        # prefill pass and one look-ahead pass, which read every streamed layer.
        count = passes() if passes is not None else tokens
        row.disk_bytes_per_token = (disk_read_bytes() - read) / max(count, 1)
    # The row's own weights plus what decoding added on top of everything in use.
    row.peak_bytes = max(row.peak_bytes, row.weight_bytes + mx.get_peak_memory() - before)


@dataclass
class DiskSpeed:
    sequential: float  # bytes/s, one reader, read() in 16 MB blocks
    mlx: float  # bytes/s, mx.load of one layer file after another
    parallel: float  # bytes/s, four readers

    @property
    def best(self) -> float:
        return max(self.sequential, self.mlx, self.parallel)


def bench_model(bm: BenchModel, *, tokens: int, rounds: int) -> tuple[list[Row], DiskSpeed]:
    """All rows of one model; returns them and the measured disk read speed."""
    from flashserve.engine.loader import load
    from flashserve.engine.streaming.residency import place

    layer_dir = bm.prepared / "layers"
    speed = DiskSpeed(
        measure_read_speed(layer_dir), mlx_read_speed(layer_dir), parallel_read_speed(layer_dir)
    )
    disk = speed.best
    log.info(
        "%s: layer files read cold at %.2f GB/s (one reader %.2f, mx.load %.2f, 4 readers %.2f)",
        bm.label,
        disk / 1e9,
        speed.sequential / 1e9,
        speed.mlx / 1e9,
        speed.parallel / 1e9,
    )
    plain = load(EngineConfig(model=str(bm.source)))
    streamed = load(
        EngineConfig(
            model=str(bm.prepared), prefetch_depth=1, extra={"stream_drop_page_cache": True}
        )
    )
    streamer = streamed.streamer
    num_layers = len(streamer.layers)
    prompt = mx.array(plain.tokenizer.encode(PROMPT))

    plain_row = Row(
        bm.label, "plain mlx-lm", None, None, num_layers, num_layers, _weight_bytes(plain.model)
    )
    rows = [plain_row]
    for fraction in RESIDENCIES:
        count = round(fraction * num_layers)
        resident = place(count, num_layers, "first_n")
        streamed_bytes = sum(
            streamer.layer_bytes(i) for i in range(num_layers) if i not in resident
        )
        weights = streamer.non_layer_bytes + sum(streamer.layer_bytes(i) for i in resident)
        for prefetch in (True, False):
            rows.append(
                Row(
                    bm.label,
                    f"streaming {fraction:.0%}",
                    fraction,
                    prefetch,
                    count,
                    num_layers,
                    weights,
                    streamed_bytes,
                    disk / streamed_bytes if streamed_bytes else None,
                )
            )

    # Warm-up: compile paths and allocator, once per model object.
    decode(plain.model, prompt, 3)
    decode(streamed.model, prompt, 3)
    for r in range(rounds):
        for row in rows:
            if row.residency is None:
                _measure(row, plain.model, prompt, tokens, bm.prepared)
                continue
            streamer.prefetch_depth = 1 if row.prefetch else 0
            streamer.drop_prefetched()
            if streamer.resident_layers != place(row.resident_layers, num_layers, "first_n"):
                streamer.apply(place(row.resident_layers, num_layers, "first_n"))
            loads, calls = streamer.stats.layer_loads, streamer.stats.streamed_calls
            layers = max(len(streamer.streamed_layers), 1)
            _measure(
                row,
                streamed.model,
                prompt,
                tokens,
                bm.prepared,
                passes=lambda c=calls, n=layers: (streamer.stats.streamed_calls - c) / n,
            )
            log.info(
                "%s %s prefetch %s round %d: %.2f tok/s, %d layer loads",
                bm.label,
                row.name,
                row.prefetch,
                r,
                row.runs[-1],
                streamer.stats.layer_loads - loads,
            )
        log.info("%s round %d done", bm.label, r)
    del plain, streamed
    gc.collect()
    mx.clear_cache()
    return rows, speed


def _table_rows(rows: list[Row], plain: float) -> list[list[object]]:
    out: list[list[object]] = []
    for row in rows:
        bound = row.io_bound
        out.append(
            [
                row.name,
                "-" if row.prefetch is None else ("on" if row.prefetch else "off"),
                f"{row.resident_layers}/{row.num_layers}",
                row.tokens_per_s,
                row.tokens_per_s / plain if plain else 0.0,
                f"{row.peak_bytes / 2**20:.0f}",
                f"{row.stream_bytes_per_token / 2**20:.1f}",
                "-"
                if row.disk_bytes_per_token is None
                else f"{row.disk_bytes_per_token / 2**20:.1f}",
                "-" if bound is None else bound,
                "-" if bound is None else row.tokens_per_s / bound,
            ]
        )
    return out


def _find(rows: list[Row], residency: float, prefetch: bool) -> Row:
    return next(r for r in rows if r.residency == residency and r.prefetch == prefetch)


def _targets(rows: list[Row]) -> list[tuple[str, float, float]]:
    """(what, measured ratio, target) for one model's rows."""
    plain = rows[0].tokens_per_s
    full = _find(rows, 1.0, True).tokens_per_s  # best of as many rounds as plain
    zero = _find(rows, 0.0, True)
    out = [
        (
            "100% residency (streaming path) / plain mlx-lm",
            full / plain if plain else 0.0,
            TARGET_RESIDENT,
        ),
        (
            "0% residency, prefetch on / I/O bound",
            zero.tokens_per_s / zero.io_bound if zero.io_bound else 0.0,
            TARGET_IO,
        ),
    ]
    for fraction in (0.5, 0.25, 0.0):
        on, off = _find(rows, fraction, True), _find(rows, fraction, False)
        out.append(
            (
                f"{fraction:.0%} residency, prefetch on / off",
                on.tokens_per_s / off.tokens_per_s if off.tokens_per_s else 0.0,
                TARGET_PREFETCH,
            )
        )
    return out


def _bound_note(rows: list[Row]) -> str:
    """Whether 0% residency is bound by I/O or by compute (plain mlx-lm's speed)."""
    plain = rows[0].tokens_per_s
    zero = _find(rows, 0.0, True)
    if not zero.io_bound or not plain:
        return ""
    if plain < zero.io_bound:
        return (
            f"compute-bound: plain mlx-lm runs {plain:.2f} tok/s, below the 0% I/O bound of "
            f"{zero.io_bound:.2f} tok/s, so 0% residency can reach at most "
            f"{plain / zero.io_bound:.2f}x the I/O bound"
        )
    return (
        f"I/O-bound: the 0% I/O bound ({zero.io_bound:.2f} tok/s) is below plain mlx-lm "
        f"({plain:.2f} tok/s)"
    )


def run(work_dir: Path, *, tokens: int = 32, quick: bool = False) -> dict:
    """Run the layer-streaming benchmark; print its table and targets; return the rows."""
    from flashserve.engine.bench.common import print_table

    rounds = 1 if quick else 2
    started = time.perf_counter()
    results: dict[str, dict] = {}
    all_targets: list[tuple[str, str, float, float]] = []
    for bm in bench_models(work_dir, quick):
        rows, speed = bench_model(bm, tokens=tokens, rounds=rounds)
        disk = speed.best
        plain = rows[0].tokens_per_s
        print_table(
            f"Layer streaming: {bm.label}, {tokens} tokens, best of {rounds} round(s), "
            f"page cache dropped; layer files read cold at {disk / 1e9:.2f} GB/s "
            f"(best of: one reader {speed.sequential / 1e9:.2f}, mx.load {speed.mlx / 1e9:.2f}, "
            f"4 readers {speed.parallel / 1e9:.2f})",
            [
                "configuration",
                "prefetch",
                "resident",
                "tokens/s",
                "x plain",
                "peak MiB",
                "streamed MiB/token",
                "disk read MiB/pass",
                "I/O bound tok/s",
                "x I/O bound",
            ],
            _table_rows(rows, plain),
        )
        if note := _bound_note(rows):
            print(note)
        targets = _targets(rows)
        all_targets += [(bm.label, what, got, want) for what, got, want in targets]
        results[bm.label] = {
            "disk_bytes_per_s": disk,
            "disk_sequential_bytes_per_s": speed.sequential,
            "disk_mlx_bytes_per_s": speed.mlx,
            "disk_parallel_bytes_per_s": speed.parallel,
            "rows": [
                {
                    "name": r.name,
                    "residency": r.residency,
                    "prefetch": r.prefetch,
                    "resident_layers": r.resident_layers,
                    "tokens_per_s": r.tokens_per_s,
                    "runs": r.runs,
                    "peak_bytes": r.peak_bytes,
                    "stream_bytes_per_token": r.stream_bytes_per_token,
                    "disk_bytes_per_token": r.disk_bytes_per_token,
                    "io_bound": r.io_bound,
                }
                for r in rows
            ],
            "targets": {what: got for what, got, _ in targets},
        }
    print("\nLayer streaming targets")
    for label, what, got, want in all_targets:
        verdict = "met" if got >= want else "MISSED"
        print(f"  {label}: {what}: {got:.2f}x (target >= {want}x) {verdict}")
    log.info("layers section took %.0f s", time.perf_counter() - started)
    return results
