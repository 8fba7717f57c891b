"""`flashserve bench --sections agent-turn`, its part over HTTP (imports anything in the
engine). over_http.py: flashserve and llama.cpp's `llama-server` serving the same GGUF,
both models, the turns an agent sends: cold prefill, a short prompt, the next turn, decode."""
