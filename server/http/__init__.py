"""HTTP plumbing shared by every route. May import flashserve.engine and server.settings.

- `errors`      the error object, APIError, and the app's exception handlers.
- `deps`        FastAPI dependencies: engine, settings, the ready model.
- `middleware`  request ids, access log, body limit, HEAD, CORS.
- `security`    the API key.
- `hosts`       the Host check of keyless servers (DNS rebinding).
- `connections` connection limit, idle timeout, open-file limit.
- `metrics`     Prometheus collectors.
- `lifecycle`   request time limits and the graceful shutdown drain.
- `production`  wires the above into an app.
- `openapi`     the OpenAPI document as the server answers (statuses, SSE, security).
"""
