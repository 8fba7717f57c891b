"""`flashserve bench`: numbers, side by side in one run. May import all of flashserve.engine.

- `runner`   the command line and the list of sections.
- `common`   bench models, engine start, concurrent streams, tables.
- `layers`, `experts`, `batch`, `prefill`: one section each.
- `cap/`     a model larger than a real cgroup memory limit, beside llama-server.
"""
