"""Decoder layers on SSD. May import engine.config, engine.weights and engine.experts.

- `streamer`   LayerStreamer: streamed layers read just before they run,
               prefetched on an I/O stream, released after.
- `residency`  which layers stay resident: planning from memory, shedding.
- `prepared`   load a prepared directory as a streamed model (with the expert
               cache when asked).
- `memory`     memory probes (RSS, available, MLX) and the /memory report.
- `diskio`     page-cache dropping and read-speed measurement.
"""
