"""The Anthropic Messages dialect. May import everything in flashserve.server but routes,
app and cli (it takes the greedy-temperature threshold from openai/common.py).

- `protocol`   request, response and stream-event schemas (pydantic).
- `translate`  a Messages body -> the chat pipeline's ChatRequest.
- `messages`   /v1/messages (output events -> content blocks, streamed or whole)
               and /v1/messages/count_tokens.
"""
