"""`flashserve chat`: a terminal conversation with the engine in-process.

Ctrl-C during a reply stops that reply; Ctrl-C or Ctrl-D at the prompt exits.
"""

from __future__ import annotations

import asyncio
import sys

from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.server.settings import Settings


async def _reply(engine: Engine, request: GenerationRequest) -> str:
    handle = engine.submit(request)
    parts: list[str] = []
    try:
        async for event in handle:
            if isinstance(event, (TokenEvent, DoneEvent)):
                parts.append(event.text)
            elif isinstance(event, ErrorEvent):
                sys.stderr.write(f"\n[error: {event.message}]")
            sys.stdout.write(parts[-1] if parts else "")
            sys.stdout.flush()
    finally:
        handle.cancel()  # no-op when finished; stops the worker on Ctrl-C
    return "".join(parts)


def run_chat(settings: Settings) -> int:
    engine = Engine(settings.engine_config())
    engine.start()
    sys.stderr.write("loading model...\n")
    if not engine.wait_ready():
        sys.stderr.write(f"flashserve: {engine.load_error}\n")
        return 2
    loaded = engine.loaded
    assert loaded is not None
    sys.stderr.write(f"{loaded.model_id} ready. Ctrl-D or Ctrl-C to quit.\n")
    history: list[dict] = []
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\n")
            break
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = loaded.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        room = loaded.context_length - len(prompt)
        if room <= 0:
            sys.stderr.write("conversation is longer than the model's context; start again\n")
            history.clear()
            continue
        request = GenerationRequest(
            prompt_tokens=list(prompt),
            max_tokens=min(settings.default_max_tokens or room, room),
            sampling=SamplingParams(temperature=0.7, top_p=0.95),
        )
        try:
            text = asyncio.run(_reply(engine, request))
        except KeyboardInterrupt:
            sys.stdout.write("\n[stopped]\n")
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": text})
    engine.shutdown()
    return 0
