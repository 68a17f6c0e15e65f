"""Independent checks of server outputs (never grammask): jsonschema, ``regex``, ``lark``,
and a small JSON prefix checker for outputs cut off at ``max_tokens``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import regex


class _Incomplete(Exception):
    """The text ended inside a value: a valid prefix so far."""


_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"


class _Prefix:
    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def peek(self) -> str:
        if self.i >= len(self.s):
            raise _Incomplete
        return self.s[self.i]

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\n\r":
            self.i += 1

    def expect(self, ch: str) -> None:
        if self.peek() != ch:
            raise ValueError(f"expected {ch!r} at {self.i}")
        self.i += 1

    def value(self) -> None:
        self.ws()
        c = self.peek()
        if c == "{":
            self.container("}", member=True)
        elif c == "[":
            self.container("]", member=False)
        elif c == '"':
            self.string()
        elif c == "-" or c.isdigit():
            self.number()
        else:
            for word in ("true", "false", "null"):
                if word.startswith(c):
                    for ch in word:
                        self.expect(ch)
                    return
            raise ValueError(f"unexpected {c!r} at {self.i}")

    def container(self, close: str, *, member: bool) -> None:
        self.i += 1
        self.ws()
        if self.peek() == close:
            self.i += 1
            return
        while True:
            if member:
                self.ws()
                self.string()
                self.ws()
                self.expect(":")
            self.value()
            self.ws()
            if self.peek() == close:
                self.i += 1
                return
            self.expect(",")

    def string(self) -> None:
        self.expect('"')
        while True:
            c = self.peek()
            self.i += 1
            if c == '"':
                return
            if ord(c) < 0x20:
                raise ValueError(f"raw control character in a string at {self.i - 1}")
            if c == "\\":
                e = self.peek()
                self.i += 1
                if e == "u":
                    for _ in range(4):
                        if self.peek() not in "0123456789abcdefABCDEF":
                            raise ValueError(f"bad \\u escape at {self.i}")
                        self.i += 1
                elif e not in '"\\/bfnrt':
                    raise ValueError(f"bad escape \\{e} at {self.i - 1}")

    def number(self) -> None:
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in "+-.eE0123456789":
            self.i += 1
        text = self.s[start:self.i]
        if self.i == len(self.s):
            if regex.fullmatch(_NUMBER, text, partial=True) is None:
                raise ValueError(f"bad number {text!r}")
            raise _Incomplete
        if regex.fullmatch(_NUMBER, text) is None:
            raise ValueError(f"bad number {text!r}")


def json_prefix_ok(text: str) -> bool:
    """Whether ``text`` is a prefix of some JSON document (complete ones included)."""
    p = _Prefix(text)
    try:
        p.value()
    except _Incomplete:
        return True
    except ValueError:
        return False
    p.ws()
    return p.i == len(text)


def check_json(text: str, finish: str, schema: dict[str, Any] | None, *,
               must_stop: bool) -> None:
    """Assert a JSON output: complete and valid against ``schema`` when it stopped; a valid
    JSON prefix when it ran to max_tokens (only allowed unless ``must_stop``)."""
    if finish == "length" and not must_stop:
        assert json_prefix_ok(text), f"not a JSON prefix: {text!r}"
        return
    assert finish == "stop", f"finish_reason {finish!r} for {text!r}"
    value = json.loads(text)
    if schema is not None:
        jsonschema.validate(value, schema)


def check_regex(pattern: str, text: str, finish: str) -> None:
    if finish == "length":
        assert regex.fullmatch(pattern, text, partial=True), (
            f"not a prefix of /{pattern}/: {text!r}")
    else:
        assert finish == "stop", finish
        assert regex.fullmatch(pattern, text), f"/{pattern}/ does not match {text!r}"


def check_lark(grammar: str, text: str, finish: str, prefix_regex: str) -> None:
    """A stopped output must parse with lark; one cut off must be a prefix of the same
    language (written as ``prefix_regex``)."""
    import lark

    if finish == "length":
        assert regex.fullmatch(prefix_regex, text, partial=True), text
        return
    assert finish == "stop", finish
    lark.Lark(grammar, start="start", parser="earley").parse(text)
