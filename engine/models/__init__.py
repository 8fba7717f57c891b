"""Several models in one process: the catalog of servable models and the pool that
loads them on demand, one Engine (and worker thread) each, and unloads them.

Imports config, weights, streaming (memory probes) and generation (Engine);
nothing in the engine imports it. The server holds one ModelPool.
"""
