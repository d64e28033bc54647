"""The disk tier's settings: `kvpool serve --pool-disk/--pool-disk-size` and the
kv_connector_extra_config keys pool_disk / pool_disk_size reach the connector settings."""
from __future__ import annotations

import argparse

import pytest

from connector.settings import PoolConnectorSettings
from kvpool_cli.serve import add_parsers, kv_transfer_config


def _settings(extra: dict) -> PoolConnectorSettings:
    return PoolConnectorSettings.from_extra(lambda k, d: extra.get(k, d), 10.0)


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parsers(p.add_subparsers())
    return p.parse_args(["serve", "--model", "m", *argv])


def test_extra_config_keys() -> None:
    s = _settings({"metaserver": "127.0.0.1:1", "pool_disk": "/d", "pool_disk_size": "2GiB"})
    assert s.disk_dir == "/d" and s.disk_size_bytes == 2 << 30
    off = _settings({"metaserver": "127.0.0.1:1"})
    assert off.disk_dir == "" and off.disk_size_bytes == 0
    with pytest.raises(ValueError, match="pool_disk_size|cannot parse size"):
        _settings({"metaserver": "127.0.0.1:1", "pool_disk_size": "lots"})


def test_serve_flags() -> None:
    cfg = kv_transfer_config(_parse("--kv-connector", "mooncake", "--metaserver", "127.0.0.1:1",
                                    "--pool-disk", "/d", "--pool-disk-size", "8GiB"))
    assert cfg.kv_connector_extra_config["pool_disk"] == "/d"
    assert cfg.kv_connector_extra_config["pool_disk_size"] == "8GiB"
    with pytest.raises(ValueError, match="cannot parse size"):
        kv_transfer_config(_parse("--kv-connector", "mooncake", "--pool-disk-size", "lots"))
    with pytest.raises(ValueError, match="need --kv-connector"):
        kv_transfer_config(_parse("--pool-disk", "/d"))
