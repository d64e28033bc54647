"""`kvpool router`: a cache-aware OpenAI-compatible front door for a set of engine nodes.

Modules: `chain` (a prompt's block-hash chain, as the nodes compute it), `backends` (the
nodes: health, load, layout), `policy` (round-robin, least-loaded, prefix), `app` (the HTTP
proxy), `metrics` (its Prometheus families, and the watch for error events in streams).
"""
