"""The OpenAI dialect. May import everything in flashserve.server but routes, app and cli.

- `protocol`     request and response schemas (pydantic).
- `chat`         /v1/chat/completions: body -> chat pipeline request; output
                 events -> chunks or one message.
- `completions`  /v1/completions.
"""
