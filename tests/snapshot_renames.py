"""Compare two behaviour snapshots (``tests.behaviour_snapshot``) across a deliberate rename.

    .venv/bin/python -m tests.snapshot_renames BEFORE.json AFTER.json

Issue 46 asked for each backend to declare what it enforces, with features per format: the
features ``format (neither backend)`` and ``format (llguidance unknown)`` named the backends,
and became one feature per format (``format: regex``, ``format: uri-reference``, ...). The
reports' strings changed with them, nothing else may. This maps the old names onto the new
ones (each old string, once, onto one new string that names a format of its group, at the same
place) and exits 1 on any other difference, printing it. The format groups are written here
from the old ``schema/features.py`` (0f081ed), not imported from the code under test.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from typing import Any

#: the old features and the formats each stood for
GROUPS = {
    "format (neither backend)": ("idn-email", "idn-hostname", "iri", "iri-reference", "regex"),
    "format (llguidance unknown)": ("uri-reference", "uri-template", "json-pointer",
                                    "relative-json-pointer"),
}
#: the old gap strings (feature plus the common gap's detail) and the new detail
DETAIL_OLD = {"format (neither backend)": " (idn-email, idn-hostname, iri, iri-reference and "
                                          "regex are not checked)"}
DETAIL_NEW = {"format (neither backend)": " (not checked)"}


def _renamed(old: str, new: str) -> bool:
    """Whether ``new`` is ``old`` under the rename (a feature key or a gap string)."""
    for name, formats in GROUPS.items():
        for fmt in formats:
            feature = f"format: {fmt}"
            if old == name and new == feature:
                return True
            if name in DETAIL_OLD and old == name + DETAIL_OLD[name] \
                    and new == feature + DETAIL_NEW[name]:
                return True
            if re.fullmatch(re.escape(name) + r" \(.*\)", old) and \
                    new == feature + old[len(name):]:
                return True
    return False


def compare(before: Any, after: Any, where: str, out: list[str], renamed: Counter[str]) -> None:
    """Append to ``out`` every difference of ``after`` from ``before`` but the rename."""
    if before == after:
        return
    if isinstance(before, dict) and isinstance(after, dict):
        gone = [k for k in before if k not in after]
        new = [k for k in after if k not in before]
        for k in before:
            if k in after:
                compare(before[k], after[k], f"{where}/{k}", out, renamed)
        # a renamed feature key: one gone, one new, same value
        for k in list(gone):
            match = [n for n in new if _renamed(k, n) and after[n] == before[k]]
            if len(match) == 1:
                gone.remove(k)
                new.remove(match[0])
                renamed["feature key"] += 1
        out.extend(f"{where}: key {k!r} gone" for k in gone)
        out.extend(f"{where}: key {k!r} new" for k in new)
    elif isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        for i, (x, y) in enumerate(zip(before, after, strict=True)):
            compare(x, y, f"{where}[{i}]", out, renamed)
    elif isinstance(before, str) and isinstance(after, str) and _renamed(before, after):
        renamed["gap string"] += 1
    else:
        out.append(f"{where}: {json.dumps(before)[:200]} -> {json.dumps(after)[:200]}")


def main(argv: list[str]) -> int:
    before, after = (json.load(open(path)) for path in argv[:2])  # noqa: SIM115
    out: list[str] = []
    renamed: Counter[str] = Counter()
    compare(before, after, "", out, renamed)
    print(f"renamed: {dict(renamed)}; other differences: {len(out)}")
    for line in out[:50]:
        print(" ", line)
    return 1 if out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
