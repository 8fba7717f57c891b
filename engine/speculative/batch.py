"""mlx-lm's GenerationBatch with a speculative step.

mlx-lm's GenerationBatch keeps, between steps, each sequence's next token
(sampled, not yet run: `_next_tokens`) with the distribution it came from,
and `tokens`: what the KV cache holds. A plain step runs the next tokens,
emits them and samples the ones after. A speculative step runs each
sequence's next token followed by its draft (prompt lookup, padded to the
longest draft of the batch) in ONE forward pass: every streamed layer is
read once for it and an MoE layer reads the union of the experts its tokens
route to once (experts/offload.py sends calls of more than one token per
sequence expert-major). Each sequence then emits its next token and the
draft tokens the pass accepted (accept.py), keeps the token after them as
its next one, and its KV cache is taken back past the rest (rollback.py).
A hybrid model's recurrent layers cannot be taken back: their state is
snapshotted before the pass and, when a sequence rejected a draft token,
restored, the attention layers trimmed to the same position and every
sequence's kept tokens run again in a second, short pass (a recompute: an
extra read of the weights, which the adaptive length counts in the step's
cost).
Between steps the state is what a plain step leaves, so plain and
speculative steps mix freely.

A step speculates only when every sequence's logits processors can run over
a draft position by position (penalties, logit_bias, a grammar that rolls
back) and every layer's cache can be rolled back (or snapshotted), when the
batch's plan (adaptive.py) finds that drafting pays the batch, and when some
sequence has a draft; otherwise it is mlx-lm's plain step. A sequence whose
request opted out never drafts; in a pass it takes its token from its own
sampler, as in a plain step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from flashserve.engine.compute import prompt_matmul
from flashserve.engine.speculative import mlx_lm_internals as internals
from flashserve.engine.speculative.accept import Sampling, accept_greedy, accept_sampled
from flashserve.engine.speculative.adaptive import CostModel, Sequence, SpeculativeStats
from flashserve.engine.speculative.draft import DraftModel
from flashserve.engine.speculative.rollback import (
    Snapshot,
    can_roll_back,
    can_snapshot,
    restore,
    roll_back,
    snapshot,
)

log = logging.getLogger(__name__)

MODES = ("off", "prompt-lookup", "draft", "both")
PRUNE_AT = 512  # sequences tracked before those no longer in the batch are dropped


@dataclass
class SpeculativeConfig:
    mode: str = "off"  # off | prompt-lookup | draft | both (lookup first, else the model)
    max_draft: int = 8  # tokens drafted per pass at most
    draft_model: str | None = None  # path of the draft model (draft, both)


class Speculation:
    """The engine's speculation: settings, each sequence's state, the counters."""

    def __init__(self, config: SpeculativeConfig, stats: SpeculativeStats) -> None:
        if config.mode not in MODES:
            raise ValueError(f"speculative must be one of {', '.join(MODES)}, not {config.mode!r}")
        if config.mode in ("draft", "both") and not config.draft_model:
            raise ValueError(f"speculative = {config.mode!r} needs speculative_draft_model")
        self.config = config
        self.stats = stats
        self.drafter: DraftModel | None = None
        self._batch: BatchGenerator | None = None  # the batch installed on, for pruning
        self._checked = False  # mlx-lm's internals looked up (mlx_lm_internals.check)
        self.cost = CostModel(config.max_draft)
        self.sequences: dict[int, Sequence] = {}

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off" and self.config.max_draft > 0

    def install(self, batch: BatchGenerator, tokenizer: Any = None) -> None:
        """Make `batch` decode with speculative steps (its generation batch is empty).
        The draft model, if any, is loaded the first time (`tokenizer`: the model's,
        which its vocabulary must match); one that cannot be loaded leaves prompt
        lookup alone, with the reason logged. An mlx-lm whose internals speculation
        relies on changed turns speculation off, naming the field."""
        if not self.enabled:
            return
        if not self._checked:
            try:
                internals.check()
            except internals.InternalsChanged as exc:
                log.error("speculative decoding off: %s", exc)
                self.config.mode = "off"
                return
            self._checked = True
        if self.config.draft_model and self.drafter is None and self.config.mode != "prompt-lookup":
            try:
                self.drafter = DraftModel.load(self.config.draft_model, tokenizer)
            except Exception as exc:
                log.error("no draft model, prompt lookup only: %s", exc)
                self.config.mode = "prompt-lookup"
        generation = internals.generation_batch(batch)
        assert not generation.uids, "install before anything is inserted"
        speculative = SpeculativeBatch.empty(generation.model, generation.fallback_sampler)
        speculative.speculation = self
        internals.set_generation_batch(batch, speculative)
        self._batch = batch

    def register(self, uid: int, wanted: bool, sampling: Sampling | None) -> None:
        """A sequence entered the batch; `wanted`: its request allows speculation."""
        if len(self.sequences) > PRUNE_AT and self._batch is not None:
            # Sequences removed before they decoded (cancelled while their prompt
            # was prefilled) never pass through SpeculativeBatch.filter.
            live = internals.live_uids(self._batch, list(self.sequences))
            self.sequences = {u: s for u, s in self.sequences.items() if u in live}
        if self.enabled and wanted:
            sequence = Sequence(sampling, shadowed=self.config.mode == "prompt-lookup")
            if self.drafter is not None:
                sequence.draft_state = self.drafter.new_state()
            self.sequences[uid] = sequence

    def plan(
        self, sequences: list[Sequence | None], rooms: list[int], contexts: list[list[int]]
    ) -> int:
        """This step's draft width for the batch (0: a plain step), from the cost model;
        the sequences' shadow drafts judged, and new ones made for a plain step."""
        asked = [
            (seq, room, context)
            for seq, room, context in zip(sequences, rooms, contexts, strict=True)
            if seq is not None and room > 0
        ]
        for seq, _, context in asked:
            if seq.shadowed:
                seq.observe(context)
        width = self.cost.plan(len(sequences), [(s.found, s.acceptance, r) for s, r, _ in asked])
        if width == 0:
            for seq, _, context in asked:
                if seq.shadowed:
                    seq.start_shadow(context, self.config.max_draft)
        self.stats.paused = self.cost.stops
        return width

    def draft(self, sequence: Sequence, context: list[int], k: int) -> list[int]:
        """Sequence's draft of at most k tokens: prompt lookup, else the draft model."""
        lookup = self.config.mode in ("prompt-lookup", "both")
        drafted = sequence.index.draft(context, k) if lookup else []
        if not drafted and self.drafter is not None and sequence.draft_state is not None:
            drafted = self.drafter.draft(sequence.draft_state, context, k)
        return drafted


class SpeculativeBatch(internals.GenerationBatchState):
    speculation: Speculation
    _started = 0.0  # when this step's own work began (CostModel.begin)

    def filter(self, keep: list[int]) -> None:
        kept = {self.uids[i] for i in keep}
        for uid in [u for u in self.uids if u not in kept]:
            self.speculation.sequences.pop(uid, None)
        super().filter(keep)

    def next(self) -> list[GenerationBatch.Response]:
        if not self.uids:
            return []
        cost, uids = self.speculation.cost, tuple(self.uids)
        self._started = time.perf_counter()
        if cost.drafting:  # the plan sees the last pass's time
            cost.end(self._started, uids)
        drafts = self._drafts()
        cost.begin(self._started, max(map(len, drafts)) if drafts else 0, uids)
        return super().next() if drafts is None else self._verify(drafts)

    def _drafts(self) -> list[list[int]] | None:
        """Each sequence's draft, or None: this step is a plain one."""
        sequences = [self.speculation.sequences.get(uid) for uid in self.uids]
        if not any(sequences) or not all(
            getattr(p, "speculative_ok", False) for ps in self.logits_processors for p in ps
        ):
            return None
        if not (can_roll_back(self.prompt_cache) or can_snapshot(self.prompt_cache)):
            return None
        # The pending token is emitted by this step too: room counts after it.
        rooms = [m - n - 1 for m, n in zip(self.max_tokens, self.emitted_counts, strict=True)]
        width = self.speculation.plan(sequences, rooms, self.tokens)
        if not width:
            return None  # no wait for the pending tokens: mlx-lm's step stays pipelined
        mx.eval(self.pending)
        # The wait was the previous step's computation: this step starts after it.
        self._started = time.perf_counter()
        pending = self.pending.tolist()
        drafts = []
        for i, seq in enumerate(sequences):
            k = min(width, rooms[i])
            draft = (
                self.speculation.draft(seq, [*self.tokens[i], pending[i]], k)
                if seq and k > 0
                else []
            )
            if seq is not None and k > 0:
                seq.record_lookup(bool(draft))
            drafts.append(draft)
        return drafts if any(drafts) else None

    def _verify(self, drafts: list[list[int]]) -> list[GenerationBatch.Response]:
        width = max(len(d) for d in drafts)
        pending = self.pending.tolist()
        # Shorter drafts are padded with their last token: whatever is there is
        # run and never accepted (acceptance stops at the draft's end).
        rows = [
            [p, *d, *([d[-1] if d else p] * (width - len(d)))]
            for p, d in zip(pending, drafts, strict=True)
        ]
        saved = None if can_roll_back(self.prompt_cache) else snapshot(self.prompt_cache)
        with prompt_matmul.decode_rows(width + 1):  # the few-row kernels, as decode
            logits = self.model(mx.array(rows, dtype=mx.uint32), cache=self.prompt_cache)
        contexts: dict[int, int] = {}  # sequence -> its processors' context size before
        if any(self.logits_processors):
            logits = mx.stack(
                [
                    self._process(i, logits[i], pending[i], drafts, contexts)
                    for i in range(len(rows))
                ]
            )
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.argmax(logprobs, axis=-1)
        sequences = [self.speculation.sequences.get(uid) for uid in self.uids]
        own = self._sample_unregistered(sequences, logprobs)
        mx.eval(logprobs, targets, list(own.values()))
        targets_list = targets.tolist()
        emitted: list[list[int]] = []
        rows_used: list[list[mx.array]] = []
        nexts: list[int] = []
        for i, draft in enumerate(drafts):
            seq = sequences[i]
            if i in own:  # no draft: its pending token's successor, from its own sampler
                n, after = 0, int(own[i].item())
            else:
                n, after = self._accept(seq, draft, logprobs[i], targets_list[i])
            emitted.append([pending[i], *draft[:n]])
            rows_used.append([self.pending_logprobs[i], *(logprobs[i, j] for j in range(n))])
            nexts.append(after)
            self._account(seq, len(draft), n)
        responses, keep, kept_tokens = self._respond(emitted, rows_used)
        for i, size in contexts.items():  # the processors' context: what the cache keeps
            internals.set_context_size(self.token_contexts[i], size + kept_tokens[i])
        if saved is None:
            roll_back(self.prompt_cache, [width + 1 - k for k in kept_tokens])
            # The roll copies each layer's keys up to the write position: run it now,
            # so that its time counts in this pass's cost and not in the next step's.
            mx.eval([c.state for c in self.prompt_cache])
        elif min(kept_tokens) < width + 1:
            kept = [e[:k] for e, k in zip(emitted, kept_tokens, strict=True)]
            self._recompute(saved, width + 1, kept)
        for i in range(len(self.uids)):
            self.tokens[i].extend(emitted[i][: kept_tokens[i]])
        for r in responses:
            if r.finish_reason is not None:
                i = self.uids.index(r.uid)
                r.prompt_cache, r.all_tokens = self.extract_cache(i), self.tokens[i]
        self.pending = mx.array(nexts, dtype=mx.uint32)
        self.pending_logprobs = [logprobs[i, len(emitted[i]) - 1] for i in range(len(self.uids))]
        stats = self.speculation.stats
        stats.passes += 1
        stats.sequence_passes += len(self.uids)
        stats.emitted_tokens += sum(kept_tokens)
        stats.refresh()
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _recompute(self, saved: Snapshot, ran: int, kept: list[list[int]]) -> None:
        """Take a hybrid batch back to before the pass (`ran` tokens) and run each
        sequence's `kept` tokens again, so every layer holds what a plain run's
        would. Rows keep different counts: they are right-padded, as mlx-lm pads
        prompts (ArraysCache `lengths` leaves the recurrent state alone past a
        row's tokens; BatchKVCache rolls the padded keys into left padding)."""
        restore(saved)
        roll_back([c for c in self.prompt_cache if type(c) is BatchKVCache], [ran] * len(kept))
        longest = max(len(k) for k in kept)
        padding = [longest - len(k) for k in kept]
        if any(padding):
            for c in self.prompt_cache:
                c.prepare(lengths=[len(k) for k in kept], right_padding=padding)
        rows = [k + [0] * p for k, p in zip(kept, padding, strict=True)]
        with prompt_matmul.decode_rows(longest):
            logits = self.model(mx.array(rows, dtype=mx.uint32), cache=self.prompt_cache)
        mx.eval(logits)
        if any(padding):
            for c in self.prompt_cache:
                c.finalize()
        mx.eval([c.state for c in self.prompt_cache])
        self.speculation.stats.recompute_passes += 1

    def _process(
        self,
        i: int,
        logits: mx.array,
        pending: int,
        drafts: list[list[int]],
        contexts: dict[int, int],
    ) -> mx.array:
        """Sequence i's logits (positions, vocab) through its processors, position by
        position, each seeing the context up to it, as in a plain step. A drafted
        token they forbid (a grammar's -inf) ends the draft there (drafts[i] is cut)."""
        processors = self.logits_processors[i]
        if not processors:
            return logits
        buffer = self.token_contexts[i]
        contexts[i] = internals.context_size(buffer)
        context = buffer.update_and_fetch(mx.array([pending], dtype=mx.int32))
        draft, rows = drafts[i], []
        for j in range(len(draft) + 1):
            row = logits[j : j + 1]
            for processor in processors:
                row = processor(context, row)
            rows.append(row)
            if j == len(draft):
                break
            if row[0, draft[j]].item() == -float("inf"):
                drafts[i] = draft[:j]
                break
            context = buffer.update_and_fetch(mx.array([draft[j]], dtype=mx.int32))
        return mx.concatenate([*rows, logits[len(rows) :]], axis=0)

    def _sample_unregistered(
        self, sequences: list[Sequence | None], logprobs: mx.array
    ) -> dict[int, mx.array]:
        """The next token of each sequence that does not speculate (its request opted
        out), drawn by its own sampler from the pass's first position, as a plain step
        draws it: the sampler's random stream advances one token, as in a plain step."""
        samplers = self.samplers or [None] * len(self.uids)
        return {
            i: (samplers[i] or self.fallback_sampler)(logprobs[i, :1])
            for i, seq in enumerate(sequences)
            if seq is None
        }

    def _accept(
        self, seq: Sequence | None, draft: list[int], logprobs: mx.array, targets: list[int]
    ) -> tuple[int, int]:
        """(drafted tokens accepted, the token after them) for a speculating sequence."""
        if seq is None or seq.sampling is None or seq.rng is None:
            return accept_greedy(targets, draft)
        probs = seq.sampling.probabilities(logprobs[: len(draft) + 1])
        return accept_sampled(np.array(probs), draft, seq.rng)

    def _account(self, seq: Sequence | None, drafted: int, accepted: int) -> None:
        stats = self.speculation.stats
        stats.drafted_tokens += drafted
        stats.accepted_tokens += accepted
        if seq is not None:
            seq.record_draft(drafted, accepted)

    def _respond(
        self, emitted: list[list[int]], rows: list[list[mx.array]]
    ) -> tuple[list[GenerationBatch.Response], list[int], list[int]]:
        """Each sequence's tokens as mlx-lm's responses, up to the first that ends it:
        (responses, sequences kept, tokens each keeps in its cache)."""
        responses, keep, kept_tokens = [], [], []
        for i, tokens in enumerate(emitted):
            finish = None
            count = 0
            for token, row in zip(tokens, rows[i], strict=True):
                count += 1
                self.emitted_counts[i] += 1
                if self.emitted_counts[i] >= self.max_tokens[i]:
                    finish = "length"
                if self.stop_matchers[i].advance(token):
                    finish = "stop"
                responses.append(self.Response(self.uids[i], token, row, finish, None, None))
                if finish is not None:
                    break
            kept_tokens.append(count)
            if finish is None:
                keep.append(i)
        return responses, keep, kept_tokens
