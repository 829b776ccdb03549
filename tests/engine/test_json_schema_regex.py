"""JSON schemas as regexes (`tandem.engine.json_schema_regex`): every string the regex matches is
JSON that validates against its schema (hypothesis draws them from the regex), documents written
as llguidance writes them match, and what the converter cannot write exactly is refused. (That
the regex accepts what llguidance's grammar accepts, token by token, is tests/engine/test_token_fsm.py.)"""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engine.json_schema_regex import UnsupportedSchema, json_schema_regex

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                           "age": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b c", 3, None]}}},
          "required": ["name", "age"], "additionalProperties": False}
OPTIONAL = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "boolean"},
                                             "z": {"type": "null"}}, "additionalProperties": False}
NESTED = {"type": "object", "properties": {"o": {"type": "object", "properties": {"k": {"const": "vé"}},
                                                 "required": ["k"], "additionalProperties": False},
                                           "s": {"type": "string", "description": "free text"}},
          "required": ["o", "s"], "additionalProperties": False, "title": "annotations are fine"}
SCHEMAS = [PERSON, OPTIONAL, NESTED, {"type": "array", "items": {"type": "integer"}},
           {"enum": [1, "two", True]}, {"type": "number", "enum": [1, 2]}]


@pytest.mark.parametrize("flexible", [False, True], ids=["compact", "flexible"])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "optional", "nested", "array", "enum", "typed-enum"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_match_is_valid_json_for_the_schema(schema, flexible, data):
    regex = json_schema_regex(schema, whitespace_flexible=flexible)
    text = data.draw(st.from_regex(regex, fullmatch=True))
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("doc,ok", [
    ({"name": "Ann", "age": 3}, True),
    ({"name": "Ann", "age": 3, "tags": ["a", 3, None, "b c"]}, True),
    ({"name": "Ann", "age": -0}, True),
    ({"age": 3, "name": "Ann"}, False),  # properties in the schema's order, as llguidance
    ({"name": "", "age": 3}, False),  # minLength
    ({"name": "Ann"}, False),  # required
    ({"name": "Ann", "age": 3, "extra": 1}, False),  # closed
    ({"name": "Ann", "age": 3.5}, False),
])
def test_documents_as_llguidance_writes_them(doc, ok):
    compact = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    assert (re.fullmatch(json_schema_regex(PERSON, whitespace_flexible=False), compact) is not None) == ok
    spaced = json.dumps(doc, indent=2, ensure_ascii=False)
    assert (re.fullmatch(json_schema_regex(PERSON), spaced) is not None) == ok
    if ok:
        assert re.fullmatch(json_schema_regex(PERSON, whitespace_flexible=False), spaced) is None


def test_optional_properties_any_subset_in_order():
    regex = json_schema_regex(OPTIONAL, whitespace_flexible=False)
    for keys in ([], ["x"], ["y"], ["z"], ["x", "y"], ["x", "z"], ["y", "z"], ["x", "y", "z"]):
        doc = {k: {"x": 1.5e3, "y": False, "z": None}[k] for k in keys}
        assert re.fullmatch(regex, json.dumps(doc, separators=(",", ":"))), keys
    assert not re.fullmatch(regex, '{"y":true,"x":1}')
    assert not re.fullmatch(regex, '{,"x":1}') and not re.fullmatch(regex, '{"x":1,}')


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}},  # open: may hold any other property
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    {"$ref": "#/$defs/x", "$defs": {"x": {"type": "integer"}}},
    {"type": "string", "pattern": "a+"},
    {"type": "string", "format": "date"},
    {"type": ["string", "null"]},
    {"enum": [1.5]},  # a float's spelling is not unique
    {"type": "string", "enum": ["a", 1]},  # a value the type excludes
    {"const": 'say "hi"'},  # nor is an escaped string's
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "object", "properties": {}, "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}},
    {},  # any JSON value
    "[1,",
])
def test_what_it_cannot_write_exactly_is_refused(schema):
    with pytest.raises(UnsupportedSchema):
        json_schema_regex(schema)
