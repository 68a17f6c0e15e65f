"""One meaning per word, and no retired module names (issue 53).

- In ``src/``'s identifiers (read through the AST: names, attributes, arguments, functions,
  classes, modules; not prose), "admission" names only the API server's check of a request
  (``integrations/vllm/admission.py``), "pending" only a row's pending grammar
  (``decode.rows.PendingGrammar``, the compiles that may serve it), and "compiler" only
  grammask's ``Compiler`` (and the backends' own compilers). A new identifier with one of
  these words fails here until its idea is checked against the list.
- The modules retired by the decode core's restructuring (and the previous one) are named
  nowhere in ``src/``, ``README.md`` or ``docs/`` (the changelog keeps history).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grammask

SRC = Path(grammask.__file__).resolve().parent
ROOT = SRC.parent.parent

#: every identifier of ``src/`` holding each word, and the one idea they all name
WORDS = {
    "admi": ({"admission", "admission_config"}, "the API server's check of a request"),
    "pending": ({"PendingGrammar", "pending"}, "a row's pending grammar"),
    "compiler": ({"Compiler", "CompilerClosedError", "GrammarCompiler", "_compiler", "_compilers",
                  "compiler", "shared_compiler", "_COMPILERS", "_COMPILERS_LOCK"},
                 "grammask's Compiler, or a backend's own compiler"),
}
#: modules gone (their jobs moved), as a reader would name them
RETIRED = ["row_table", "admissions", "steptypes", "fill_worker", "fill_placement",
           "cpu_placement", "rowmasks", "hostlogits", "compile_slots", "compile_cache",
           "decode/token_watch", "decode.token_watch", "decode/agreement", "decode.agreement",
           "decode/pending", "decode.pending", "decode/drafts", "decode.drafts",
           "decode/digests", "decode.digests", "decode/filler", "decode.filler",
           "attempts.PlanRunner", "masks.Filler", "vllm/compiler.py", "vllm.compiler"]


def _identifiers() -> dict[str, set[str]]:
    """Each identifier of ``src/`` and the modules it appears in."""
    found: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        where = str(path.relative_to(SRC))
        found.setdefault(path.stem, set()).add(where)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.append(node.name)
            elif isinstance(node, ast.Name):
                names.append(node.id)
            elif isinstance(node, ast.Attribute):
                names.append(node.attr)
            elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
                names.append(node.arg)
            elif isinstance(node, ast.alias):
                names.append(node.asname or node.name.split(".")[-1])
            for name in names:
                found.setdefault(name, set()).add(where)
    return found


def test_each_word_names_one_idea() -> None:
    identifiers = _identifiers()
    for word, (allowed, idea) in WORDS.items():
        holding = {name for name in identifiers if word in name.lower()}
        assert holding == allowed, (
            f"identifiers with {word!r} ({idea}) changed: new "
            f"{ {n: sorted(identifiers[n]) for n in holding - allowed} }, gone "
            f"{sorted(allowed - holding)}")
    # "admission" as a module is the API server's check, and nothing else is named so
    assert identifiers["admission"] <= {"integrations/vllm/admission.py",
                                        "integrations/vllm/plugin_core.py"}


def test_retired_module_names_are_gone() -> None:
    texts = [p for p in SRC.rglob("*.py")] + [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    found = []
    for path in texts:
        text = path.read_text()
        for name in RETIRED:
            for match in re.finditer(rf"(?<![\w]){re.escape(name)}(?![\w])", text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not found, found
