"""Benchmarks, a repository tool (not in the installed package): ``python -m bench.compile ...``
from a source checkout (``grammask bench ...`` there does the same); numbers come from here,
never from tests."""
