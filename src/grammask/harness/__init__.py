"""Mask-correctness harness: prove, for a tokenizer and a set of specs, that the masks are right.

Every token a mask allows must keep the output completable, and no token that could continue
a valid output may be blocked. The harness checks both with oracles that share no code with
the backends, on hand-made specs or a whole corpus (``grammask check``).

Modules, one job each:
- ``oracles``: regex (``regex`` partial matching), choice, JSON Schema (``jsonschema``),
  grammars (``lark``); byte-level prefix handling for tokens that end inside a character;
- ``gbnf``: an independent GBNF to Lark translation for the grammar oracle;
- ``walk``: feeding known texts, random walks under the mask, the mask audit;
- ``diff``: the two backends' masks on one prefix, differences classified and resolved;
- ``corpus``: items (a spec and its labelled instances) read from the corpus;
- ``check``: one item on one backend inside a worker (compile, instances, samples);
- ``runner``: worker processes with hard deadlines (a crash or hang is recorded, the run
  goes on);
- ``report``: summaries, the ``auto`` targets, routing feedback, the text table;
- ``cli``: ``grammask check``.
"""
