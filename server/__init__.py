"""flashserve.server: the HTTP side. Imports flashserve.engine; the engine never imports it.

Subpackages and modules, from the bottom up (each may import those above it):

- `settings`  the one Settings object: config.toml < FLASHSERVE_* env < flags.
- `http`      plumbing every route shares: error objects, dependencies,
              middleware, API keys, metrics, request lifecycle, production wiring.
- `generation` the server's client of the engine: submit, read events, cancel,
              budget the context, stream as SSE.
- `chat`      the dialect-neutral chat pipeline: internal request, prompt
              rendering, tools, reasoning, structured output, output events.
- `fim`       fill-in-the-middle prompts (a model's FIM tokens), for any dialect.
- `openai`    the OpenAI dialect: protocol (schemas) and one serving module per
              endpoint, translating into the chat pipeline and out of its events.
- `anthropic`, `llamacpp`  the Anthropic Messages and llama.cpp (/infill) dialects.
- `routes`    one FastAPI router per resource; thin.
- `app`       create_app: the composition root.
- `cli`       `flashserve` commands and the terminal chat.
"""

# Only ever imported as flashserve.server: a second copy under a bare "server" name (a
# script run from the repository root) would hold its own engine state and classes.
if __name__ != "flashserve.server":
    raise ImportError(f"import flashserve.server, not {__name__} (pip install -e .)")
