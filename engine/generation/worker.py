"""The generation worker: one thread owns every MLX call but a vision tower's.

Requests arrive on a queue from the event loop; each request's events go back
through its RequestHandle (loop.call_soon_threadsafe). A failing generation is
reported to its own client only; the worker keeps serving. A request's images
are encoded on a thread of their own while the batch decodes (vision/embed.py).
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import logging
import queue
import threading
import time
from dataclasses import asdict
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from flashserve.engine.compute import blas, heap
from flashserve.engine.config import EngineConfig
from flashserve.engine.distributed.mirror import Mirror, load_model
from flashserve.engine.generation import decode_step, fairness, prompt_states
from flashserve.engine.generation.choices import Choice, Start, detokenizer_for
from flashserve.engine.generation.memory_guard import MemoryGuard, kv_tokens
from flashserve.engine.generation.prefill import last_token
from flashserve.engine.generation.prefill.alone import (
    PrefillCancelled,
    PromptScores,
    prefill_alone,
)
from flashserve.engine.generation.prefill.layer_major import (
    LayerMajorPrefill,
    LayerMajorUnsupported,
    PrefillJob,
)
from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    InvalidRequest,
    RequestHandle,
    error_event,
)
from flashserve.engine.generation.sampling import (
    GuardedProcessors,
    make_request_processors,
    make_request_sampler,
    sample_first,
    speculative_sampling,
)
from flashserve.engine.generation.stats import (
    BATCH_SIZE_BUCKETS,
    WorkerStats,
    weight_bytes_read,
)
from flashserve.engine.generation.stops import StopMatcher
from flashserve.engine.prompt_cache.cache import PromptCache, prompt_cache_for
from flashserve.engine.speculative.batch import Speculation, SpeculativeConfig
from flashserve.engine.vision.embed import ImageEncodes, batch_caches, image_embedder, real_tokens
from flashserve.engine.weights.model import LoadedModel
from flashserve.engine.weights.reader import WeightFileError

log = logging.getLogger(__name__)


def _log_failure(what: str, exc: BaseException) -> None:
    """A damaged or stalled weight file: one line naming it; anything else, a bug: its trace."""
    if isinstance(exc, WeightFileError):
        log.error("%s: %s", what, exc)
    else:
        log.error(what, exc_info=exc)


class QueueFullError(Exception):
    """Too many requests are waiting; the client should retry later."""


class EngineNotReadyError(Exception):
    pass


class Engine:
    def __init__(self, config: EngineConfig):
        heap.limit_arenas()  # before the threads that allocate start (compute/heap.py)
        self.config = config
        self.state = "loading"  # loading | ready | failed | stopped
        self.load_error: str | None = None
        self.loaded: LoadedModel | None = None
        self.prompt_cache: PromptCache | None = None  # set once the model is loaded
        self._layer_major: LayerMajorPrefill | None = None
        self.guard: MemoryGuard | None = None  # set once the model is loaded
        self._held: RequestHandle | None = None  # next in line, waiting for KV room
        self.mirror: Mirror | None = None  # the model is split across ranks: rank 0's side
        self.stats = WorkerStats()
        self.encodes = ImageEncodes(lambda: self.loaded, self._refuse)  # the vision thread
        self.speculation = Speculation(
            SpeculativeConfig(
                config.speculative, config.speculative_max_draft, config.speculative_draft_model
            ),
            self.stats.speculative,
        )
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue()
        self._admission_lock = threading.Lock()
        self._admitted = 0  # requests submitted and not yet ended or cancelled in the queue
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashserve-worker", daemon=True)

    # -- called from the event loop -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.state == "ready"

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self.state != "ready":
            raise EngineNotReadyError(self.load_error or f"model is {self.state}")
        # Admission is decided here, as requests arrive, against every slot the
        # engine has (batch and queue): the worker takes requests only between
        # steps, so the queue alone would refuse requests while batch slots are free.
        limit = self.config.max_batch + self.config.max_queue
        with self._admission_lock:
            if self._admitted >= limit:
                raise QueueFullError(
                    f"{self._admitted} requests are already running or waiting, the most "
                    f"max_batch + max_queue allow"
                )
            self._admitted += 1
        handle = RequestHandle(request, asyncio.get_running_loop(), self._release_slot)
        self._queue.put(handle)
        return handle

    def _release_slot(self) -> None:
        with self._admission_lock:
            self._admitted -= 1

    @property
    def idle(self) -> bool:
        return self.stats.active == 0 and self._queue.empty()

    def shutdown(self, timeout: float = 5.0, release: bool = False) -> None:
        """Stop the worker; `release`: also drop the model (an unload, engine/models/)."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self.state != "failed":  # a failed load stays failed: `serve` exits 2 on it
            self.state = "stopped"
        if self.prompt_cache is not None:
            self.prompt_cache.close(timeout)  # pending disk writes: they outlive the run
        experts = self.loaded.experts if self.loaded is not None else None
        if experts is not None:
            experts.close()  # flushes the routing trace, stops the pread pool
        if release:
            self.loaded = self.prompt_cache = self.guard = self._layer_major = None

    def stats_dict(self) -> dict:
        out = asdict(self.stats)
        # Waiting requests that still hold a slot (cancelled ones have let go).
        out["queued"] = max(0, self._admitted - self.stats.active)
        return out

    # -- the worker thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self.loaded, self.mirror = load_model(self.config)  # split across ranks?
            self.prompt_cache = prompt_cache_for(self.config, self.loaded)
            self._layer_major = LayerMajorPrefill.for_engine(self.config, self.loaded)
            self.guard = MemoryGuard.for_loaded(self.loaded, self.prompt_cache, self._layer_major)
            self.state = "ready"
            log.info(
                "model %s ready (context %d tokens, float matmuls on %s BLAS)",
                self.loaded.model_id,
                self.loaded.context_length,
                blas.describe(),
            )
        except Exception as exc:
            log.error("model failed to load: %s", exc)
            self.load_error = str(exc)
            self.state = "failed"
        finally:
            self._ready.set()
        if self.state != "ready":
            self._refuse_all()
            return
        while True:
            try:
                self._loop()
                if self.mirror is not None:
                    self.mirror.close()  # the other ranks stop with rank 0
                return
            except Exception:
                # A bug outside a step; a dead worker would hang every later request.
                log.exception("worker loop failed; restarting it")

    def _refuse_all(self) -> None:
        while (handle := self._queue.get()) is not None:
            handle.push(ErrorEvent(self.load_error or "model not loaded"))

    def _new_batch(self) -> BatchGenerator:
        assert self.loaded is not None
        loaded = self.loaded
        compile_ok = self.config.compile_decode and self.mirror is None
        compile_ok = compile_ok and loaded.experts is None
        batch = BatchGenerator(
            decode_step.for_model(loaded.model, compile=compile_ok, streamer=loaded.streamer),
            completion_batch_size=self.config.max_batch,
            prefill_batch_size=self.config.max_batch,
            prefill_step_size=self.config.prefill_step_size,
        )
        if self.mirror is None:  # the ranks of a split model step alike: plain steps only
            last_token.install(batch)  # a prompt's last token runs in its tail
            self.speculation.install(batch, loaded.tokenizer)
            fairness.gate(batch)  # beside other engines: another's prefill first, briefly
            fairness.first_token_gate(batch)  # on the CPU: out before the step after
        return batch if self.mirror is None else self.mirror.wrap(batch)  # type: ignore[return-value]

    def _loop(self) -> None:
        """Continuous batching: admit, step the whole batch once, dispatch tokens."""
        batch = self._new_batch()
        active: dict[int, Choice] = {}
        while True:
            # Cancelled requests leave first: a retry admitted next then finds
            # what they prefilled (_drop_cancelled stores it).
            self._drop_cancelled(batch, active)
            if not self._admit(batch, active, block=not active and not self.encodes.waiting):
                break
            try:
                self._step(batch, active)
            except Exception as exc:
                # The step is shared, so every request in it fails; the worker goes on.
                _log_failure("batch step failed", exc)
                fairness.leave()  # its prefill, if it was one, ended here
                for uid in list(active):
                    self._fail(active, uid, exc)
                batch = self._new_batch()
        for uid in list(active):
            self._finish(active, uid, "cancelled")
        fairness.leave()  # stopped part way through a prefill: other engines go on

    def _drop_cancelled(self, batch: BatchGenerator, active: dict[int, Choice]) -> None:
        """Remove cancelled choices from the batch; a prompt cancelled during its prefill
        keeps what was prefilled in the prompt cache (a client's retry resumes there)."""
        cancelled = [u for u, a in active.items() if a.handle.cancelled]
        if not cancelled:
            return
        for uid, (state, tokens) in batch.extract_cache(cancelled).items():
            choice = active[uid]
            unprefilled = prompt_states.unprefilled(choice, tokens)
            # Counted whole when the prompt entered the batch (_start).
            self.stats.prefill_tokens_total -= unprefilled
            if unprefilled and self.prompt_cache is not None:
                prompt_states.store_cancelled_prefill(self.prompt_cache, choice, state, tokens)
        for uid in cancelled:
            batch.remove([uid])
            self._finish(active, uid, "cancelled")

    def _step(self, batch: BatchGenerator, active: dict[int, Choice]) -> None:
        self._drop_cancelled(batch, active)
        if not active:
            return
        self.stats.batch_size = len(active)
        read_before = self.weight_bytes_read()
        prompts, responses = batch.next()
        prefilled_at = time.perf_counter()
        for response in prompts:
            choice = active.get(response.uid) if response.end_of_prompt else None
            if choice is not None and choice.prefilled_at is None:  # else prefilled outside
                choice.prefilled_at = prefilled_at
        ends = []
        if self.prompt_cache is not None and self.config.prompt_prefix_states:
            ends = prompt_states.prompt_ends(batch, active, prompts, responses)
        self.stats.steps += 1
        self.stats.batch_size_sum += len(active)
        self.stats.batch_size_steps[bisect.bisect_left(BATCH_SIZE_BUCKETS, len(active))] += 1
        self.stats.last_step_read_bytes = self.weight_bytes_read() - read_before
        self.stats.kv_cache_bytes = batch.prompt_cache_nbytes
        ended = [e for e in [self._on_token(batch, active, r) for r in responses] if e]
        # Once every token of the step went out: the answers' states, then their ends
        # (a client's next turn comes after), then the prompts' own (prompt_states.py).
        answers = [(active[r.uid], r) for r, _ in ended]
        prompt_states.store_answers(self.prompt_cache, answers, self.guard)
        for response, finish in ended:
            self._finish(active, response.uid, finish)
        prompt_states.store_prompt_ends(self.prompt_cache, ends)
        for uid in [u for u, a in active.items() if a.failed]:
            batch.remove([uid])
            self._fail(active, uid, active[uid].failed)
        if self.guard is not None:
            self.guard.after_step(self.stats, active)

    def _admit(self, batch: BatchGenerator, active: dict[int, Choice], block: bool) -> bool:
        """Move waiting requests into the batch while slots are free; False on shutdown."""
        handles: list[RequestHandle] = []
        running = True
        # A request takes one slot per choice; one with more choices than the slots
        # left still comes in whole (the batch runs over max_batch by fewer than n).
        reserved = sum(kv_tokens(c.handle.request) // c.handle.request.n for c in active.values())
        while len(active) + sum(h.request.n for h in handles) < self.config.max_batch:
            try:
                handle, self._held = self._held or self._queue.get(block, None), None
            except queue.Empty:
                break
            block = False
            if handle is None:
                running = False
                break
            if handle.cancelled:
                self._cancel_waiting(handle)
                continue
            if self.guard is not None and not self.guard.admits(reserved, handle.request):
                self._held = handle  # first in line once the batch's KV has room
                break
            reserved += kv_tokens(handle.request)
            handle.started = True
            handle.taken_at = time.perf_counter()
            handles.append(handle)
        if handles and self.guard is not None:  # before any restored state takes room
            self.guard.before_prefill(handles, self.stats, active)
        starts = self.encodes.ready([s for s in map(self._prepare, handles) if s], not active)
        self._prefill_layer_major(starts)
        for start in starts:
            if start.failed:
                continue
            try:
                self._start(batch, start, active)
            except Exception as exc:
                _log_failure(f"request {start.handle.request.request_id} could not start", exc)
                self._refuse(start.handle, exc)
        if handles and self.guard is not None:  # every prompt in: the prefill's room back
            self.guard.after_prefill(self.stats, active, starts)
        return running

    def _cancel_waiting(self, handle: RequestHandle) -> None:
        """End a request that was cancelled before it started: every choice."""
        self.stats.requests_cancelled += 1
        prompt = len(handle.request.prompt_tokens)
        for index in range(handle.request.n):
            handle.push(DoneEvent("cancelled", prompt, 0, index=index))

    def _refuse(self, handle: RequestHandle, exc: BaseException) -> None:
        self.stats.requests_failed += 1
        handle.push(error_event(exc))

    def _prepare(self, handle: RequestHandle) -> Start | None:
        """The request's prompt, its longest cached prefix and its processors."""
        request = handle.request
        try:
            if not 1 <= request.n <= self.config.max_batch:
                raise InvalidRequest(f"n must be between 1 and {self.config.max_batch}", "n")
            if self.mirror is not None and (refused := self.mirror.refusal(request)):
                raise InvalidRequest(*refused)
            processors = self._processors(request, 0)
            prompt = list(request.prompt_tokens)
            cache, reused = None, 0
            # Prompt logprobs need every position computed: nothing is restored.
            restore = request.use_prompt_cache and request.prompt_logprobs is None
            if self.prompt_cache is not None and restore:
                cache, reused = self.prompt_cache.fetch(prompt)
            handle.admit(reused)
        except Exception as exc:
            if not isinstance(exc, InvalidRequest):  # the client's mistake is no bug
                log.exception("request %s could not start", request.request_id)
            self._refuse(handle, exc)
            return None
        return Start(handle, prompt, cache, reused, processors)

    @staticmethod
    def _processors(request: GenerationRequest, choice: int) -> GuardedProcessors | None:
        extra = (
            request.processor_factory(choice)
            if request.processor_factory is not None
            else request.logits_processors
        )
        return make_request_processors(request.sampling, extra)

    def _prefill_layer_major(self, starts: list[Start]) -> None:
        """Prefill the prompts together, layer-major, when weights come from disk: one pass
        gives each its cache and first token (prefill/layer_major.py); the batch the rest."""
        # A request that wants its prompt's logprobs is prefilled alone, which keeps them.
        starts = [s for s in starts if s.handle.request.prompt_logprobs is None]
        loaded = self.loaded
        if self._layer_major is None or loaded is None or not starts:
            return
        if loaded.experts is None and not loaded.streamer.streamed_layers:
            return  # every weight is resident now (shedding can stream more layers)
        for start in starts:
            if start.cache is None:
                start.cache = make_prompt_cache(loaded.model)
        jobs = [
            PrefillJob(
                s.prompt[s.reused :],
                s.cache,
                keep_prefix=self.prompt_cache is not None
                and self.config.prompt_prefix_states
                and s.handle.request.use_prompt_cache,
                cancelled=s.handle.was_cancelled,
                embed=image_embedder(self.loaded, s.prompt, s.images, s.encoded, s.cache),
            )
            for s in starts
        ]
        self._layer_major.fold = last_token.engine_folds(self.loaded, self.mirror)
        try:
            self._layer_major.run(jobs)
            mx.eval([job.logits for job in jobs if not job.dropped])
        except LayerMajorUnsupported as exc:
            log.warning("prefilling chunk by chunk from now on: %s", exc)
            self._layer_major = None
            return
        except Exception as exc:
            _log_failure("layer-major prefill failed", exc)
            for start in starts:
                start.failed = True
                self._refuse(start.handle, exc)
            return
        for start, job in zip(starts, jobs, strict=True):
            if job.dropped:
                start.failed = True
                self.stats.requests_cancelled += 1
                start.handle.push(DoneEvent("cancelled", len(start.prompt), 0))
                continue
            if job.prefix_state is not None and self.prompt_cache is not None:
                self.prompt_cache.store(start.prompt[:-1], job.prefix_state)
            self.stats.prefill_tokens_total += len(start.prompt) - start.reused
            start.reused = len(start.prompt)
            start.logits = job.logits
            start.prefilled_at = time.perf_counter()

    def _start(self, batch: BatchGenerator, start: Start, active: dict[int, Choice]) -> None:
        """Put the request's choices into the batch; after a prefill outside it, each choice
        samples its first token from the prompt's logits, on a copy of the prompt's state."""
        assert self.loaded is not None
        request = start.handle.request
        self.stats.requests_total += 1
        if start.alone and start.logits is None:
            if not self._prefill_alone(start):
                return
        elif start.logits is None:
            self.stats.prefill_tokens_total += len(start.prompt) - start.reused
        if start.scores is not None:
            start.handle.push(start.scores.event())
        for index in range(request.n):
            choice = Choice(
                uid=-1,
                handle=start.handle,
                index=index,
                detokenizer=detokenizer_for(self.loaded.tokenizer, request.continuation),
                stops=StopMatcher(request.stop),
                processors=start.processors if index == 0 else self._processors(request, index),
                started=start.started,
                cached_tokens=start.cached,
                prefilled_at=start.prefilled_at,
            )
            last = index == request.n - 1
            cache = start.cache if last or start.cache is None else copy.deepcopy(start.cache)
            self._start_choice(batch, start, choice, cache, active)
            if start.handle.cancelled:  # a choice failed: the request has ended
                return

    def _prefill_alone(self, start: Start) -> bool:
        """Prefill outside the batch (generation/prefill/alone.py); False if the request ended."""
        assert self.loaded is not None
        request = start.handle.request
        start.cache = start.cache or make_prompt_cache(self.loaded.model)
        if request.prompt_logprobs is not None:
            start.scores = PromptScores(start.prompt, request.prompt_logprobs)
        try:
            start.logits = prefill_alone(
                self.loaded.model,
                start.prompt,
                start.cache,
                start.reused,
                self.config.prefill_step_size,
                start.scores,
                start.handle.was_cancelled,
                image_embedder(self.loaded, start.prompt, start.images, start.encoded, start.cache),
                prompt_states.prefix_keeper(self.prompt_cache, self.config, start),
                fold=last_token.engine_folds(self.loaded, self.mirror),
            )
        except PrefillCancelled:
            self._cancel_waiting(start.handle)
            return False
        self.stats.prefill_tokens_total += len(start.prompt) - start.reused
        start.reused = len(start.prompt)
        start.prefilled_at = time.perf_counter()
        return True

    def _start_choice(
        self,
        batch: BatchGenerator,
        start: Start,
        choice: Choice,
        cache: list[Any] | None,
        active: dict[int, Choice],
    ) -> None:
        request = choice.handle.request
        prompt, reused = start.prompt, start.reused
        tokenizer = self.loaded.tokenizer if self.loaded is not None else None
        assert tokenizer is not None
        sampler = make_request_sampler(request.sampling, choice.index)
        inputs, max_tokens = prompt[reused:], request.max_tokens
        if max_tokens == 0:  # the prompt alone was asked for (its logprobs)
            self._finish_entry(choice, "length")
            return
        if start.logits is not None:  # the whole prompt is in the cache
            first, logprobs = sample_first(start.logits, prompt, sampler, choice.processors)
            if choice.processors is not None and choice.processors.error is not None:
                self._fail_entry(choice, choice.processors.error)
                return
            if first in tokenizer.eos_token_ids or max_tokens == 1:
                # A natural end: as at the end of any answer, the state (here:
                # after the prompt) is kept for the next turn.
                if self.prompt_cache is not None and request.use_prompt_cache:
                    self.prompt_cache.store(prompt, cache)
                eos = first in tokenizer.eos_token_ids
                if not eos:
                    choice.emit(first, logprobs)
                self._finish_entry(choice, "stop" if eos or choice.stops.hit else "length")
                return
            choice.emit(first, logprobs)
            if choice.stops.hit:
                self._finish_entry(choice, "stop")
                return
            inputs, max_tokens = [first], max_tokens - 1
        folded = start.logits is None and last_token.engine_folds(self.loaded, self.mirror)
        pending = prompt_states.tail_end_pending(self.prompt_cache, self.config, request, inputs)
        choice.prompt_end_pending = folded and pending
        (choice.uid,) = (batch.insert_segments if folded else batch.insert)(  # mirrored: insert
            [last_token.segments(inputs, self.config.prefill_step_size) if folded else inputs],
            max_tokens=[max_tokens],
            caches=batch_caches(self.loaded, cache, len(inputs)),
            # The reused tokens are history for penalties, as in a cold prefill.
            all_tokens=[real_tokens(prompt[: min(reused, len(prompt))])],
            samplers=[sampler],
            logits_processors=[[choice.processors] if choice.processors else []],
            stop_sequences=[StopSequences([[t] for t in tokenizer.eos_token_ids])],
        )
        active[choice.uid] = choice
        self.stats.active = len(active)
        sampling = speculative_sampling(request.sampling, choice.index)
        self.speculation.register(choice.uid, request.speculative, sampling)

    def _on_token(self, batch: BatchGenerator, active: dict[int, Choice], response) -> Any:
        """Send the token; (response, finish reason) where its answer ended."""
        entry = active.get(response.uid)
        if entry is None:
            return None
        if entry.processors is not None and entry.processors.error is not None:
            entry.failed = entry.processors.error
            return None
        finish = response.finish_reason
        if finish != "stop":  # "stop" from the batch means an EOS token: not emitted
            entry.emit(response.token, response.logprobs)
            if entry.stops.hit:
                batch.remove([response.uid])
                finish = "stop"
        return None if finish is None else (response, finish)

    def _finish(self, active: dict[int, Choice], uid: int, reason: str) -> None:
        entry = active.pop(uid)
        self.stats.active = len(active)  # idle before the client hears the end
        self._finish_entry(entry, reason)
        heap.trim()  # the request's KV is gone (compute/heap.py)

    def _finish_entry(self, entry: Choice, reason: str) -> None:
        if reason == "cancelled" and entry.index == 0:
            self.stats.requests_cancelled += 1
        self._record(entry)
        entry.handle.push(entry.done(reason))

    def _fail(self, active: dict[int, Choice], uid: int, exc: BaseException | None) -> None:
        entry = active.pop(uid)
        self.stats.active = len(active)
        self._fail_entry(entry, exc)

    def _fail_entry(self, entry: Choice, exc: BaseException | None) -> None:
        """A choice's failure ends its request: the other choices are cancelled."""
        if entry.handle.cancelled:
            return  # a sibling already failed it
        self.stats.requests_failed += 1
        entry.handle.push(error_event(exc))
        entry.handle.cancelled = True

    def weight_bytes_read(self) -> int:
        """Weight bytes read from disk so far: streamed layers and offloaded experts."""
        return weight_bytes_read(self.loaded)

    def _record(self, entry: Choice) -> None:
        # The prompt is the request's, whatever n is: counted with choice 0.
        prompt = len(entry.handle.request.prompt_tokens) if entry.index == 0 else 0
        self.stats.record(prompt, entry.generated, entry.started, entry.first_token_at)
        if entry.index == 0 and (parts := entry.ttft_parts()) is not None:
            self.stats.ttft.add(parts)
