"""The OpenAI dialect. May import everything in flashserve.server but routes, app and cli.

- `protocol`     request and response schemas (pydantic).
- `chat`         /v1/chat/completions: body -> chat pipeline request; output
                 events -> chunks or one message.
- `completions`  /v1/completions.
- `logprobs`     token strings and bytes; the logprobs objects of chat and completions.
- `responses_protocol`  /v1/responses schemas: request, Response, stream events.
- `responses_schema`    the published JSON Schema of input items, tools, text.format.
- `responses_input`     /v1/responses body (+ a stored conversation) -> chat
                        pipeline request.
- `responses`    /v1/responses: output events -> output items and typed SSE events.
- `response_store`      stored responses (SQLite under data_dir), for
                        previous_response_id, GET and DELETE.
"""
