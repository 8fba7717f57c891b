"""Load a prepared directory (weights/layout.py) as a streamed model.

Builds the mlx-lm model from its config, checks every layer's tensors against
the manifest, loads the non-layer weights, plans residency from the memory
there is (streaming/residency.py), and hands the decoder layers to a
LayerStreamer; with `expert_cache`, the experts go to the expert cache
(experts/install.py) instead of travelling with their layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from flashserve.engine.compute import prompt_matmul, qmm
from flashserve.engine.config import EngineConfig
from flashserve.engine.experts.install import offload_from_config
from flashserve.engine.kv.cache import head_dims
from flashserve.engine.kv.price import kv_bytes_per_token, kv_price
from flashserve.engine.streaming.denseplan import DenseShape, apply_dense_plan, record_in
from flashserve.engine.streaming.memplan import apply_memory_plan, is_auto
from flashserve.engine.streaming.residency import (
    MODES,
    ResidencyManager,
    fmt_bytes,
    plan_residency,
)
from flashserve.engine.streaming.streamer import EMPTY, LayerInfo, LayerStreamer, Slot
from flashserve.engine.weights.derived import parse as parse_derived
from flashserve.engine.weights.layout import (
    NON_LAYER_FILE,
    check_small_files,
    checksum_chunk,
    find_layers,
    read_manifest,
    reprepare_command,
    verify_files,
)
from flashserve.engine.weights.model import (
    LoadedModel,
    ModelLoadError,
    compute_dtype,
    context_length_of,
)
from flashserve.engine.weights.reader import CHUNK_BYTES, read_tensors

log = logging.getLogger(__name__)


def _slots(layer: nn.Module) -> list[Slot]:
    slots = []
    for name, _ in tree_flatten(layer.parameters()):
        container: Any = layer
        *path, last = name.split(".")
        for part in path:
            container = container[int(part)] if isinstance(container, list) else container[part]
        key = int(last) if isinstance(container, list) else last
        slots.append(Slot(container, key, name))
    return slots


def _layer_info(root: Path, entry: dict, module: nn.Module, prefix: str) -> LayerInfo:
    index = entry["index"]
    slots = _slots(module)
    experts = entry.get("experts") or {}
    switches = experts.get("switches", [])
    derived = parse_derived(entry.get("derived"))
    lp = f"{prefix}{index}."
    have = {n[len(lp) :] for n in entry["tensors"]}
    for sw in switches:
        have |= {f"{sw['path'][len(lp) :]}.{name}" for name in sw["tensors"]}
    want = {s.name for s in slots}
    if have != want:
        missing = sorted(want - have)[:3]
        extra = sorted(have - want)[:3]
        raise ModelLoadError(
            f"{root / entry['file']}: tensors do not match the model "
            f"(missing {missing}, unexpected {extra})"
        )
    return LayerInfo(
        index=index,
        module=module,
        file=root / entry["file"],
        tensors=list(entry["tensors"]),
        experts_file=root / experts["file"] if experts else None,
        switches=switches,
        slots=slots,
        dense_bytes=int(entry["tensor_bytes"]),
        expert_bytes=int(experts.get("tensor_bytes", 0)),
        file_bytes=int(entry["bytes"]),
        crc32=entry.get("crc32"),
        experts_file_bytes=int(experts.get("bytes", 0)),
        derived=derived[0],
        derived_bytes=derived[1],
        left_out_bytes=sum(d.nbytes for d in derived[0]),
    )


def _build_model(root: Path, manifest: dict) -> tuple[nn.Module, dict]:
    from mlx_lm.utils import _get_classes, load_config

    config = load_config(root)
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except Exception as exc:
        raise ModelLoadError(
            f"{root}: cannot build model {config.get('model_type')}: {exc}"
        ) from exc
    quant = manifest["quantization"]["modules"]
    if quant:
        nn.quantize(
            model, class_predicate=lambda path, _: dict(quant[path]) if path in quant else False
        )
    model.eval()
    return model, config


def _load_non_layer(
    root: Path, model: nn.Module, prefix: str, entry: dict, chunk: int, timeout: float
) -> int:
    file = root / NON_LAYER_FILE
    # Checked against the manifest's checksums as it is read (WeightFileError names it).
    weights = read_tensors(
        file, int(entry["bytes"]), entry.get("crc32"), chunk_bytes=chunk, timeout=timeout
    )
    expected = {n: a for n, a in tree_flatten(model.parameters()) if not n.startswith(prefix)}
    if set(weights) != set(expected):
        missing = sorted(set(expected) - set(weights))[:3]
        extra = sorted(set(weights) - set(expected))[:3]
        raise ModelLoadError(
            f"{file}: tensors do not match the model (missing {missing}, unexpected {extra})"
        )
    for name, arr in weights.items():
        if arr.shape != expected[name].shape:
            raise ModelLoadError(
                f"{file}: {name} has shape {arr.shape}, the model expects {expected[name].shape}"
            )
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(list(weights.values()))
    return sum(a.nbytes for a in weights.values())


def runtime_reserve(config: dict, engine: EngineConfig) -> int:
    """R_runtime: memory for activations and the MLX runtime beyond weights and KV.

    A base for buffers and fragmentation, plus a prefill chunk's attention
    scores and activations, plus logits for a full batch. An estimate; set
    `extra["runtime_reserve"]` (bytes) to use a measured one.
    """
    if "runtime_reserve" in engine.extra:
        return int(engine.extra["runtime_reserve"])
    return 256 * 1024 * 1024 + activation_bytes(config, engine)


def activation_bytes(config: dict, engine: EngineConfig) -> int:
    """A prefill chunk's attention scores and activations, and a full batch's logits."""
    text = config.get("text_config") or {}
    hidden = int(config.get("hidden_size", text.get("hidden_size", 4096)))
    heads = int(config.get("num_attention_heads", text.get("num_attention_heads", 32)))
    vocab = int(config.get("vocab_size", text.get("vocab_size", 32000)))
    step = int(engine.prefill_step_size)
    activations = step * hidden * 4 * 16 + heads * step * step * 4 * 2
    logits = engine.max_batch * vocab * 4 * 4
    return activations + logits


def dense_activations(
    config: dict, engine: EngineConfig, kv_bits: int | None = None
) -> Callable[[int, int], int]:
    """(chunk tokens, context tokens) -> what a prompt chunk holds at once in a layer
    (its hidden states, q/k/v, the MLP's three rows, and its attention scores
    against the whole context, with the softmax's copy), and a full batch's logits.
    With `kv_bits`, also what a quantized cache adds: the float copy a chunk's
    attention makes of the layer's keys and values, with its temporary, per
    context token (kv/cache.py `_dequantize`)."""
    text = config.get("text_config") or {}

    def get(key: str, default: int) -> int:
        return int(config.get(key) or text.get(key) or default)

    hidden = get("hidden_size", 4096)
    heads = get("num_attention_heads", 32)
    kv_heads = get("num_key_value_heads", heads)
    head_dim = get("head_dim", hidden // heads)
    inter = get("intermediate_size", 4 * hidden)
    vocab = get("vocab_size", 32000)
    size = compute_dtype().size
    per_token = 6 * hidden + (heads + 2 * kv_heads) * head_dim + 3 * inter
    logits = engine.max_batch * vocab * 4 * 4
    dequantized = 0 if kv_bits is None else 2 * 2 * kv_heads * head_dim * size

    def activations(chunk: int, context: int) -> int:
        scores = 2 * heads * chunk * context * size
        return chunk * per_token * size + scores + context * dequantized + logits

    return activations


def _float_copies(config: EngineConfig, layers: list[nn.Module]) -> tuple[int, int]:
    """The most float weight any layer's prompt chunks hold (compute/prompt_matmul.py
    float_copies), read from the built layers' shapes (nothing is evaluated)."""
    kernel = config.quantized_matmul != "mlx" and _avx512_kernel()
    integer = (
        config.quantized_matmul != "mlx"
        and config.prompt_matmul != "float"
        and prompt_matmul.integer_available()
    )
    copies = [
        prompt_matmul.float_copies(layer, compute_dtype(), kernel, integer) for layer in layers
    ]
    return max((c[0] for c in copies), default=0), max((c[1] for c in copies), default=0)


def _dense_shape(
    model: nn.Module,
    model_config: dict,
    config: EngineConfig,
    copies: tuple[int, int],
    layer_bytes: list[int],
    kv_bits: int | None,
) -> DenseShape:
    """The dense plan's view of a model, its KV at `kv_bits`: `copies` from
    _float_copies."""
    text = model_config.get("text_config") or {}
    hidden = int(model_config.get("hidden_size") or text.get("hidden_size") or 4096)
    price = kv_price(model, model_config, kv_bits, config.kv_group_size)
    # The plan may only quantize where kv_bits would be taken (kv/cache.py).
    fits = all(dim % config.kv_group_size == 0 for dim in head_dims(model))
    return DenseShape(
        layer_bytes=layer_bytes,
        kv_bytes_per_token=price.unbounded + sum(per for per, _ in price.bounded),
        kv_bytes=price.bytes,
        held_bytes_per_token=2 * hidden * compute_dtype().size,  # generation/prefill/layer_major.py
        context_length=context_length_of(model_config),
        activations=dense_activations(model_config, config, kv_bits),
        float_copy_bytes=copies[0],
        float_slice_bytes=copies[1],
        kv_bits=kv_bits,
        requantize=(
            (lambda bits: _dense_shape(model, model_config, config, copies, layer_bytes, bits))
            if fits
            else None
        ),
    )


def _avx512_kernel() -> bool:
    ext = qmm.extension()
    return ext is not None and bool(getattr(ext, "avx512_active", lambda: False)())


def _scaled_biases(infos: list[LayerInfo], prefix: str) -> bool:
    """Whether the layers hold no biases their scales give (compute/qmm.py scaled_biases):
    where every linear that has such biases runs on the fast kernel with float32
    activations (qmm.select ran before the load: engine/loader.py)."""
    if compute_dtype() != mx.float32 or not any(info.derived for info in infos):
        return False
    for info in infos:
        owners = {slot.name: slot.container for slot in info.slots}
        lp = f"{prefix}{info.index}."
        for d in info.derived:
            owner = owners.get(d.name[len(lp) :])
            if owner is None or not qmm.takes_scaled_biases(owner):
                return False
    return True


def load_prepared(path: Path, config: EngineConfig) -> LoadedModel:
    """Load a prepared directory with the residency `config` asks for."""
    from mlx_lm.utils import load_tokenizer

    root = Path(path)
    manifest = read_manifest(root)
    verify_files(root, manifest)
    chunk = checksum_chunk(manifest)
    if chunk is None:
        log.warning(
            "%s has no checksums (written by an older flashserve): weight files are read "
            "unverified; run flashserve prepare MODEL %s --force to add them",
            root / "manifest.json",
            root,
        )
    check_small_files(root, manifest)
    model, model_config = _build_model(root, manifest)
    layers, prefix = find_layers(model)
    if prefix != manifest["layers_prefix"] or len(layers) != manifest["num_layers"]:
        raise ModelLoadError(
            f"{root}: model has {len(layers)} layers under {prefix!r}, manifest says "
            f"{manifest['num_layers']} under {manifest['layers_prefix']!r}"
        )
    infos = [
        _layer_info(root, entry, layers[entry["index"]], prefix) for entry in manifest["layers"]
    ]
    # Before the random initial weights go: the float copies a prompt makes are
    # read from the quantized linears' shapes, and which linears the fast kernel takes.
    scaled = _scaled_biases(infos, prefix)
    dense_plan = config.residency == "auto" and not config.expert_cache
    copies = _float_copies(config, [info.module for info in infos]) if dense_plan else (0, 0)
    for info in infos:  # drop the random initial weights before anything evaluates them
        for slot in info.slots:
            slot.container[slot.key] = EMPTY
        info.module._fs_index = info.index
        info.module._fs_streamer = None
    non_layer_bytes = _load_non_layer(
        root, model, prefix, manifest["non_layer"], chunk or CHUNK_BYTES, config.io_timeout
    )

    streamer = LayerStreamer(
        model=model,
        root=root,
        manifest=manifest,
        prefix=prefix,
        layers=infos,
        non_layer_bytes=non_layer_bytes,
        prefetch_depth=max(0, int(config.prefetch_depth)),
        max_prefetch_depth=max(0, int(config.prefetch_depth)),
        drop_page_cache=bool(config.extra.get("stream_drop_page_cache", False)),
        io_timeout=float(config.io_timeout),
        chunk_bytes=chunk or CHUNK_BYTES,
        scaled_biases=scaled,
    )
    if config.expert_cache:
        # The expert cache owns the experts (experts/): layers
        # are planned and streamed without them.
        streamer.detach_experts()
    context_length = context_length_of(model_config)
    layer_bytes = [streamer.layer_bytes(i) for i in range(len(infos))]
    if dense_plan:
        # The dense memory plan writes its numbers into `config` (the worker's too);
        # streamed layers are read around the page cache it leaves no room for.
        shape = _dense_shape(model, model_config, config, copies, layer_bytes, config.kv_bits)
        chunk, keep = int(config.prefill_step_size), bool(config.prefill_keep_float_copies)
        streamer.memory_plan = apply_dense_plan(config, shape)
        if config.kv_bits != shape.kv_bits and shape.requantize is not None:
            shape = shape.requantize(config.kv_bits)  # the plan took a quantized cache
        # What a prefill may take back while the loan leaves room (streaming/lending.py).
        streamer.dense_shape, streamer.max_prefill = shape, (chunk, keep)
        streamer.planned_prefill = (config.prefill_step_size, config.prefill_keep_float_copies)
        streamer.prefetch_depth = int(config.prefetch_depth)
        streamer.direct_reads = mx.default_device() == mx.cpu
    # At the KV precision the dense plan chose; priced for the context the plans
    # reserve: a sliding window holds less per token the longer the context.
    kv_per_token = kv_bytes_per_token(
        model,
        model_config,
        config.kv_bits,
        config.kv_group_size,
        tokens=MODES.get(config.residency_mode) or context_length,
        chunk=config.prefill_step_size,
    )
    if is_auto(config.expert_cache):
        # The memory plan writes its numbers into `config` (the worker's too).
        streamer.memory_plan = apply_memory_plan(
            config,
            manifest,
            model_config,
            layer_bytes=layer_bytes,
            kv_bytes_per_token=kv_per_token,
            context_length=context_length,
            activations=lambda: activation_bytes(model_config, config),
        )
    plan = plan_residency(
        config,
        layer_bytes=layer_bytes,
        non_layer_bytes=non_layer_bytes,
        kv_bytes_per_token=kv_per_token,
        context_length=context_length,
        runtime_reserve=runtime_reserve(model_config, config),
    )
    memory_plan = getattr(streamer, "memory_plan", None)
    if dense_plan and memory_plan is not None:
        record_in(plan.inputs, memory_plan, config.residency_mode)
    log.info(plan.describe())
    streamer.plan = plan
    streamer.apply(plan.resident_layers)
    streamer.residency = ResidencyManager(
        demote=streamer.demote,
        resident=lambda: streamer.resident_layers,
        floor=int(config.shed_floor),
    )
    experts = None
    if config.expert_cache:
        experts = offload_from_config(model, root, manifest, config, model_config)
        streamer.residency.add_pressure_hook(experts.shrink)
        memory_plan = getattr(streamer, "memory_plan", None)
        if memory_plan is not None:
            experts.cache.prefill_room = memory_plan.prefill_reserve_bytes
            experts.cache.chunk_activation_bytes = activation_bytes(model_config, config)
            experts.cache.state_bytes_per_token = kv_per_token
    bound = getattr(memory_plan, "context_tokens", None)
    try:
        tokenizer = load_tokenizer(root, eos_token_ids=model_config.get("eos_token_id"))
    except Exception as exc:
        raise ModelLoadError(f"{root}: cannot load tokenizer: {exc}") from exc
    log.info(
        "loaded prepared model %s: %d/%d layers resident, %s resident weights",
        root,
        len(plan.resident_layers),
        len(infos),
        fmt_bytes(streamer.snapshot()["resident_weight_bytes"]),
    )
    if streamer.streamed_layers and manifest.get("format_version") == 2:
        log.info(  # a symmetric quant's biases are on disk: a tenth more read per layer
            "%s is layout version 2: prepared again (%s) its layer files leave out the "
            "biases their scales give (Q4_0, Q5_0, Q8_0), and streamed layers read less",
            root,
            reprepare_command(root, manifest),
        )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=model_config,
        model_id=config.model_id or root.name,
        path=root,
        context_length=min(context_length, bound) if bound else context_length,
        streamer=streamer,
        experts=experts,
        model_context_length=context_length if bound and bound < context_length else None,
    )
