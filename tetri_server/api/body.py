"""Reading a JSON request body, the one way every JSON route does: Content-Type, size, arrival
time, nesting depth, then ``json.loads``.

The depth is checked before decoding: ``json.loads`` recurses once per nesting level, and a body
of ``[`` * 100000 would otherwise end in a ``RecursionError`` (a 500) instead of a 400.
"""

from __future__ import annotations

import asyncio
import json
import re
from array import array
from itertools import accumulate
from typing import Any

from aiohttp import web

from tetri_server.api.errors import APIError

MAX_JSON_DEPTH = 64  # arrays/objects inside each other; a chat request needs 4

_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)  # brackets in strings don't nest
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


async def read_json_body(request: web.Request, *, max_bytes: int, timeout_s: float) -> bytes:
    """The raw body of a JSON POST: 415 unless ``Content-Type: application/json``, 413 beyond
    ``max_bytes`` (the app's ``client_max_size``), 408 if it takes longer than ``timeout_s``."""
    if request.content_type != "application/json":
        given = request.headers.get("Content-Type")
        raise APIError(
            "the request body must be JSON sent with 'Content-Type: application/json'"
            + (f", not {given!r}" if given else "; the header is missing"),
            status=415,
            code="unsupported_media_type",
        )
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(
            f"the request body is larger than the server's limit of {max_bytes} bytes",
            status=413,
            code="request_too_large",
        ) from None
    except TimeoutError:
        raise APIError(
            f"the request body did not arrive within {timeout_s:g} s", status=408, code="timeout"
        ) from None
    except web.RequestPayloadError as e:  # e.g. a Content-Encoding whose data is broken
        raise APIError(f"the request body could not be decoded ({e})",
                       code="invalid_body") from None


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in ``raw`` (brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(array("b", brackets.translate(_STEP))), default=0)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    if not raw:
        raise APIError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8-sig")  # a leading BOM, as json.loads takes it
    except UnicodeDecodeError as e:
        raise APIError(
            f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8"
        ) from None
    depth = nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(
            f"the request body nests arrays/objects {depth} deep; at most {MAX_JSON_DEPTH} "
            "levels are accepted",
            code="invalid_json",
        )
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(
            f"the request body must be a JSON object, not {json_type(body)}", code="invalid_json"
        )
    if _SURROGATE_ESCAPE.search(raw):
        where = lone_surrogate_at(body)
        if where is not None:
            raise APIError(
                f"{where or 'the request body'} holds a lone UTF-16 surrogate (an escape such "
                "as \\ud800 without its pair): not text that can be encoded",
                param=where or None, code="invalid_unicode")
    return body


# The escape of a UTF-16 surrogate, paired or not: json.loads turns a lone one into a string no
# UTF-8 can carry (the tokenizer, the channel to a worker and a grammar compiler raise on it).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path of the first string in a parsed body that holds a lone surrogate (a key
    counts as its object's: ``""`` is the body itself), or None when none does."""
    if isinstance(value, str):
        return None if _encodes(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if not _encodes(key):
                return path
            found = lone_surrogate_at(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_type(value: Any) -> str:
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
