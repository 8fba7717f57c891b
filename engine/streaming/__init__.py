"""Decoder layers on SSD. May import engine.config, engine.kv, engine.weights and
engine.experts.

- `streamer`   LayerStreamer: streamed layers read just before they run
               (checked, prefetched on the weights reader's pool), released after.
- `residency`  which layers stay resident: planning from memory, shedding.
- `prepared`   load a prepared directory as a streamed model (with the expert
               cache when asked).
- `memory`     memory probes (RSS, available within the host and the cgroup
               limit, MLX) and the /memory report.
- `diskio`     page-cache dropping and read-speed measurement.
"""
