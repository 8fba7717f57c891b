"""`flashserve bench --plot DIR`: the benchmark's numbers as PNGs (matplotlib).

matplotlib is optional (`pip install 'flashserve[plot]'`); `check()` says so
before any section runs. Nothing is measured here: each figure draws the
numbers one section returned, so a figure and its table always agree.

  residency.png     decode tokens/s vs the share of resident layers, prefetch
                    on and off, per model (section layers)
  expert_cache.png  hit rate vs cache size per policy, Belady's optimum beside
                    LRU and LFU (trace replay), and the hit rate measured live
                    (section experts)
  ttft.png          time to first token vs prompt length: from disk (section
                    prefill) and with the prompt cache (section prompt-cache)
  batch.png         aggregate decode tokens/s vs concurrent streams (section batch)

A section that did not run draws no figure.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

INSTALL_HINT = "--plot needs matplotlib: pip install 'flashserve[plot]'"
DPI = 110
SIZE = (7.0, 4.2)


def check() -> str | None:
    """None when plots can be drawn; otherwise what to install."""
    return None if importlib.util.find_spec("matplotlib") else INSTALL_HINT


def write(directory: Path, results: dict[str, Any]) -> list[Path]:
    """Draw a PNG for each section in `results` (section name -> what its run returned)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    directory.mkdir(parents=True, exist_ok=True)
    drawers: list[tuple[str, str, Callable[[Any, Any], None]]] = [
        ("layers", "residency.png", _residency),
        ("experts", "expert_cache.png", _expert_cache),
        ("batch", "batch.png", _batch),
    ]
    written = []
    for section, name, draw in drawers:
        if results.get(section):
            written.append(
                _figure(directory / name, lambda fig, d=draw, s=section: d(fig, results[s]))
            )
    if results.get("prefill") or results.get("prompt-cache"):
        path = directory / "ttft.png"
        written.append(_figure(path, lambda fig: _ttft(fig, results)))
    for path in written:
        log.info("wrote %s", path)
    return written


def _figure(path: Path, draw: Callable[[Any], None]) -> Path:
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=SIZE, dpi=DPI)
    try:
        draw(fig)
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return path


def _residency(fig: Any, models: dict[str, dict]) -> None:
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, (label, result) in zip(axes, models.items(), strict=True):
        rows = result["rows"]
        for prefetch, style in ((True, "-o"), (False, ":o")):
            points = sorted(
                (100 * r["residency"], r["tokens_per_s"])
                for r in rows
                if r["residency"] is not None and r["prefetch"] is prefetch
            )
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, label="prefetch on" if prefetch else "prefetch off")
        plain = [r["tokens_per_s"] for r in rows if r["residency"] is None]
        if plain:
            ax.axhline(plain[0], color="grey", ls="--", lw=1, label="plain mlx-lm")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("resident decoder layers (%)")
        ax.set_ylabel("decode tokens/s")
        ax.set_xlim(-3, 103)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Tokens/s vs residency (the rest streamed from SSD, page cache dropped)")


def _expert_cache(fig: Any, result: dict) -> None:
    ax = fig.add_subplot()
    replay = sorted(result.get("replay", []), key=lambda r: r["fraction"])
    xs = [100 * r["fraction"] for r in replay]
    for policy, label, style in (
        ("lru", "LRU", "-o"),
        ("lfu", "LFU (decay)", "-s"),
        ("belady", "Belady (optimal)", "--^"),
    ):
        ax.plot(xs, [100 * r[policy] for r in replay], style, label=f"{label}, trace replay")
    live = sorted(
        (100 * r["cache_fraction"], 100 * r["hit_rate"], r["name"])
        for r in result.get("rows", [])
        if r["cache_fraction"] is not None and r["hit_rate"] is not None and r["prefetch"] == "none"
    )
    if live:
        ax.scatter(
            [x for x, _, _ in live],
            [y for _, y, _ in live],
            color="black",
            marker="x",
            zorder=3,
            label="measured while decoding",
        )
    ax.set_xlabel("expert cache size (% of all experts)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("Expert cache: hit rate vs cache size, per policy")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _ttft(fig: Any, results: dict[str, Any]) -> None:
    offload = (results.get("prefill") or {}).get("offload") or []
    turns = results.get("prompt-cache") or []
    panels = [p for p in (offload, turns) if p]
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    ax_iter = iter(axes)
    if offload:
        ax = next(ax_iter)
        models = list(dict.fromkeys(r["model"] for r in offload))
        for i, model in enumerate(models):
            rows = sorted((r for r in offload if r["model"] == model), key=_prompt_tokens)
            xs = [r["prompt_tokens"] for r in rows]
            ax.plot(xs, [r["layer_major_s"] for r in rows], "-o", color=f"C{i}", label=model)
            ax.plot(xs, [r["resident_s"] for r in rows], ":", color=f"C{i}", alpha=0.7)
        ax.set_title("From disk (dotted: all resident)", fontsize=9)
        _ttft_axes(ax)
    if turns:
        ax = next(ax_iter)
        for i, residency in enumerate(dict.fromkeys(r["residency"] for r in turns)):
            rows = sorted((r for r in turns if r["residency"] == residency), key=_prompt_tokens)
            xs = [r["prompt_tokens"] for r in rows]
            for key, style, what in (
                ("cold_s", "-o", "cold"),
                ("memory_hit_s", "--s", "memory hit"),
                ("disk_hit_s", ":^", "disk hit"),
            ):
                label = f"{residency} resident, {what}"
                ax.plot(xs, [r[key] for r in rows], style, color=f"C{i}", label=label)
        ax.set_title("Prompt cache: a growing conversation", fontsize=9)
        _ttft_axes(ax)
    fig.suptitle("Time to first token vs prompt length")


def _prompt_tokens(row: dict) -> int:
    return int(row["prompt_tokens"])


def _ttft_axes(ax: Any) -> None:
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def _batch(fig: Any, result: dict) -> None:
    ax = fig.add_subplot()
    rows = result["rows"]
    for i, name in enumerate(dict.fromkeys(r["configuration"] for r in rows)):
        points = sorted(
            (r["streams"], r["tokens_per_s"]) for r in rows if r["configuration"] == name
        )
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, "-o", color=f"C{i}", label=name)
        # Perfect scaling from one stream: one weight load shared by the whole batch.
        ax.plot(xs, [ys[0] * x / xs[0] for x in xs], ":", color=f"C{i}", alpha=0.5)
    streams = sorted({r["streams"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, labels=[str(n) for n in streams])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title("Batch scaling (dotted: linear in the streams)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
