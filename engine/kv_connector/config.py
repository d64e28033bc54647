"""`--kv-transfer-config`: the connector's settings, in the JSON form of vLLM's flag.

    {"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"metaserver": "127.0.0.1:50051", "pool_size": "4GiB"}}

Roles: kv_both (load hits and save new blocks), kv_producer (save only), kv_consumer
(load only). `kv_load_wait_s` (default 0.05): how long a load-ahead step (loads started
just before a batch is formed, nothing computed) waits on them, so that a quick load's
request is prefilled in the very next batch. Load failure policy: recompute (the default:
failed blocks and everything after them are computed again) or fail (the request ends with
an error).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.json_flag import json_object

ROLES = ("kv_both", "kv_producer", "kv_consumer")
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    kv_load_timeout_s: float = 30.0      # a request never waits longer for its loads
    # A load started before a batch is formed that finishes within this time joins that
    # batch (its request is prefilled at once); a slower one goes on in the background and
    # its request joins a later one. 0: always in the background (vLLM's async loads).
    kv_load_wait_s: float = 0.05
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.kv_connector:
            raise ValueError("kv_connector is required")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(FAILURE_POLICIES)}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not 0 < self.kv_load_timeout_s <= 3600:
            raise ValueError(f"kv_load_timeout_s must be in (0, 3600], got {self.kv_load_timeout_s}")
        if not 0 <= self.kv_load_wait_s <= 10:
            raise ValueError(f"kv_load_wait_s must be in [0, 10], got {self.kv_load_wait_s}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    def extra(self, key: str, default: Any = None) -> Any:  # noqa: ANN401 - free-form JSON
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parse the flag's JSON; ValueError with a one-line message for anything wrong."""
        obj = json_object(text, "--kv-transfer-config", cls.__dataclass_fields__)
        if not obj.get("kv_connector"):
            raise ValueError("--kv-transfer-config: kv_connector is required")
        try:
            return cls(**obj)
        except TypeError as err:
            raise ValueError(f"--kv-transfer-config: {err}") from None
