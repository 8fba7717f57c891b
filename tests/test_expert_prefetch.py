"""Next-layer expert prefetch inside the expert cache's bytes (experts/prefetch.py).

Under the memory plan every byte the experts take must come out of the cache's
capacity: a guessed expert's read reserves its bytes (evicting for them) until
the next layer takes it or drops it. Greedy output stays the resident model's.
"""

from __future__ import annotations

import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.experts.compute import EveryCached
from flashserve.engine.loader import load
from flashserve.engine.weights.layout import read_manifest
from tests.test_experts import LAYERS, TOP_K, greedy, prepared, reference  # noqa: F401


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_prefetch_reads_come_out_of_the_caches_bytes(prepared, reference, arch) -> None:  # noqa: F811
    manifest = read_manifest(prepared[arch])
    record = max(
        s["record_bytes"]
        for layer in manifest["layers"]
        if layer.get("experts")
        for s in layer["experts"]["switches"]
    )
    capacity = (TOP_K * LAYERS + TOP_K) * record
    loaded = load(
        EngineConfig(
            model=str(prepared[arch]),
            expert_cache=f"{capacity}B",
            expert_prefetch="next-layer",
        )
    )
    experts = loaded.experts
    cache = experts.cache
    seen: list[tuple[int, int]] = []
    issue = experts.prefetcher.issue

    def watched(layer, predicted) -> None:
        issue(layer, predicted)
        seen.append((cache.nbytes, cache.prefetching))

    experts.prefetcher.issue = watched
    try:
        tokens, _ = greedy(loaded)
        assert tokens == reference[arch][0]
        assert any(reserved > 0 for _, reserved in seen), seen  # it did read ahead
        assert all(n + reserved <= capacity for n, reserved in seen), seen
        in_flight = sum(i.nbytes for d in experts.prefetcher._pending.values() for i in d.values())
        assert cache.prefetching == in_flight  # taken and dropped reads gave theirs back
        view = experts.snapshot().since_start
        assert view.prefetch_hits > 0 and view.prefetch_reads > 0
        assert view.evictions > 0
        # No list over a layer's cached experts outlives an eviction from the layer:
        # it would keep evicted records in memory beside the cache (280 MB of them
        # beside a 300 MB cache on the cap bench's model).
        for layer, info in experts.layers.items():
            assert info.every is None or info.every.version == cache.version(layer), layer
        key = next(iter(cache.keys()))
        info = experts.layers[key[0]]
        info.every = EveryCached(cache.version(key[0]), {})
        cache.evict(key)
        assert info.every is None
        experts.reset(clear_cache=True)
        assert cache.prefetching == 0
    finally:
        experts.close()
