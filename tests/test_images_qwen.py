"""Images in on Qwen: M-RoPE positions through mlx-lm's language model, served for real.

Tiny random Qwen vision-language models are built in mlx-vlm's format with
Qwen's real image processor (engine/vision/synthetic.py): Qwen3.5 and its
MoE (gated delta-net and full attention layers, a quarter of each head
rotated by M-RoPE), Qwen2.5-VL, Qwen3-VL and its MoE (deepstack features from
the tower's inner layers). Their image tokens have three-part positions and
the text after an image runs behind the token count (the rope delta):
vision/mrope.py gives them to mlx-lm's model. Two things are judged. Against
mlx-vlm's own model of the same weights, for each architecture: the first
token's logits and a greedy answer (decoded in the batch, where the delta
lives in the offsets) are mlx-vlm's. From outside, as tests/test_images.py
does for Gemma 3: the same image gives the same tokens through every API,
every way the layers are held (resident or streamed, alone or batched,
kv_bits, speculative), and as the next turn from the prompt cache (as a cold
prefill of the whole conversation gives).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from .conftest import NO_EOS, Server, start_server, stop_server
from .test_images import (
    QUESTION,
    at_once,
    b64,
    data_url,
    encoded,
    image_part,
    png,
    prepare,
)

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install 'flashserve[vision]'")

OUT = 12  # greedy tokens compared
WIDE, TALL = (64, 96), (96, 64)  # pixels (rows, columns): 2 x 3 and 3 x 2 tokens
# Greedy answers never end (EOS) nor write Qwen's image markup: a random model's
# "<|image_pad|>" in an answer would be image markup in the next turn's history.
BIAS = dict(NO_EOS)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    from flashserve.engine.vision.synthetic import QWEN_IMAGE_TOKENS, make_qwen3_5_vlm

    out = make_qwen3_5_vlm(tmp_path_factory.mktemp("models") / "tiny-qwen3_5-vlm")
    markup = AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids(QWEN_IMAGE_TOKENS)
    BIAS.update({str(i): -100 for i in markup})
    return out


@pytest.fixture(scope="module")
def server(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(
        vlm_dir, tmp_path_factory.mktemp("qwen-server"), "--prompt-cache-bytes", "64000000"
    )
    yield running
    stop_server(running)


def chat(
    server: Server,
    content: Any,
    history: tuple[dict[str, Any], ...] = (),
    bias: Any = BIAS,
    **kwargs: Any,
) -> Any:
    return server.client().chat.completions.create(
        model=server.model_id,
        messages=[*history, {"role": "user", "content": content}],
        max_tokens=OUT,
        temperature=0,
        logit_bias=bias,
        **kwargs,
    )


def ask_about(data: bytes) -> list[dict[str, Any]]:
    return [QUESTION, image_part(data), {"type": "text", "text": "Say more."}]


# -- against mlx-vlm's model --------------------------------------------------------


def _prompt(loaded: Any, images: list[Any], text: str) -> list[int]:
    """A user turn with IMAGE where each image stands, rendered and marked."""
    from flashserve.engine.vision.prompt import SENTINEL

    turn = [{"role": "user", "content": text.replace("IMAGE", SENTINEL)}]
    prompt = loaded.vision.prompt(images)
    rendered = loaded.tokenizer.apply_chat_template(
        turn, tokenize=False, add_generation_prompt=True
    )
    return prompt.mark(loaded.tokenizer.encode(prompt.expand(rendered), add_special_tokens=False))


def _reference(vlm_dir: Path, loaded: Any, prompt: list[int], images: list[Any], n: int) -> Any:
    """mlx-vlm's whole model (its own positions): the first logits and n greedy tokens
    with their logprobs, each from a forward pass over the prompt and the tokens before it."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm import load

    from flashserve.engine.vision.prompt import real_tokens

    model, _ = load(str(vlm_dir))
    out = loaded.vision.processor(images=[i.pixels for i in images], return_tensors="np")
    pixels, grids = mx.array(np.asarray(out["pixel_values"])), mx.array(out["image_grid_thw"])
    ids, first, tokens = real_tokens(prompt), None, []
    for _ in range(n):
        inputs = mx.array([ids])
        logits = model(inputs, pixel_values=pixels, image_grid_thw=grids, mask=mx.ones_like(inputs))
        last = logits.logits[0, -1]
        first = last if first is None else first
        token = int(mx.argmax(last).item())
        tokens.append((token, (last[token] - mx.logsumexp(last)).item()))
        ids.append(token)
    return first, tokens


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashserve.engine.vision.synthetic import make_qwen3_5_vlm

    return make_qwen3_5_vlm(tmp_path_factory.mktemp("models") / "tiny-qwen3_5_moe", moe=True)


@pytest.fixture(scope="module")
def qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashserve.engine.vision.synthetic import make_qwen2_5_vl

    return make_qwen2_5_vl(tmp_path_factory.mktemp("models") / "tiny-qwen2_5_vl")


@pytest.fixture(scope="module")
def qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashserve.engine.vision.synthetic import make_qwen3_vl

    return make_qwen3_vl(tmp_path_factory.mktemp("models") / "tiny-qwen3_vl")


@pytest.fixture(scope="module")
def qwen3_vl_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashserve.engine.vision.synthetic import make_qwen3_vl

    return make_qwen3_vl(tmp_path_factory.mktemp("models") / "tiny-qwen3_vl_moe", moe=True)


@pytest.fixture(scope="module")
def qwen3_5_real_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashserve.engine.vision.synthetic import make_qwen3_5_vlm

    out = tmp_path_factory.mktemp("models") / "tiny-qwen3_5-real-rope"
    return make_qwen3_5_vlm(out, real_rope=True)


@pytest.mark.parametrize(
    "kind",
    ["qwen3_5", "qwen3_5_real_rope", "qwen3_5_moe", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"],
)
def test_positions_and_decode_are_mlx_vlms(kind: str, request: pytest.FixtureRequest) -> None:
    """The prefill's logits are mlx-vlm's to float rounding (without M-RoPE they are
    not), and the greedy answer, decoded in the batch at offset + rope delta, is
    mlx-vlm's answer token for token, beside a text request too."""
    fixture = {"qwen3_5": "vlm_dir", "qwen3_5_moe": "moe_dir"}.get(kind, f"{kind}_dir")
    vlm_dir = request.getfixturevalue(fixture)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from flashserve.engine.config import EngineConfig
    from flashserve.engine.generation.prefill.alone import prefill_alone
    from flashserve.engine.generation.requests import GenerationRequest, SamplingParams
    from flashserve.engine.generation.worker import Engine
    from flashserve.engine.vision.embed import image_embedder
    from flashserve.engine.vision.images import decode_image
    from flashserve.engine.vision.mrope import RopeOffset

    engine = Engine(EngineConfig(model=str(vlm_dir), max_batch=4))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    try:
        loaded = engine.loaded
        images = [decode_image(png(1, WIDE), 1 << 20), decode_image(png(2, TALL), 1 << 20)]
        assert [loaded.vision.count(i) for i in images] == [6, 6]
        prompt = _prompt(loaded, images, "Compare IMAGE with IMAGE, then tell me more.")
        positions = loaded.vision.positions(prompt, images)
        assert positions.delta == -6  # each image: 6 tokens, positions advance by 3

        def first_logits(place: bool) -> mx.array:
            cache = make_prompt_cache(loaded.model)
            embed = image_embedder(loaded, prompt, images, None, cache if place else None)
            logits = prefill_alone(loaded.model, prompt, cache, 0, 7, embed=embed)
            offsets = [c.offset for c in cache if isinstance(getattr(c, "offset", 0), RopeOffset)]
            # Placed, every attention cache has them; Qwen3-VL's chunks left no rows behind.
            assert len(offsets) == (sum(hasattr(c, "keys") for c in cache) if place else 0)
            assert not any(o.positions.deepstack for o in offsets)
            return logits

        reference, tokens = _reference(vlm_dir, loaded, prompt, images, OUT)
        assert mx.abs(first_logits(True) - reference).max().item() < 1e-4
        assert mx.abs(first_logits(False) - reference).max().item() > 1e-2
        greedy = SamplingParams(temperature=0)
        story = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "A story."}])

        async def tokens_of(request: GenerationRequest) -> list[tuple[int, float]]:
            events = [e async for e in engine.submit(request)]
            return [(e.token, e.logprob) for e in events if hasattr(e, "token")]

        async def both() -> list[list[int]]:
            return await asyncio.gather(
                tokens_of(GenerationRequest(prompt, OUT, greedy, images=images, logprobs=0)),
                tokens_of(GenerationRequest(story, OUT, greedy, logprobs=0)),
            )

        alone = asyncio.run(
            tokens_of(GenerationRequest(prompt, OUT, greedy, images=images, logprobs=0))
        )
        together, _ = asyncio.run(both())
    finally:
        engine.shutdown()
    # Token for token; each logprob mlx-vlm's to float rounding (a decode at the
    # wrong position moves them by more than 1e-3 while keeping most tokens).
    for answer in (alone, together):
        assert [t for t, _ in answer] == [t for t, _ in tokens]
        assert max(abs(a - b) for (_, a), (_, b) in zip(answer, tokens, strict=True)) < 1e-4


def test_a_sequence_joins_the_batch_at_its_rope_delta() -> None:
    """A prompt's caches merge into the batch with its rope delta on the offset of each
    (every quantized part too), whichever sequence mlx-lm merges through."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from flashserve.engine.kv.cache import QuantizedSeqKVCache
    from flashserve.engine.vision.mrope import Positions, joining, place

    # Two text tokens, a 2 x 2 image at (2 + h, 2 + w), one text token at 5: delta -2.
    table = np.array([[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]])
    positions = Positions(table)
    assert positions.delta == -2
    assert positions.runs == [(0, 3, True), (3, 6, False), (6, 7, True)]
    for make in (KVCache, lambda: QuantizedSeqKVCache(group_size=32, bits=8)):
        image, text = make(), make()
        place([image], positions)
        for cache, n in ((image, 7), (text, 3)):
            cache.update_and_fetch(mx.zeros((1, 1, n, 32)), mx.zeros((1, 1, n, 32)))
        assert image.offset.delta == -2
        # Trimmed back (the prompt cache's prefix of another prompt): a plain offset.
        assert type(image.offset - 1) is int
        batch = joining([text])[0].merge(joining([text, image]))  # the text one first
        for part in getattr(batch, "parts", None) or [batch]:
            assert part.offset.tolist() == [3, 7 - 2]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen2_5_vl"])
def test_token_counts_are_the_processors(kind: str, request: pytest.FixtureRequest) -> None:
    """An image's tokens are counted from its size alone (no pixel touched while the
    server renders), and the count is the one Qwen's processor cuts it into, for sizes
    below, inside and past its pixel bounds; a shape it refuses is an ImageError."""
    import numpy as np
    from transformers import AutoImageProcessor

    from flashserve.engine.config import EngineConfig
    from flashserve.engine.loader import load
    from flashserve.engine.vision.images import ImageError, decode_image

    model = request.getfixturevalue("vlm_dir" if kind == "qwen3_5" else f"{kind}_dir")
    vision = load(EngineConfig(model=str(model))).vision
    processor = AutoImageProcessor.from_pretrained(str(model), backend="pil")
    rng = np.random.default_rng(0)
    for height, width in [(1, 1), (17, 300), (64, 96), (333, 97), *rng.integers(8, 400, (8, 2))]:
        image = decode_image(png(10, (int(height), int(width))), 1 << 20)
        cut = processor(images=[image.pixels], return_tensors="np")["image_grid_thw"][0]
        assert vision.qwen.grid(image) == tuple(int(v) for v in cut), (height, width)
        assert vision.count(image) == cut.prod() // 4  # merged 2 x 2
    with pytest.raises(ImageError, match="cannot take"):
        vision.count(decode_image(png(11, (2, 600)), 1 << 20))  # aspect ratio past 200


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_a_later_turn_from_the_cache_is_a_cold_prefill(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Attention-only Qwen models reuse the whole first turn, its answer included: the
    answer's keys were rotated while it decoded in the batch (offset + rope delta) and
    the next turn's prompt continues after them. Its answer, logprobs and all, is a
    cold prefill's of the whole conversation, where those tokens are prompt text."""
    from flashserve.engine.config import EngineConfig
    from flashserve.engine.generation.requests import (
        DoneEvent,
        GenerationRequest,
        SamplingParams,
    )
    from flashserve.engine.generation.worker import Engine
    from flashserve.engine.vision.images import decode_image

    model = request.getfixturevalue(f"{kind}_dir")
    warm = Engine(EngineConfig(model=str(model), max_batch=4, prompt_cache_bytes=1 << 28))
    cold = Engine(EngineConfig(model=str(model), max_batch=4))
    for engine in (warm, cold):
        engine.start()
        assert engine.wait_ready(120), engine.load_error
    greedy = SamplingParams(temperature=0)

    async def answer(engine: Engine, prompt: list[int]) -> tuple[list[Any], int]:
        request = GenerationRequest(prompt, OUT, greedy, images=[image], logprobs=0)
        events = [e async for e in engine.submit(request)]
        done = next(e for e in events if isinstance(e, DoneEvent))
        return [(e.token, e.logprob) for e in events if hasattr(e, "token")], done.cached_tokens

    try:
        loaded = warm.loaded
        image = decode_image(png(13, WIDE), 1 << 20)
        first = _prompt(loaded, [image], "Look: IMAGE. What is it?")
        said, _ = asyncio.run(answer(warm, first))
        # The next turn as the answer's own tokens continue it (this template writes
        # a newline before a past answer that the generation prompt does not).
        tail = "<|im_end|><|im_start|>user\nAnd its colours?<|im_end|><|im_start|>assistant"
        later = [*first, *[t for t, _ in said], *loaded.tokenizer.encode(tail)]
        cached, reused = asyncio.run(answer(warm, later))
        fresh, none = asyncio.run(answer(cold, later))
    finally:
        warm.shutdown()
        cold.shutdown()
    assert none == 0 and reused > len(first) + OUT // 2  # the answer's keys too
    assert [t for t, _ in cached] == [t for t, _ in fresh]
    assert max(abs(a - b) for (_, a), (_, b) in zip(cached, fresh, strict=True)) < 1e-4


# -- served ---------------------------------------------------------------------------


def test_the_image_reaches_the_model_through_every_api(server: Server) -> None:
    wide, tall = png(3, WIDE), png(3, TALL)
    first, other = chat(server, ask_about(wide), bias=None), chat(server, ask_about(tall))
    assert first.usage.completion_tokens > 0  # Messages has no logit_bias: compared without
    assert first.choices[0].message.content != other.choices[0].message.content
    text = chat(server, [QUESTION, {"type": "text", "text": "Say more."}])
    # The image's 6 tokens and its markup are the prompt's.
    assert first.usage.prompt_tokens >= text.usage.prompt_tokens + 8
    sdk = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": b64(wide)}
    message = sdk.messages.create(
        model=server.model_id,
        max_tokens=OUT,
        messages=[{"role": "user", "content": [QUESTION, {"type": "image", "source": source},
                                               {"type": "text", "text": "Say more."}]}],
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert message.content[0].text == first.choices[0].message.content  # type: ignore[union-attr]
    parts = [{"type": "input_text", "text": QUESTION["text"]},
             {"type": "input_image", "image_url": data_url(wide)},
             {"type": "input_text", "text": "Say more."}]  # fmt: skip
    response = server.client().responses.create(
        model=server.model_id,
        input=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        max_output_tokens=OUT,
        temperature=0,
    )
    assert response.output_text == first.choices[0].message.content
    # n choices share one prefill (its caches copied per choice, positions and all).
    both = chat(server, ask_about(wide), bias=None, n=2)
    assert [c.message.content for c in both.choices] == [first.choices[0].message.content] * 2


def test_an_image_the_processor_refuses_is_a_400_naming_its_part(server: Server) -> None:
    """Qwen's processor refuses an aspect ratio past 200: the part's 400, never a 500,
    and the server answers the next request."""
    thin = [QUESTION, image_part(png(12, (2, 600)))]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(server, thin)
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "messages.0.content.1.image_url.url"
    assert body["code"] == "invalid_image" and "cannot take" in body["message"]
    assert chat(server, ask_about(png(12, WIDE))).usage.completion_tokens == OUT


def conversation(image: bytes, answer: str) -> tuple[dict[str, Any], ...]:
    return (
        {"role": "user", "content": ask_about(image)},
        {"role": "assistant", "content": answer},
    )


FOLLOW_UP = "And its colours?"


def test_next_turn_reuses_the_image_without_the_tower(server: Server) -> None:
    image = png(4, WIDE)
    first = chat(server, ask_about(image))
    before = encoded(server)
    second = chat(server, FOLLOW_UP, conversation(image, first.choices[0].message.content))
    # Recurrent state (the gated delta-net layers) is reused only where it was stored:
    # the first turn's prompt[:-1], its image inside (tests/test_prompt_cache.py).
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert encoded(server) == before
    # A second image in the next turn: the first from the cache, the second encoded.
    third = chat(
        server,
        [image_part(png(5, TALL)), {"type": "text", "text": FOLLOW_UP}],
        (*conversation(image, first.choices[0].message.content),
         {"role": "user", "content": FOLLOW_UP},
         {"role": "assistant", "content": second.choices[0].message.content}),
    )  # fmt: skip
    assert third.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 1
    assert encoded(server) == before + 1


def answers(server: Server, image: bytes, earlier: str | None) -> dict[str, str]:
    """The image's answer alone, a text's, both in one batch, and (given the first
    answer) the next turn, prefilled whole here: this server keeps no prompt cache."""

    def say(content: Any, history: tuple[dict[str, Any], ...] = ()) -> str:
        return chat(server, content, history).choices[0].message.content

    out = {"alone": say(ask_about(image)), "text": say("Tell me a story.")}
    out["image_batched"], out["text_batched"] = at_once(
        lambda: say(ask_about(image)), lambda: say("Tell me a story.")
    )
    out["next_turn"] = say(FOLLOW_UP, conversation(image, earlier or out["alone"]))
    return out


def test_streamed_layers_batches_and_the_cache_give_the_same_tokens(
    vlm_dir: Path, server: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("qwen-streamed")
    prepared = prepare(vlm_dir, workdir / "prepared")
    image = png(6, WIDE)
    # The next turn from the module's server, its first turn from the prompt cache.
    first = chat(server, ask_about(image)).choices[0].message.content
    cached_next = chat(server, FOLLOW_UP, conversation(image, first))
    assert cached_next.usage.prompt_tokens_details.cached_tokens > 0
    results = {}
    for name, model, flags in (
        ("resident", vlm_dir, ()),
        ("streamed", prepared, ("--residency", "fixed", "--resident-layers", "0")),
        ("kv_bits", vlm_dir, ("--kv-bits", "8", "--kv-group-size", "32")),
    ):
        (workdir / name).mkdir()
        running = start_server(model, workdir / name, "--max-batch", "4", *flags)
        try:
            if name == "streamed":
                assert running.http().get("/memory").json()["streamed_layers"]
            results[name] = answers(running, image, first)
        finally:
            stop_server(running)
    resident = results["resident"]
    assert resident["alone"] == first
    assert resident["image_batched"] == resident["alone"]
    assert resident["text_batched"] == resident["text"]
    assert resident["next_turn"] == cached_next.choices[0].message.content
    assert results["streamed"] == resident
    quantized = results["kv_bits"]
    assert quantized["image_batched"] == quantized["alone"]
    assert quantized["text_batched"] == quantized["text"]


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_vl"])
def test_weights_from_disk_give_the_resident_tokens(
    kind: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Layers streamed from a prepared layout: a prompt with an image prefills
    layer-major in chunks of 28 tokens (its rows, 26 to 31, across two), and answers as
    the resident model does. Qwen3.5-MoE's experts come through the expert cache (two
    slots of four, one call per MoE layer for every chunk); Qwen3-VL's deepstack rows
    join each chunk after its first two layers."""
    model = request.getfixturevalue("moe_dir" if kind == "qwen3_5_moe" else f"{kind}_dir")
    workdir = tmp_path_factory.mktemp(f"disk-{kind}")
    prepared = prepare(model, workdir / "prepared")
    image = png(7, TALL)
    streamed = ("--residency", "fixed", "--resident-layers", "0")
    if kind == "qwen3_5_moe":
        streamed += ("--expert-cache", "2")
    results = {}
    for name, path, flags in (("resident", model, ()), ("streamed", prepared, streamed)):
        (workdir / name).mkdir()
        running = start_server(
            path, workdir / name, "--max-batch", "4", "--prefill-step-size", "28", *flags
        )
        try:
            results[name] = answers(running, image, None)
            if name == "streamed":
                assert running.http().get("/memory").json()["streamed_layers"]
            if name == "streamed" and kind == "qwen3_5_moe":  # the experts came from disk
                start = running.http().get("/cache/stats").json()["since_start"]
                assert start["misses"] > 0 and start["bytes_read"] > 0
        finally:
            stop_server(running)
    assert results["streamed"] == results["resident"]
    assert results["resident"]["image_batched"] == results["resident"]["alone"]


def _narrowed(server: Server, image: bytes, speculative: bool) -> list[tuple[str, float]]:
    """A greedy answer about the image among two tokens: its tokens and logprobs."""
    body = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": ask_about(image)}],
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": True,
        "logit_bias": {"100": 30, "101": 30},
        "speculative": speculative,
    }
    response = server.http().post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [(t["token"], t["logprob"]) for t in content]


def test_speculative_decoding_after_an_image_gives_the_plain_tokens(
    vlm_dir: Path, qwen2_5_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Prompt lookup's drafts verified in one pass per sequence, at offset + rope delta:
    with speculation the answer after an image is the plain one, logprobs included,
    alone and batched, on Qwen3.5 (recurrent state recomputed after a rejection) and
    Qwen2.5-VL. The random model is narrowed to two tokens (tests/test_speculative.py)
    so that drafts are partly right."""
    from .test_speculative import spec_counters

    image = png(8, WIDE)
    for name, model in (("qwen3_5", vlm_dir), ("qwen2_5_vl", qwen2_5_vl_dir)):
        workdir = tmp_path_factory.mktemp(f"spec-{name}")
        flags = ("--speculative", "prompt-lookup", "--speculative-max-draft", "6")
        running = start_server(model, workdir, "--max-batch", "4", *flags)
        try:
            plain = _narrowed(running, image, False)
            before = spec_counters(running)
            alone = _narrowed(running, image, True)
            batched = at_once(*[functools.partial(_narrowed, running, image, True)] * 2)
            after = spec_counters(running)
        finally:
            stop_server(running)
        assert after["accepted_tokens_total"] > before["accepted_tokens_total"], name
        for answer in (alone, *batched):
            assert [t for t, _ in answer] == [t for t, _ in plain], name
            assert max(abs(a - b) for (_, a), (_, b) in zip(answer, plain, strict=True)) < 1e-3


def test_the_image_state_on_disk_serves_the_next_turn_after_a_restart(
    vlm_dir: Path, tmp_path: Path
) -> None:
    """The SSD tier keeps Qwen3.5's state before the first turn's last token (its
    offsets written as plain ints): after a restart the next turn starts there, the
    image not encoded again, and answers as a server that kept it in memory."""
    image = png(9, WIDE)
    args = ("--prompt-cache-bytes", "64000000", "--prompt-cache-dir", str(tmp_path / "pc"))
    running = start_server(vlm_dir, tmp_path, *args)
    try:
        first = chat(running, ask_about(image))
        history = conversation(image, first.choices[0].message.content)
        kept = chat(running, FOLLOW_UP, history).choices[0].message.content
        running.wait_idle(30)
    finally:
        stop_server(running)
    running = start_server(vlm_dir, tmp_path, *args)
    try:
        again = chat(running, FOLLOW_UP, history)
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
        assert encoded(running) == 0
        assert again.choices[0].message.content == kept
    finally:
        stop_server(running)
