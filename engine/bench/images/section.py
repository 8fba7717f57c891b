"""Bench section `images`: what an image costs a turn, and what the prompt cache saves.

A random Gemma 3 vision-language model (a SigLIP-like tower of 12 layers on
448-pixel images, 256 tokens an image; --quick: the tests' tiny one) is
served in-process. One image and a question are sent three ways:

- cold: the prompt cache is not asked; the tower encodes the image and the
  whole prompt is prefilled;
- first turn: the same, its prompt + answer stored in the prompt cache;
- next turn: that conversation resent with a new question; the prefix with
  the image comes from the prompt cache, so the tower does not run.

Each row gives the time to first token, the tower's encode time (what
/metrics' flashserve_image_encode_seconds_total added) and the cached tokens.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from flashserve.engine.bench.common import print_table, start_engine
from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.vision.images import Image, decode_image
from flashserve.engine.vision.prompt import SENTINEL
from flashserve.engine.vision.synthetic import make_gemma3_vlm

log = logging.getLogger(__name__)

# SigLIP-base-like: 1,024 patches of 14 pixels, pooled to 256 tokens (Gemma 3's count).
TOWER = {"num_hidden_layers": 12, "hidden_size": 768, "intermediate_size": 3072}
TOWER_HEADS = {"num_attention_heads": 12}
TEXT = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8}
ANSWER = 8  # tokens of the first turn's answer


def _model(work_dir: Path, quick: bool) -> Path:
    out = work_dir / ("images-gemma3" + "-quick" * quick)
    if not (out / "config.json").exists():
        if quick:
            make_gemma3_vlm(out)
        else:
            make_gemma3_vlm(
                out,
                image_size=448,
                tokens_per_image=256,
                text=TEXT,
                vision={**TOWER, **TOWER_HEADS},
            )
    return out


def _image(size: int) -> Image:
    pixels = (np.random.default_rng(0).random((size, size, 3)) * 255).astype("uint8")
    from PIL import Image as PILImage  # the vision extra's

    data = io.BytesIO()
    PILImage.fromarray(pixels).save(data, "PNG")
    return decode_image(data.getvalue(), 1 << 22)


def _prompt(engine: Engine, turns: list[dict[str, str]], image: Image) -> list[int]:
    """The conversation rendered, the image's placeholder made its tokens, marked."""
    loaded = engine.loaded
    assert loaded is not None and loaded.vision is not None
    images = loaded.vision.prompt([image])
    text = loaded.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    ids = loaded.tokenizer.encode(images.expand(text), add_special_tokens=False)
    return images.mark(ids)


def _turn(
    engine: Engine, prompt: list[int], image: Image, cache: bool, max_tokens: int = 1
) -> dict[str, Any]:
    vision = engine.loaded.vision  # type: ignore[union-attr]
    encoded = vision.encode_seconds
    request = GenerationRequest(
        prompt, max_tokens, SamplingParams(temperature=0.0), use_prompt_cache=cache, images=[image]
    )

    async def go() -> tuple[float, int, list[int]]:
        started = time.perf_counter()
        first, cached, tokens = 0.0, 0, []
        async for event in engine.submit(request):
            if isinstance(event, ErrorEvent):
                raise RuntimeError(f"bench request failed: {event.message}")
            if isinstance(event, TokenEvent):
                first = first or time.perf_counter() - started
                tokens.append(event.token)
            if isinstance(event, DoneEvent):
                cached = event.cached_tokens
        return first, cached, tokens

    ttft, cached, tokens = asyncio.run(go())
    return {
        "prompt_tokens": len(prompt),
        "ttft_s": ttft,
        "encode_s": vision.encode_seconds - encoded,
        "cached_tokens": cached,
        "answer": tokens,
    }


def run(work_dir: Path, *, quick: bool) -> dict[str, Any]:
    """Run the images section; print its table; return its numbers."""
    path = _model(work_dir, quick)
    engine = start_engine(
        EngineConfig(model=str(path), prompt_cache_bytes=1 << 30, prompt_cache_disk_bytes=0)
    )
    try:
        vision = engine.loaded.vision  # type: ignore[union-attr]
        image = _image(56 if quick else 448)
        question = [{"role": "user", "content": f"What is in this picture? {SENTINEL}"}]
        _turn(engine, _prompt(engine, question, image), image, cache=False)  # warm up
        cold = _turn(engine, _prompt(engine, question, image), image, cache=False)
        first = _turn(engine, _prompt(engine, question, image), image, True, ANSWER)
        answer = engine.loaded.tokenizer.decode(first["answer"])  # type: ignore[union-attr]
        turns = [
            *question,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And its colours?"},
        ]
        following = _turn(engine, _prompt(engine, turns, image), image, cache=True)
    finally:
        engine.shutdown()
    rows = [
        [name, t["prompt_tokens"], t["encode_s"], t["ttft_s"], t["cached_tokens"]]
        for name, t in (("cold", cold), ("first turn", first), ("next turn", following))
    ]
    print_table(
        f"Images: one {image.width}x{image.height} image, {vision.count(image)} tokens "
        "(random Gemma 3 vision-language model)",
        ["turn", "prompt tokens", "encode s", "TTFT s", "cached tokens"],
        rows,
    )
    return {
        "encode_s": cold["encode_s"],
        "ttft_cold_s": cold["ttft_s"],
        "ttft_next_turn_s": following["ttft_s"],
        "next_turn_encode_s": following["encode_s"],
        "next_turn_cached_tokens": following["cached_tokens"],
    }
