"""The prompt cache: a prompt starts from the longest prefix already computed.
May import config and weights.

- `cache`     PromptCache: longest-prefix reuse across requests, the memory
              tier (mlx-lm's LRUPromptCache); prompt_cache_for, the worker's.
- `disk`      its SSD tier: segment files LRU by bytes, a writer thread,
              survives restarts.
- `files`     one file: checksummed header + raw array bytes.
- `segments`  a state cut where a stored prefix ends, and joined back.
- `budget`    the disk tier's write budget (bytes per hour).

Which states the worker stores, and when, is the worker's business
(generation/prompt_states.py).
"""
