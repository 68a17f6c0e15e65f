"""The one table of JSON Schema keys whose values are subschemas, and the order the walk
stacks them in (``walk.Walk``)."""

from __future__ import annotations

#: keys holding an object of subschemas (one per name)
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: keys holding an array of subschemas
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
#: keys holding one subschema
SINGLE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
          "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
#: single-subschema keys that may hold an array of subschemas instead (draft 4-7 tuples)
TUPLES = frozenset({"items", "additionalItems"})
#: single-subschema keys under which an empty range says something rather than being an
#: error (``not: {minimum: 5, maximum: 1}`` is a way to say "anything")
NEGATING = frozenset({"not", "if"})

#: each key's place: a node's children are stacked in this order (the last key's visited first)
ORDER: dict[str, int] = {k: i for i, k in enumerate((*MAPS, *LISTS, *SINGLE))}
KEYS = frozenset(ORDER)
MAP_KEYS, LIST_KEYS = frozenset(MAPS), frozenset(LISTS)
