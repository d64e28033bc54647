"""The README's configuration reference and the settings dataclasses agree (issue 41): every
key has a row, every row names a key, each row's default is the field's, and a key that is
not given takes that default."""
from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

from connector.settings import PoolConnectorSettings, config_key
from kvpool.layout import parse_size
from kvpool.transfer import TransferConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def reference_rows() -> dict[str, str]:
    """key -> its default cell, from the README's "Configuration reference" table."""
    text = README.read_text()
    section = text[text.index("## Configuration reference"):]
    section = section[:section.index("\n## ")]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([a-z_]+)` \| ([^|]+) \|", section, re.M)}


def defaults() -> dict[str, object]:
    """key -> the default its field declares (every key of kv_connector_extra_config)."""
    out: dict[str, object] = {}
    for f in fields(TransferConfig):
        out[f.name] = f.default
    for f in fields(PoolConnectorSettings):
        if f.name != "transfer":
            assert f.default is not MISSING, f"{f.name} has no default"
            out[config_key(f.name)] = f.default
    return out


def test_every_key_has_a_row_and_every_row_a_key() -> None:
    rows, keys = reference_rows(), defaults()
    assert sorted(set(keys) - set(rows)) == [], "keys without a README row"
    assert sorted(set(rows) - set(keys)) == [], "README rows that name no key"


def test_each_rows_default_is_its_fields() -> None:
    keys = defaults()
    for key, cell in reference_rows().items():
        default = keys[key]
        if not cell.startswith("`"):  # "required", "none", "this host and process": an empty default
            assert default in ("", 0) and key not in ("pool_size",), (key, cell, default)
            continue
        value = cell.strip("`")
        if isinstance(default, bool):
            assert value == str(default).lower(), (key, cell, default)
        elif key.endswith("_size") or key == "pool_disk_size":
            assert parse_size(value) == default, (key, cell, default)
        else:
            assert type(default)(value) == default, (key, cell, default)


def test_a_key_not_given_takes_its_fields_default() -> None:
    given = {"metaserver": "127.0.0.1:1", "node_id": "n"}
    s = PoolConnectorSettings.from_extra(lambda k, d=None: given.get(k, d), 3600.0)
    assert s == PoolConnectorSettings(metaserver="127.0.0.1:1", node_id="n")
    assert s.transfer == TransferConfig()
    raw = {"metaserver": "m:1", "pool_size": "2GiB", "pool_disk_size": "1GiB", "lookup_view": "off",
           "transfer_timeout_s": "30", "metaserver_token_file": "/t", "read_timeout_s": 99}
    s = PoolConnectorSettings.from_extra(lambda k, d=None: raw.get(k, d), 30.0)
    assert (s.pool_size_bytes, s.disk_size_bytes, s.lookup_view, s.transfer.transfer_timeout_s, s.token_file,
            s.read_timeout_s) == (2 << 30, 1 << 30, False, 30, "/t", 30.0)
    assert s.node_id  # this host and process
