"""POST /v1/completions (legacy text completion) in the OpenAI dialect, streaming and not.

n choices decode together after one prefill; each choice's pieces become its
chunks (`choices[0].index`) or its text. `echo` puts the prompt's text first
(in the first chunk of each choice when streamed) and, with `logprobs`, the
prompt's tokens first in `logprobs` (the engine's PromptLogprobsEvent).
`max_tokens: 0` with echo scores the prompt alone (lm-evaluation-harness).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from flashserve.engine.generation.requests import GenerationRequest, PromptLogprobsEvent
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.chat.conversation import PromptLimits
from flashserve.server.chat.prompts import check_unicode, encode, run_render_job
from flashserve.server.fim import fill_stops, suffix_prompt
from flashserve.server.generation import (
    Generation,
    Piece,
    cancel_on_disconnect,
    completion_budget,
    new_id,
    now,
    sse_events,
    submit,
    with_keepalive,
)
from flashserve.server.http.errors import invalid_request
from flashserve.server.http.sse import EventStream
from flashserve.server.openai.common import choice_count, sampling_params, usage
from flashserve.server.openai.completions_protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from flashserve.server.openai.logprobs import CompletionLogprobsWriter, joined, token_strings
from flashserve.server.openai.protocol import Usage


async def create_completion(
    body: CompletionRequest,
    request: Request,
    loaded: LoadedModel,
    engine: Engine,
    default_max_tokens: int | None,
    vocab_size: int,
    limits: PromptLimits | None = None,
    keepalive: float = 0.0,
) -> Completion | EventStream:
    n = choice_count(body, engine.config.max_batch)
    if body.max_tokens == 0 and not body.echo:
        raise invalid_request(
            "max_tokens 0 asks for no completion, which only echo can use (echo: true "
            "returns the prompt, and its logprobs with logprobs).",
            "max_tokens",
            "invalid_value",
        )

    def encode_job(deadline: float) -> tuple[list[int], str]:
        tokens = encode_completion_prompt(loaded.tokenizer, body.prompt, vocab_size, body.suffix)
        return tokens, (echo_text(loaded.tokenizer, body.prompt, tokens) if body.echo else "")

    # Tokenizing is CPU work: on a render thread, within template_timeout (chat/prompts.py).
    prompt, echoed = await run_render_job(encode_job, limits or PromptLimits(), "prompt")
    max_tokens = completion_budget(
        len(prompt),
        body.max_tokens,
        loaded.context_length,
        default_max_tokens,
        prompt_param="prompt",
    )
    completion = Completion(id=new_id("cmpl"), created=now(), model=loaded.model_id, choices=[])
    scored = body.echo and body.logprobs is not None  # the prompt's own logprobs
    generation = submit(
        engine,
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            sampling=sampling_params(body, vocab_size),
            stop=body.stop_list + fill_stops(loaded.tokenizer, body.suffix),
            request_id=completion.id,
            continuation=True,
            n=n,
            logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if scored else None,
            speculative=body.speculative is not False,
        ),
        tracker=request.app.state.tracker,
    )
    choices = _Choices(n, echoed if body.echo else None, loaded.tokenizer, body.logprobs)
    if body.stream:
        return EventStream(
            sse_events(
                generation,
                _stream(generation, completion, choices, body.include_usage, keepalive),
            )
        )
    async with cancel_on_disconnect(request, generation):
        parts = [choices.piece(piece) async for piece in generation.choice_pieces()]
    completion.choices = choices.fold(parts)
    completion.usage = _usage(generation)
    return completion


class _Choices:
    """Each choice's pieces as CompletionChoices: the echoed prompt first, then its
    text; with logprobs, a writer per choice keeps its text_offset running."""

    def __init__(self, n: int, echo: str | None, tokenizer: Any, logprobs: int | None):
        self.echo = echo
        strings = token_strings(tokenizer) if logprobs is not None else None
        self._writers = [
            CompletionLogprobsWriter(strings) if strings is not None else None for _ in range(n)
        ]
        self.echoed = echo is None  # whether the echo went out (nothing to send without it)

    def prompt(self, event: PromptLogprobsEvent | None) -> list[CompletionChoice]:
        """The echoed prompt of every choice (with its logprobs when they were asked)."""
        self.echoed = True
        echo = self.echo or ""
        out = []
        for index, writer in enumerate(self._writers):
            logprobs = None
            if writer is not None:
                if event is not None:
                    logprobs = writer.prompt(event, echo)
                else:  # echo with logprobs always has the prompt's (an empty list if not)
                    logprobs, writer.offset = CompletionLogprobs(), len(echo)
            out.append(CompletionChoice(index=index, text=echo, logprobs=logprobs))
        return out

    def piece(self, piece: Piece) -> list[CompletionChoice]:
        if piece.prompt is not None:
            return self.prompt(piece.prompt)
        out = [] if self.echoed else self.prompt(None)
        writer = self._writers[piece.index]
        out.append(
            CompletionChoice(
                index=piece.index,
                text=piece.text,
                finish_reason=piece.done.finish_reason if piece.done else None,
                logprobs=writer.tokens(piece.tokens) if writer is not None else None,
            )
        )
        return out

    def fold(self, parts: list[list[CompletionChoice]]) -> list[CompletionChoice]:
        """The pieces of a non-streamed response as one choice per index."""
        by_index: dict[int, list[CompletionChoice]] = {}
        for part in parts:
            for choice in part:
                by_index.setdefault(choice.index, []).append(choice)
        out = []
        for index, pieces in sorted(by_index.items()):
            logprobs = [p.logprobs for p in pieces if p.logprobs is not None]
            out.append(
                CompletionChoice(
                    index=index,
                    text="".join(p.text for p in pieces),
                    finish_reason=pieces[-1].finish_reason,
                    logprobs=joined(logprobs) if self._writers[index] is not None else None,
                )
            )
        return out


def _usage(generation: Generation) -> Usage:
    """The prompt once (one prefill for every choice), every choice's tokens."""
    outcomes = list(generation.outcomes.values())
    first = outcomes[0]
    completion = sum(o.completion_tokens for o in outcomes)
    return usage(first.prompt_tokens, completion, first.cached_tokens)


async def _stream(
    generation: Generation,
    header: Completion,
    choices: _Choices,
    include_usage: bool,
    keepalive: float,
) -> AsyncIterator[str]:
    def chunk(choice: CompletionChoice) -> str:
        return header.model_copy(update={"choices": [choice]}).model_dump_json()

    if not choices.echoed and generation.handle.request.prompt_logprobs is None:
        # Echo without logprobs: the prompt's text needs nothing from the engine.
        for choice in choices.prompt(None):
            yield chunk(choice)
    async for piece in with_keepalive(generation.choice_pieces(), keepalive):
        if piece is None:  # a keepalive: no text yet
            yield chunk(CompletionChoice(index=0, text=""))
            continue
        for choice in choices.piece(piece):
            yield chunk(choice)
    if include_usage:
        yield header.model_copy(update={"usage": _usage(generation)}).model_dump_json()


def echo_text(tokenizer: Any, prompt: Any, tokens: list[int]) -> str:
    """The prompt as echoed: a text prompt as sent, token ids as the tokenizer reads them."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(tokens)


def encode_completion_prompt(
    tokenizer: Any, prompt: Any, vocab_size: int, suffix: str | None = None
) -> list[int]:
    """A /v1/completions prompt (a string or token ids, one prompt) -> token ids.

    With a `suffix`, the prompt is the code before it: a fill-in-the-middle prompt
    around both (server/fim.py; 400 naming suffix for a model without FIM tokens).
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if suffix:
        if not isinstance(prompt, str):
            prompt = encode_completion_prompt(tokenizer, prompt, vocab_size)  # ids checked
        return suffix_prompt(tokenizer, prompt, suffix)
    if isinstance(prompt, str):
        tokens = encode(tokenizer, check_unicode(prompt, "prompt"), add_special_tokens=True)
    else:
        tokens = [int(t) for t in prompt]
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise invalid_request(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                "prompt",
            )
    if not tokens:
        raise invalid_request("The prompt is empty.", "prompt")
    return tokens
