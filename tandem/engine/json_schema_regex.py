"""JSON schemas as regexes, for the schemas whose documents form a regular language: closed
objects (`additionalProperties: false`), properties in schema order, scalars, enums and consts,
arrays of such. Token automata (`tandem.engine.token_fsm`) then run them on the device.

The regex accepts exactly what llguidance's JSON grammar accepts for the same schema, so the
backend a request gets does not change what it may produce: properties in the order the schema
lists them, the required ones always; no whitespace but between tokens, and there only with
`whitespace_flexible` (any run of space, tab, newline, return); in strings any character but `"`,
`\\`, U+0000-U+001F and U+007F, or the escapes `\\" \\\\ \\b \\f \\n \\r \\t` and `\\u` for
U+0000-U+001F and U+007F; integers and numbers without leading zeros (`-0` allowed). The walk test
(tests/engine/test_token_fsm.py) holds the two to the same masks over a real vocabulary.

Anything else (open objects, bounds on numbers, anyOf, $ref, formats, patterns, `"x-guidance"`)
raises UnsupportedSchema and the schema goes to llguidance.
"""

from __future__ import annotations

import json
import re

_WS = r"[ \t\n\r]*"
_STRING_CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\(?:["\\bfnrt]|u00[01][0-9a-fA-F]|u007[fF]))'
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALARS = {"integer": _INTEGER, "number": _NUMBER, "boolean": "(?:true|false)", "null": "null"}
# keywords that describe a value without constraining it
_ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly"}
_MAX_PROPERTIES = 32  # an object of only optional properties: the regex grows as its square


class UnsupportedSchema(ValueError):
    """The schema's documents are not a language this converter writes (llguidance takes it)."""


def json_schema_regex(schema: dict | str, whitespace_flexible: bool = True) -> str:
    """The regex of the JSON documents `schema` admits, as llguidance would emit them."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise UnsupportedSchema(f"not JSON: {e}") from None
    return _Writer(_WS if whitespace_flexible else "").value(schema)


class _Writer:
    def __init__(self, ws: str):
        self.ws = ws

    def value(self, schema) -> str:
        if not isinstance(schema, dict):
            raise UnsupportedSchema(f"a schema must be an object, got {schema!r}")
        if "const" in schema or "enum" in schema:
            self._only(schema, {"const", "enum", "type"})
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values or ("const" in schema and "enum" in schema):
                raise UnsupportedSchema("enum must be a non-empty list (and no const beside it)")
            if "type" in schema and any(_type_of(v) not in _kinds(schema["type"]) for v in values):
                raise UnsupportedSchema("enum or const values of another type than the schema's")
            return "(?:" + "|".join(_literal(v) for v in values) + ")"
        kind = schema.get("type")
        if not isinstance(kind, str):
            raise UnsupportedSchema(f"type {kind!r}" if kind is not None else f"keywords {sorted(schema)}")
        if kind in _SCALARS:
            self._only(schema, {"type"})
            return _SCALARS[kind]
        if kind == "string":
            self._only(schema, {"type", "minLength", "maxLength"})
            lo, hi = schema.get("minLength", 0), schema.get("maxLength")
            if not _count(lo) or (hi is not None and (not _count(hi) or hi < lo)):
                raise UnsupportedSchema(f"string bounds {lo!r}..{hi!r}")
            reps = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else hi}}}"
            return f'"{_STRING_CHAR}{reps}"'
        if kind == "array":
            self._only(schema, {"type", "items"})
            item = self.value(schema.get("items", {}))
            ws = self.ws
            return rf"\[{ws}(?:{item}(?:{ws},{ws}{item})*)?{ws}\]"
        if kind == "object":
            return self._object(schema)
        raise UnsupportedSchema(f"type {kind!r}")

    def _object(self, schema: dict) -> str:
        self._only(schema, {"type", "properties", "required", "additionalProperties"})
        if schema.get("additionalProperties") is not False:
            raise UnsupportedSchema("an object that may hold other properties (additionalProperties is not false)")
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if not isinstance(props, dict) or not required <= set(props) or len(props) > _MAX_PROPERTIES:
            raise UnsupportedSchema("properties / required")
        ws, comma = self.ws, f"{self.ws},{self.ws}"
        items = [(rf"{_literal(k)}{ws}:{ws}{self.value(v)}", k in required) for k, v in props.items()]
        if not items:
            body = ""
        elif any(req for _, req in items):
            first = next(i for i, (_, req) in enumerate(items) if req)
            body = "".join(f"(?:{p}{comma})?" for p, _ in items[:first]) + items[first][0]
            body += "".join(f"{comma}{p}" if req else f"(?:{comma}{p})?" for p, req in items[first + 1:])
        else:  # all optional: which one comes first, then any of those after it
            starts = [p + "".join(f"(?:{comma}{q})?" for q, _ in items[i + 1:])
                      for i, (p, _) in enumerate(items)]
            body = "(?:" + "|".join(starts) + ")?"
        return rf"\{{{ws}{body}{ws}\}}"

    @staticmethod
    def _only(schema: dict, allowed: set[str]) -> None:
        extra = set(schema) - allowed - _ANNOTATIONS
        if extra:
            raise UnsupportedSchema(f"keywords {sorted(extra)}")


def _type_of(value) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", str: "string"}.get(type(value), "other")


def _kinds(kind) -> set[str]:
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    return kinds | ({"integer"} if "number" in kinds else set())


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _literal(value) -> str:
    """A const or enum value as llguidance writes it: compact JSON, non-ASCII as itself."""
    if isinstance(value, float) or (isinstance(value, str) and re.search(r'["\\\x00-\x1f\x7f]', value)):
        raise UnsupportedSchema(f"literal {value!r}")  # (its spelling is not unique)
    if not isinstance(value, (str, int, bool)) and value is not None:
        raise UnsupportedSchema(f"literal {value!r}")
    return re.escape(json.dumps(value, ensure_ascii=False))
