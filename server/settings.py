"""The one settings object: config.toml < FLASHSERVE_* environment < CLI flags.

Every key is documented with its default in config.example.toml. An unknown
key or a bad value is a startup error that names it.
"""

from __future__ import annotations

import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

from flashserve.engine.config import EngineConfig

ENV_PREFIX = "FLASHSERVE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


class SettingsError(Exception):
    """Bad configuration; the message names the key."""


def parse_size(value: Any) -> int:
    """'3GB', '512MiB', '300mb' or a plain number of bytes -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"not a size: {value!r} (use e.g. 3GB, 512MB or bytes)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    scale = _UNITS[unit[:1]] if unit else 1
    if "i" in unit:
        scale = 1024 ** "bkmgt".index(unit[0]) if unit[0] != "b" else 1
    return int(number * scale)


class Settings(BaseSettings):
    model_config = ConfigDict(extra="forbid", validate_default=True)  # type: ignore[assignment]

    # Model and server
    model: str | None = Field(None, description="model dir, GGUF file, prepared dir or HF repo id")
    model_id: str | None = Field(None, description="name in /v1/models (default: from the path)")
    models_dir: str | None = Field(
        None,
        description="several models: every GGUF file, prepared layout and mlx-lm directory "
        "in it is a model, its id the file or folder name; each loads on its first request",
    )
    models: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="[models.NAME] tables: one model's path, aliases, pinned and its own "
        "settings (residency, expert_cache, kv_bits, speculative, context, ...); JSON on "
        "the command line",
    )
    models_max: int = Field(
        0, ge=0, description="models loaded at once at most (0: as many as memory holds)"
    )
    idle_unload: float = Field(
        0.0, ge=0, description="seconds unused after which a model is unloaded (0: never)"
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="what the log shows: info = loading, plans and one access line per "
        "request; warning = only problems (memory pressure, dropped states, failures); "
        "error = failures; debug = info and diagnostics",
    )
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="a cap on the output of a request that sets no limit; unset: it runs "
        "until the model stops or the context is full (as OpenAI's APIs and llama.cpp do)",
    )
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="auto: the GPU where MLX has one (float16), else the CPU (float32)"
    )

    # Layer streaming
    residency: Literal["all", "fixed", "auto"] = "all"
    resident_layers: int | None = Field(None, ge=0)
    memory_budget: int | None = Field(None, description="bytes, e.g. 3GB")
    residency_mode: Literal["max_tps", "balanced", "max_context"] = "balanced"
    placement: Literal["auto", "first_n", "last_n", "interleaved"] = "auto"
    prefetch_depth: int = Field(2, ge=0, le=8)
    shed_floor: int = Field(300_000_000, description="available memory under which to shed")

    # MoE expert offload
    expert_cache: str | None = Field(
        None, description="slots (2048), bytes (3GB), or auto: planned from the memory limit"
    )
    expert_policy: Literal["lru", "lfu"] = "lru"
    expert_threads: int = Field(8, ge=1, le=64)
    # auto: next-layer under `expert_cache = "auto"` when the experts do not all fit
    # (its reads come out of the cache's bytes: experts/prefetch.py), else none.
    expert_prefetch: Literal["auto", "none", "next-layer"] = "auto"
    record_routing: str | None = None

    # Generation
    max_batch: int = Field(8, ge=1, le=256)
    prefill_step_size: int = Field(512, ge=16)
    prefill_order: Literal["auto", "chunked"] = Field(
        "auto", description="auto: layer-major when weights come from disk; chunked: mlx-lm's"
    )
    prefill_group_bytes: int = Field(
        512_000_000, ge=1, description="activations a layer-major prefill may hold"
    )
    max_queue: int = Field(64, ge=1)
    prompt_cache_bytes: int = Field(
        1_000_000_000, ge=0, description="memory for cached prompt states; 0 turns reuse off"
    )
    prompt_cache_disk_bytes: int = Field(
        10_000_000_000, ge=0, description="SSD for cached prompt states; 0 keeps them in memory"
    )
    prompt_cache_dir: str | None = Field(
        None,
        description="where they go; default ~/.cache/flashserve/prompt-cache/<weights "
        "fingerprint> (Linux), ~/Library/Caches/flashserve/prompt-cache/<...> (macOS)",
    )
    prompt_cache_write_bytes_per_hour: int = Field(
        4_000_000_000,
        ge=0,
        description="SSD bytes the prompt cache may write in any hour; past it states stay "
        "in memory; 0 = no cap",
    )
    kv_bits: int | None = Field(
        None,
        description="attention KV cache kept quantized: 8 or 4 bits (less memory per "
        "token, prompt cache included); unset (or 'none') keeps it float",
    )
    kv_group_size: int = Field(
        64, description="kv_bits: values per quantization group along a head: 32, 64 or 128"
    )
    plan_kv_bits: int | None = Field(
        8,
        description="residency auto, kv_bits unset: the bits the memory plan may keep the KV "
        "cache at when the model's layers do not all fit beside a float cache ('none': "
        "never; greedy output is then the float cache's)",
    )
    data_dir: str | None = Field(
        None,
        description="stored responses (/v1/responses store=true); default "
        "~/.local/share/flashserve (Linux), ~/Library/Application Support/flashserve (macOS)",
    )
    response_store_max: int = Field(
        10_000, ge=0, description="stored responses kept; the oldest go first; 0 stores none"
    )
    blas: Literal["auto", "mkl", "reference"] = Field(
        "auto", description="Linux: BLAS for float matmuls; auto = mkl when installed"
    )
    quantized_matmul: Literal["auto", "fast", "mlx"] = Field(
        "auto",
        description="CPU: kernel for quantized matmuls with few rows (decode) and the "
        "step ops (norms, RoPE, attention, SwiGLU, log-sum-exp); "
        "auto = flashserve's where they run, else MLX's",
    )
    prompt_matmul: Literal["int16", "int8", "float"] = Field(
        "int16",
        description="CPU: prompt chunks through 4- and 8-bit linears (an offloaded MoE's "
        "expert rows included); int16 / int8 = rows "
        "rounded to that many bits per block of 32, integer dot products on every core "
        "(accuracy against float: docs/benchmarks/agent-turns.md); float = dequantize + BLAS",
    )
    decode_matmul: Literal["int16", "float"] = Field(
        "int16",
        description="CPU: decode steps (the LM head, experts and speculative verify rows "
        "too) through 4- and 8-bit linears; int16 = x rounded per block of 32 as the prompt "
        "rows are, integer dot products (AVX-512 or AVX2; faster than float); float = x "
        "kept in float32",
    )
    compile_decode: bool = Field(
        True,
        description="CPU, every weight resident: run each decode step as one compiled "
        "MLX function (less Python per step; the same tokens)",
    )
    speculative: Literal["off", "prompt-lookup", "draft", "both"] = Field(
        "off",
        description="speculative decoding: drafts from prompt lookup (n-grams of the prompt "
        "and output), a draft model, or both, verified several per pass; greedy output "
        "unchanged",
    )
    speculative_max_draft: int = Field(
        8, ge=1, le=64, description="drafted tokens per pass at most (adapts below it)"
    )
    speculative_draft_model: str | None = Field(
        None, description="draft | both: a small model with the same vocabulary (dir or GGUF)"
    )

    # Several machines (engine/distributed/): one model split by layer ranges
    hostfile: str | None = Field(
        None, description="mlx.launch hostfile (JSON): serve starts one rank per host"
    )
    layer_split: str | None = Field(
        None, description="decoder layers per rank, e.g. 10,14; default: even"
    )
    distributed_backend: Literal["ring", "jaccl", "jaccl-ring"] = Field(
        "ring", description="mlx.launch backend: ring (TCP) or jaccl (Thunderbolt RDMA)"
    )
    distributed_port: int = Field(
        32323, ge=1, le=65535, description="first port of the ring backend (one per rank)"
    )

    # Tools and reasoning
    tool_parser: str | None = Field(
        None, description="override the parser chosen from the template"
    )
    reasoning_parser: str | None = Field(None, description="'none' turns reasoning parsing off")
    history_thinking: Literal["template", "empty", "keep"] = Field(
        "empty",
        description="earlier assistant turns' <think> blocks: template (as the chat template "
        "renders them) | empty (thinking off: the empty block the model saw, so the next turn "
        "reuses prompt + answer) | keep (also the reasoning a client passes back)",
    )

    # Images (vision-language models)
    max_images: int = Field(8, ge=1, le=256, description="images per request, at most")
    max_image_pixels: int = Field(
        1_048_576,
        ge=784,
        description="pixels per image; a larger image is downscaled to fit (aspect kept)",
    )
    allow_image_urls: bool = Field(
        False,
        description="fetch http(s) image URLs in requests (off: a 400 asks for a data: URL); "
        "hosts on public addresses only, unless image_url_private",
    )
    image_url_private: bool = Field(
        False,
        description="allow_image_urls: also fetch from loopback, private and link-local "
        "addresses (the server's own network: any client can then make it read there)",
    )
    image_url_max_bytes: int = Field(
        20_000_000, ge=1024, description="allow_image_urls: bytes one fetched image may have"
    )
    image_url_timeout: float = Field(
        10.0, gt=0, description="allow_image_urls: seconds to fetch one image, redirects included"
    )

    # Production
    api_key: str | None = None
    api_key_file: str | None = None
    allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_body_bytes: int = Field(4_000_000, ge=1024)
    request_timeout: float = Field(600.0, gt=0, description="seconds per request")
    stream_keepalive: float = Field(
        5.0,
        ge=0,
        description="seconds without output after which a stream sends its dialect's "
        "keepalive event (a long prefill); 0 sends none",
    )
    shutdown_grace: float = Field(10.0, ge=0, description="seconds SIGTERM waits for generations")
    log_prompts: bool = False
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="extra Host names accepted when no API key is set"
    )
    allow_client_chat_template: bool = Field(
        False, description="let requests bring their own chat template (chat_template_kwargs)"
    )
    template_timeout: float = Field(
        10.0, gt=0, description="seconds to render and tokenize one prompt"
    )
    io_timeout: float = Field(
        30.0, gt=0, description="seconds a weight read may stall before its request fails"
    )
    max_connections: int = Field(1000, ge=1, description="open HTTP connections at most")
    keep_alive_timeout: float = Field(5.0, gt=0, description="seconds an idle connection stays")

    @field_validator(
        "memory_budget",
        "shed_floor",
        "max_body_bytes",
        "image_url_max_bytes",
        "prompt_cache_bytes",
        "prompt_cache_disk_bytes",
        "prompt_cache_write_bytes_per_hour",
        "prefill_group_bytes",
        mode="before",
    )
    @classmethod
    def _sizes(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)

    @field_validator("models", mode="before")
    @classmethod
    def _models_json(cls, value: Any) -> Any:
        if isinstance(value, str):  # the command line and the environment give JSON
            import json

            try:
                return json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON: {exc}") from None
        return value

    @field_validator("kv_bits", "plan_kv_bits", mode="before")
    @classmethod
    def _kv_bits(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "none", "off", "float"):
            return None
        return value

    @field_validator("kv_bits", "plan_kv_bits", "kv_group_size")
    @classmethod
    def _kv_quantization(cls, value: int | None, info: ValidationInfo) -> int | None:
        from flashserve.engine.kv import BITS, GROUP_SIZES  # no MLX: the BLAS is not chosen yet

        bits = info.field_name != "kv_group_size"
        allowed = BITS if bits else GROUP_SIZES
        if value is not None and value not in allowed:
            unset = " or unset (a float cache)" if bits else ""
            raise ValueError(f"must be one of {', '.join(map(str, allowed))}{unset}")
        return value

    @field_validator("hostfile")
    @classmethod
    def _hostfile(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("kv_bits") is not None:
            raise ValueError("a model split across machines keeps a float KV cache: unset kv_bits")
        return value

    @field_validator("tool_parser")
    @classmethod
    def _tool_parser(cls, value: str | None) -> str | None:
        from flashserve.server.chat.tool_parsers import available

        if value is not None and value != "auto" and value not in available():
            raise ValueError(
                f"unknown tool parser {value!r} (known: auto, {', '.join(available())})"
            )
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _reasoning_parser(cls, value: str | None) -> str | None:
        from flashserve.server.chat.reasoning import check_setting

        check_setting(value)
        return value

    @field_validator("speculative_draft_model")
    @classmethod
    def _draft_model(cls, value: str | None, info: Any) -> str | None:
        if value is None and info.data.get("speculative") in ("draft", "both"):
            raise ValueError("speculative = draft or both needs a draft model (a dir or GGUF)")
        return value

    @field_validator("allowed_origins", "allowed_hosts", mode="before")
    @classmethod
    def _origins(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [o.strip() for o in value.split(",") if o.strip()]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = TomlConfigSettingsSource(settings_cls, toml_file=_config_file_in_use)
        return (init_settings, env_settings, toml)

    def model_entries(self) -> tuple[list[Any], str | None]:
        """The models this server serves (engine/models/catalog.py), and the one loaded
        at start: the --model, or none when only models_dir / [models.*] name them."""
        from flashserve.engine.models.catalog import CatalogError, build

        try:
            return build(
                self.engine_config(), self.model, self.model_id, self.models_dir, self.models
            )
        except CatalogError as exc:
            raise SettingsError(str(exc)) from None

    @property
    def several_models(self) -> bool:
        return bool(self.models_dir or self.models)

    def engine_config(self) -> EngineConfig:
        names = {f.name for f in fields(EngineConfig)} - {"extra"}
        values = {name: getattr(self, name) for name in names if hasattr(self, name)}
        if self.residency == "all" and (self.resident_layers is not None or self.memory_budget):
            values["residency"] = "fixed"
        if self.hostfile:  # a model split across machines keeps a float KV cache
            values["plan_kv_bits"] = None
        return EngineConfig(**values)


# Set by load_settings for the duration of one Settings() construction.
_config_file_in_use: Path | None = None


def load_settings(config_file: str | Path | None = None, **cli: Any) -> Settings:
    """Build Settings from config file < FLASHSERVE_* env < CLI values (None = not given)."""
    global _config_file_in_use
    path = config_file or os.environ.get(CONFIG_ENV)
    if path is None and Path("config.toml").exists():
        path = "config.toml"
    if path is not None and not Path(path).is_file():
        raise SettingsError(f"config file {path}: no such file")
    _check_env_names()
    _config_file_in_use = Path(path) if path else None
    try:
        return Settings(**{k: v for k, v in cli.items() if v is not None}, _env_prefix=ENV_PREFIX)
    except ValidationError as exc:
        raise SettingsError(_describe(exc, path)) from None
    except (OSError, ValueError) as exc:  # unreadable or malformed TOML
        raise SettingsError(f"{path or 'settings'}: {exc}") from None
    finally:
        _config_file_in_use = None


def _check_env_names() -> None:
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields} | {CONFIG_ENV}
    for name in os.environ:
        if name.startswith(ENV_PREFIX) and name not in known:
            raise SettingsError(f"unknown setting in environment: {name}")


def _describe(exc: ValidationError, path: Any) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "?"
        if err["type"] == "extra_forbidden":
            where = f" in {path}" if path else ""
            lines.append(f"unknown setting '{key}'{where}")
        else:
            lines.append(f"setting '{key}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)
