"""The mlx-lm internals speculative decoding relies on (engine/speculative/mlx_lm_internals.py).

The installed mlx-lm has every one of them and lies in the range pyproject.toml
pins; a release that renames one is caught by name, and speculation is then
switched off with that name in the log instead of failing mid-request.
"""

from __future__ import annotations

import logging
import re
import sys
from importlib.metadata import version

import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import ArraysCache, BatchKVCache, TokenBuffer
from packaging.requirements import Requirement

from flashserve.engine.speculative import mlx_lm_internals
from flashserve.engine.speculative.adaptive import SpeculativeStats
from flashserve.engine.speculative.batch import Speculation, SpeculativeConfig
from tests.conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def test_installed_mlx_lm_is_in_the_pinned_range_and_has_every_internal() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (spec,) = [Requirement(d) for d in project["dependencies"] if d.startswith("mlx-lm")]
    assert any(s.operator == "<" for s in spec.specifier), "mlx-lm needs an upper bound"
    assert spec.specifier.contains(version("mlx-lm"))
    mlx_lm_internals.check()


def _without(monkeypatch: pytest.MonkeyPatch, cls: type, field: str) -> None:
    """`cls`'s instances made without `field`, as if a release had renamed it."""
    if field in vars(cls):
        monkeypatch.delattr(cls, field)
        return
    init = cls.__init__

    def renamed(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.__dict__.pop(field, None)

    monkeypatch.setattr(cls, "__init__", renamed)


@pytest.mark.parametrize(
    ("cls", "field"),
    [
        (BatchGenerator, "_generation_batch"),
        (BatchGenerator, "_find_uids"),
        (GenerationBatch, "_next_tokens"),
        (GenerationBatch, "_num_tokens"),
        (GenerationBatch, "_token_context"),
        (TokenBuffer, "_size"),
        (BatchKVCache, "_idx"),
        (BatchKVCache, "_right_padding"),
        (ArraysCache, "lengths"),
    ],
)
def test_a_renamed_internal_is_named(
    monkeypatch: pytest.MonkeyPatch, cls: type, field: str
) -> None:
    _without(monkeypatch, cls, field)
    with pytest.raises(mlx_lm_internals.InternalsChanged, match=re.escape(f".{field} is gone")):
        mlx_lm_internals.check()


def test_a_changed_parameter_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchKVCache, "prepare", lambda self, *, left_padding=None: None)
    with pytest.raises(mlx_lm_internals.InternalsChanged, match="'lengths'"):
        mlx_lm_internals.check()


def test_changed_internals_turn_speculation_off_with_the_field_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _without(monkeypatch, BatchKVCache, "_idx")
    speculation = Speculation(SpeculativeConfig("prompt-lookup", 4), SpeculativeStats())
    batch = BatchGenerator(None)
    with caplog.at_level(logging.ERROR):
        speculation.install(batch)
    assert "BatchKVCache._idx is gone" in caplog.text
    assert not speculation.enabled
    assert type(mlx_lm_internals.generation_batch(batch)) is GenerationBatch  # plain steps
