"""How far each prompt path moves the next-token probabilities from flashserve's float
path, llama.cpp's own beside ours (issue 57's accuracy table), on the same GGUF.

llama-server gives no probabilities for a prompt's positions, only for the tokens it
generates: so on each of a few fixed prompts it generates greedily (`n_probs`: its
top 20 log-probabilities at every generated position), and flashserve's model then
reads the prompt and llama.cpp's tokens in one pass, on the float path
(`prompt_matmul` "float": dequantize + BLAS), int16 and int8, giving every
position's distribution. At each generated position the float path's top 5 tokens
are compared: the largest and mean change of their probabilities, and whether the
most likely token agrees. A float top-5 token outside llama.cpp's top 20 counts
with probability 0 there (its true probability is below the 20th's).
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np

from flashserve.engine.bench.common import print_table
from flashserve.engine.bench.prefill import LlamaServer
from flashserve.engine.compute import cores, prompt_matmul
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load

log = logging.getLogger(__name__)

PROMPTS = [  # fixed prompts of every kind: question, story, code, list, fact
    "Q: What is the capital of France?\nA:",
    "Once upon a time, in a small village,",
    "def add(a, b):\n    return",
    "The three primary colors are",
    "1, 2, 3, 4, 5,",
    "The largest planet in the solar system is",
]
GENERATED = 40  # positions per prompt
TOP = 5
LLAMA_TOP = 20
PATHS = ("int16", "int8")


def _llama_positions(client: httpx.Client, prompt: str) -> tuple[list[int], list[dict[int, float]]]:
    """llama.cpp's prompt tokens + its greedy tokens, and each generated position's top
    probabilities (token id -> probability)."""
    ids = client.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    reply = client.post(
        "/completion",
        json={
            "prompt": ids,
            "n_predict": GENERATED,
            "n_probs": LLAMA_TOP,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
        },
    )
    reply.raise_for_status()
    positions = reply.json()["completion_probabilities"]
    tokens = [int(p["id"]) for p in positions]
    tops = [
        {int(t["id"]): float(np.exp(t["logprob"])) for t in p["top_logprobs"]} for p in positions
    ]
    return ids + tokens, tops


def _probabilities(model: object, ids: list[int]) -> np.ndarray:
    logits = model(mx.array([ids]))  # type: ignore[operator]
    return np.array(mx.softmax(logits[0].astype(mx.float32), axis=-1))


def measure(gguf: Path, binary: Path) -> dict[str, dict[str, float]]:
    """Per path (llama.cpp, int16, int8): max and mean top-5 change, argmax agreement."""
    llama = LlamaServer(binary, gguf, 1024, cores.usable())
    try:
        runs = [_llama_positions(llama.client, p) for p in PROMPTS]
    finally:
        llama.close()
    loaded = load(EngineConfig(model=str(gguf), prompt_cache_bytes=0))
    diffs: dict[str, list[np.ndarray]] = {"llama.cpp": [], **{p: [] for p in PATHS}}
    agree: dict[str, list[bool]] = {k: [] for k in diffs}
    for ids, tops in runs:
        first = len(ids) - len(tops) - 1  # the position whose logits give generated token 0
        prompt_matmul.set_prompt_matmul(loaded.model, "float")
        ref = _probabilities(loaded.model, ids)[first : first + len(tops)]
        best = np.argsort(-ref, axis=-1)[:, :TOP]
        want = np.take_along_axis(ref, best, -1)
        pairs = list(zip(best, tops, strict=True))
        theirs = np.array([[top.get(int(t), 0.0) for t in row] for row, top in pairs])
        diffs["llama.cpp"].append(np.abs(want - theirs))
        agree["llama.cpp"] += [max(top, key=top.get) == row[0] for row, top in pairs]
        for path in PATHS:
            prompt_matmul.set_prompt_matmul(loaded.model, path)
            got = _probabilities(loaded.model, ids)[first : first + len(tops)]
            diffs[path].append(np.abs(want - np.take_along_axis(got, best, -1)))
            agree[path] += list(got.argmax(-1) == best[:, 0])
    prompt_matmul.set_prompt_matmul(loaded.model, "int16")
    out = {}
    for name, parts in diffs.items():
        d = np.concatenate(parts)
        out[name] = {
            "positions": len(d),
            "max": float(d.max()),
            "mean": float(d.mean()),
            "argmax": float(np.mean(agree[name])),
        }
    return out


def _cells(v: dict[str, float]) -> list[str]:
    return [f"{v['max']:.4f}", f"{v['mean']:.5f}", f"{100 * v['argmax']:.1f}%"]


def run(ggufs: list[Path], binary: Path | None) -> dict:
    """The table for each GGUF; nothing without a llama-server binary."""
    if binary is None or not binary.is_file():
        print("\nllama.cpp's deviation from the float path: not measured (no llama-server)")
        return {}
    results = {}
    for gguf in ggufs:
        got = measure(gguf, binary)
        results[gguf.name] = got
        print_table(
            f"Deviation from flashserve's float path, {gguf.name}: top-{TOP} next-token "
            f"probabilities at llama.cpp's greedy positions ({len(PROMPTS)} prompts)",
            ["path", "positions", "max top-5 change", "mean", "argmax agrees"],
            [
                [
                    n,
                    v["positions"],
                    f"{v['max']:.4f}",
                    f"{v['mean']:.5f}",
                    f"{100 * v['argmax']:.1f}%",
                ]
                for n, v in got.items()
            ],
        )
    return results
