"""Turn a model spec into a LoadedModel ready to generate.

The one place that composes the ways weights arrive: plain models come from
weights/sources.py (GGUF, mlx-lm), a prepared directory from
streaming/prepared.py (layer streaming, and the expert cache when asked).
Quantized linears then take prompts through dequantize + BLAS
(compute/prompt_matmul.py), and matmuls with few rows (decode steps, the LM
head, experts) through flashserve's CPU kernel (compute/qmm.py). With
`kv_bits`, the model hands out quantized attention caches (kv/cache.py).
"""

from __future__ import annotations

import logging

from flashserve.engine.compute import device, qmm, step_ops
from flashserve.engine.compute.half_scales import float32_embeddings
from flashserve.engine.compute.prompt_experts import use_integer_experts
from flashserve.engine.compute.prompt_matmul import use_blas_for_prompts
from flashserve.engine.config import EngineConfig
from flashserve.engine.kv import cache as kv_cache
from flashserve.engine.streaming.prepared import load_prepared
from flashserve.engine.vision.tower import VisionError, load_vision
from flashserve.engine.weights.model import LoadedModel, ModelLoadError, context_length_of
from flashserve.engine.weights.sources import is_prepared, load_plain, model_id, resolve

log = logging.getLogger(__name__)


def load(config: EngineConfig) -> LoadedModel:
    try:  # first: the compute dtype and every fast path follow the device
        device.select(config.device)  # type: ignore[arg-type]
    except device.DeviceError as exc:
        raise ModelLoadError(str(exc)) from None
    try:  # before loading: a prepared model's layers follow the kernel (streaming/prepared.py)
        qmm.select(config.quantized_matmul)
        qmm.set_decode_matmul(config.decode_matmul)
    except qmm.QmmError as exc:
        raise ModelLoadError(str(exc)) from None
    target = resolve(config.model)
    prepared = is_prepared(target)
    if config.expert_cache and not prepared:
        raise ModelLoadError(
            "--expert-cache needs a prepared model directory (run: flashserve prepare MODEL OUT)"
        )
    if prepared:
        loaded = load_prepared(target, config)
    else:
        model, tokenizer, model_config = load_plain(target)
        loaded = LoadedModel(
            model=model,
            tokenizer=tokenizer,
            config=model_config,
            model_id=config.model_id or model_id(target),
            path=target if not isinstance(target, str) else None,
            context_length=context_length_of(model_config),
        )
    try:  # before the language model's fast paths: a refusal should come first
        loaded.vision = load_vision(loaded.path, loaded.config, loaded.tokenizer)
        if loaded.vision is not None:
            loaded.vision.attach(loaded.model.layers)  # Qwen's M-RoPE positions
    except VisionError as exc:
        raise ModelLoadError(str(exc)) from None
    if config.context_length and config.context_length < loaded.context_length:
        loaded.model_context_length = loaded.model_context_length or loaded.context_length
        loaded.context_length = config.context_length
    float32_embeddings(loaded.model)  # a prepared GGUF's float16 embedding scales
    try:  # kv_bits: every cache the model hands out from here on (kv/cache.py)
        kv_cache.install(loaded.model, config.kv_bits, config.kv_group_size)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    use_integer_experts(loaded.model)  # a resident MoE's prompt rows as its offloaded twin's
    changed = use_blas_for_prompts(loaded.model, config.prompt_matmul)
    if changed:
        log.debug("%d quantized linears run prompts as dequantize + BLAS matmul", changed)
    # After use_blas_for_prompts: the fast classes wrap the prompt class, so
    # prompt chunks still go to the BLAS and only the rest comes here.
    step_ops.install()  # norms, RoPE, attention, SwiGLU, log-sum-exp: one CPU op each
    changed = qmm.use_fast_qmm(loaded.model)
    if loaded.experts is not None:
        # Offloaded experts compute through their original SwitchGLU (kept
        # outside the model tree): the same kernel as a resident model's.
        for info in loaded.experts.layers.values():
            changed += qmm.use_fast_qmm(info.template)
    if changed:
        log.debug("%d quantized modules take few-row matmuls on flashserve's kernel", changed)
    return loaded
