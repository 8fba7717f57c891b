"""What a server can serve: one entry per model, by name, with its own engine settings.

Entries come from `--model` (one model, as before), from every model under
`--models-dir` (a GGUF file, a prepared layout, an mlx-lm directory: its id
is the file or folder name, a GGUF's without `.gguf`), and from
`[models.NAME]` tables, whose settings override the server's for that model.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashserve.engine.config import EngineConfig
from flashserve.engine.weights.layout import MANIFEST_NAME

log = logging.getLogger(__name__)

# Engine settings a [models.NAME] table may give its model. The rest are the
# process's (device, BLAS, kernels: chosen once per process) or the server's.
PER_MODEL = frozenset(
    {
        "residency",
        "resident_layers",
        "memory_budget",
        "residency_mode",
        "placement",
        "prefetch_depth",
        "expert_cache",
        "expert_policy",
        "expert_prefetch",
        "max_batch",
        "prefill_step_size",
        "speculative",
        "speculative_max_draft",
        "speculative_draft_model",
        "kv_bits",
        "kv_group_size",
        "plan_kv_bits",
        "prompt_cache_bytes",
        "prompt_cache_disk_bytes",
        "prompt_cache_dir",
        "compile_decode",
        "context",  # EngineConfig.context_length: a cap on the model's context
    }
)
# Keys of a [models.NAME] table that are the pool's, not the engine's.
ENTRY_KEYS = frozenset({"path", "aliases", "pinned"})


class CatalogError(ValueError):
    """A models setting that cannot be served; the message names it."""


@dataclass
class ModelEntry:
    name: str  # the id clients send and /v1/models lists
    config: EngineConfig  # its engine's settings; config.model is its path
    aliases: tuple[str, ...] = ()
    pinned: bool = False  # never unloaded to make room, nor when idle
    disk_bytes: int = 0  # weights on disk: the size /v1/models reports
    names: frozenset[str] = field(default_factory=frozenset)  # every name that resolves here


def disk_bytes(path: Path) -> int:
    """Bytes of a model's files (a GGUF file, or every file under a directory)."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


def is_model(path: Path) -> bool:
    """A GGUF file, a prepared layout or an mlx-lm model directory."""
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and ((path / MANIFEST_NAME).exists() or (path / "config.json").exists())


def discover(models_dir: Path) -> dict[str, Path]:
    """Every model directly under `models_dir`, by id (sorted by name)."""
    if not models_dir.is_dir():
        raise CatalogError(f"models_dir {models_dir}: not a directory")
    found: dict[str, Path] = {}
    for child in sorted(models_dir.iterdir()):
        if child.name.startswith(".") or not is_model(child):
            continue
        name = child.stem if child.is_file() else child.name
        if name in found:  # a GGUF beside a folder of the same name: the folder keeps it
            log.warning("models_dir: %s and %s share the id %s", found[name], child, name)
            continue
        found[name] = child
    return found


def build(
    base: EngineConfig,
    default_model: str | None,
    default_id: str | None,
    models_dir: str | None,
    tables: dict[str, dict[str, Any]],
) -> tuple[list[ModelEntry], str | None]:
    """The entries a server serves, and the name of the one loaded at start (--model).

    With neither models_dir nor tables: one entry, the --model (or the bundled
    default model), exactly as a one-model server."""
    paths: dict[str, Path | str] = {}
    if models_dir:
        paths.update(discover(Path(models_dir).expanduser()))
    settings: dict[str, dict[str, Any]] = {}
    for name, table in tables.items():
        unknown = set(table) - PER_MODEL - ENTRY_KEYS
        if unknown:
            raise CatalogError(
                f"models.{name}: unknown or process-wide setting(s) {', '.join(sorted(unknown))}"
                f" (a model may set: {', '.join(sorted(PER_MODEL | ENTRY_KEYS))})"
            )
        if "path" in table:
            paths[name] = Path(str(table["path"])).expanduser()
        elif name not in paths:
            raise CatalogError(f"models.{name}: no path, and no model of that id in models_dir")
        settings[name] = table
    default_name: str | None = None
    if default_model is not None or not paths:
        default_name = default_id or _spec_id(default_model)
        paths.setdefault(default_name, default_model or "")
    entries = []
    for name, path in paths.items():
        table = settings.get(name, {})
        values = {k: v for k, v in table.items() if k in PER_MODEL and k != "context"}
        if "context" in table:
            values["context_length"] = int(table["context"])
        # The --model keeps its spec as given (None: the bundled model), as before.
        model = base.model if name == default_name else str(path)
        config = dataclasses.replace(base, model=model, model_id=name, **values)
        aliases = tuple(str(a) for a in table.get("aliases", ()))
        names = {name, *aliases}
        if name == default_name and default_model:  # the spec as given, as before
            spec = Path(default_model)
            names |= {default_model, spec.name, spec.stem}
        entries.append(
            ModelEntry(
                name=name,
                config=config,
                aliases=aliases,
                pinned=bool(table.get("pinned", False)) or name == default_name,
                disk_bytes=disk_bytes(_local_path(path)),
                names=frozenset(names),
            )
        )
    _check_names(entries)
    _draft_paths(entries)
    return entries, default_name


def _draft_paths(entries: list[ModelEntry]) -> None:
    """A speculative draft model named by another entry's id or alias: that model's files
    (the draft is its own resident copy, beside the verifying model's worker)."""
    paths = {n: e.config.model for e in entries for n in e.names if e.config.model}
    for entry in entries:
        draft = entry.config.speculative_draft_model
        if draft in paths and draft not in entry.names:
            entry.config = dataclasses.replace(entry.config, speculative_draft_model=paths[draft])


def _local_path(path: Path | str) -> Path:
    """Where a model's files are (the bundled model for an empty spec), for its size."""
    from flashserve.engine.weights.model import ModelLoadError
    from flashserve.engine.weights.sources import resolve

    try:
        found = resolve(str(path) if str(path) else None)
    except ModelLoadError:
        return Path(str(path))
    return found if isinstance(found, Path) else Path(str(path))


def _spec_id(spec: str | None) -> str:
    """The id a one-model server has always reported for its --model."""
    from flashserve.engine.weights.model import ModelLoadError
    from flashserve.engine.weights.sources import model_id, resolve

    try:
        return model_id(resolve(spec))
    except ModelLoadError:  # reported when it loads, as before
        return spec or "default"


def _check_names(entries: list[ModelEntry]) -> None:
    owner: dict[str, str] = {}
    for entry in entries:
        for name in entry.names:
            if owner.setdefault(name, entry.name) != entry.name:
                raise CatalogError(f"the name {name!r} is both {owner[name]}'s and {entry.name}'s")
