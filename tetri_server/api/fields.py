"""Reading a JSON request body: bytes -> object, and typed getters that name the bad field.

JSON ``null`` means "not given" for every field, as OpenAI clients send it. Booleans are never
accepted where a number is expected (``True`` is an ``int`` in Python, not in the API).
"""

from __future__ import annotations

import json
import math
from typing import Any

from tetri_server.api.errors import APIError, bad_param


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    if not raw:
        raise APIError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8"
        ) from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(
            f"the request body must be a JSON object, not {_json_type(body)}", code="invalid_json"
        )
    return body


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


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
        if not is_int(value):
            raise bad_param(name, f"expected an integer, got {_json_type(value)}")
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
            raise bad_param(name, f"expected a number, got {_json_type(value)}")
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
            raise bad_param(name, f"expected true or false, got {_json_type(value)}")
        return value

    def string(self, name: str, default: str | None) -> str | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad_param(name, f"expected a string, got {_json_type(value)}")
        return value

    def obj(self, name: str) -> dict[str, Any] | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise bad_param(name, f"expected an object, got {_json_type(value)}")
        return value

    def string_list(self, name: str, *, max_items: int, max_len: int) -> list[str]:
        """A string or a list of strings (``stop``); each non-empty and at most ``max_len``."""
        value = self.body.get(name)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad_param(name, "expected a string or a list of strings")
        if len(items) > max_items:
            raise bad_param(name, f"at most {max_items} entries, got {len(items)}")
        for s in items:
            if not s:
                raise bad_param(name, "stop strings must not be empty")
            if len(s) > max_len:
                raise bad_param(name, f"each stop string is at most {max_len} characters")
        return list(dict.fromkeys(items))

    def int_list(self, name: str, *, low: int, high: int) -> list[int]:
        value = self.body.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(is_int(v) for v in value):
            raise bad_param(name, "expected a list of integers")
        for v in value:
            if not low <= v < high:
                raise bad_param(name, f"token id {v} is outside the vocabulary [0, {high})")
        return list(value)

    def require_absent(self, name: str, allowed: tuple[Any, ...], what: str) -> None:
        """Reject a known OpenAI field we cannot honour unless it has a no-op value."""
        value = self.body.get(name)
        if value is not None and value not in allowed:
            raise bad_param(name, f"{what} is not supported by this server")
