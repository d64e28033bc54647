"""kvpool_harness: real processes on loopback for tests, benchmarks and `kvpool cluster`.

`processes`: `ChildProcess` (a `python -m kvpool_cli ...` child), `EtcdProcess`,
`MetaserverProcess`, `free_port`, `wait_serving`. `engine_node`: `EngineProcess` (one
`kvpool serve` node), `http_json`, `read_api_key`. `cluster`: `LocalCluster` / `ClusterSpec`
(etcd, a metaserver and N engine nodes) and the `kvpool cluster` subcommand. `tcp_proxy`:
`TcpProxy`, a loopback TCP proxy that can cut its link as a partition would (chaos runs).

Where it sits: below `kvpool_bench` and `kvpool_cli`, above `connector`, `engine`, `kvpool`
and `metaserver`: it may import those (it starts them as child processes and speaks their
protocols), and only kvpool_bench, kvpool_cli and the tests import it.
"""
from kvpool_harness.cluster import ClusterSpec, LocalCluster
from kvpool_harness.engine_node import EngineProcess, http_json, read_api_key
from kvpool_harness.processes import ChildProcess, EtcdProcess, MetaserverProcess, free_port, wait_serving

__all__ = ["ChildProcess", "ClusterSpec", "EngineProcess", "EtcdProcess", "LocalCluster", "MetaserverProcess",
           "free_port", "http_json", "read_api_key", "wait_serving"]
