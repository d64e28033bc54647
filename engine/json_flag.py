"""Flags that take a JSON object (vLLM's `--kv-transfer-config`, `--speculative-config`)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def json_object(text: str, flag: str, known: Iterable[str]) -> dict[str, Any]:
    """The flag's JSON object; ValueError with a one-line message if it is not JSON, not an
    object, or has keys outside `known`."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} is not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise ValueError(f"{flag}: unknown keys {unknown}; known: {sorted(known)}")
    return obj
