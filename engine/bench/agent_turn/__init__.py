"""`flashserve bench --sections agent-turn`, its part over HTTP (imports anything in the
engine). over_http.py: flashserve and llama.cpp's `llama-server` serving the same GGUF,
both models, the turns an agent sends: cold prefill, a short prompt, the next turn, decode;
deviation.py: how far llama.cpp's server and the integer prompt paths move the next-token
probabilities from flashserve's float path, on the same GGUF."""
