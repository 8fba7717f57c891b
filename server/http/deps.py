"""FastAPI dependencies for the state the app shares: engine, settings, the loaded model.

Routes take them in the `Annotated` form (`engine: EngineDep`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from flashserve.engine.generation.requests import LogitsProcessor
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.http.errors import model_not_found, not_ready
from flashserve.server.settings import Settings


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def ready_model(engine: EngineDep) -> LoadedModel:
    """The loaded model, or 503 while it loads (or when loading failed)."""
    if engine.state != "ready" or engine.loaded is None:
        raise not_ready(engine.state, engine.load_error)
    return engine.loaded


ReadyModel = Annotated[LoadedModel, Depends(ready_model)]


def request_logits_processors() -> list[LogitsProcessor]:
    """Logits processors a caller embedding the app adds to every chat request.

    None here. An embedding application (or a test that scripts a tiny
    model's output) supplies them with `app.dependency_overrides`.
    """
    return []


ExtraProcessors = Annotated[list[LogitsProcessor], Depends(request_logits_processors)]


def served_names(loaded: LoadedModel, settings: Settings) -> set[str]:
    """Names a request's `model` may use: the served id, and the --model spec as given,
    or its file/directory name (with and without suffix)."""
    names = {loaded.model_id}
    if settings.model:
        spec = Path(settings.model)
        names |= {settings.model, spec.name, spec.stem}
    return names


def check_model(name: str | None, loaded: LoadedModel, settings: Settings) -> None:
    """A request naming another model gets 404 model_not_found; none means ours."""
    if name is not None and name not in served_names(loaded, settings):
        raise model_not_found(name)


def vocab_size(loaded: LoadedModel) -> int:
    """Size of the model's output layer (token ids a logit_bias may name)."""
    config = loaded.config or {}
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else len(loaded.tokenizer)
