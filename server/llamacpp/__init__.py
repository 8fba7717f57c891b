"""llama.cpp's server dialect: POST /infill, the fill-in-the-middle endpoint that code
editors' plugins (llama.vim, llama.vscode, Continue, Zed's llama.cpp provider) call.

May import everything in flashserve.server but routes, app and cli (it takes the
greedy-temperature threshold from openai/common.py and the WHOLE integers of
openai/protocol.py, as the Anthropic dialect does).

- `protocol`  request, response and stream-chunk schemas (pydantic), llama.cpp's names.
- `infill`    /infill: the body -> a FIM prompt (server/fim.py), generation, the
              response or its SSE chunks.
"""
