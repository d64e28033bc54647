"""Connectors by name: `--kv-connector mooncake` (or the class name, as vLLM spells it).

The registry holds "module:Class" strings, imported on first use, so the engine names an
implementation without importing it (the layering contract forbids the import)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_connector.base import EngineContext, KVConnectorBase_V1, KVConnectorRole
    from engine.kv_connector.config import KVTransferConfig

# name -> "module:Class"; imported only when used.
_REGISTRY: dict[str, str] = {
    "mooncake": "connector.mooncake:MooncakeConnector",
    "MooncakeConnector": "connector.mooncake:MooncakeConnector",
}


def register(name: str, target: str) -> None:
    """Add a connector under `name` ("module:Class")."""
    if name in _REGISTRY and _REGISTRY[name] != target:
        raise ValueError(f"connector {name!r} is already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = target


def names() -> list[str]:
    return sorted(_REGISTRY)


def connector_class(config: KVTransferConfig) -> type[KVConnectorBase_V1]:
    """The class registered under `config.kv_connector` (ValueError if none is)."""
    target = _REGISTRY.get(config.kv_connector)
    if target is None:
        raise ValueError(f"unknown KV connector {config.kv_connector!r}; known: {', '.join(names())}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def create(config: KVTransferConfig, ctx: EngineContext, role: KVConnectorRole) -> KVConnectorBase_V1:
    return connector_class(config)(config, ctx, role)
