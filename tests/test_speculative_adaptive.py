"""Whether a batch drafts, and how far (engine/speculative/adaptive.py).

The plan is the batch's: a verification pass runs every sequence, so drafting
must beat plain steps for the batch as a whole, on measured step times. The
engine test runs real batches of the tiny model on a modelled clock (each
forward advances it by a cost that grows with the rows it runs), so what the
plan gains or loses is exact and repeatable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load as mlx_load

from flashserve.engine.speculative import batch as speculative_batch
from flashserve.engine.speculative.adaptive import (
    FIRST_PAUSE,
    PLAIN_SAMPLES,
    CostModel,
    Sequence,
    SpeculativeStats,
)
from flashserve.engine.speculative.batch import Speculation, SpeculativeConfig


def measured(times: dict[tuple[int, int], float], max_draft: int = 8) -> CostModel:
    """A cost model that measured PLAIN_SAMPLES steps of each (batch size, width):
    seconds (each size's plain steps first)."""
    cost = CostModel(max_draft)
    clock = 0.0
    for (batch, width), seconds in times.items():
        uids = tuple(range(batch))
        for _ in range(PLAIN_SAMPLES + 1):
            cost.begin(clock, width, uids)
            clock += seconds
        cost.end(clock, ())  # another batch: the last interval closes unrecorded
    return cost


def test_a_batch_drafts_long_where_a_pass_costs_about_a_plain_step() -> None:
    cost = measured({(1, 0): 0.010, (1, 1): 0.0105, (1, 2): 0.011, (1, 4): 0.0115, (1, 8): 0.012})
    assert cost.plan(1, [(1.0, 0.9, 100)]) == 8
    assert cost.plan(1, [(1.0, 0.9, 3)]) == 4  # room for 3 more: a width of 4 costs less
    assert cost.plan(1, [(1.0, 0.02, 100)]) == 0  # drafts all rejected: plain steps


def test_a_costly_width_is_avoided_and_an_unmeasured_one_explored() -> None:
    cost = measured({(1, 0): 0.010, (1, 1): 0.011, (1, 2): 0.012, (1, 4): 0.014, (1, 8): 0.05})
    assert cost.plan(1, [(1.0, 0.9, 100)]) == 4
    fresh = measured({(1, 0): 0.010, (1, 1): 0.011})
    # 2 is not measured: estimated from 1 plus a small slope, and tried; 4 not yet.
    assert fresh.plan(1, [(1.0, 0.95, 100)]) == 2


def test_drafting_pays_alone_but_not_for_a_batch_that_shares_the_pass() -> None:
    """One sequence repeats its prompt (accepts most drafts); three others find no
    draft. Alone, a pass of 2 drafts (1.3 plain steps) gives it 2.5 tokens; in a batch
    of four a pass of 4 x 3 rows costs 1.9 of the batch's plain steps, and gives the
    batch 5.5 tokens for the 4 of a plain step: 2.9 per plain step's time."""
    times = {(1, 0): 0.010, (1, 1): 0.0115, (1, 2): 0.013, (4, 0): 0.018, (4, 1): 0.026}
    cost = measured({**times, (4, 2): 0.034})
    repeats, prose = (1.0, 0.8, 100), (0.1, 0.2, 100)
    assert cost.plan(1, [repeats]) > 0
    assert cost.plan(4, [repeats, prose, prose, prose]) == 0


def test_a_batch_that_does_not_pay_tries_again_after_doubling_pauses() -> None:
    cost = measured({(1, 0): 0.010, (1, 1): 0.02, (1, 2): 0.03})
    plans = [cost.plan(1, [(1.0, 0.3, 100)]) for _ in range(3 * FIRST_PAUSE + 2)]
    tries = [i for i, width in enumerate(plans) if width]
    assert tries == [FIRST_PAUSE, FIRST_PAUSE + 1 + 2 * FIRST_PAUSE]  # 8 plain, a try, 16 ...
    assert cost.stops == 1


def test_costs_are_in_plain_steps_and_carry_over_to_another_batch_size() -> None:
    cost = measured({(1, 0): 0.010, (1, 1): 0.030, (2, 0): 0.012})
    assert cost.estimate(1, 1) == pytest.approx(3.0)
    assert cost.estimate(2, 1) == pytest.approx(3.0)  # as at one sequence, until measured


def test_a_pass_is_costed_against_the_plain_steps_just_before_it() -> None:
    """Passes measured at 1.5 plain steps while the machine was quiet; then it gets
    busy and plain steps take twice as long. Against absolute times a pass would now
    look cheaper than a plain step; as a ratio it still costs 1.5, and drafts three in
    ten of which are accepted still do not pay."""
    cost = measured({(1, 0): 0.010, (1, 1): 0.015})
    uids, clock = (0,), 1.0
    for _ in range(PLAIN_SAMPLES + 1):
        cost.begin(clock, 0, uids)
        clock += 0.020
    cost.end(clock, uids)
    assert cost.estimate(1, 1) == pytest.approx(1.5)
    assert cost.plan(1, [(1.0, 0.3, 100)]) == 0


def test_one_slow_step_does_not_move_the_estimate() -> None:
    cost = measured({(1, 0): 0.010, (1, 1): 0.011})
    uids = (0,)
    for seconds in (0.011, 0.2, 0.011):  # another process took the cores once
        cost.begin(0.0, 1, uids)
        cost.end(seconds, uids)
    assert cost.estimate(1, 1) == pytest.approx(1.1)


def test_shadow_drafts_judge_prompt_lookup_while_the_batch_does_not_draft() -> None:
    """Prompt lookup's draft after each plain step, judged against what the model then
    produced: output that repeats raises the acceptance, other output lowers it."""
    seq = Sequence(shadowed=True)
    context = [1, 2, 3, 4, 5, 6, 7, 8]
    for token in [1, 2, 3, 4, 5, 6, 7, 8] * 3:  # the model repeats its context
        seq.observe(context)
        seq.start_shadow(context, 4)
        context = [*context, token]
    assert seq.acceptance > 0.9 and seq.found > 0.9
    for token in [t for i in range(12) for t in (1, 2, 100 + i)]:  # "1 2" then anything
        seq.observe(context)
        seq.start_shadow(context, 4)
        context = [*context, token]
    assert seq.acceptance < 0.3


# -- a real batch on a modelled clock --------------------------------------------------


class Clock:
    """Modelled time: a plain step of B sequences costs BASE + ROW * B; a pass over k
    drafts runs B x (k+1) rows and costs BASE + ROW * B * (k+1): cheap rows for one
    sequence, costly ones for a batch (as on resident weights on a CPU)."""

    BASE, ROW = 0.010, 0.002

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedModel:
    """The model, advancing the clock by each forward's modelled cost."""

    def __init__(self, model: Any, clock: Clock) -> None:
        self._model, self._clock = model, clock

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self._clock.now += Clock.BASE + Clock.ROW * inputs.shape[0] * inputs.shape[1]
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class TruthIndex:
    """Prompt lookup's stand-in: the plain run's next tokens for a repeating sequence,
    tokens one off for the others (found, always rejected)."""

    def __init__(self, truth: list[int], right: bool) -> None:
        self.truth, self.right = truth, right

    def draft(self, context: list[int], k: int) -> list[int]:
        if self.truth[: len(context)] != context:
            return []
        return [t + (not self.right) for t in self.truth[len(context) : len(context) + k]]


def timed_run(
    clock: Clock,
    model: Any,
    prompts: list[list[int]],
    speculative: bool,
    truth: list[list[int]] | None = None,
) -> tuple[float, list[list[int]], SpeculativeStats]:
    """Greedy generation of 60 tokens per prompt: (modelled seconds, tokens, counters);
    with `truth`, the first prompt's drafts are right and the others' wrong."""
    start = clock.now
    batch = BatchGenerator(TimedModel(model, clock), completion_batch_size=4)
    stats = SpeculativeStats()
    spec = Speculation(SpeculativeConfig("prompt-lookup", 8), stats)
    if speculative:
        spec.install(batch)
    uids = batch.insert(prompts, max_tokens=[60] * len(prompts))
    for i, uid in enumerate(uids):
        spec.register(uid, speculative, None)
        if speculative and truth is not None:
            spec.sequences[uid].index = TruthIndex(truth[i], right=i == 0)  # type: ignore[assignment]
    finished: dict[int, list[int]] = {}
    while len(finished) < len(uids):
        for r in batch.next_generated():
            if r.finish_reason is not None:
                finished[r.uid] = r.all_tokens
    return clock.now - start, [finished[u] for u in uids], stats


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir: Path) -> Any:
    model, _ = mlx_load(str(tiny_llama_dir))
    return model


def test_a_batch_where_drafting_does_not_pay_runs_as_fast_as_plain(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone, the repeating sequence's drafts pay (a pass of 9 rows costs 2.3 plain
    steps for up to 9 tokens). Beside three sequences whose drafts are all rejected
    the batch's pass costs 4.6 of its plain steps for at most 12 tokens: drafting
    would make the batch slower, so it drafts only to measure, and the batch is as
    fast as without speculation (within 3%), with the same tokens."""
    clock = Clock()
    monkeypatch.setattr(speculative_batch, "time", clock)  # the cost model's clock
    prompts = [[5 + i % 7 for i in range(40)]]
    prompts += [[9 + (i * j) % 23 for i in range(25)] for j in (1, 2, 3)]
    plain_s, truth, _ = timed_run(clock, tiny_model, prompts, False)
    alone_plain_s, _, _ = timed_run(clock, tiny_model, prompts[:1], False)
    alone_s, alone_tokens, alone = timed_run(clock, tiny_model, prompts[:1], True, truth)
    assert alone_tokens == truth[:1] and alone.accepted_tokens > 0
    assert alone_s < alone_plain_s / 1.5
    spec_s, tokens, stats = timed_run(clock, tiny_model, prompts, True, truth)
    assert tokens == truth
    assert stats.passes > 0  # it measured what a pass costs the batch ...
    assert spec_s <= plain_s / 0.97  # ... and stopped drafting
