"""FastAPI dependencies for the state the app shares: engine, settings, the loaded model."""

from __future__ import annotations

from pathlib import Path

from fastapi import Depends, Request

from engine.loader import LoadedModel
from engine.worker import Engine

from .errors import model_not_found, not_ready
from .settings import Settings


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def ready_model(engine: Engine = Depends(get_engine)) -> LoadedModel:
    """The loaded model, or 503 while it loads (or when loading failed)."""
    if engine.state != "ready" or engine.loaded is None:
        raise not_ready(engine.state, engine.load_error)
    return engine.loaded


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
