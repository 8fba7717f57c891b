"""The BLAS behind MLX's float matmuls (engine/compute/blas.py): MKL on Linux x86_64.

MKL is chosen per process before mlx is imported, so these tests run fresh
interpreters and servers. What they pin down: MKL really serves MLX's
matmuls and computes the same numbers, and with it streaming still never
changes greedy output.
"""

from __future__ import annotations

import concurrent.futures
import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashserve.engine.compute import blas
from flashserve.engine.weights.prepare import prepare

from .conftest import NO_EOS, REPO, start_server, stop_server

needs_mkl = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the mkl wheel is a dependency on Linux x86_64 only",
)

# Runs in a fresh interpreter: choose the BLAS, then import mlx and multiply
# the shapes a decoder uses (one row, a batch, a prompt; 4-D attention scores).
PROBE = """
import json, sys
import numpy as np
from flashserve.engine.compute import blas
name = blas.select(sys.argv[1])
import mlx.core as mx
mx.set_default_device(mx.cpu)
out = {}
for rows in (1, 3, 8, 300):
    x = mx.random.normal((rows, 1024), key=mx.random.key(1))
    w = mx.random.normal((2048, 1024), key=mx.random.key(2))
    out[f"linear{rows}"] = np.array(x @ w.T).tolist()
q = mx.random.normal((2, 4, 7, 64), key=mx.random.key(3))
k = mx.random.normal((2, 4, 9, 64), key=mx.random.key(4))
out["scores"] = np.array(q @ k.swapaxes(-1, -2)).tolist()
maps = open("/proc/self/maps").read()
print(json.dumps({"blas": name, "describe": blas.describe(),
                  "mkl_mapped": "libmkl_rt" in maps, "out": out}))
"""


def probe(choice: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, choice],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@needs_mkl
def test_mkl_serves_mlx_matmuls_with_the_same_numbers():
    mkl = probe("auto")
    ref = probe("reference")
    assert (mkl["blas"], mkl["describe"], mkl["mkl_mapped"]) == ("mkl", "mkl", True)
    assert (ref["blas"], ref["describe"], ref["mkl_mapped"]) == ("reference", "reference", False)
    for name, values in ref["out"].items():
        a, b = np.array(values), np.array(mkl["out"][name])
        assert a.shape == b.shape, name
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-3, err_msg=name)
    # Different kernels: the results are not bit-identical, which proves MKL ran.
    assert any(mkl["out"][n] != ref["out"][n] for n in ref["out"])


def test_mkl_cannot_be_chosen_once_mlx_is_loaded():
    import mlx.core  # noqa: F401  (this pytest process has loaded it long ago)

    if blas.describe() == "reference" and blas.mkl_library() is not None:
        with pytest.raises(blas.BlasError, match="before mlx is imported"):
            blas.select("mkl")
    # "auto" never fails: it keeps what the process has.
    assert blas.select("auto") == blas.describe()


@needs_mkl
def test_server_on_mkl_streams_token_identical_and_batches(tiny_llama_dir, tmp_path_factory):
    """With MKL, 0% residency is token-identical to resident; a batch of 4 completes."""
    prepared = prepare(str(tiny_llama_dir), tmp_path_factory.mktemp("blas") / "prepared")
    work = tmp_path_factory.mktemp("blas-servers")
    prompts = ["hello there", "What is the capital of France?", "a b c d e", "count: 1 2 3"]
    outputs: dict[str, list[str]] = {}
    for name, model, args in (
        ("resident", tiny_llama_dir, ()),
        ("streamed", prepared, ("--residency", "fixed", "--resident-layers", "0")),
    ):
        server = start_server(model, work, "--blas", "mkl", *args)
        try:
            health = server.health().json()
            assert health["blas"] == "mkl"
            maps = Path(f"/proc/{server.process.pid}/maps").read_text()
            assert "libmkl_rt" in maps
            client = server.client()

            def ask(prompt: str, client=client, server=server) -> str:
                return (
                    client.completions.create(
                        model=server.model_id,
                        prompt=prompt,
                        max_tokens=16,
                        temperature=0,
                        logit_bias=NO_EOS,
                    )
                    .choices[0]
                    .text
                )

            outputs[name] = [ask(p) for p in prompts]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                batched = list(pool.map(ask, prompts))
            # Batched rows may round differently from one row alone on MKL, so
            # only shape is checked here; identity is tested on the reference BLAS.
            assert all(len(text) > 0 for text in batched)
            assert server.health().json()["stats"]["requests_failed"] == 0
        finally:
            stop_server(server)
    assert outputs["streamed"] == outputs["resident"]
    assert len(set(outputs["resident"])) > 1


@needs_mkl
def test_server_reports_reference_blas_when_asked(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path, "--blas", "reference")
    try:
        assert server.health().json()["blas"] == "reference"
        assert "libmkl_rt" not in Path(f"/proc/{server.process.pid}/maps").read_text()
    finally:
        stop_server(server)


def test_settings_and_cli_load_without_mlx():
    """The CLI reads its settings before choosing the BLAS, so that must not load mlx."""
    code = (
        "import sys; import flashserve.server.cli.main; "
        "from flashserve.server.settings import load_settings; "
        "load_settings(None); print('mlx.core' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
