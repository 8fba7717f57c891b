"""Images in: a tiny random Gemma 3 vision-language model, served for real.

The model is built here in mlx-vlm's format with a real image processor
(engine/vision/synthetic.py), served by `flashserve serve`, and asked through
the official SDKs. With greedy decoding the answer is a function of the
prompt's embeddings, so what the model saw is judged from outside: two
images give two answers, one image gives one answer through every dialect
and every way the language model's layers are held (resident or streamed,
alone or beside a text request in the batch).
"""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from .conftest import NO_EOS, Server, _clean_env, free_port, metric, start_server, stop_server

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install 'flashserve[vision]'")
np = pytest.importorskip("numpy")
PIL = pytest.importorskip("PIL.Image")

OUT = 12  # greedy tokens compared
TOKENS_PER_IMAGE = 4  # the tiny model's (engine/vision/synthetic.py)


def png(seed: int, size: tuple[int, int] = (60, 70), kind: str = "PNG") -> bytes:
    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    PIL.fromarray(pixels).save(out, kind)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{b64(data)}"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashserve.engine.vision.synthetic import make_gemma3_vlm

    return make_gemma3_vlm(tmp_path_factory.mktemp("models") / "tiny-gemma3-vlm")


@pytest.fixture(scope="module")
def server(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("vlm-server")
    running = start_server(
        vlm_dir,
        workdir,
        *("--prompt-cache-bytes", "64000000", "--max-images", "3"),
        *("--max-image-pixels", "1000000"),
    )
    yield running
    stop_server(running)


def chat(
    server: Server, content: Any, history: tuple[dict[str, Any], ...] = (), **kwargs: Any
) -> Any:
    kwargs.setdefault("logit_bias", NO_EOS)
    return server.client().chat.completions.create(
        model=server.model_id,
        messages=[*history, {"role": "user", "content": content}],
        max_tokens=OUT,
        temperature=0,
        **kwargs,
    )


def image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


QUESTION = {"type": "text", "text": "What is in this picture?"}


def ask_about(data: bytes) -> list[dict[str, Any]]:
    return [QUESTION, image_part(data)]


def encoded(server: Server) -> float:
    text = server.http().get("/metrics").text
    return metric(text, "flashserve_images_encoded_total") or 0.0


def test_the_image_reaches_the_model(server: Server) -> None:
    first, second = chat(server, ask_about(png(1))), chat(server, ask_about(png(2)))
    text = chat(server, "What is in this picture?")
    assert first.choices[0].message.content != second.choices[0].message.content
    assert first.choices[0].message.content != text.choices[0].message.content
    # The image's tokens are the prompt's: 4 placeholders and their markup.
    assert first.usage.prompt_tokens > text.usage.prompt_tokens + TOKENS_PER_IMAGE
    # Two images in one message reach the model in their order.
    ab = chat(server, [QUESTION, image_part(png(1)), image_part(png(2))])
    ba = chat(server, [QUESTION, image_part(png(2)), image_part(png(1))])
    assert ab.usage.prompt_tokens == ba.usage.prompt_tokens
    assert ab.usage.prompt_tokens > first.usage.prompt_tokens + TOKENS_PER_IMAGE
    assert ab.choices[0].message.content != ba.choices[0].message.content
    # n choices share one prefill with the image: greedy, each is the same answer.
    both = chat(server, ask_about(png(1)), n=2)
    assert [c.message.content for c in both.choices] == [first.choices[0].message.content] * 2


def test_the_three_apis_give_the_same_tokens(server: Server) -> None:
    image = png(3)
    seen = chat(server, ask_about(image), logit_bias=None)  # Messages has no logit_bias
    sdk = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(image)}}  # fmt: skip
    message = sdk.messages.create(
        model=server.model_id,
        max_tokens=OUT,
        messages=[{"role": "user", "content": [QUESTION, block]}],
        extra_body={"temperature": 0},
    )
    assert seen.usage.completion_tokens > 0
    counted = sdk.messages.count_tokens(
        model=server.model_id, messages=[{"role": "user", "content": [QUESTION, block]}]
    )
    assert counted.input_tokens == seen.usage.prompt_tokens
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == seen.usage.prompt_tokens
    assert message.content[0].text == seen.choices[0].message.content  # type: ignore[union-attr]
    # Responses (Codex's --image): input_text and input_image parts.
    parts = [{"type": "input_text", "text": QUESTION["text"]},
             {"type": "input_image", "image_url": data_url(image)}]  # fmt: skip
    response = server.client().responses.create(
        model=server.model_id,
        input=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        max_output_tokens=OUT,
        temperature=0,
    )
    assert response.usage is not None
    assert response.usage.input_tokens == seen.usage.prompt_tokens
    assert response.output_text == seen.choices[0].message.content


def test_next_turn_reuses_the_image_without_the_tower(server: Server) -> None:
    image = png(4)
    first = chat(server, ask_about(image))
    before = encoded(server)
    history = (
        {"role": "user", "content": ask_about(image)},
        {"role": "assistant", "content": first.choices[0].message.content},
    )
    second = chat(server, "And its colours?", history)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The whole first turn (its image inside) came from the prompt cache...
    assert cached >= first.usage.prompt_tokens
    # ...and the vision tower did not run for it.
    assert encoded(server) == before
    vision = server.http().get("/memory").json()["vision"]
    assert vision["images_encoded"] == before and vision["weight_bytes"] > 0
    # Another image in the same place: only the text before it is reused.
    other = chat(server, ask_about(png(5)))
    other_next = chat(
        server,
        "And its colours?",
        ({"role": "user", "content": ask_about(png(5))},
         {"role": "assistant", "content": other.choices[0].message.content}),
    )  # fmt: skip
    assert other_next.usage.prompt_tokens_details.cached_tokens >= other.usage.prompt_tokens
    fresh = chat(server, ask_about(png(6)))
    assert fresh.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - (
        TOKENS_PER_IMAGE
    )


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    """Each call's result, the calls made at the same time (so the server batches them)."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def answers(server: Server, image: bytes) -> tuple[str, str, str, str]:
    """The image's answer alone, the text's alone, then both at once in one batch."""

    def say(content: Any) -> str:
        return chat(server, content).choices[0].message.content

    alone, text = say(ask_about(image)), say("Tell me a story.")
    image_batched, text_batched = at_once(
        lambda: say(ask_about(image)), lambda: say("Tell me a story.")
    )
    return alone, text, image_batched, text_batched


def prepare(model: Path, out: Path) -> Path:
    """`flashserve prepare` of the model: its layout, the vision tower's file in it."""
    subprocess.run(
        [sys.executable, "-m", "flashserve.server.cli", "prepare", str(model), str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (out / "vision.safetensors").is_file()  # the tower travels with the layout
    return out


def test_streamed_layers_give_the_resident_tokens(
    vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("vlm-streamed")
    prepared = prepare(vlm_dir, workdir / "prepared")
    image = png(7)
    results = {}
    for name, model, flags in (
        ("resident", vlm_dir, ()),
        ("streamed", prepared, ("--residency", "fixed", "--resident-layers", "0")),
        ("kv_bits", vlm_dir, ("--kv-bits", "8", "--kv-group-size", "32")),  # alone == batched
    ):
        (workdir / name).mkdir()
        running = start_server(model, workdir / name, "--max-batch", "4", *flags)
        try:
            if name == "streamed":
                memory = running.http().get("/memory").json()
                assert memory["streamed_layers"], memory
            results[name] = answers(running, image)
        finally:
            stop_server(running)
    alone, text, image_batched, text_batched = results["resident"]
    assert image_batched == alone and text_batched == text
    assert results["streamed"] == results["resident"]
    alone, text, image_batched, text_batched = results["kv_bits"]
    assert image_batched == alone and text_batched == text


# -- bad input ------------------------------------------------------------------------


def refused_openai(server: Server, content: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(server, content)
    body = refused.value.body
    assert isinstance(body, dict)
    return body


def test_bad_images_are_400s_naming_the_part(server: Server) -> None:
    text = {"type": "text", "text": "Look:"}

    def url(value: str) -> list[dict[str, Any]]:
        return [text, {"type": "image_url", "image_url": {"url": value}}]

    unreadable = refused_openai(server, url(data_url(b"not an image at all")))
    assert unreadable["param"] == "messages.0.content.1.image_url.url"
    assert "cannot be read" in unreadable["message"]
    not_base64 = refused_openai(server, url("data:image/png;base64,%%%"))
    assert "base64" in not_base64["message"]
    tiff = refused_openai(server, url(data_url(png(8, kind="TIFF"))))
    assert "TIFF is not supported" in tiff["message"]
    remote = refused_openai(server, url("https://example.com/cat.png"))
    assert remote["param"] == "messages.0.content.1.image_url.url"
    assert "not fetched" in remote["message"]
    many = refused_openai(server, [text, *[image_part(png(9))] * 4])  # --max-images 3
    assert many["param"] == "messages.0.content.4.image_url.url"
    assert many["code"] == "too_many_images"
    # The client's own text holding the model's image markup: the counts disagree.
    markup = refused_openai(
        server, [{"type": "text", "text": "<image_soft_token>"}, image_part(png(9))]
    )
    assert "image tokens do not match" in markup["message"]
    # Responses: the same refusals, named its way.
    parts = [{"type": "input_image", "image_url": "https://example.com/cat.png"}]
    with pytest.raises(openai.BadRequestError) as responses:
        server.client().responses.create(
            model=server.model_id,
            input=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        )
    body = responses.value.body
    assert isinstance(body, dict) and body["param"] == "input[0].content[0].image_url"
    # A large image is downscaled, never refused.
    ramp = np.linspace(0, 255, 1500 * 1400 * 3).reshape(1500, 1400, 3).astype("uint8")
    out = io.BytesIO()
    PIL.fromarray(ramp).save(out, "PNG")  # 2.1 megapixels over --max-image-pixels
    big = chat(server, ask_about(out.getvalue()))
    assert big.usage.completion_tokens > 0


def test_bad_anthropic_images_are_anthropic_400s(server: Server) -> None:
    def ask(source: dict[str, Any]) -> httpx.Response:
        block = {"type": "image", "source": source}
        return server.http().post(
            "/v1/messages",
            json={"model": server.model_id, "max_tokens": 4,
                  "messages": [{"role": "user", "content": [block]}]},
        )  # fmt: skip

    garbage = ask({"type": "base64", "media_type": "image/png", "data": b64(b"garbage")})
    remote = ask({"type": "url", "url": "https://example.com/cat.png"})
    for response, says in ((garbage, "cannot be read"), (remote, "not fetched")):
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert says in error["error"]["message"]
    # Inside a tool_result (Claude Code's Read of a PNG) a vision model sees the image.
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.png"}}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(png(11))}}  # fmt: skip
    body = {
        "model": server.model_id,
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "Read a.png"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [image]}]},
        ],
    }  # fmt: skip
    before = encoded(server)
    seen = server.http().post("/v1/messages", json=body)
    assert seen.status_code == 200, seen.text
    assert encoded(server) == before + 1


def test_a_large_image_is_downscaled_to_the_pixel_limit() -> None:
    from flashserve.engine.vision.images import decode_image

    image = decode_image(png(12, size=(400, 300)), max_pixels=30_000)
    assert image.width * image.height <= 30_000
    assert abs(image.width / image.height - 300 / 400) < 0.02  # aspect kept
    small = decode_image(png(12, size=(40, 30)), max_pixels=30_000)
    assert (small.width, small.height) == (30, 40)


@contextmanager
def _vlm_engine(vlm_dir: Path) -> Iterator[Any]:
    """An in-process engine on the tiny VLM (batch of 4), shut down after."""
    from flashserve.engine.config import EngineConfig
    from flashserve.engine.generation.worker import Engine

    engine = Engine(EngineConfig(model=str(vlm_dir), max_batch=4))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    assert engine.loaded is not None
    try:
        yield engine
    finally:
        engine.shutdown()


def _marked(loaded: Any, image: Any) -> list[int]:
    """A one-image user turn's prompt ids, the image's placeholders marked by its hash."""
    from flashserve.engine.vision.prompt import SENTINEL

    images = loaded.vision.prompt([image])
    chat = [{"role": "user", "content": f"Look: {SENTINEL}"}]
    text = images.expand(loaded.tokenizer.apply_chat_template(chat, tokenize=False))
    return images.mark(loaded.tokenizer.encode(text, add_special_tokens=False))


def test_images_encode_on_their_own_thread_while_the_batch_decodes(vlm_dir: Path) -> None:
    """The tower made slow (a second an image): a text answer in the batch keeps
    producing tokens meanwhile, and the encode runs on the vision thread."""
    from flashserve.engine.generation.requests import GenerationRequest, SamplingParams
    from flashserve.engine.vision.images import decode_image

    with _vlm_engine(vlm_dir) as engine:
        loaded = engine.loaded
        vision, tokenizer = loaded.vision, loaded.tokenizer
        encode = vision.features
        threads: list[str] = []
        windows: list[tuple[float, float]] = []

        def slow(image: Any) -> Any:
            started = time.perf_counter()
            threads.append(threading.current_thread().name)
            time.sleep(1.0)
            rows = encode(image)
            windows.append((started, time.perf_counter()))
            return rows

        vision.features = slow
        image = decode_image(png(13), 1 << 20)
        marked = _marked(loaded, image)
        greedy = SamplingParams(temperature=0, logit_bias={int(k): v for k, v in NO_EOS.items()})
        story = tokenizer.apply_chat_template([{"role": "user", "content": "A story."}])
        times: list[float] = []

        async def go() -> list[Any]:
            talking = engine.submit(GenerationRequest(story, 400, greedy))

            async def listen() -> None:  # each text token's arrival
                async for _ in talking:
                    times.append(time.perf_counter())

            listening = asyncio.create_task(listen())
            while len(times) < 3:  # the text answer decodes before the image arrives
                await asyncio.sleep(0.01)
            looking = engine.submit(GenerationRequest(marked, 4, greedy, images=[image]))
            seen: list[Any] = [event async for event in looking]
            await listening
            return seen

        seen = asyncio.run(go())
        parts = engine.stats.ttft.total  # summed over both requests: the image's alone
    assert threads == ["flashserve-vision_0"]
    assert len([e for e in seen if getattr(e, "token", None) is not None]) == 4
    ((started, ended),) = windows
    assert sum(started < t < ended for t in times) >= 5  # tokens while the tower ran
    # Its time to first token says where the second went.
    assert parts.image_encode_s >= 1.0 > parts.prefill_s


def test_a_vision_model_without_the_extra_names_the_install_command(
    vlm_dir: Path, tmp_path: Path
) -> None:
    """mlx-vlm missing (a module that fails to import stands in for it): the model does
    not load, and the one line `serve` exits with says how to add it."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "mlx_vlm.py").write_text('raise ImportError("No module named mlx_vlm")\n')
    env = {**_clean_env(), "PYTHONPATH": str(stub)}
    cmd = [sys.executable, "-m", "flashserve.server.cli", "serve", "--model", str(vlm_dir)]
    cmd += ["--port", str(free_port()), "--prompt-cache-dir", str(tmp_path / "pc")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=120)
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert "pip install 'flashserve[vision]'" in last, last


def test_an_image_state_on_disk_serves_the_next_turn_after_a_restart(
    vlm_dir: Path, tmp_path: Path
) -> None:
    """The SSD tier keeps the image's hash in its token keys: after a restart the
    next turn with the same image is restored from disk and not encoded again."""
    image = png(14)
    args = ("--prompt-cache-bytes", "64000000", "--prompt-cache-dir", str(tmp_path / "pc"))
    running = start_server(vlm_dir, tmp_path, *args)
    try:
        first = chat(running, ask_about(image))
        running.wait_idle(30)
    finally:
        stop_server(running)
    history = (
        {"role": "user", "content": ask_about(image)},
        {"role": "assistant", "content": first.choices[0].message.content},
    )
    running = start_server(vlm_dir, tmp_path, *args)
    try:
        again = chat(running, "And its colours?", history)
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert encoded(running) == 0
        other = (
            {"role": "user", "content": ask_about(png(15))},
            {"role": "assistant", "content": first.choices[0].message.content},
        )
        fresh = chat(running, "And its colours?", other)
        assert fresh.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
        assert encoded(running) == 1
    finally:
        stop_server(running)


def test_an_image_that_fails_to_encode_fails_its_request_alone(vlm_dir: Path) -> None:
    """The tower raising for one image: that request gets its error, a text request
    beside it its answer, and the worker serves the next image."""
    from flashserve.engine.generation.requests import (
        ErrorEvent,
        GenerationRequest,
        SamplingParams,
        TokenEvent,
    )
    from flashserve.engine.vision.images import decode_image

    with _vlm_engine(vlm_dir) as engine:
        loaded = engine.loaded
        vision, tokenizer = loaded.vision, loaded.tokenizer
        bad, good = decode_image(png(16), 1 << 20), decode_image(png(17), 1 << 20)
        encode = vision.features

        def failing(image: Any) -> Any:
            if image.digest == bad.digest:
                raise ValueError("the tower cannot take this image")
            return encode(image)

        vision.features = failing

        greedy = SamplingParams(temperature=0)
        story = tokenizer.apply_chat_template([{"role": "user", "content": "A story."}])

        async def collect(request: GenerationRequest) -> list[Any]:
            return [event async for event in engine.submit(request)]

        async def go() -> list[list[Any]]:
            return await asyncio.gather(
                collect(GenerationRequest(_marked(loaded, bad), 4, greedy, images=[bad])),
                collect(GenerationRequest(story, 4, greedy)),
            )

        failed, text = asyncio.run(go())
        after = asyncio.run(
            collect(GenerationRequest(_marked(loaded, good), 4, greedy, images=[good]))
        )
    assert isinstance(failed[-1], ErrorEvent) and "cannot take" in failed[-1].message
    assert sum(isinstance(e, TokenEvent) for e in text) == 4
    assert sum(isinstance(e, TokenEvent) for e in after) == 4


# Run by the test below in a Python of its own: an engine encodes an image and is
# dropped (its vision thread must end), another encodes one, stops, and the process
# exits with that engine's vision thread alive. (The worker is given time to end:
# a thread that ran compiled MLX functions and ends as Python finalizes aborts it,
# the vision thread's fault here being the one tested.)
EXIT_SCRIPT = """
import asyncio, gc, sys, threading
from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import GenerationRequest, SamplingParams
from flashserve.engine.generation.worker import Engine
from flashserve.engine.vision.images import decode_image
from flashserve.engine.vision.prompt import SENTINEL

def encode(image):
    engine = Engine(EngineConfig(model=sys.argv[1]))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    vision, tokenizer = engine.loaded.vision, engine.loaded.tokenizer
    images = vision.prompt([image])
    chat = [{"role": "user", "content": f"Look: {SENTINEL}"}]
    text = images.expand(tokenizer.apply_chat_template(chat, tokenize=False))
    prompt = images.mark(tokenizer.encode(text, add_special_tokens=False))
    request = GenerationRequest(prompt, 2, SamplingParams(temperature=0), images=[image])

    async def run():
        return [event async for event in engine.submit(request)]

    asyncio.run(run())
    assert vision.encodes == 1
    return engine

def vision_threads():
    return [t for t in threading.enumerate() if t.name.startswith("flashserve-vision")]

image = decode_image(open(sys.argv[2], "rb").read(), 1 << 20)
dropped = encode(image)
dropped.shutdown()
del dropped
gc.collect()
for _ in range(100):
    if not vision_threads():
        break
    threading.Event().wait(0.05)
assert not vision_threads(), "a dropped engine's vision thread lives on"
kept = encode(image)
kept.shutdown()
threading.Event().wait(0.5)
assert vision_threads()
print("exiting")
"""


def test_the_vision_thread_ends_with_its_engine_and_never_as_python_exits(
    vlm_dir: Path, tmp_path: Path
) -> None:
    """A dropped engine's vision thread ends (it would hold the tower's memory after an
    unload), and a process that exits with one alive exits cleanly: a thread ending as
    Python finalizes runs MLX's thread-local destructors, which take the GIL then and
    abort the process (a pool's thread, joined at exit, did so about half the time)."""
    image = tmp_path / "image.png"
    image.write_bytes(png(18))
    cmd = [sys.executable, "-c", EXIT_SCRIPT, str(vlm_dir), str(image)]
    for _ in range(4):  # the old pool thread aborted one exit in three
        done = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-3000:]
