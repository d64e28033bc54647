"""The KV connector contract, kept beside the scheduler that calls it (as vLLM keeps `base.py`).

`base` is the interface (vLLM's `KVConnectorBase_V1`: a scheduler half and a worker half),
`config` the `--kv-transfer-config` settings, `factory` the registry of implementations by
name ("module:Class" strings, imported only when used). Implementations live outside the
engine (`connector/`) and import this package, never the other way round.
"""
from engine.kv_connector.base import (EngineContext, KVConnectorBase_V1, KVConnectorError, KVConnectorMetadata,
                                      KVConnectorOutput, KVConnectorRole)
from engine.kv_connector.config import KVTransferConfig

__all__ = ["EngineContext", "KVConnectorBase_V1", "KVConnectorError", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorRole", "KVTransferConfig"]
