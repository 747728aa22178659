"""Typed getters over a decoded JSON request body that name the bad field.

JSON ``null`` means "not given" for every field, as OpenAI clients send it. Booleans are never
accepted where a number is expected (``True`` is an ``int`` in Python, not in the API).
"""

from __future__ import annotations

import math
from typing import Any

from tetri_server.api.body import json_type
from tetri_server.api.errors import bad_param


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """Typed, validated access to the fields of one request body."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def raw(self, name: str) -> Any:
        return self.body.get(name)

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def integer(
        self, name: str, default: int | None, *, low: int | None = None, high: int | None = None
    ) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 100.0, as vLLM's request models (pydantic) take it
        if not is_int(value):
            raise bad_param(name, f"expected an integer, got {json_type(value)}")
        if low is not None and value < low:
            raise bad_param(name, f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise bad_param(name, f"must be <= {high}, got {value}")
        return int(value)

    def number(
        self,
        name: str,
        default: float,
        *,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
    ) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_param(name, f"expected a number, got {json_type(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise bad_param(name, "must be a finite number")
        if low is not None and (value <= low if low_open else value < low):
            raise bad_param(name, f"must be {'>' if low_open else '>='} {low:g}, got {value:g}")
        if high is not None and value > high:
            raise bad_param(name, f"must be <= {high:g}, got {value:g}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_param(name, f"expected true or false, got {json_type(value)}")
        return value

    def string(self, name: str, default: str | None) -> str | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad_param(name, f"expected a string, got {json_type(value)}")
        return value

    def obj(self, name: str) -> dict[str, Any] | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise bad_param(name, f"expected an object, got {json_type(value)}")
        return value

    def string_list(self, name: str, *, max_items: int, max_len: int) -> list[str]:
        """A string or a list of strings (``stop``); each non-empty and at most ``max_len``."""
        value = self.body.get(name)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list) and len(items) > max_items:
            raise bad_param(name, f"at most {max_items} entries, got {len(items)}")
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad_param(name, "expected a string or a list of strings")
        for s in items:
            if not s:
                raise bad_param(name, "stop strings must not be empty")
            if len(s) > max_len:
                raise bad_param(name, f"each stop string is at most {max_len} characters")
        return list(dict.fromkeys(items))

    def token_ids(self, name: str, *, vocab_size: int, max_items: int) -> list[int]:
        """A list of at most ``max_items`` token ids, each in ``[0, vocab_size)``."""
        value = self.body.get(name)
        if value is None:
            return []
        if isinstance(value, list) and len(value) > max_items:
            raise bad_param(name, f"at most {max_items} entries, got {len(value)}")
        if not isinstance(value, list) or not all(is_int(v) for v in value):
            raise bad_param(name, "expected a list of integers")
        for v in value:
            if not 0 <= v < vocab_size:
                raise bad_param(name, f"token id {v} is outside the vocabulary [0, {vocab_size})")
        return list(value)

    def require_absent(self, name: str, allowed: tuple[Any, ...] = (), what: str = "") -> None:
        """Reject a known field we cannot honour unless it has a no-op value of ``allowed``
        (``1`` is ``1.0``; ``0`` is not ``false``)."""
        value = self.body.get(name)
        if value is not None and not any(
                value == v and isinstance(value, bool) == isinstance(v, bool) for v in allowed):
            raise bad_param(name, f"{what} is not supported by this server".lstrip())
