"""The chat pipeline, the same for every API dialect. May import flashserve.engine,
server.settings, server.http and server.generation; never a dialect (server.openai).

One pass: internal request (`conversation`) -> plan tools and format for this
model (`tooling`) -> render the prompt (`prompts`; Jinja in `sandbox`) ->
constrain (`constraints`) -> generate -> output events (`output`, parsed by
`output_parser` with `tool_parsers` and `reasoning`). `pipeline` runs that pass.
"""
