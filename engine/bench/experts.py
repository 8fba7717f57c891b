"""The `experts` section of `flashserve bench`: the MoE expert cache, measured.

On a ~2 GB random qwen3_moe model with 4-bit experts (written and prepared
once under the work dir), in one run:

* decode tokens/s of the fully resident model, and with the expert cache at
  100 / 50 / 25 / 10 % of all experts, next-layer prefetch off and on; the
  page cache is dropped before each configuration;
* per configuration: hit rate, share of decode time blocked on expert I/O,
  bytes read per token, read GB/s during misses, prefetch precision / recall /
  wasted bytes, and the I/O bound 1 / max(compute time, I/O time), where
  compute time is the resident model's time per token and I/O time is the
  bytes read per token at the disk speed measured in the same run;
* a routing trace recorded during the run, replayed through LRU, LFU with
  decay and Belady's optimal policy at the same capacities.

Each configuration first decodes a warm-up prompt (so the cache is in its
steady state), then the counters are reset, the page cache dropped, and a
different prompt is decoded and timed from its first token to its last.
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from flashserve.engine.config import EngineConfig
from flashserve.engine.streaming.diskio import drop_page_cache, measure_read_speed
from flashserve.engine.weights.layout import is_current

log = logging.getLogger(__name__)

# ~2.0 GB on disk: 20 MoE layers x 64 experts of 1.47 MB (4-bit, group 64),
# 8 experts per token (the ratio of Qwen3-30B-A3B's 8 of 128, halved).
BENCH_MOE = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 20,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "num_experts_per_tok": 8,
}
QUICK_MOE = dict(
    BENCH_MOE,
    hidden_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_experts=16,
    num_experts_per_tok=4,
    num_attention_heads=4,
    head_dim=64,
)
FRACTIONS = (1.0, 0.5, 0.25, 0.10)
SEED = 1234
PAIRED_RUNS = 3
HALF_PAIRED_RUNS = 5  # its ratio is a target: more rounds against this machine's noise
WARM_PROMPT = "Once upon a time, in a quiet village by the sea, there lived"
PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a long story about it:"
TRACE_PROMPTS = [
    "What is the capital of France? Explain the history of Paris.",
    "Write a short poem about the ocean and the wind.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} Describe the result.',
]
# The paired rounds' prompts, one a round: each routes to experts of its own, so an
# offload round reads what the rounds before it did not leave in the cache.
ROUND_PROMPTS = [PROMPT, *TRACE_PROMPTS, "List ten uses of a paperclip, with reasons."]


def make_moe_source(
    out: Path, overrides: dict, *, bits: int = 4, group_size: int = 64, seed: int = 0
) -> Path:
    """A random quantized qwen3_moe model directory, built without a float copy in memory.

    engine.weights.synthetic.make_model_dir materializes the float model before
    quantizing (16 GB for this one); here the random init stays lazy and each
    layer is quantized and evaluated on its own, so peak memory is the 4-bit
    model plus one layer of floats.
    """
    from mlx import nn
    from mlx_lm.utils import _get_classes, save_model

    from flashserve.engine.weights.synthetic import ARCHITECTURES, SPECIAL_TOKENS, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    config = dict(ARCHITECTURES["qwen3_moe"])
    config.update(overrides)
    config["vocab_size"] = max(config.get("vocab_size", 0), vocab)
    config["eos_token_id"] = SPECIAL_TOKENS.index("<|im_end|>")
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    nn.quantize(model, group_size=group_size, bits=bits)
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    config["quantization"] = {"group_size": group_size, "bits": bits}
    save_model(out, model, donate_model=True)
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return out


def bench_moe_model(work_dir: Path, quick: bool = False) -> Path:
    """The prepared bench model, written once under `work_dir` (reused afterwards)."""
    from flashserve.engine.weights.prepare import prepare

    name = "experts-moe" + ("-quick" if quick else "")
    source = work_dir / name / "source"
    prepared = work_dir / name / "prepared"
    if not (source / "config.json").exists():
        log.info("writing the expert bench model (%s)", source)
        make_moe_source(source, QUICK_MOE if quick else BENCH_MOE)
    if not is_current(prepared):  # missing, or an older layout
        log.info("preparing %s", prepared)
        prepare(str(source), prepared, force=True)
    return prepared


@dataclass
class Row:
    name: str
    cache_fraction: float | None
    cache_slots: int | None
    prefetch: str
    tokens_per_s: float
    hit_rate: float | None = None
    served_from_memory: float | None = None  # hits + prefetch hits
    io_wait_share: float | None = None
    bytes_per_token: float = 0.0
    read_gb_per_s: float | None = None
    precision: float | None = None
    recall: float | None = None
    wasted_bytes_per_token: float | None = None
    io_bound_tokens_per_s: float | None = None
    paired_ratio: float | None = None  # paired rows: median of the rounds' x bound


def _paired(
    prepared: Path, slots: int, warm_tokens: int, tokens: int, *, preload: bool, rounds: int
) -> tuple[list[tuple[float, float]], float]:
    """Rounds of the resident model, then an offload with `slots` cached experts,
    decoding the same prompt (another one each round); returns their tokens/s per
    round and the offload's bytes read per decoded token. Before each offload
    round the page cache is dropped, so its misses read from the disk."""
    from flashserve.engine.loader import load

    resident = load(EngineConfig(model=str(prepared)))
    offload = load(EngineConfig(model=str(prepared), expert_cache=str(slots)))
    experts = offload.experts
    if preload:
        experts.preload()
    _decode(resident, WARM_PROMPT, warm_tokens)
    _decode(offload, WARM_PROMPT, warm_tokens)
    pairs, read = [], []
    for r in range(rounds):
        text = ROUND_PROMPTS[r % len(ROUND_PROMPTS)]
        first = _decode(resident, text, tokens)
        drop_page_cache(prepared)
        pairs.append((first, _decode(offload, text, tokens, on_first=experts.reset)))
        experts.flush()
        view = experts.snapshot().since_start
        read.append(view.bytes_read / max(view.forwards, 1))
    _release(resident)
    _release(offload)
    return pairs, statistics.mean(read)


def _decode(loaded: Any, text: str, tokens: int, on_first: Any = None) -> float:
    """Decode `tokens` tokens; decode tokens/s from the first token to the last.

    Sampled at temperature 1 with a fixed seed, not greedy: a random model's
    greedy output loops over a few tokens, and a looping token stream routes
    the same experts over and over, which no real text does. The seed makes
    every configuration decode the same tokens (the offload is bit-exact).
    """
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(SEED)
    prompt = mx.array(loaded.tokenizer.encode(text))
    first = None
    n = 0
    for _token, _ in generate_step(
        prompt, loaded.model, max_tokens=tokens, sampler=make_sampler(temp=1.0)
    ):
        n += 1
        if first is None:
            first = time.perf_counter()
            if on_first is not None:
                on_first()
    end = time.perf_counter()
    return (n - 1) / max(end - (first or end), 1e-9)


def _release(loaded: Any) -> None:
    if getattr(loaded, "experts", None) is not None:
        loaded.experts.flush()  # counts and traces the slab layers' last tokens
        loaded.experts.close()
    del loaded
    gc.collect()
    mx.clear_cache()


def run(work_dir: Path, *, tokens: int = 32, quick: bool = False) -> dict:
    """Run the expert-cache benchmark; print its tables; return the numbers."""
    from flashserve.engine.bench.common import print_table
    from flashserve.engine.experts.replay import load_trace, replay, routing_skew
    from flashserve.engine.loader import load
    from flashserve.engine.weights.layout import read_manifest

    work_dir = Path(work_dir)
    prepared = bench_moe_model(work_dir, quick)
    manifest = read_manifest(prepared)
    moe = [entry for entry in manifest["layers"] if entry.get("experts")]
    total = sum(e["experts"]["switches"][0]["num_experts"] for e in moe)
    record = moe[0]["experts"]["switches"][0]["record_bytes"]
    cfg = json.loads((prepared / "config.json").read_text())
    top_k = int(cfg["num_experts_per_tok"])
    disk = measure_read_speed(prepared / "experts", limit=1 << 30)
    log.info("disk: %.2f GB/s cold sequential", disk / 1e9)
    warm_tokens = max(8, tokens // 2)
    trace = work_dir / ("routing-quick.jsonl" if quick else "routing.jsonl")
    trace.unlink(missing_ok=True)

    def resident_run() -> float:
        loaded = load(EngineConfig(model=str(prepared)))
        _decode(loaded, WARM_PROMPT, warm_tokens)
        tps = _decode(loaded, PROMPT, tokens)
        _release(loaded)
        return tps

    # Paired runs: the resident model and an offload loaded side by side and
    # decoding in turns, so both see the same load from the other processes on
    # this machine; the median ratio is the overhead. With every expert cached
    # (the steady state of a full cache), and with half of them.
    pairs, _ = _paired(prepared, total, warm_tokens, tokens, preload=True, rounds=PAIRED_RUNS)
    paired_resident = statistics.median(a for a, _ in pairs)
    paired_ratio = statistics.median(b / a for a, b in pairs)
    half_slots = round(0.5 * total)
    half_pairs, half_bytes = _paired(
        prepared, half_slots, warm_tokens, tokens, preload=False, rounds=HALF_PAIRED_RUNS
    )
    # Each round's I/O bound: its resident speed, unless reading takes longer.
    half_ratio = statistics.median(b * max(1.0 / a, half_bytes / disk) for a, b in half_pairs)
    rows: list[Row] = [
        Row("resident (paired)", None, None, "-", paired_resident),
        Row(
            "100% cache (paired)",
            1.0,
            total,
            "none",
            statistics.median(b for _, b in pairs),
            1.0,
            1.0,
            0.0,
            paired_ratio=paired_ratio,
        ),
        Row(
            "50% cache (paired)",
            0.5,
            half_slots,
            "none",
            statistics.median(b for _, b in half_pairs),
            bytes_per_token=half_bytes,
            paired_ratio=half_ratio,
        ),
    ]
    log.info("paired resident / 100%% cache tokens/s: %s", pairs)
    log.info("paired resident / 50%% cache tokens/s: %s", half_pairs)

    configs = [(f, p, "lru") for f in FRACTIONS for p in ("none", "next-layer")]
    configs.append((FRACTIONS[-1], "none", "lfu"))  # the frequency-aware policy where LRU cycles
    for fraction, prefetch, policy in configs:
        slots = max(top_k, round(fraction * total))
        record_trace = fraction == 1.0 and prefetch == "none"
        config = EngineConfig(
            model=str(prepared),
            expert_cache=str(slots),
            expert_prefetch=prefetch,
            expert_policy=policy,
            record_routing=str(trace) if record_trace else None,
        )
        drop_page_cache(prepared)
        loaded = load(config)
        offload = loaded.experts
        if fraction == 1.0:
            offload.preload()  # every expert cached: the steady state of a full cache
        _decode(loaded, WARM_PROMPT, warm_tokens)
        offload.reset()
        drop_page_cache(prepared)
        tps = _decode(loaded, PROMPT, tokens, on_first=offload.reset)
        offload.flush()
        view = offload.snapshot().since_start
        per_token = view.bytes_read / max(view.forwards, 1)
        rows.append(
            Row(
                name=f"{fraction:.0%} cache" + (f" ({policy})" if policy != "lru" else ""),
                cache_fraction=fraction,
                cache_slots=slots,
                prefetch=prefetch,
                tokens_per_s=tps,
                hit_rate=view.hit_rate,
                served_from_memory=view.served_without_demand_read,
                io_wait_share=view.blocked_s * tps / max(view.forwards, 1),
                bytes_per_token=per_token,
                read_gb_per_s=view.read_gb_per_s or None,
                precision=view.prefetch_precision,
                recall=view.prefetch_recall,
                wasted_bytes_per_token=view.prefetch_wasted_bytes / max(view.forwards, 1),
            )
        )
        if record_trace:
            for text in TRACE_PROMPTS:
                _decode(loaded, text, tokens)
        _release(loaded)
        log.info("expert bench: %s", rows[-1])

    last_resident = resident_run()
    rows.append(Row("resident (last)", None, None, "-", last_resident))
    # Compute time per token: the faster resident measurement (conservative for
    # the I/O bound, which can only grow with it).
    resident_tps = max(paired_resident, last_resident)
    compute_s = 1.0 / resident_tps
    for r in rows:
        if r.cache_fraction is not None:
            io_s = r.bytes_per_token / disk
            r.io_bound_tokens_per_s = 1.0 / max(compute_s, io_s)

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    def mb(v: float | None) -> str:
        return "-" if v is None else f"{v / 1e6:.1f}"

    print_table(
        f"MoE expert cache: decode tokens/s ({tokens} tokens, page cache dropped; "
        f"{total} experts of {record / 1e6:.2f} MB, top-{top_k}; disk {disk / 1e9:.2f} GB/s; "
        f"compute {compute_s * 1e3:.0f} ms/token resident)",
        [
            "configuration",
            "prefetch",
            "tokens/s",
            "x resident",
            "hit rate",
            "served from RAM",
            "I/O wait",
            "MB read/token",
            "read GB/s",
            "precision",
            "recall",
            "wasted MB/token",
            "I/O bound tok/s",
            "x bound",
        ],
        [
            [
                r.name,
                r.prefetch,
                r.tokens_per_s,
                r.tokens_per_s / resident_tps,
                pct(r.hit_rate),
                pct(r.served_from_memory),
                pct(r.io_wait_share),
                mb(r.bytes_per_token),
                "-" if r.read_gb_per_s is None else r.read_gb_per_s,
                pct(r.precision),
                pct(r.recall),
                mb(r.wasted_bytes_per_token),
                "-" if r.io_bound_tokens_per_s is None else r.io_bound_tokens_per_s,
                r.paired_ratio
                if r.paired_ratio is not None
                else "-"
                if r.io_bound_tokens_per_s is None
                else r.tokens_per_s / r.io_bound_tokens_per_s,
            ]
            for r in rows
        ],
    )

    groups = load_trace(trace)
    per_token = top_k * len(moe)
    replay_rows = []
    replays: list[dict] = []
    for fraction in FRACTIONS:
        slots = max(top_k, round(fraction * total))
        results = {p: replay(groups, slots, p, per_token) for p in ("lru", "lfu", "belady")}
        best = max(results["lru"].hit_rate, results["lfu"].hit_rate)
        gap = results["belady"].hit_rate - best
        replays.append(
            {
                "fraction": fraction,
                "slots": slots,
                **{p: r.hit_rate for p, r in results.items()},
                "gap": gap,
            }
        )
        replay_rows.append(
            [
                f"{fraction:.0%}",
                slots,
                pct(results["lru"].hit_rate),
                pct(results["lfu"].hit_rate),
                pct(results["belady"].hit_rate),
                f"{100 * gap:.1f}",
            ]
        )
    accesses = sum(len(g) for g in groups)
    distinct, share = routing_skew(groups, top_k)
    experts_per_layer = total // len(moe)
    print_table(
        f"Routing-trace replay: hit rates ({len(groups)} layer calls, {accesses} expert uses; "
        f"decode used {distinct:.0f} of {experts_per_layer} experts per layer, the top {top_k} "
        f"took {100 * share:.0f}% of uses)",
        ["cache", "slots", "LRU", "LFU-decay", "Belady (optimal)", "Belady - best (points)"],
        replay_rows,
    )

    targets = [
        [
            "every expert cached >= 0.9x resident (median of paired runs)",
            f"{paired_ratio:.2f}x",
            "met" if paired_ratio >= 0.9 else "missed",
        ],
        [
            "50% cache >= 0.8x I/O bound (median of paired runs)",
            f"{half_ratio:.2f}x",
            "met" if half_ratio >= 0.8 else "missed",
        ],
    ]
    for r in replays:
        targets.append(
            [
                f"better policy within 5 points of Belady ({r['fraction']:.0%} cache)",
                f"{100 * r['gap']:.1f} points",
                "met" if r["gap"] <= 0.05 else "missed",
            ]
        )
    print_table("Expert cache targets", ["target", "measured", "status"], targets)
    return {
        "disk_bytes_per_s": disk,
        "resident_tokens_per_s": resident_tps,
        "paired": pairs,
        "paired_ratio": paired_ratio,
        "paired_half": half_pairs,
        "paired_half_ratio": half_ratio,
        "rows": [asdict(r) for r in rows],
        "replay": replays,
        "targets": targets,
        "trace": str(trace),
        "routing_skew": {"distinct_per_layer": distinct, "top_k_share": share},
    }
