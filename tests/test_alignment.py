"""Every tensor view of a read buffer sits at an aligned offset (issue 43).

MLX's CUDA matmuls fail on views aligned only to their element size, and Metal
kernels assume aligned buffers: prepared files (layout format 2) put every
tensor and expert record at a multiple of ALIGN, and a view anywhere else is a
copy off the CPU. These run on the CPU, so CI guards the GPU backends' needs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.experts import store as store_module
from flashserve.engine.experts.store import ExpertStore, layouts_from_manifest
from flashserve.engine.loader import load
from flashserve.engine.weights import reader
from flashserve.engine.weights.layout import ALIGN, MANIFEST_NAME, read_manifest
from flashserve.engine.weights.model import ModelLoadError
from tests.streaming_fixtures import prepared_model


def _address(arr: mx.array) -> int:
    mx.eval(arr)
    return np.array(arr.reshape(-1).view(mx.uint8), copy=False).ctypes.data


def _weight_files(manifest: dict) -> list[dict]:
    entries = [manifest["non_layer"], *manifest["layers"]]
    return entries + [e["experts"] for e in manifest["layers"] if e.get("experts")]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_reader_views_are_aligned_and_zero_copy(tmp_path_factory, arch):
    out = prepared_model(tmp_path_factory, arch)
    manifest = read_manifest(out)
    for entry in _weight_files(manifest):
        buffer, raw = reader.allocate(entry["bytes"])
        reader.FileRead(
            out / entry["file"],
            entry["bytes"],
            reader.chunk_pieces(raw, None, reader.CHUNK_BYTES),
            reader.shared_pool(),
        ).wait(30)
        base = _address(buffer)
        views = reader.safetensors_views(buffer, raw, out / entry["file"])
        assert views
        for name, arr in views.items():
            at = _address(arr) - base
            assert 0 <= at < entry["bytes"], f"{name}: a copy, not a view of the read buffer"
            assert at % ALIGN == 0, f"{entry['file']}: {name} at offset {at}"


def test_expert_records_and_their_tensors_are_aligned(tmp_path_factory):
    out = prepared_model(tmp_path_factory, "qwen3_moe")
    layouts = layouts_from_manifest(out, read_manifest(out))
    for layout in layouts.values():
        assert layout.record_bytes % ALIGN == 0
        assert all(offset % ALIGN == 0 for offset, _ in layout.records)
        assert all(spec.offset % ALIGN == 0 for spec in layout.tensors)
    store = ExpertStore(layouts, threads=2)
    try:
        layer = min(layouts)
        for expert in (0, layouts[layer].num_experts - 1):
            record = store.submit(layer, expert).result().record
            base = _address(record)
            assert base % ALIGN == 0  # the record itself, inside its (direct-read) buffer
            for name, arr in store.tensors(layer, record).items():
                at = _address(arr) - base
                assert 0 <= at < record.size, f"{name}: a copy, not a view of the record"
                assert at % ALIGN == 0, f"{name} at offset {at} of its record"
    finally:
        store.close()


def test_streaming_and_expert_cache_view_only_aligned_offsets(tmp_path_factory, monkeypatch):
    """Every offset the streamer and the expert cache make a view at, through a forward."""
    out = prepared_model(tmp_path_factory, "qwen3_moe")
    seen: list[int] = []
    real = reader.can_view

    def recording(offset: int, dtype: mx.Dtype) -> bool:
        seen.append(offset)
        return real(offset, dtype)

    monkeypatch.setattr(reader, "can_view", recording)
    monkeypatch.setattr(store_module, "can_view", recording)
    tokens = mx.array([[1, 2, 3, 40, 41]])
    for config in (
        EngineConfig(model=str(out), resident_layers=0),  # streamed layers, experts with them
        EngineConfig(model=str(out), resident_layers=0, expert_cache="4"),  # the expert cache
    ):
        loaded = load(config)
        mx.eval(loaded.model(tokens))
    assert seen
    assert [o for o in seen if o % ALIGN] == []


def test_misaligned_view_is_a_copy_off_the_cpu(monkeypatch):
    buffer, raw = reader.allocate(4 * ALIGN)
    raw[:] = np.arange(raw.size) % 251
    want = np.frombuffer(raw[6 : 6 + 64].tobytes(), np.float16)
    # On the CPU an element-aligned offset is a view ...
    view = reader.view_as(buffer, raw, 6, 6 + 64, mx.float16, [32])
    assert _address(view) - _address(buffer) == 6
    # ... on a GPU only a multiple of ALIGN is: anything else is copied, same values.
    monkeypatch.setattr(reader.mx, "default_device", lambda: mx.gpu)
    assert not reader.can_view(6, mx.float16)
    assert reader.can_view(2 * ALIGN, mx.float16)
    monkeypatch.undo()
    monkeypatch.setattr(reader, "can_view", lambda offset, dtype: offset % ALIGN == 0)
    copied = reader.view_as(buffer, raw, 6, 6 + 64, mx.float16, [32])
    assert not 0 <= _address(copied) - _address(buffer) < raw.size
    np.testing.assert_array_equal(np.array(copied), want)


def test_old_format_is_refused_with_the_command_that_reprepares_it(tmp_path_factory, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(prepared_model(tmp_path_factory, "llama"), old)
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    manifest["format_version"] = 1
    manifest["options"] = {"bits": 4, "expert_bits": None, "group_size": 32}
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    source = manifest["source"]["spec"]
    with pytest.raises(ModelLoadError) as info:
        load(EngineConfig(model=str(old)))
    message = str(info.value)
    assert "version 1" in message and "not aligned" in message
    assert message.endswith(f"flashserve prepare {source} {old} --bits 4 --group-size 32 --force")


def test_newer_format_is_refused_too(tmp_path_factory, tmp_path):
    new = tmp_path / "new"
    shutil.copytree(prepared_model(tmp_path_factory, "llama"), new)
    manifest = json.loads((new / MANIFEST_NAME).read_text())
    manifest["format_version"] = 99
    (new / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="newer flashserve"):
        read_manifest(Path(new))
