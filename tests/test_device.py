"""The `device` setting: auto | cpu | gpu, chosen once as the model loads (issue 43)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from flashserve.engine.compute import device
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights.model import ModelLoadError, compute_dtype
from flashserve.server.settings import SettingsError, load_settings


def test_auto_takes_the_gpu_where_mlx_has_one_and_the_cpu_otherwise():
    chosen = device.select("auto")
    assert chosen == (mx.gpu if mx.is_available(mx.gpu) else mx.cpu)
    assert compute_dtype() == (mx.float16 if chosen == mx.gpu else mx.float32)


def test_cpu_is_float32():
    try:
        assert device.select("cpu") == mx.cpu
        assert device.describe() == "cpu"
        assert compute_dtype() == mx.float32
    finally:
        device.select("auto")


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this MLX has a GPU")
def test_gpu_without_a_gpu_backend_is_refused_naming_the_extra(tmp_path):
    with pytest.raises(device.DeviceError, match="cuda13"):
        device.select("gpu")
    # Before the model is even looked for: the error is the device's, not the path's.
    with pytest.raises(ModelLoadError, match="no GPU backend"):
        load(EngineConfig(model=str(tmp_path / "nowhere"), device="gpu"))


def test_setting_reaches_the_engine_config(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no stray ./config.toml
    monkeypatch.setenv("FLASHSERVE_DEVICE", "cpu")
    assert load_settings().engine_config().device == "cpu"
    with pytest.raises(SettingsError, match="device"):
        load_settings(device="tpu")
