"""Benchmarks, a repository tool (not in the installed package): ``python -m bench`` lists
them, ``python -m bench NAME ...`` (or ``python -m bench.NAME ...``) runs one from a source
checkout; numbers come from here, never from tests (docs/benchmarks.md)."""
