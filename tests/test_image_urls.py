"""Remote image URLs: fetched under `allow_image_urls`, refused without it.

A tiny HTTP server in this process (127.0.0.1, a thread) serves a PNG and
everything a fetch can meet instead: a page, a 404, a stall before the
headers, a body that trickles past the time limit, a redirect and a loop of
them, images over the byte limit (declared, or found as they arrive), bytes
that are not an image. The real `flashserve serve` of tests/test_images.py's
tiny Gemma 3 model fetches them; the official SDKs ask. The same image by URL
and as a data: URL is the same prompt, so greedy decoding gives the same
tokens.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import anthropic
import openai
import pytest

from .conftest import NO_EOS, Server, free_port, start_server, stop_server
from .test_images import OUT, QUESTION, b64, data_url, encoded, png

pytest.importorskip("mlx_vlm", reason="the vision extra: pip install 'flashserve[vision]'")

IMAGE = png(21)
BIG = png(22, size=(200, 200))  # ~120 kB: over the server's --image-url-max-bytes
MAX_BYTES = 50_000
TIMEOUT_S = 1.0  # --image-url-timeout


class _Images(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hits.append(self.path)
        path = self.path
        if path in ("/cat.png", "/cat"):
            self._send(
                200, "image/png" if path == "/cat.png" else "application/octet-stream", IMAGE
            )
        elif path == "/page.html":
            self._send(200, "text/html; charset=utf-8", b"<html>not an image</html>")
        elif path == "/garbage.png":
            self._send(200, "image/png", b"these bytes are no PNG")
        elif path == "/huge.png":  # refused on its declared length, before any body
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(10**10))
            self.end_headers()
            self.wfile.flush()
            time.sleep(3 * TIMEOUT_S)
        elif path == "/big-unsized.png":  # no Content-Length: the body ends as the connection does
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(BIG)
        elif path == "/stall.png":
            time.sleep(3 * TIMEOUT_S)  # nothing at all until past the limit
            self._send(200, "image/png", IMAGE)
        elif path == "/trickle.png":
            # Each read comes in time; the whole does not.
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            step = len(IMAGE) // 8 + 1
            for at in range(0, len(IMAGE), step):
                self.wfile.write(IMAGE[at : at + step])
                self.wfile.flush()
                time.sleep(0.4 * TIMEOUT_S)
        elif path == "/moved":
            self._redirect("/cat.png")
        elif path == "/loop":
            self._redirect("/loop")
        else:
            self._send(404, "text/plain", b"no such image")

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, to: str) -> None:
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):  # the fetch gave up on a slow answer
            super().handle()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    """The image server's base URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashserve.engine.vision.synthetic import make_gemma3_vlm

    return make_gemma3_vlm(tmp_path_factory.mktemp("models") / "tiny-gemma3-vlm")


@pytest.fixture(scope="module")
def fetching(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(
        vlm_dir,
        tmp_path_factory.mktemp("fetching"),
        "--allow-image-urls",
        "--image-url-private",  # the test's image server is on 127.0.0.1
        *("--image-url-max-bytes", str(MAX_BYTES), "--image-url-timeout", str(TIMEOUT_S)),
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def public_only(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(vlm_dir, tmp_path_factory.mktemp("public"), "--allow-image-urls")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def refusing(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(vlm_dir, tmp_path_factory.mktemp("refusing"))
    yield running
    stop_server(running)


def chat(server: Server, url: str) -> Any:
    return server.client().chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": [QUESTION, image_url(url)]}],
        max_tokens=OUT,
        temperature=0,
        logit_bias=NO_EOS,
    )


def image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def respond(server: Server, url: str) -> Any:
    parts = [{"type": "input_text", "text": QUESTION["text"]},
             {"type": "input_image", "image_url": url}]  # fmt: skip
    return server.client().responses.create(
        model=server.model_id,
        input=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        max_output_tokens=OUT,
        temperature=0,
    )


def anthropic_sdk(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def message(server: Server, source: dict[str, Any], tool_result: bool = False) -> Any:
    block: dict[str, Any] = {"type": "image", "source": source}
    messages: list[dict[str, Any]] = [{"role": "user", "content": [QUESTION, block]}]
    if tool_result:  # Claude Code's Read of an image comes back this way
        call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.png"}}
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [block]}
        messages = [
            {"role": "user", "content": "Read a.png"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
    return anthropic_sdk(server).messages.create(
        model=server.model_id,
        max_tokens=OUT,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"temperature": 0},
    )


BASE64 = {"type": "base64", "media_type": "image/png", "data": b64(IMAGE)}


def url_source(url: str) -> dict[str, Any]:
    return {"type": "url", "url": url}


def test_a_url_gives_the_data_urls_tokens(fetching: Server, images: str) -> None:
    inline = chat(fetching, data_url(IMAGE))
    before = encoded(fetching)
    for url in (f"{images}/cat.png", f"{images}/moved", f"{images}/cat"):
        fetched = chat(fetching, url)
        assert fetched.choices[0].message.content == inline.choices[0].message.content, url
        assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    # The fetched bytes key the prompt cache as the inline ones do: no cache here,
    # so each of the three requests ran the tower.
    assert encoded(fetching) == before + 3
    # Responses' input_image.
    inline_response = respond(fetching, data_url(IMAGE))
    fetched_response = respond(fetching, f"{images}/cat.png")
    assert fetched_response.output_text == inline_response.output_text
    assert fetched_response.usage is not None and inline_response.usage is not None
    assert fetched_response.usage.input_tokens == inline_response.usage.input_tokens
    # Messages: a url source, at the top level and inside a tool_result.
    prompts = []
    for tool_result in (False, True):
        base64 = message(fetching, BASE64, tool_result)
        fetched_message = message(fetching, url_source(f"{images}/cat.png"), tool_result)
        assert fetched_message.content[0].text == base64.content[0].text
        assert fetched_message.usage.input_tokens == base64.usage.input_tokens
        prompts.append(base64.usage.input_tokens)
    image = {"type": "image", "source": url_source(f"{images}/cat.png")}
    counted = anthropic_sdk(fetching).messages.count_tokens(
        model=fetching.model_id, messages=[{"role": "user", "content": [QUESTION, image]}]
    )
    assert counted.input_tokens == prompts[0]


FAILURES = {
    "/missing.png": "HTTP 404",
    "/page.html": "'text/html', not an image",
    "/garbage.png": "cannot be read",
    "/huge.png": f"larger than {MAX_BYTES} bytes",
    "/big-unsized.png": f"larger than {MAX_BYTES} bytes",
    "/stall.png": f"within {TIMEOUT_S:g} s",
    "/trickle.png": f"within {TIMEOUT_S:g} s",
    "/loop": "more than 5 redirects",
    "closed": "could not be fetched",
}


def openai_refusal(call: Any, *args: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        call(*args)
    body = refused.value.body
    assert isinstance(body, dict)
    return body


def anthropic_refusal(call: Any, *args: Any) -> dict[str, Any]:
    with pytest.raises(anthropic.BadRequestError) as refused:
        call(*args)
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]


@pytest.mark.parametrize("path", list(FAILURES))
def test_a_url_that_gives_no_image_is_a_400_in_each_dialect(
    fetching: Server, images: str, path: str
) -> None:
    url, says = images + path, FAILURES[path]
    if path == "closed":  # a port nothing listens on
        url = f"http://127.0.0.1:{free_port()}/cat.png"
    started = time.monotonic()
    _Images.hits.clear()
    body = openai_refusal(chat, fetching, url)
    if path == "/loop":  # the first request and five redirects, then the fetch gave up
        assert _Images.hits == ["/loop"] * 6
    assert says in body["message"], body
    assert body["param"] == "messages.0.content.1.image_url.url", body
    code = "invalid_image" if path == "/garbage.png" else "image_fetch_failed"
    assert body["code"] == code, body
    body = openai_refusal(respond, fetching, url)
    assert says in body["message"] and body["param"] == "input[0].content[1].image_url", body
    for tool_result in (False, True):
        error = anthropic_refusal(message, fetching, url_source(url), tool_result)
        assert says in error["message"], error
        # Messages' errors carry no param: the message names the part.
        where = "messages.2.content.0.content.0" if tool_result else "messages.0.content.1"
        assert f"{where}.source.url: " in error["message"], error
    if "within" in says:  # four requests, each cut at the limit
        assert time.monotonic() - started < 4 * (TIMEOUT_S + 1.5)
    assert fetching.health().status_code == 200


def test_urls_are_refused_while_the_setting_is_off(refusing: Server, images: str) -> None:
    url = f"{images}/cat.png"
    _Images.hits.clear()
    body = openai_refusal(chat, refusing, url)
    assert body["param"] == "messages.0.content.1.image_url.url"
    assert "allow_image_urls" in body["message"] and "data: URL" in body["message"]
    body = openai_refusal(respond, refusing, url)
    assert body["param"] == "input[0].content[1].image_url"
    assert "allow_image_urls" in body["message"]
    for tool_result in (False, True):
        error = anthropic_refusal(message, refusing, url_source(url), tool_result)
        assert "allow_image_urls" in error["message"], error
    assert _Images.hits == []  # nothing was fetched
    # The data: URL still works.
    assert chat(refusing, data_url(IMAGE)).usage.completion_tokens > 0


def test_local_addresses_are_refused_unless_allowed(public_only: Server, images: str) -> None:
    """allow_image_urls alone fetches from public addresses only: a loopback host, by
    address or by name, is a 400 naming image_url_private in each dialect, and
    nothing is fetched (a client cannot make the server read its own network)."""
    port = images.rsplit(":", 1)[1]
    _Images.hits.clear()
    for url in (f"{images}/cat.png", f"http://localhost:{port}/cat.png"):
        body = openai_refusal(chat, public_only, url)
        assert body["param"] == "messages.0.content.1.image_url.url", body
        assert "image_url_private" in body["message"], body
        body = openai_refusal(respond, public_only, url)
        assert "image_url_private" in body["message"], body
        for tool_result in (False, True):
            error = anthropic_refusal(message, public_only, url_source(url), tool_result)
            assert "image_url_private" in error["message"], error
    assert _Images.hits == []
    assert public_only.health().status_code == 200
