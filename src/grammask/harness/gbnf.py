"""GBNF (llama.cpp) to Lark, written here so the grammar oracle shares no code with a backend.

llguidance ships its own converter (``llguidance.gbnf_to_lark``), and the guidance backend uses
it; an oracle built on that converter would repeat its mistakes. This one is small on purpose:

- every literal becomes a regex of fixed length and every character class a one-character
  regex, so Lark's dynamic Earley lexer sees no lexing ambiguity and the parse is exact;
- ``{m,n}`` repetitions are unrolled (``m`` copies, then ``n - m`` nested optionals);
- rule names are mapped to ``r_<name>`` (Lark wants lower-case names); ``root`` is the start.

Not supported (``GbnfError``): llama.cpp token references (``<[id]>``, ``<name>``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

START_RULE = "r_root"


class GbnfError(ValueError):
    """The GBNF text does not parse (or uses a construct this translator does not cover)."""


@dataclass
class _Tok:
    kind: str  # name, def, str, cls, dot, lp, rp, bar, op, rep
    value: str
    pos: int


_NAME = re.compile(r"[A-Za-z0-9_-]+")
_REP = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}")


def _lex(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("::=", i):
            out.append(_Tok("def", "::=", i))
            i += 3
        elif c == '"':
            value, i = _read_string(text, i + 1)
            out.append(_Tok("str", value, i))
        elif c == "[":
            value, i = _read_class(text, i + 1)
            out.append(_Tok("cls", value, i))
        elif c == ".":
            out.append(_Tok("dot", c, i))
            i += 1
        elif c in "()|":
            out.append(_Tok({"(": "lp", ")": "rp", "|": "bar"}[c], c, i))
            i += 1
        elif c in "*+?":
            out.append(_Tok("op", c, i))
            i += 1
        elif c == "{":
            m = _REP.match(text, i)
            if m is None:
                raise GbnfError(f"bad repetition at offset {i}")
            out.append(_Tok("rep", m.group(0), i))
            i = m.end()
        elif c == "<" or c == "!":
            raise GbnfError(f"token references are not supported (offset {i})")
        else:
            m = _NAME.match(text, i)
            if m is None:
                raise GbnfError(f"unexpected {c!r} at offset {i}")
            out.append(_Tok("name", m.group(0), i))
            i = m.end()
    return out


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]",
            "-": "-", "/": "/", "0": "\0"}


def _read_char(text: str, i: int) -> tuple[str, int]:
    """One (possibly escaped) character starting at ``i``."""
    if i >= len(text):
        raise GbnfError("unexpected end of grammar")
    if text[i] != "\\":
        return text[i], i + 1
    if i + 1 >= len(text):
        raise GbnfError("dangling backslash")
    e = text[i + 1]
    width = {"x": 2, "u": 4, "U": 8}.get(e)
    if width is not None:
        digits = text[i + 2:i + 2 + width]
        if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
            raise GbnfError(f"bad \\{e} escape at offset {i}")
        return chr(int(digits, 16)), i + 2 + width
    return _ESCAPES.get(e, e), i + 2


def _read_until(text: str, i: int, close: str, what: str,
                item: Callable[[str, int], tuple[str, int]]) -> tuple[str, int]:
    """``item``s read from ``i`` up to the closing ``close`` (past it on return)."""
    parts: list[str] = []
    while True:
        if i >= len(text):
            raise GbnfError(f"unterminated {what}")
        if text[i] == close:
            return "".join(parts), i + 1
        part, i = item(text, i)
        parts.append(part)


def _read_string(text: str, i: int) -> tuple[str, int]:
    return _read_until(text, i, '"', "string literal", _read_char)


def _class_item(text: str, i: int) -> tuple[str, int]:
    """One character of a class, or a range ``a-z``, escaped for the regex."""
    lo, i = _read_char(text, i)
    if i + 1 < len(text) and text[i] == "-" and text[i + 1] != "]":
        hi, i = _read_char(text, i + 1)
        return f"{_esc(lo)}-{_esc(hi)}", i
    return _esc(lo), i


def _read_class(text: str, i: int) -> tuple[str, int]:
    """A character class as a Python regex class body (``^`` kept, chars escaped)."""
    negated = i < len(text) and text[i] == "^"
    body, i = _read_until(text, i + negated, "]", "character class", _class_item)
    return ("^" if negated else "") + body, i


def _esc(ch: str) -> str:
    """A character spelled for a Lark ``/.../`` regex: Lark turns ``\\uXXXX`` into the raw
    character before Python's ``re`` sees it, so punctuation gets a backslash instead."""
    if ch.isascii() and ch.isalnum():
        return ch
    if " " <= ch <= "~":
        return "\\" + ch
    code = ord(ch)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


class _Parser:
    def __init__(self, toks: list[_Tok]) -> None:
        self.toks = toks
        self.i = 0
        #: helper rules for bounded repetitions (nested optionals would make Lark expand
        #: 2^n alternatives; a chain of two-alternative rules stays linear)
        self.helpers: list[tuple[str, str]] = []

    def peek(self, k: int = 0) -> _Tok | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def at_rule_start(self) -> bool:
        a, b = self.peek(), self.peek(1)
        return a is not None and b is not None and a.kind == "name" and b.kind == "def"

    def rules(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self.peek() is not None:
            if not self.at_rule_start():
                tok = self.peek()
                assert tok is not None
                raise GbnfError(f"expected 'name ::=' at offset {tok.pos}")
            name = self.take().value
            self.take()
            out.append((name, self.alternatives(top=True)))
        return out

    def alternatives(self, *, top: bool) -> str:
        seqs = [self.sequence(top=top)]
        while (tok := self.peek()) is not None and tok.kind == "bar":
            self.take()
            seqs.append(self.sequence(top=top))
        filled = [s for s in seqs if s]
        if not filled:
            return ""
        body = " | ".join(filled)
        if len(filled) < len(seqs):
            return f"({body})?"
        return body if len(filled) == 1 else f"({body})"

    def sequence(self, *, top: bool) -> str:
        items: list[str] = []
        while (tok := self.peek()) is not None:
            if tok.kind in ("bar", "rp") or (top and self.at_rule_start()):
                break
            items.append(self.item())
        return " ".join(i for i in items if i)

    def item(self) -> str:
        base = self.primary()
        while (tok := self.peek()) is not None and tok.kind in ("op", "rep"):
            self.take()
            if not base:
                continue
            base = f"({base}){tok.value}" if tok.kind == "op" else self.repeat(base, tok.value)
        return base

    def primary(self) -> str:
        tok = self.take()
        if tok.kind == "str":
            return f"/{''.join(_esc(c) for c in tok.value)}/" if tok.value else ""
        if tok.kind == "cls":
            return f"/[{tok.value}]/"
        if tok.kind == "dot":
            return "/[\\s\\S]/"
        if tok.kind == "name":
            return _rule_ref(tok.value)
        if tok.kind == "lp":
            inner = self.alternatives(top=False)
            close = self.peek()
            if close is None or close.kind != "rp":
                raise GbnfError(f"unclosed '(' at offset {tok.pos}")
            self.take()
            return f"({inner})" if inner else ""
        raise GbnfError(f"unexpected {tok.value!r} at offset {tok.pos}")


    def repeat(self, base: str, spec: str) -> str:
        m = _REP.fullmatch(spec)
        assert m is not None
        lo_text, comma, hi_text = m.groups()
        lo = int(lo_text or 0)
        hi: int | None = lo if not comma else int(hi_text) if hi_text else None
        if hi is not None and hi < lo:
            raise GbnfError(f"bad repetition {spec}")
        parts = [f"({base})"] * lo
        if hi is None:
            parts.append(f"({base})*")
        elif hi > lo:
            n = len(self.helpers)
            names = [f"h_rep{n}_{j}" for j in range(hi - lo)]
            for j, name in enumerate(names):
                body = f"({base}) {names[j + 1]} | ({base})" if j + 1 < len(names) else base
                self.helpers.append((name, body))
            parts.append(f"({names[0]})?")
        return " ".join(parts)


def _rule_ref(name: str) -> str:
    return "r_" + re.sub(r"[^a-z0-9_]", "_", name.lower()) + (
        "" if name.islower() or not any(c.isupper() for c in name) else
        "_" + format(sum(1 << i for i, c in enumerate(name) if c.isupper()), "x"))


def gbnf_to_lark(text: str) -> str:
    """The Lark (Earley) equivalent of a GBNF grammar; its start rule is ``START_RULE``."""
    parser = _Parser(_lex(text))
    rules = parser.rules()
    if not rules:
        raise GbnfError("no rules")
    merged: dict[str, list[str]] = {}
    for name, body in rules:
        merged.setdefault(_rule_ref(name), []).append(body)
    if START_RULE not in merged:
        raise GbnfError("no 'root' rule")
    lines = []
    for ref, bodies in merged.items():
        alts = [b for b in bodies if b]
        body = " | ".join(alts)
        if len(alts) < len(bodies):
            body = f"({body})?" if body else ""
        lines.append(f"{ref}: {body}")
    lines.extend(f"{name}: {body}" for name, body in parser.helpers)
    return "\n".join(lines) + "\n"
