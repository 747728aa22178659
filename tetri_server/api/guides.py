"""Structured-output fields -> one ``Guide`` for the workers, with the body field it came from.

OpenAI's ``response_format`` (``text`` | ``json_object`` | ``json_schema``), vLLM's extras
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and their newer
form ``structured_outputs`` (``json`` | ``regex`` | ``choice`` | ``grammar`` | ``json_object``);
a forced tool call builds its own (``tools.py``). At most one per request.

Only shapes are checked here. Whether a schema, regex or grammar compiles is known in a worker
(the grammar library imports torch, which the control process never does): one that does not
comes back from the worker before any work as a 400 naming the same field (``GenRequest
.guide_param``).
"""

from __future__ import annotations

import json
from typing import Any

from tetri_server.api.body import json_type
from tetri_server.api.errors import bad_param
from tetri_server.api.fields import Fields
from tetri_server.messages import Guide

MAX_SPEC_CHARS = 65536  # a schema (as JSON text), regex or grammar
MAX_CHOICES = 256
BACKENDS = ("auto", "xgrammar")  # guided_decoding_backend values accepted (all mean xgrammar)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                   "grammar": "guided_grammar"}


def _spec(text: str, param: str) -> str:
    if len(text) > MAX_SPEC_CHARS:
        raise bad_param(param, f"at most {MAX_SPEC_CHARS} characters, got {len(text)}")
    return text


# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_SUB_SCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties", "not", "if", "then", "else")
_SUB_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
             "dependencies")
# Beside a ``$ref``, ``anyOf``, ``oneOf`` or ``allOf`` the compiler reads that keyword alone and
# drops the others: only these (which constrain nothing) may stand there.
_ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment",
                          "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
                          "$schema", "$id", "discriminator", "nullable"))
_COMBINERS = ("$ref", "anyOf", "oneOf", "allOf")


def sub_schemas(schema: Any, path: str = "#") -> list[tuple[str, dict[str, Any]]]:
    """Every schema object within ``schema`` (itself first), with its JSON pointer; the values
    of ``enum``, ``const``, ``default`` and ``examples`` are data, not schemas."""
    if not isinstance(schema, dict):
        return []
    out = [(path, schema)]
    for key in _SUB_SCHEMA:
        value = schema.get(key)
        if isinstance(value, list):  # items as a list (an older draft's tuple form)
            for i, v in enumerate(value):
                out += sub_schemas(v, f"{path}/{key}/{i}")
        else:
            out += sub_schemas(value, f"{path}/{key}")
    for key in _SUB_LISTS:
        value = schema.get(key)
        for i, v in enumerate(value if isinstance(value, list) else []):
            out += sub_schemas(v, f"{path}/{key}/{i}")
    for key in _SUB_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, v in value.items():
                out += sub_schemas(v, f"{path}/{key}/{name}")
    return out


def unenforced(schema: Any) -> str | None:
    """Where ``schema`` uses a keyword the grammar compiler accepts but does not enforce (an
    output breaking it would come back as a 200), as "keyword at pointer"; None if nowhere.
    ``oneOf`` is enforced as ``anyOf``, as vLLM's xgrammar does."""
    for where, node in sub_schemas(schema):
        for key in ("not", "if", "then", "else", "dependentSchemas", "dependentRequired",
                    "dependencies", "minContains", "maxContains"):
            if key in node:
                return f"{key} at {where}"
        if node.get("uniqueItems") is True:
            return f"uniqueItems at {where}"
        if "contains" in node:  # alone or beside items: not enforced
            return f"contains at {where}"
        for key in ("minLength", "maxLength"):  # the pattern or format alone is enforced
            shape = next((k for k in ("pattern", "format") if k in node), None)
            if key in node and shape is not None:
                return f"{key} beside {shape} at {where}"
        if "pattern" in node and "format" in node:
            return f"pattern beside format at {where}"
        required, props = node.get("required"), node.get("properties")
        if isinstance(required, list):
            missing = [r for r in required
                       if not isinstance(props, dict) or r not in props]
            if missing:
                return f"required {missing[0]!r} without a property of that name at {where}"
        values = _listed(node)
        if values is not None:
            beside = sorted(k for k in node if k not in _ANNOTATIONS
                            and k not in ("enum", "const", "type"))
            if beside and not all(_meets(v, node, beside) for v in values):
                return f"{', '.join(beside)} beside {'enum' if 'enum' in node else 'const'} " \
                       f"at {where}"
            if "type" in node and not all(_has_type(v, node["type"]) for v in values):
                return f"a listed value of another type than {node['type']!r} at {where}"
        combiner = next((k for k in _COMBINERS if k in node), None)
        if combiner is not None:
            beside = sorted(k for k in node if k != combiner and k not in _ANNOTATIONS)
            if beside:
                return f"{', '.join(beside)} beside {combiner} at {where}"
        step = node.get("multipleOf")
        if step is not None and not (
                node.get("type") == "integer" and isinstance(step, int) and 0 < step <= 1024
                and ("minimum" in node) == ("maximum" in node)):
            return f"multipleOf {step!r} at {where} (only an integer's, up to 1024, with both " \
                   "or neither bounds)"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"allOf of more than one schema at {where}"
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"a $ref outside the schema ({ref!r}) at {where}"
    return None


def _listed(node: dict[str, Any]) -> list[Any] | None:
    """The values ``enum`` or ``const`` allows (the compiler reads those alone), or None."""
    if "const" in node:
        return [node["const"]]
    enum = node.get("enum")
    return enum if isinstance(enum, list) else None


def _meets(value: Any, node: dict[str, Any], keys: list[str]) -> bool:
    """Whether a listed value meets the scalar constraints ``keys`` of its node (the grammar
    allows the listed values alone, so then nothing is left unenforced); False for any other
    keyword (``pattern`` too: the client's regex run here could backtrack for hours)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    for key in keys:
        bound = node[key]
        if key in ("minLength", "maxLength") and isinstance(value, str) and isinstance(bound, int):
            ok = len(value) >= bound if key == "minLength" else len(value) <= bound
        elif key in _BOUNDS and number and isinstance(bound, int | float):
            ok = _BOUNDS[key](value, bound)
        else:
            return False
        if not ok:
            return False
    return True


_BOUNDS = {"minimum": lambda v, b: v >= b, "maximum": lambda v, b: v <= b,
           "exclusiveMinimum": lambda v, b: v > b, "exclusiveMaximum": lambda v, b: v < b}


def _has_type(value: Any, types: Any) -> bool:
    """Whether a JSON value is of ``type`` (a name or a list of names)."""
    names = types if isinstance(types, list) else [types]
    kinds = {"null": value is None, "boolean": isinstance(value, bool),
             "string": isinstance(value, str), "array": isinstance(value, list),
             "object": isinstance(value, dict),
             "integer": (isinstance(value, int) and not isinstance(value, bool))
             or (isinstance(value, float) and value.is_integer()),
             "number": isinstance(value, int | float) and not isinstance(value, bool)}
    return any(kinds.get(n, False) for n in names)


def schema_guide(schema: Any, param: str) -> Guide:
    """A JSON schema given as an object or as JSON text; one that uses a keyword the grammar
    would not enforce is a 400 naming it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_param(param, "the schema is not valid JSON") from None
    if not isinstance(schema, dict):
        raise bad_param(param, f"the schema must be a JSON object, got {json_type(schema)}")
    bad = unenforced(schema)
    if bad is not None:
        raise bad_param(param, f"the schema uses {bad}, which structured output cannot "
                               "enforce")
    return Guide("json_schema", _spec(json.dumps(schema, ensure_ascii=False), param))


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_param(param, "expected a non-empty string")
    return _spec(value, param)


def _choice(value: Any, param: str) -> Guide:
    if (not isinstance(value, list) or not value
            or not all(isinstance(c, str) and c for c in value)):
        raise bad_param(param, "expected a non-empty list of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise bad_param(param, f"at most {MAX_CHOICES} choices, got {len(value)}")
    return Guide("choice", _spec(json.dumps(value, ensure_ascii=False), param))


def _guided(kind: str, value: Any, param: str) -> Guide:
    if kind == "guided_json":
        return schema_guide(value, param)
    if kind == "guided_regex":
        return Guide("regex", _text(value, param))
    if kind == "guided_choice":
        return _choice(value, param)
    return Guide("grammar", _text(value, param))


def _response_format(fmt: dict[str, Any]) -> Guide | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_object")
    if kind != "json_schema":
        raise bad_param("response_format.type", "expected 'text', 'json_object' or "
                                                f"'json_schema', got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_param("response_format.json_schema",
                        "expected an object with 'name' and 'schema'")
    if spec.get("schema") is None:  # OpenAI's schema is optional: any JSON object
        return Guide("json_object")
    return schema_guide(spec["schema"], "response_format")


def _structured(value: dict[str, Any]) -> Guide | None:
    found: list[Guide] = []
    for key, item in value.items():
        param = f"structured_outputs.{key}"
        if item is None or item is False:
            continue
        if key == "json_object":
            if item is not True:
                raise bad_param(param, "expected true or false")
            found.append(Guide("json_object"))
        elif key in STRUCTURED_KEYS:
            found.append(_guided(STRUCTURED_KEYS[key], item, param))
        else:
            raise bad_param(param, "is not supported by this server")
    if len(found) > 1:
        raise bad_param("structured_outputs", "give only one of json, regex, choice, grammar "
                                              "and json_object")
    return found[0] if found else None


def parse_guide(f: Fields) -> tuple[Guide | None, str]:
    """(the request's guide or None, the field it came from)."""
    backend = f.string("guided_decoding_backend", "auto")
    if backend not in BACKENDS:
        raise bad_param("guided_decoding_backend", f"only {' and '.join(BACKENDS)} "
                                                   f"(xgrammar) are available, got {backend!r}")
    found: list[tuple[Guide, str]] = []
    fmt = f.obj("response_format")
    guide = _response_format(fmt) if fmt is not None else None
    if guide is not None:
        found.append((guide, "response_format"))
    for name in GUIDED:
        if f.has(name):
            found.append((_guided(name, f.raw(name), name), name))
    structured = f.obj("structured_outputs")
    guide = _structured(structured) if structured is not None else None
    if guide is not None:
        found.append((guide, "structured_outputs"))
    if len(found) > 1:
        raise bad_param(found[1][1], f"cannot be combined with {found[0][1]}: one structured "
                                     "output constraint per request")
    return found[0] if found else (None, "")
