"""The `models` section of `flashserve bench`: several models in one server.

One `flashserve serve` with two models from `[models.*]` tables: a big one
streamed from its prepared layout (the batch section's 466 MB float32 llama,
two of its eight layers resident) and a small resident one (the default
SmolLM2-135M GGUF). Nothing is loaded at start. Per model: the time its load
took (/v1/models), and the first request's time to first token, load
included. Then the small model's TTFT alone (loaded, a new prompt each time,
no prompt cache) against its TTFT while the big model decodes a long answer:
each model has its own worker, so the small model's requests should not wait
for the big one's steps (target: <= 1.5x). Both share the machine's cores, so
on two cores the ratio also shows their contention for compute.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from flashserve.engine.bench.batch import BATCH_MODEL
from flashserve.engine.bench.common import bench_model, free_port, print_table
from flashserve.engine.weights.gguf.container import GGUFFile
from flashserve.engine.weights.sources import default_model_path
from flashserve.engine.weights.synthetic import SPECIAL_TOKENS

log = logging.getLogger(__name__)

QUICK_BIG = dict(BATCH_MODEL, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
STARTUP_S = 120.0
TARGET_RATIO = 1.5
SMALL_PROMPT = "Write one sentence about the sea, number {}."


def _post_stream(
    url: str, body: dict, on_first: threading.Event | None = None
) -> tuple[float, int, float]:
    """(seconds to the first text, text chunks, seconds in all) of one streamed completion;
    `on_first` is set at its first text."""
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    first, chunks = None, 0
    with urllib.request.urlopen(request, timeout=900) as response:
        for line in response:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
                    if on_first is not None:
                        on_first.set()
    if first is None:
        raise RuntimeError(f"no text from {body['model']}")
    return first - start, chunks, time.perf_counter() - start


def _models(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return {card["id"]: card for card in json.load(response)["data"]}


def _no_eos(gguf: Path) -> dict[str, int]:
    """A logit_bias that keeps the GGUF's model from ending at once (no token, no TTFT)."""
    metadata = GGUFFile(gguf).metadata
    ids = {metadata.get("tokenizer.ggml.eos_token_id"), metadata.get("tokenizer.ggml.eot_token_id")}
    return {str(i): -100 for i in ids if i is not None}


def _small_ttfts(url: str, count: int, start: int) -> list[float]:
    body = {"model": "small", "max_tokens": 4, "temperature": 0}
    body["logit_bias"] = _no_eos(default_model_path())  # the small model's file
    return [
        _post_stream(url, body | {"prompt": SMALL_PROMPT.format(start + i)})[0]
        for i in range(count)
    ]


def _serve(config: Path, work: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flashserve.server.cli", "serve", "--config", str(config)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prompt-cache-bytes", "0"]
    cmd += ["--data-dir", str(work / "data"), "--log-level", "info"]
    log_file = open(work / "serve-models.log", "wb")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(cmd, cwd=work, stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server did not start; see {log_file.name}")
        time.sleep(0.2)


def run(work_dir: Path, *, tokens: int = 32, quick: bool = False) -> list[dict]:
    """Load times, first-request TTFTs, the small model's TTFT alone and while the big one
    decodes; print the tables; return the rows."""
    name, config = ("models-big-quick", QUICK_BIG) if quick else ("batch-dense-f32", BATCH_MODEL)
    _, big = bench_model(work_dir, name, "llama", config, bits=None)
    small = default_model_path()
    work = work_dir / "models-section"
    work.mkdir(parents=True, exist_ok=True)
    toml = work / "config.toml"
    toml.write_text(
        f'[models.big]\npath = "{big}"\nresidency = "fixed"\nresident_layers = 2\n\n'
        f'[models.small]\npath = "{small}"\n'
    )
    process, url = _serve(toml, work)
    rows: list[dict] = []
    try:
        big_body = {"model": "big", "prompt": "The history of ships", "temperature": 0}
        big_body["logit_bias"] = {str(SPECIAL_TOKENS.index("<|im_end|>")): -100}
        first: dict[str, float] = {}
        small_body = {"model": "small", "prompt": "Hi", "max_tokens": 4}
        first["small"] = _post_stream(url, small_body | {"logit_bias": _no_eos(small)})[0]
        first["big"] = _post_stream(url, big_body | {"max_tokens": 4})[0]
        cards = _models(url)
        for model in ("big", "small"):
            card = cards[model]
            rows.append(
                {
                    "model": model,
                    "size MB": card["size_bytes"] / 1e6,
                    "load s": card["load_seconds"],
                    "memory MB": (card["memory_bytes"] or 0) / 1e6,
                    "first TTFT s (load included)": first[model],
                }
            )
        print_table(
            "Models: load on first request (nothing loaded at start)",
            list(rows[0]),
            [list(r.values()) for r in rows],
        )
        alone = _small_ttfts(url, 3 if quick else 5, 0)
        decode_tokens = max(tokens, 48) * (1 if quick else 4)
        big_run: dict[str, tuple[float, int, float]] = {}
        decoding = threading.Event()

        def decode_big() -> None:
            body = big_body | {"max_tokens": decode_tokens}
            big_run["big"] = _post_stream(url, body, decoding)

        thread = threading.Thread(target=decode_big, daemon=True)
        thread.start()
        decoding.wait(300)  # past the big model's prefill: into its decode
        beside = []
        while thread.is_alive() and len(beside) < (3 if quick else 5):
            beside += _small_ttfts(url, 1, 100 + len(beside))
        thread.join()
        ratio = statistics.median(beside) / statistics.median(alone) if beside else None
        contention = [
            {
                "small TTFT alone s": statistics.median(alone),
                "small TTFT while big decodes s": statistics.median(beside) if beside else None,
                "ratio": ratio,
                "target": f"<= {TARGET_RATIO}x",
                "met": "yes" if ratio is not None and ratio <= TARGET_RATIO else "no",
                "big decode s": big_run["big"][2] - big_run["big"][0],
            }
        ]
        print_table(
            "Models: the small model's time to first token while the big one decodes "
            f"({len(beside)} requests beside, {len(alone)} alone; medians)",
            list(contention[0]),
            [list(r.values()) for r in contention],
        )
        rows += contention
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return rows
