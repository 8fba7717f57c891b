"""Fill-in-the-middle: `suffix` on /v1/completions, and llama.cpp's /infill.

Tiny real models whose tokenizers carry each family's FIM tokens (Qwen2.5-Coder,
StarCoder, CodeLlama with a BOS-adding tokenizer) serve both routes in this
process. The engine's `submit` is wrapped to keep every GenerationRequest, so the
tests read the exact prompt token ids the model received; /infill's output is
scripted (the `x-test-script` header, as in tests/scripted.py) through the real
generation, detokenization and stop path. The stock tiny model, which has no FIM
tokens, is the CLI server of conftest.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import Request

from flashserve.engine.generation.constraints import ForcedTokens
from flashserve.engine.generation.requests import GenerationRequest
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.synthetic import build_tokenizer, make_model_dir
from flashserve.server.fim import fim_tokens, require_fim, suffix_prompt
from flashserve.server.http.deps import ReadyModel, request_logits_processors
from flashserve.server.http.errors import APIError

from .conftest import Server, serve_app
from .scripted import SCRIPT_HEADER

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@dataclass(frozen=True)
class Style:
    tokens: list[str]  # extra special tokens of the tokenizer
    fim: tuple[str, str, str]  # prefix, suffix, middle markers
    end: str  # a token that ends a fill and is not the model's EOS
    eos: str = "<|im_end|>"
    file_sep: str | None = None
    repo_name: str | None = None
    bos: str | None = None  # a tokenizer that starts every encoding with it


STYLES = {
    "qwen": Style(
        [
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ],
        ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
        end="<|fim_pad|>",
        file_sep="<|file_sep|>",
        repo_name="<|repo_name|>",
    ),
    "starcoder": Style(
        ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>", "<repo_name>"],
        ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
        end="<fim_pad>",
        eos="<|endoftext|>",
        file_sep="<file_sep>",
        repo_name="<repo_name>",
    ),
    "codellama": Style(
        ["<s>", "</s>", "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"],
        ("▁<PRE>", "▁<SUF>", "▁<MID>"),
        end="▁<EOT>",
        eos="</s>",
        bos="<s>",
    ),
}


def make_fim_model(out: Path, style: Style) -> Path:
    path = make_model_dir(out, "llama", extra_special_tokens=style.tokens, eos_token=style.eos)
    if style.bos is not None:
        _add_bos(path, style.bos)
    return path


def _add_bos(path: Path, bos: str) -> None:
    """Make the tokenizer start every encoding with `bos`, as Llama's tokenizer.json does."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["bos_token"] = bos
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@dataclass
class FimServer:
    server: Server
    engine: Engine
    style: Style
    requests: list[GenerationRequest]

    @property
    def tokenizer(self) -> Any:
        assert self.engine.loaded is not None
        return self.engine.loaded.tokenizer

    def id(self, token: str) -> int:
        return self.tokenizer._tokenizer.get_vocab()[token]

    def ids(self, text: str) -> list[int]:
        """Plain text's ids (no special-token strings in it: the same either way)."""
        return self.tokenizer._tokenizer.encode(text, add_special_tokens=False)

    def fim(self, prefix: list[int], suffix: list[int], context: list[int] = ()) -> list[int]:
        pre, suf, mid = (self.id(t) for t in self.style.fim)
        bos = [self.id(self.style.bos)] if self.style.bos else []
        return [*bos, *context, pre, *prefix, suf, *suffix, mid]

    def last_prompt(self) -> list[int]:
        return list(self.requests[-1].prompt_tokens)


async def _scripted(request: Request, loaded: ReadyModel) -> list[Any]:
    raw = request.headers.get(SCRIPT_HEADER)
    if raw is None:
        return []
    ids = loaded.tokenizer.encode(json.loads(raw), add_special_tokens=False)
    return [ForcedTokens(ids, min(loaded.tokenizer.eos_token_ids))]


@contextlib.contextmanager
def fim_server(model: Path, style: Style) -> Iterator[FimServer]:
    from flashserve.server.app import create_app
    from flashserve.server.settings import load_settings

    settings = load_settings(model=str(model), prompt_cache_bytes=0, prompt_cache_disk_bytes=0)
    engine = Engine(settings.engine_config())
    seen: list[GenerationRequest] = []
    submit = engine.submit

    def recording(request: GenerationRequest) -> Any:
        seen.append(request)
        return submit(request)

    engine.submit = recording  # type: ignore[method-assign]
    app = create_app(settings, engine)
    app.dependency_overrides[request_logits_processors] = _scripted
    with serve_app(app) as server:
        if not engine.wait_ready(120):
            raise RuntimeError(f"model failed to load: {engine.load_error}")
        yield FimServer(server, engine, style, seen)


@pytest.fixture(scope="module", params=sorted(STYLES))
def fim(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FimServer]:
    style = STYLES[request.param]
    path = make_fim_model(tmp_path_factory.mktemp("fim") / request.param, style)
    with fim_server(path, style) as server:
        yield server


def script(text: str) -> dict[str, str]:
    return {SCRIPT_HEADER: json.dumps(text)}


def sse(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


# -- /v1/completions with suffix ------------------------------------------------------------


def test_completion_suffix_prompt_is_prefix_suffix_middle(fim: FimServer):
    client = fim.server.client()
    # A FIM marker written in the code stays text: it cannot become the marker.
    suffix = SUFFIX + "# " + fim.style.fim[2]
    out = client.completions.create(
        model=fim.server.model_id, prompt=PREFIX, suffix=suffix, max_tokens=3, temperature=0
    )
    assert out.choices[0].finish_reason in {"length", "stop"}
    prompt = fim.last_prompt()
    middle = fim.id(fim.style.fim[2])
    assert prompt.count(middle) == 1 and prompt[-1] == middle
    suffix_ids = prompt[prompt.index(fim.id(fim.style.fim[1])) + 1 : -1]
    assert fim.tokenizer.decode(suffix_ids) == suffix
    assert prompt == fim.fim(fim.ids(PREFIX), suffix_ids)
    # The model's FIM end tokens stop the fill (as stop strings on their text).
    assert set(fim.requests[-1].stop) >= {fim.style.end}


def test_completion_suffix_ends_at_the_fim_end_token(fim: FimServer):
    # Every step's most likely token is the end of the fill (not the model's EOS).
    bias = {str(fim.id(fim.style.end)): 100}
    client = fim.server.client()
    out = client.completions.create(
        model=fim.server.model_id, prompt=PREFIX, suffix=SUFFIX, max_tokens=5, logit_bias=bias
    )
    assert out.choices[0].text == ""
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.prompt_tokens == len(fim.last_prompt())


def test_completion_suffix_streams(fim: FimServer):
    word = fim.ids("Paris")
    assert len(word) == 1
    client = fim.server.client()
    stream = client.completions.create(
        model=fim.server.model_id,
        prompt=PREFIX,
        suffix=SUFFIX,
        max_tokens=3,
        logit_bias={str(word[0]): 100},
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "ParisParisParis"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert fim.last_prompt() == fim.fim(fim.ids(PREFIX), fim.ids(SUFFIX))


def test_completion_token_ids_are_the_prefix(fim: FimServer):
    ids = fim.ids(PREFIX)
    fim.server.client().completions.create(
        model=fim.server.model_id, prompt=ids, suffix=SUFFIX, max_tokens=1
    )
    assert fim.last_prompt() == fim.fim(ids, fim.ids(SUFFIX))


# -- /infill --------------------------------------------------------------------------------


def test_infill_arranges_extra_files_prefix_prompt_suffix(fim: FimServer):
    http = fim.server.http()
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "prompt": "return",
        "input_extra": [{"filename": "util.py", "text": "X = 1\n"}],
        "n_predict": 8,
    }
    end = fim.style.end
    response = http.post("/infill", json=body, headers=script("a + b" + end + "junk"))
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["content"] == "a + b"
    assert out["stop"] is True and out["stop_type"] == "eos" and out["stopping_word"] == ""
    assert out["tokens_predicted"] == len(fim.ids("a + b")) + 1  # the end token too
    assert out["tokens_evaluated"] == len(fim.last_prompt())
    assert out["model"] == fim.server.model_id
    assert out["truncated"] is False and out["timings"]["predicted_n"] == out["tokens_predicted"]
    if fim.style.file_sep is not None:  # repository-level shape, as llama.cpp writes it
        repo, sep = fim.id(fim.style.repo_name), fim.id(fim.style.file_sep)
        context = [repo, *fim.ids("myproject\n"), sep, *fim.ids("util.py\n")]
        context += [*fim.ids("X = 1\n"), sep, *fim.ids("filename\n")]
    else:
        context = [*fim.ids("\n\n--- snippet ---\n\n"), *fim.ids("X = 1\n")]
    prefix = fim.ids(PREFIX) + fim.ids("return")
    assert fim.last_prompt() == fim.fim(prefix, fim.ids(SUFFIX), context)


def test_infill_without_extra_is_the_completion_prompt(fim: FimServer):
    http = fim.server.http()
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 2}
    out = http.post("/infill", json=body, headers=script("x = 1\ny = 2\n")).json()
    assert out["stop_type"] == "limit" and out["tokens_predicted"] == 2
    assert fim.last_prompt() == fim.fim(fim.ids(PREFIX), fim.ids(SUFFIX))


def test_infill_streams_llama_cpp_chunks(fim: FimServer):
    http = fim.server.http()
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": True, "stop": ["+"]}
    headers = script("return a + b" + fim.style.end)
    with http.stream("POST", "/infill", json=body, headers=headers) as response:
        assert response.status_code == 200
        events = [json.loads(data) for data in sse(response)]  # no [DONE]: all JSON
    *chunks, last = events
    assert chunks and all(c["stop"] is False for c in chunks)
    assert "".join(c["content"] for c in chunks) == "return a "
    assert last["stop"] is True and last["content"] == ""
    assert last["stop_type"] == "word" and last["stopping_word"] == "+"
    assert last["tokens_evaluated"] == len(fim.last_prompt())


def test_infill_n_predict_0_only_reads_the_prompt(fim: FimServer):
    http = fim.server.http()
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 0}
    out = http.post("/infill", json=body, headers=script("x")).json()
    assert out["content"] == "" and out["tokens_predicted"] == 0 and out["stop_type"] == "limit"
    assert out["tokens_evaluated"] == len(fim.fim(fim.ids(PREFIX), fim.ids(SUFFIX)))


def test_infill_bad_fields_are_400(fim: FimServer):
    http = fim.server.http()
    for body, param in [
        ({"input_extra": [{"filename": "a.py"}]}, "input_extra.0.text"),
        ({"n_predict": -2}, "n_predict"),
        ({"temperature": True}, "temperature"),
    ]:
        response = http.post("/infill", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param


# -- models without FIM tokens ---------------------------------------------------------------


def test_no_fim_tokens_completion_suffix_is_400(llama_server: Server):
    client = llama_server.client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model=llama_server.model_id, prompt="a", suffix="b", max_tokens=1, stream=stream
            )
        error = err.value.body
        assert isinstance(error, dict) and error["param"] == "suffix"
        assert "<|fim_prefix|>" in error["message"] and "<fim_middle>" in error["message"]
    # An empty suffix is no suffix: today's completion.
    out = client.completions.create(
        model=llama_server.model_id, prompt="a", suffix="", max_tokens=1
    )
    assert out.choices[0].finish_reason in {"length", "stop"}


def test_no_fim_tokens_infill_is_400(llama_server: Server):
    response = httpx.post(
        llama_server.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=60
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "input_suffix" and "<|fim_prefix|>" in error["message"]


def test_suffix_with_echo_is_400(llama_server: Server):
    with pytest.raises(openai.BadRequestError) as err:
        llama_server.client().completions.create(
            model=llama_server.model_id, prompt="a", suffix="b", echo=True, max_tokens=1
        )
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "suffix"


# -- detection, without a server -------------------------------------------------------------


def _tokenizer(tmp_path: Path, tokens: list[str]) -> Any:
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path, extra_special_tokens=tokens)
    return AutoTokenizer.from_pretrained(str(tmp_path))


def test_deepseek_style_is_found(tmp_path: Path):
    bar = "\uff5c"
    begin, hole, end = (f"<{bar}fim▁{name}{bar}>" for name in ("begin", "hole", "end"))
    tokenizer = _tokenizer(tmp_path, [begin, hole, end])
    fim = fim_tokens(tokenizer)
    assert fim is not None and fim.style == "deepseek"
    vocab = tokenizer.get_vocab()
    assert (fim.prefix, fim.suffix, fim.middle) == (vocab[begin], vocab[hole], vocab[end])
    code = tokenizer.encode("x = 1", add_special_tokens=False)
    tail = tokenizer.encode("y", add_special_tokens=False)
    assert suffix_prompt(tokenizer, "x = 1", "y") == [
        vocab[begin],
        *code,
        vocab[hole],
        *tail,
        vocab[end],
    ]


def test_incomplete_fim_tokens_name_the_missing_one(tmp_path: Path):
    tokenizer = _tokenizer(tmp_path, ["<fim_prefix>", "<fim_suffix>"])
    assert fim_tokens(tokenizer) is None
    with pytest.raises(APIError) as err:
        require_fim(tokenizer, "suffix")
    assert err.value.status == 400 and err.value.detail.param == "suffix"
    assert "<fim_middle>" in err.value.detail.message
    assert "<fim_prefix>" not in err.value.detail.message


def test_infill_cuts_what_does_not_fit_the_context(fim: FimServer):
    """Other files first (the oldest whole), then the prefix's start: as llama.cpp does."""
    http = fim.server.http()
    context = fim.engine.loaded.context_length
    old = {"filename": "old.py", "text": "y = 2\n" * context}
    new = {"filename": "new.py", "text": "X = 1\n"}
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4}
    out = http.post("/infill", json={**body, "input_extra": [old, new]}).json()
    assert out["truncated"] is True
    whole = fim.last_prompt()
    assert len(whole) <= context - 4
    kept = http.post("/infill", json={**body, "input_extra": [new]}).json()
    assert kept["truncated"] is False and fim.last_prompt() == whole  # only `new` was kept
    # A prefix longer than the context keeps its end, at the cursor.
    long = "z = 3\n" * context + "def tail():"
    out = http.post("/infill", json={**body, "input_prefix": long}).json()
    assert out["truncated"] is True and out["tokens_evaluated"] <= context - 4
    prompt = fim.last_prompt()
    tail = fim.ids("def tail():")
    suffix_at = prompt.index(fim.id(fim.style.fim[1]))
    assert prompt[suffix_at - len(tail) : suffix_at] == tail
    assert prompt[suffix_at + 1 : -1] == fim.ids(SUFFIX)
