"""KV connector implementations (the contract lives in `engine.kv_connector`).

The pool connector is two host-independent halves over plain values, and a thin front per
host:
- `settings`: `kv_connector_extra_config` read once into a frozen dataclass;
- `pool_scheduler.PoolScheduler`: lookups in the global index, pending loads, save planning;
- `pool_worker.PoolWorker`: the node pool, reads into the engine's cache, saves out of it;
- `messages`: what the scheduler half hands the worker half each step;
- `mooncake.MooncakeConnector`: the front for our engine (`--kv-connector mooncake`).

Imports point down only: this package uses `engine.kv_connector`, `kvpool` and the
metaserver client; nothing below imports it.
"""
