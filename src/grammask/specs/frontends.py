"""Front ends: the request fields of OpenAI and vLLM, read into a ``GrammarSpec``.

Front ends disagree on names and defaults (OpenAI's ``strict``, vLLM's
``disable_additional_properties``); they are read here, so that everything downstream sees
only the one ``GrammarSpec``. (vLLM's ``extra_args`` go through ``request``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidSpecError
from .grammar_spec import GrammarSpec, backend_name
from .limits import check_bool, check_opt_str


def from_openai(response_format: Mapping[str, Any]) -> GrammarSpec | None:
    """OpenAI ``response_format``. ``text`` means no constraint (None).

    ``strict: true`` closes objects and refuses schemas with keywords no backend enforces
    (OpenAI's guarantee); ``strict: false`` or absent keeps plain JSON Schema semantics
    (undeclared keys allowed) and serves best-effort with the gaps listed.
    """
    if not isinstance(response_format, Mapping):
        raise InvalidSpecError("response_format must be an object", where="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, Mapping):
            raise InvalidSpecError("json_schema must be an object with a 'schema'",
                                   where="response_format.json_schema")
        if "schema" not in body:
            raise InvalidSpecError("json_schema.schema is missing",
                                   where="response_format.json_schema")
        strict = body.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise InvalidSpecError("strict must be a boolean",
                                   where="response_format.json_schema.strict")
        return GrammarSpec.json_schema(body["schema"], strict=bool(strict),
                                       extra_properties=not strict)
    raise InvalidSpecError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        where="response_format.type",
    )


def from_vllm(params: Mapping[str, Any]) -> GrammarSpec:
    """A vLLM ``structured_outputs`` object, with its per-request options honoured."""
    if not isinstance(params, Mapping):
        raise InvalidSpecError(
            f"structured outputs must be an object, got {type(params).__name__}")
    known = set(_VLLM_KINDS) | set(_VLLM_OPTIONS) | {"backend", "strict", "extra_properties"}
    unknown = sorted(k for k in params if k not in known and params[k] is not None)
    if unknown:
        raise InvalidSpecError(f"unknown structured-output keys {unknown}",
                               where=unknown[0])
    given = [k for k in _VLLM_KINDS if params.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidSpecError(
            "exactly one of json, regex, choice, grammar, grammar_name, json_object, "
            "structural_tag "
            f"must be given, got {given or 'none'}"
        )
    kind = given[0]
    value = params[kind]
    backend = backend_name(params.get("backend"))
    any_ws = not check_bool(params.get("disable_any_whitespace", False),
                            "disable_any_whitespace")
    ws_pattern = check_opt_str(params.get("whitespace_pattern"), "whitespace_pattern")
    if kind == "json":
        extra = params.get("extra_properties")
        if extra is None:
            extra = not check_bool(params.get("disable_additional_properties", True),
                                   "disable_additional_properties")
        return GrammarSpec.json_schema(
            value, any_whitespace=any_ws, whitespace_pattern=ws_pattern,
            extra_properties=check_bool(extra, "extra_properties"),
            strict=check_bool(params.get("strict", False), "strict"), backend=backend,
        )
    if kind == "json_object":
        return GrammarSpec.json_object(any_whitespace=any_ws, whitespace_pattern=ws_pattern,
                                       backend=backend)
    if kind == "regex":
        return GrammarSpec.regex(value, backend=backend)
    if kind == "choice":
        return GrammarSpec.choice(value, backend=backend)
    if kind == "grammar":
        return GrammarSpec.grammar(value, backend=backend)
    if kind == "grammar_name":
        return GrammarSpec.named(value, backend=backend)
    return GrammarSpec.structural_tag(value, backend=backend)


_VLLM_KINDS = ("json", "regex", "choice", "grammar", "grammar_name", "json_object",
               "structural_tag")
_VLLM_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                 "disable_fallback", "all_choices", "all_tokens")
